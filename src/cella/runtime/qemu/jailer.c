/* cella-jailer: runs one QEMU in its own jail, then becomes it (exec, same pid).
 *
 *   cella-jailer [options] -- PROGRAM ARG...
 *     --uid N --gid N      the VM's own user and group (no one else runs as them)
 *     --group N            a supplementary group (read-only images; repeatable)
 *     --root DIR           an empty directory: the jail's root is a tmpfs mounted on it
 *     --ro PATH, --rw PATH a host file or directory, visible at the same path in the jail
 *     --dev PATH           a device node, visible at the same path
 *     --die-with-parent    SIGKILL when the process that started the jailer goes away
 *
 * In order: new mount, IPC, UTS and network namespaces; a tmpfs root holding only the
 * given paths (bind mounts; read-only ones remounted so, all nosuid) and /usr for QEMU's
 * own files; pivot_root into it; the capability bounding set emptied; the groups, gid and
 * uid set (which clears every capability); no_new_privs; exec. QEMU's own seccomp filter
 * (-sandbox) follows once it has started. QEMU forks nothing, so no PID namespace: its
 * pid stays the one the daemon watches, and no /proc is mounted for it to look around.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>
#include <linux/capability.h>

#define MAX_PATHS 64
#define MAX_GROUPS 8

static void die(const char *what, const char *detail) {
    fprintf(stderr, "cella-jailer: %s%s%s: %s\n", what, detail ? " " : "", detail ? detail : "",
            strerror(errno));
    exit(125);
}

static void usage(const char *why) {
    fprintf(stderr, "cella-jailer: %s\n", why);
    exit(125);
}

static long number(const char *text) {
    char *end;
    errno = 0;
    long value = strtol(text, &end, 10);
    if (errno || *end || value < 0) usage("a number was expected");
    return value;
}

/* mkdir -p of `path` (absolute, under the new root) */
static void make_dirs(char *path) {
    for (char *p = path + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(path, 0755) && errno != EEXIST) die("mkdir", path);
        *p = '/';
    }
    if (mkdir(path, 0755) && errno != EEXIST) die("mkdir", path);
}

/* the mount point for host `path` under `root`: a directory or an empty file like it */
static void mount_point(const char *root, const char *path, char *out, size_t size) {
    struct stat st;
    if (stat(path, &st)) die("stat", path);
    if ((size_t)snprintf(out, size, "%s%s", root, path) >= size) usage("a path is too long");
    char *slash = strrchr(out, '/');
    if (S_ISDIR(st.st_mode)) {
        make_dirs(out);
        return;
    }
    *slash = 0;
    make_dirs(out);
    *slash = '/';
    int fd = open(out, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0 && errno != EEXIST) die("create", out);
    if (fd >= 0) close(fd);
}

static void bind(const char *root, const char *path, unsigned long flags) {
    char target[4096];
    mount_point(root, path, target, sizeof target);
    if (mount(path, target, NULL, MS_BIND | MS_REC, NULL)) die("bind", path);
    if (mount(NULL, target, NULL, MS_BIND | MS_REMOUNT | flags, NULL)) die("remount", path);
}

/* /lib, /lib64, /bin and /sbin as the host has them (symlinks into /usr on Debian) */
static void usr_links(const char *root) {
    const char *names[] = {"/lib", "/lib64", "/bin", "/sbin"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        char link[4096], target[4096];
        ssize_t n = readlink(names[i], link, sizeof link - 1);
        if (n < 0) continue; /* absent, or a real directory: QEMU finds its files in /usr */
        link[n] = 0;
        snprintf(target, sizeof target, "%s%s", root, names[i]);
        if (symlink(link, target) && errno != EEXIST) die("symlink", names[i]);
    }
}

int main(int argc, char **argv) {
    long uid = -1, gid = -1;
    gid_t groups[MAX_GROUPS];
    int ngroups = 0, nro = 0, nrw = 0, ndev = 0, die_with_parent = 0;
    const char *root = NULL, *ro[MAX_PATHS], *rw[MAX_PATHS], *dev[MAX_PATHS];
    int i = 1;
    for (; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--")) {
            i++;
            break;
        }
        if (!strcmp(a, "--die-with-parent")) {
            die_with_parent = 1;
            continue;
        }
        if (i + 1 >= argc) usage("an option lacks its value");
        const char *v = argv[++i];
        if (!strcmp(a, "--uid")) uid = number(v);
        else if (!strcmp(a, "--gid")) gid = number(v);
        else if (!strcmp(a, "--group") && ngroups < MAX_GROUPS) groups[ngroups++] = number(v);
        else if (!strcmp(a, "--root")) root = v;
        else if (!strcmp(a, "--ro") && nro < MAX_PATHS) ro[nro++] = v;
        else if (!strcmp(a, "--rw") && nrw < MAX_PATHS) rw[nrw++] = v;
        else if (!strcmp(a, "--dev") && ndev < MAX_PATHS) dev[ndev++] = v;
        else usage("unknown option, or too many of it");
    }
    if (i >= argc || !root || uid <= 0 || gid <= 0) usage("--uid, --gid, --root and a program are required");
    pid_t parent = getppid();
    mode_t umask_given = umask(022); /* the jail's directories: traversable by the VM's uid */

    if (unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNET)) die("unshare", NULL);
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL)) die("make / private", NULL);
    if (mount("jail", root, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0755,size=1m"))
        die("mount tmpfs on", root);
    bind(root, "/usr", MS_RDONLY | MS_NOSUID | MS_NODEV);
    usr_links(root);
    for (int k = 0; k < nro; k++) bind(root, ro[k], MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC);
    for (int k = 0; k < nrw; k++) bind(root, rw[k], MS_NOSUID | MS_NODEV | MS_NOEXEC);
    for (int k = 0; k < ndev; k++) bind(root, dev[k], MS_NOSUID | MS_NOEXEC);

    if (chdir(root)) die("chdir", root);
    if (syscall(SYS_pivot_root, ".", ".")) die("pivot_root", root);
    if (umount2(".", MNT_DETACH)) die("detach the host's root", NULL);
    if (chdir("/")) die("chdir /", NULL);
    if (mount(NULL, "/", NULL, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0755"))
        die("remount the root read-only", NULL);
    if (sethostname("cella-vm", 8)) die("sethostname", NULL);

    for (int cap = 0; cap <= CAP_LAST_CAP; cap++)
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) && errno != EINVAL) die("drop a capability", NULL);
    if (setgroups(ngroups, groups)) die("setgroups", NULL);
    if (setresgid(gid, gid, gid)) die("setresgid", NULL);
    if (setresuid(uid, uid, uid)) die("setresuid", NULL);
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)) die("no_new_privs", NULL);
    /* after the uid change, which clears it */
    if (die_with_parent) {
        if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)) die("pdeathsig", NULL);
        if (getppid() != parent) exit(125);
    }
    umask(umask_given); /* what QEMU makes (a RAM file, sockets) keeps the daemon's mask */
    execvp(argv[i], argv + i); /* QEMU keeps its plain name as argv[0] */
    die("exec", argv[i]);
}
