/*
 * cella guest agent: runs as PID 1 inside the microVM and serves the host over one
 * virtio-serial port. The wire format is described in cella/guest/protocol.py; both
 * sides must agree on every constant below.
 *
 * One thread, one poll loop: execs (with streamed stdout/stderr, stdin, timeouts that
 * kill the whole process tree through a per-exec cgroup), file reads streamed in
 * chunks, atomic file writes, listings and metadata. The host is trusted by the agent;
 * the agent is not trusted by the host.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/random.h>
#include <linux/sched.h>
#include <arpa/inet.h>
#include <net/if.h>
#include <net/route.h>
#include <netinet/in.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/syscall.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

#define AGENT_VERSION "cella-agent/2"
#define PORT_NAME "cella.agent"
#define MAX_FRAME (1u << 20)
#define HDR 9
#define CHUNK (256u << 10)
/* Output the host has not acknowledged yet, per exec, file read or stream: past it the agent
   stops reading, so a slow consumer slows the producer instead of filling the host. */
#define WINDOW (1u << 20)
#define STREAM_BIT 0x80000000u /* channels of streams the guest opened */
#define MAX_STREAMS 1024
#define CGROUP_ROOT "/sys/fs/cgroup/cella"
#define INITRAMFS_MARK "/cella-initramfs" /* only the initramfs has it (images/boot.py) */
/* The guest's only way out: the agent listens on these ports of EGRESS_ADDR (on loopback;
   the VM has no NIC) and carries each connection to the host as a stream, where the daemon
   hands it to cella's egress proxy. Every name resolves to EGRESS_ADDR. */
#define EGRESS_ADDR "10.0.2.100"
#define DNS_ADDR "127.0.0.53"

/* host -> guest */
enum {
    T_PING = 0x01, T_EXEC = 0x02, T_STDIN = 0x03, T_KILL = 0x04,
    T_READ = 0x10, T_WRITE = 0x11, T_WDATA = 0x12, T_WEND = 0x13, T_LIST = 0x14,
    T_STAT = 0x15, T_MKDIR = 0x16, T_REMOVE = 0x17, T_CHMOD = 0x18, T_IDENTITY = 0x19,
    T_SHUTDOWN = 0x1A, T_ACK = 0x1B, T_SDATA = 0x1C, T_SCLOSE = 0x1D, T_CONNECT = 0x1E,
    T_RESIZE = 0x1F,
};
/* guest -> host */
enum {
    M_PONG = 0x81, M_STARTED = 0x82, M_STDOUT = 0x83, M_STDERR = 0x84, M_EXIT = 0x85,
    M_DATA = 0x86, M_END = 0x87, M_OK = 0x88, M_SOPEN = 0x89, M_SDATA = 0x8A,
    M_SCLOSE = 0x8B, M_ACK = 0x8C, M_ERROR = 0x8F,
};
/* request fields (tag, u32 length, value) */
enum {
    F_ARG = 1, F_ENV = 2, F_CWD = 3, F_USER = 4, F_TIMEOUT_MS = 5, F_STDIN = 6, F_PATH = 7,
    F_MODE = 8, F_PARENTS = 9, F_RECURSIVE = 10, F_HOSTNAME = 11, F_TIME_NS = 12, F_SEED = 13,
    F_SIGNAL = 14, F_SANDBOX_ID = 15, F_PIDS_MAX = 16, F_PTY = 17,
    /* a file's metadata: XATTR (key NUL value) set on a written file, XATTRS (flag) asks
       stat and list to report each entry's after it */
    F_XATTR = 18, F_XATTRS = 19,
};
/* the namespace of the metadata a caller sets on files (E2B's: `user.e2b.<key>`) */
#define XATTR_PREFIX "user.e2b."

static int port = -1;
static int port_hup = 0;
static int have_cgroups = 0;
static char sandbox_id[64] = "";
/*
 * Kept open from boot, so a restored guest's identity call rewrites them without a path
 * walk or a file creation: right after a restore every kernel path the guest runs is new to
 * its QEMU's translation cache, and under emulation each costs milliseconds.
 */
static int sandbox_id_fd = -1; /* /run/cella/sandbox-id */
static int pids_max_fd = -1;   /* CGROUP_ROOT/pids.max */

static void logf_(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "cella-agent: ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

static void halt_with(const char *why) {
    logf_("%s", why);
    sync();
    reboot(RB_AUTOBOOT); /* QEMU runs with -no-reboot: this ends the VM */
    _exit(1);
}

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void put32(uint8_t *p, uint32_t v) {
    p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v;
}
static void put64(uint8_t *p, uint64_t v) {
    put32(p, (uint32_t)(v >> 32)); put32(p + 4, (uint32_t)v);
}
static uint32_t get32(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

/* ---- output to the host ------------------------------------------------------------ */

static void write_all(int fd, const void *buf, size_t len) {
    const uint8_t *p = buf;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) {
                struct pollfd pfd = {.fd = fd, .events = POLLOUT};
                poll(&pfd, 1, 100);
                continue;
            }
            return; /* host gone: drop, it will reconnect and resync by channel */
        }
        p += n;
        len -= (size_t)n;
    }
}

static void send_frame(uint32_t chan, uint8_t type, const void *a, size_t alen, const void *b,
                       size_t blen) {
    uint8_t hdr[HDR];
    put32(hdr, (uint32_t)(alen + blen));
    put32(hdr + 4, chan);
    hdr[8] = type;
    struct iovec_like { const void *p; size_t n; } parts[3] = {{hdr, HDR}, {a, alen}, {b, blen}};
    /* one write when small keeps frames contiguous and cheap */
    if (alen + blen <= 4096) {
        uint8_t buf[HDR + 4096];
        memcpy(buf, hdr, HDR);
        if (alen) memcpy(buf + HDR, a, alen);
        if (blen) memcpy(buf + HDR + alen, b, blen);
        write_all(port, buf, HDR + alen + blen);
        return;
    }
    for (int i = 0; i < 3; i++)
        if (parts[i].n) write_all(port, parts[i].p, parts[i].n);
}

static void send_error(uint32_t chan, int err, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (n < 0) n = 0;
    if (n >= (int)sizeof msg) n = sizeof msg - 1;
    uint8_t e[4];
    put32(e, (uint32_t)err);
    send_frame(chan, M_ERROR, e, 4, msg, (size_t)n);
}

static void send_ok(uint32_t chan) { send_frame(chan, M_OK, NULL, 0, NULL, 0); }

/* ---- request fields ------------------------------------------------------------------ */

struct field { uint8_t tag; uint32_t len; const uint8_t *val; };
#define MAX_FIELDS 4096

static int parse_fields(const uint8_t *p, uint32_t len, struct field *out, int max) {
    int n = 0;
    uint32_t off = 0;
    while (off < len) {
        if (len - off < 5 || n >= max) return -1;
        uint32_t flen = get32(p + off + 1);
        if (flen > len - off - 5) return -1;
        out[n].tag = p[off];
        out[n].len = flen;
        out[n].val = p + off + 5;
        n++;
        off += 5 + flen;
    }
    return n;
}

/* Copies a field into a NUL-terminated string; refuses embedded NULs. */
static char *field_str(const struct field *f) {
    if (memchr(f->val, 0, f->len)) return NULL;
    char *s = malloc(f->len + 1);
    memcpy(s, f->val, f->len);
    s[f->len] = 0;
    return s;
}

static const struct field *find_field(const struct field *fs, int n, uint8_t tag) {
    for (int i = 0; i < n; i++)
        if (fs[i].tag == tag) return &fs[i];
    return NULL;
}

static uint64_t field_u64(const struct field *f) {
    uint64_t v = 0;
    for (uint32_t i = 0; i < f->len && i < 8; i++) v = (v << 8) | f->val[i];
    return v;
}

#include "proctrace.c"

/* ---- execs ------------------------------------------------------------------------------ */

struct exec {
    uint32_t chan;
    pid_t pid;
    int out_fd, err_fd, in_fd;
    uint8_t *inbuf;
    size_t inlen;
    int stdin_eof;
    int64_t deadline;
    int timed_out;
    int exited, status; /* reaped; the exit frame follows the rest of its output */
    size_t tail;        /* output still forwarded after the exit (background writers) */
    int pty;            /* a terminal: out_fd is its master, stdin is written to it too */
    uint32_t inflight;  /* output sent, not yet acknowledged */
    char cgroup[64];
    void *fs;           /* the file changes it made so far (fswatch.c) */
    int exempt;         /* the host's own upkeep: not held to the exec policy */
    struct exec *next;
};
static struct exec *execs;

struct reader { uint32_t chan; int fd; uint32_t inflight; struct reader *next; };
static struct reader *readers;

struct writer {
    uint32_t chan;
    int fd;
    int err;
    char tmp[4096];
    char dst[4096];
    struct writer *next;
};
static struct writer *writers;

struct pending_cg { char path[64]; struct pending_cg *next; };
static struct pending_cg *pending_cgroups;

static struct exec *find_exec(uint32_t chan) {
    for (struct exec *e = execs; e; e = e->next)
        if (e->chan == chan) return e;
    return NULL;
}

static void set_nonblock(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

/* file changes per exec, and the exec policy (inlined here by images/boot.py) */
#include "fswatch.c"
#include "execpolicy.c"

static void write_file(const char *path, const char *val) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return;
    if (write(fd, val, strlen(val)) < 0) { /* best effort */ }
    close(fd);
}

struct user { uid_t uid; gid_t gid; char name[64]; char home[256]; char shell[256]; };

/* Looks a user up by name or number in /etc/passwd (no NSS in a static binary). */
static int lookup_user(const char *who, struct user *u) {
    FILE *f = fopen("/etc/passwd", "re");
    if (!f) { /* an image without a passwd file (distroless): root, and numeric ids, work */
        char *end;
        long want = strcmp(who, "root") == 0 ? 0 : strtol(who, &end, 10);
        if (want != 0 && (!*who || *end)) return -1;
        u->uid = u->gid = (uid_t)want;
        snprintf(u->name, sizeof u->name, "%s", want == 0 ? "root" : who);
        snprintf(u->home, sizeof u->home, "%s", want == 0 ? "/root" : "/");
        return 0;
    }
    char line[1024];
    char *end;
    long want = strtol(who, &end, 10);
    int numeric = *who && !*end;
    int found = -1;
    while (fgets(line, sizeof line, f)) {
        char *fields[7];
        char *s = line;
        int i;
        for (i = 0; i < 7 && s; i++) fields[i] = strsep(&s, ":\n");
        if (i < 7) continue;
        long uid = strtol(fields[2], NULL, 10);
        if (numeric ? uid == want : strcmp(fields[0], who) == 0) {
            u->uid = (uid_t)uid;
            u->gid = (gid_t)strtol(fields[3], NULL, 10);
            snprintf(u->name, sizeof u->name, "%s", fields[0]);
            snprintf(u->home, sizeof u->home, "%s", fields[5]);
            snprintf(u->shell, sizeof u->shell, "%s", fields[6]);
            found = 0;
            break;
        }
    }
    fclose(f);
    if (found < 0 && numeric) { /* a uid with no passwd entry is still a valid identity */
        u->uid = u->gid = (uid_t)want;
        snprintf(u->name, sizeof u->name, "%ld", want);
        snprintf(u->home, sizeof u->home, "/");
        found = 0;
    }
    return found;
}

static int user_groups(const char *name, gid_t primary, gid_t *out, int max) {
    int n = 0;
    out[n++] = primary;
    FILE *f = fopen("/etc/group", "re");
    if (!f) return n;
    char line[4096];
    while (fgets(line, sizeof line, f) && n < max) {
        char *s = line;
        char *gname = strsep(&s, ":");
        strsep(&s, ":");
        char *gid = strsep(&s, ":");
        char *members = strsep(&s, "\n");
        (void)gname;
        if (!gid || !members) continue;
        char *m;
        while ((m = strsep(&members, ",")))
            if (strcmp(m, name) == 0) out[n++] = (gid_t)strtol(gid, NULL, 10);
    }
    fclose(f);
    return n;
}

/* Runs in the forked child; never returns. Reports exec failure as an errno on errpipe. */
static void exec_child(char **argv, char **env, const char *cwd, const struct user *u,
                       int in_fd, int out_fd, int err_fd, int errpipe, const char *tty) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    signal(SIGPIPE, SIG_DFL);
    setsid();
    if (tty) { /* a terminal of its own: the session's controlling tty on 0, 1 and 2 */
        int t = open(tty, O_RDWR);
        if (t >= 0) ioctl(t, TIOCSCTTY, 0);
        in_fd = out_fd = err_fd = t;
    }
    dup2(in_fd, 0);
    dup2(out_fd, 1);
    dup2(err_fd, 2);
    /* the failing step travels with its errno so the host can say what went wrong */
    int err = 0, stage = 0;
    if (u) {
        gid_t groups[64];
        int ng = user_groups(u->name, u->gid, groups, 64);
        if (setgroups((size_t)ng, groups) || setgid(u->gid) || setuid(u->uid)) err = errno, stage = 1;
    }
    if (!err) {
        const char *dir = cwd;
        struct stat st;
        if (!dir) dir = stat(u->home, &st) == 0 && S_ISDIR(st.st_mode) ? u->home : "/";
        if (chdir(dir)) err = errno, stage = 2;
    }
    if (!err) {
        environ = env; /* execvp searches the PATH the command will see */
        execvp(argv[0], argv);
        err = errno, stage = 3;
    }
    uint8_t e[5];
    put32(e, (uint32_t)err);
    e[4] = (uint8_t)stage;
    if (write(errpipe, e, 5) < 0) { /* parent sees EOF instead */ }
    _exit(127);
}

/*
 * Forks the exec's process straight into a cgroup of its own (clone3 CLONE_INTO_CGROUP), so
 * a timeout can kill the whole tree, daemons and all, with cgroup.kill. Moving a process in
 * afterwards through cgroup.procs waits for an RCU grace period: slow under emulation.
 * Empty cgroups are kept for reuse for the same reason.
 */
static void remove_cgroup(const char *path);
static char free_cgroups[64][64];
static int n_free_cgroups;
static unsigned cgroup_seq;

static pid_t spawn_in_cgroup(struct exec *e) {
    if (!have_cgroups) return fork();
    if (n_free_cgroups > 0) {
        snprintf(e->cgroup, sizeof e->cgroup, "%s", free_cgroups[--n_free_cgroups]);
    } else {
        snprintf(e->cgroup, sizeof e->cgroup, CGROUP_ROOT "/x%u", ++cgroup_seq);
        if (mkdir(e->cgroup, 0755) && errno != EEXIST) {
            e->cgroup[0] = 0;
            return fork();
        }
    }
    int cg = open(e->cgroup, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    struct clone_args args = {.flags = CLONE_INTO_CGROUP, .exit_signal = SIGCHLD,
                              .cgroup = (uint64_t)cg};
    pid_t pid = cg < 0 ? -1 : (pid_t)syscall(SYS_clone3, &args, sizeof args);
    if (cg >= 0) close(cg);
    if (pid < 0) { /* no clone3: fall back to a plain fork without tree kill */
        rmdir(e->cgroup);
        e->cgroup[0] = 0;
        return fork();
    }
    return pid;
}

static char **build_env(const struct field *fs, int n, const struct user *u) {
    int count = 0;
    for (int i = 0; i < n; i++) count += fs[i].tag == F_ENV;
    char **env = calloc((size_t)count + 8, sizeof(char *));
    int k = 0;
    const char *defaults[][2] = {
        {"PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
        {"HOME", u->home}, {"USER", u->name}, {"LOGNAME", u->name}, {"LANG", "C.UTF-8"},
        {"SHELL", u->shell[0] ? u->shell : "/bin/sh"},
        {"CELLA_SANDBOX_ID", sandbox_id},
    };
    for (size_t d = 0; d < sizeof defaults / sizeof defaults[0]; d++) {
        size_t klen = strlen(defaults[d][0]);
        int overridden = 0;
        for (int i = 0; i < n; i++)
            if (fs[i].tag == F_ENV && fs[i].len > klen && fs[i].val[klen] == '=' &&
                memcmp(fs[i].val, defaults[d][0], klen) == 0)
                overridden = 1;
        if (!overridden) {
            if (asprintf(&env[k], "%s=%s", defaults[d][0], defaults[d][1]) < 0) continue;
            k++;
        }
    }
    for (int i = 0; i < n; i++)
        if (fs[i].tag == F_ENV) {
            char *s = field_str(&fs[i]);
            if (s) env[k++] = s;
        }
    env[k] = NULL;
    return env;
}

static void free_strv(char **v) {
    if (!v) return;
    for (char **p = v; *p; p++) free(*p);
    free(v);
}

static void handle_exec(uint32_t chan, const uint8_t *p, uint32_t len) {
    static struct field fs[MAX_FIELDS];
    int n = parse_fields(p, len, fs, MAX_FIELDS);
    if (n < 0) return send_error(chan, EINVAL, "malformed exec request");
    if (find_exec(chan)) return send_error(chan, EINVAL, "channel %u already in use", chan);
    int argc = 0;
    for (int i = 0; i < n; i++) argc += fs[i].tag == F_ARG;
    if (argc == 0) return send_error(chan, EINVAL, "empty argv");

    struct user u = {0};
    const struct field *fu = find_field(fs, n, F_USER);
    char *who = fu ? field_str(fu) : strdup("root");
    if (!who || lookup_user(who, &u) < 0) {
        send_error(chan, ESRCH, "unknown user: %s", who ? who : "?");
        free(who);
        return;
    }
    free(who);

    char **argv = calloc((size_t)argc + 1, sizeof(char *));
    int a = 0;
    for (int i = 0; i < n; i++)
        if (fs[i].tag == F_ARG) {
            argv[a] = field_str(&fs[i]);
            if (!argv[a]) {
                free_strv(argv);
                return send_error(chan, EINVAL, "NUL byte in argument");
            }
            a++;
        }
    char **env = build_env(fs, n, &u);
    const struct field *fc = find_field(fs, n, F_CWD);
    char *cwd = fc ? field_str(fc) : NULL;
    if (fc && !cwd) {
        free_strv(argv);
        free_strv(env);
        return send_error(chan, EINVAL, "NUL byte in cwd");
    }
    const struct field *ft = find_field(fs, n, F_TIMEOUT_MS);
    uint64_t timeout_ms = ft ? field_u64(ft) : 0;
    int want_stdin = find_field(fs, n, F_STDIN) != NULL;
    const struct field *fp = find_field(fs, n, F_PTY);
    int master = -1;
    char *tty = NULL;

    int outp[2], errp[2], inp[2] = {-1, -1}, ep[2];
    if (pipe2(outp, O_CLOEXEC) || pipe2(errp, O_CLOEXEC) || pipe2(ep, O_CLOEXEC) ||
        (want_stdin ? pipe2(inp, O_CLOEXEC) : 0)) {
        send_error(chan, errno, "pipe: %s", strerror(errno));
        goto out;
    }
    if (!want_stdin) {
        inp[0] = open("/dev/null", O_RDONLY | O_CLOEXEC);
    }
    if (fp) { /* cols << 16 | rows */
        uint64_t size = field_u64(fp);
        struct winsize ws = {.ws_row = (unsigned short)(size & 0xffff),
                             .ws_col = (unsigned short)((size >> 16) & 0xffff)};
        master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
        if (master < 0 || grantpt(master) || unlockpt(master) || !(tty = ptsname(master))) {
            send_error(chan, errno, "pty: %s", strerror(errno));
            if (master >= 0) close(master);
            close(outp[0]); close(outp[1]); close(errp[0]); close(errp[1]);
            close(ep[0]); close(ep[1]);
            if (inp[0] >= 0) close(inp[0]);
            if (inp[1] >= 0) close(inp[1]);
            goto out;
        }
        ioctl(master, TIOCSWINSZ, &ws);
        tty = strdup(tty);
    }

    const struct field *ftr = find_field(fs, n, F_TRACE);
    int traced = ftr != NULL;
    if (traced) pt_prepare();
    struct exec *e = calloc(1, sizeof *e);
    e->chan = chan;
    e->exempt = find_field(fs, n, F_EXEMPT) != NULL;
    pid_t pid = spawn_in_cgroup(e);
    if (pid == 0)
        exec_child(argv, env, cwd, &u, inp[0], outp[1], errp[1], ep[1], tty);
    close(outp[1]);
    close(errp[1]);
    close(ep[1]);
    if (inp[0] >= 0) close(inp[0]);
    if (pid < 0) {
        send_error(chan, errno, "fork: %s", strerror(errno));
        close(outp[0]); close(errp[0]); close(ep[0]);
        if (inp[1] >= 0) close(inp[1]);
        if (master >= 0) close(master);
        remove_cgroup(e->cgroup);
        free(e);
        goto out;
    }
    /* exec failures (missing binary, bad cwd, bad user) come back as an errno */
    uint8_t eb[5];
    ssize_t r;
    policy_wait_child(ep[0], pid, find_field(fs, n, F_WRAPPER) != NULL, e->exempt);
    do r = read(ep[0], eb, 5); while (r < 0 && errno == EINTR);
    close(ep[0]);
    if (r == 5) {
        int err = (int)get32(eb);
        waitpid(pid, NULL, 0);
        if (eb[4] == 1) send_error(chan, err, "cannot switch to user %s: %s", u.name, strerror(err));
        else if (eb[4] == 2) send_error(chan, err, "cannot change to directory %s: %s", cwd ? cwd : u.home, strerror(err));
        else send_error(chan, err, "cannot run %s: %s", argv[0], strerror(err));
        close(outp[0]); close(errp[0]);
        if (inp[1] >= 0) close(inp[1]);
        if (master >= 0) close(master);
        remove_cgroup(e->cgroup);
        free(e);
        goto out;
    }
    e->pid = pid;
    if (traced) pt_exec_started(chan, field_u64(ftr), pid, u.uid, argv, cwd ? cwd : u.home);
    e->out_fd = outp[0];
    e->err_fd = errp[0];
    e->in_fd = inp[1];
    if (master >= 0) { /* the terminal carries both directions; the pipes stay unused */
        close(outp[0]);
        close(errp[0]);
        if (inp[1] >= 0) close(inp[1]);
        e->pty = 1;
        e->out_fd = master;
        e->err_fd = -1;
        e->in_fd = dup(master);
    }
    set_nonblock(e->out_fd);
    set_nonblock(e->err_fd);
    if (e->in_fd >= 0) set_nonblock(e->in_fd);
    e->deadline = timeout_ms ? now_ms() + (int64_t)timeout_ms : 0;
    e->next = execs;
    execs = e;
    uint8_t pb[4];
    put32(pb, (uint32_t)pid);
    send_frame(chan, M_STARTED, pb, 4, NULL, 0);
out:
    free_strv(argv);
    free_strv(env);
    free(cwd);
    free(tty);
}

static void handle_resize(uint32_t chan, const uint8_t *p, uint32_t len) {
    struct exec *e = find_exec(chan);
    if (!e || !e->pty || e->out_fd < 0 || len < 8) return;
    struct winsize ws = {.ws_col = (unsigned short)get32(p), .ws_row = (unsigned short)get32(p + 4)};
    ioctl(e->out_fd, TIOCSWINSZ, &ws);
}

static void kill_tree(struct exec *e, int sig) {
    if (e->cgroup[0] && sig == SIGKILL) {
        char p[128];
        snprintf(p, sizeof p, "%s/cgroup.kill", e->cgroup);
        write_file(p, "1");
    }
    kill(-e->pid, sig);
    kill(e->pid, sig);
}

/* Forwards what a pipe holds now, as far as the window allows: PUMP_EOF once the pipe is
   closed, PUMP_DRAINED when it is empty for now, PUMP_MORE when it stopped early. */
enum { PUMP_EOF, PUMP_DRAINED, PUMP_MORE };

static int pump(struct exec *e, int *fd, uint8_t type, size_t *budget) {
    static uint8_t buf[64 << 10];
    while (*fd >= 0) {
        if (e->inflight >= WINDOW || *budget == 0) return PUMP_MORE;
        size_t want = WINDOW - e->inflight;
        if (want > sizeof buf) want = sizeof buf;
        if (want > *budget) want = *budget;
        ssize_t n = read(*fd, buf, want);
        if (n > 0) {
            send_frame(e->chan, type, buf, (size_t)n, NULL, 0);
            e->inflight += (uint32_t)n;
            *budget -= (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno == EAGAIN) return PUMP_DRAINED;
        close(*fd);
        *fd = -1;
        return PUMP_EOF;
    }
    return PUMP_EOF;
}

static int cgroup_empty(const char *path) {
    char p[128], buf[64];
    snprintf(p, sizeof p, "%s/cgroup.events", path);
    int fd = open(p, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    buf[n > 0 ? n : 0] = 0;
    return strstr(buf, "populated 0") != NULL;
}

static void remove_cgroup(const char *path) {
    if (!path[0]) return;
    if (n_free_cgroups < 64 && cgroup_empty(path)) {
        snprintf(free_cgroups[n_free_cgroups++], 64, "%s", path);
        return;
    }
    if (rmdir(path) == 0 || errno == ENOENT) return;
    struct pending_cg *p = calloc(1, sizeof *p); /* still has background processes */
    snprintf(p->path, sizeof p->path, "%s", path);
    p->next = pending_cgroups;
    pending_cgroups = p;
}

static void finish_exec(struct exec *e) {
    int status = e->status;
    if (e->out_fd >= 0) close(e->out_fd);
    if (e->err_fd >= 0) close(e->err_fd);
    if (e->in_fd >= 0) close(e->in_fd);
    if (e->timed_out) kill_tree(e, SIGKILL);
    watch_exec_finished(e);
    uint8_t r[9];
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    int sig = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    put32(r, (uint32_t)code);
    put32(r + 4, (uint32_t)sig);
    r[8] = (uint8_t)e->timed_out;
    pt_exec_finished(e->chan);
    send_frame(e->chan, M_EXIT, r, 9, NULL, 0);
    remove_cgroup(e->cgroup);
    struct exec **pp = &execs;
    while (*pp != e) pp = &(*pp)->next;
    *pp = e->next;
    free(e->inbuf);
    free(e);
}

static void reap(void) {
    int status;
    pid_t pid;
    pt_read(); /* exit events first: a zombie's CPU time is still readable */
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        for (struct exec *e = execs; e; e = e->next)
            if (e->pid == pid) {
                e->exited = 1;
                e->status = status;
                e->tail = 4u << 20;
                break;
            }
    }
}

/* An exited command ends once what it wrote before exiting is sent: its pipes are empty
   (or closed; background processes may keep them open) and the host has taken it all. */
static void settle_execs(void) {
    struct exec *e = execs;
    while (e) {
        struct exec *next = e->next;
        if (e->exited) {
            int out = pump(e, &e->out_fd, M_STDOUT, &e->tail);
            int err = out == PUMP_MORE ? PUMP_MORE : pump(e, &e->err_fd, M_STDERR, &e->tail);
            if ((out != PUMP_MORE && err != PUMP_MORE) || e->tail == 0) finish_exec(e);
        }
        e = next;
    }
}

static void handle_stdin(uint32_t chan, const uint8_t *p, uint32_t len) {
    struct exec *e = find_exec(chan);
    if (!e || e->in_fd < 0) return; /* exec already over: input is moot */
    if (len == 0) {
        e->stdin_eof = 1;
    } else {
        e->inbuf = realloc(e->inbuf, e->inlen + len);
        memcpy(e->inbuf + e->inlen, p, len);
        e->inlen += len;
    }
}

static void flush_stdin(struct exec *e) {
    while (e->inlen > 0) {
        ssize_t n = write(e->in_fd, e->inbuf, e->inlen);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) return;
            e->inlen = 0; /* reader went away */
            e->stdin_eof = 1;
            break;
        }
        memmove(e->inbuf, e->inbuf + n, e->inlen - (size_t)n);
        e->inlen -= (size_t)n;
    }
    if (e->stdin_eof && e->inlen == 0) {
        if (e->pty) { /* a terminal has no end of input but the EOF character */
            char eot = 4;
            if (write(e->in_fd, &eot, 1) < 0) { /* the program is gone */ }
        }
        close(e->in_fd);
        e->in_fd = -1;
    }
}

/* ---- files ------------------------------------------------------------------------------ */

static char *request_path(uint32_t chan, const struct field *fs, int n) {
    const struct field *f = find_field(fs, n, F_PATH);
    char *path = f ? field_str(f) : NULL;
    if (!path || path[0] != '/') {
        send_error(chan, EINVAL, "path must be absolute and free of NUL bytes");
        free(path);
        return NULL;
    }
    return path;
}

#define PARSE_OR_FAIL()                                                     \
    static struct field fs[64];                                             \
    int n = parse_fields(p, len, fs, 64);                                   \
    if (n < 0) return send_error(chan, EINVAL, "malformed request");        \
    char *path = request_path(chan, fs, n);                                 \
    if (!path) return;

static void handle_read(uint32_t chan, const uint8_t *p, uint32_t len) {
    PARSE_OR_FAIL();
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0) {
        send_error(chan, errno, "%s: %s", path, strerror(errno));
    } else if (fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) {
        send_error(chan, EISDIR, "%s: %s", path, strerror(EISDIR));
        close(fd);
    } else {
        struct reader *r = calloc(1, sizeof *r);
        r->chan = chan;
        r->fd = fd;
        r->next = readers;
        readers = r;
    }
    free(path);
}

static int readers_ready(void) {
    for (struct reader *r = readers; r; r = r->next)
        if (r->inflight < WINDOW) return 1;
    return 0;
}

/* One chunk per active read per loop turn, so a large download never stalls execs. */
static void pump_readers(void) {
    static uint8_t buf[CHUNK];
    struct reader **pp = &readers;
    while (*pp) {
        struct reader *r = *pp;
        if (r->inflight >= WINDOW) { /* waits for the host to take what it has */
            pp = &r->next;
            continue;
        }
        size_t want = WINDOW - r->inflight < sizeof buf ? WINDOW - r->inflight : sizeof buf;
        ssize_t n = read(r->fd, buf, want);
        if (n > 0) {
            send_frame(r->chan, M_DATA, buf, (size_t)n, NULL, 0);
            r->inflight += (uint32_t)n;
            pp = &r->next;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) send_error(r->chan, errno, "read: %s", strerror(errno));
        else send_frame(r->chan, M_END, NULL, 0, NULL, 0);
        close(r->fd);
        *pp = r->next;
        free(r);
    }
}

static int mkdirs(const char *path, mode_t mode) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s", path);
    for (char *s = tmp + 1; *s; s++)
        if (*s == '/') {
            *s = 0;
            if (mkdir(tmp, mode) && errno != EEXIST) return -1;
            *s = '/';
        }
    if (mkdir(tmp, mode) && errno != EEXIST) return -1;
    struct stat st;
    if (stat(tmp, &st)) return -1;
    if (!S_ISDIR(st.st_mode)) { errno = ENOTDIR; return -1; }
    return 0;
}

static struct writer *find_writer(uint32_t chan) {
    for (struct writer *w = writers; w; w = w->next)
        if (w->chan == chan) return w;
    return NULL;
}

static void handle_write(uint32_t chan, const uint8_t *p, uint32_t len) {
    PARSE_OR_FAIL();
    const struct field *fm = find_field(fs, n, F_MODE);
    mode_t mode = fm ? (mode_t)field_u64(fm) & 07777 : 0644;
    struct writer *w = calloc(1, sizeof *w);
    w->chan = chan;
    w->fd = -1;
    w->next = writers;
    writers = w;
    snprintf(w->dst, sizeof w->dst, "%s", path);
    char *slash = strrchr(path, '/');
    char dir[4096];
    snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
    if (!dir[0]) strcpy(dir, "/");
    struct stat st;
    if (slash[1] == 0) {
        w->err = EISDIR;
    } else if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
        w->err = EISDIR;
    } else if (find_field(fs, n, F_PARENTS) && mkdirs(dir, 0755)) {
        w->err = errno;
    } else {
        snprintf(w->tmp, sizeof w->tmp, "%s/.cella-%u-%ld.tmp", dir, chan, (long)now_ms());
        w->fd = open(w->tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
        if (w->fd < 0) w->err = errno;
        else fchmod(w->fd, mode); /* not subject to umask */
        /* metadata goes on the new file before it replaces the old one, so an overwrite
           keeps none of the old file's and a rename keeps all of it */
        for (int i = 0; i < n && w->fd >= 0 && !w->err; i++) {
            if (fs[i].tag != F_XATTR) continue;
            const uint8_t *nul = memchr(fs[i].val, 0, fs[i].len);
            size_t kl = nul ? (size_t)(nul - fs[i].val) : 0;
            char name[256];
            if (!nul || kl == 0 || kl + sizeof XATTR_PREFIX > sizeof name) { w->err = EINVAL; break; }
            snprintf(name, sizeof name, "%s%.*s", XATTR_PREFIX, (int)kl, (const char *)fs[i].val);
            if (fsetxattr(w->fd, name, nul + 1, fs[i].len - kl - 1, 0)) w->err = errno;
        }
        if (w->err && w->fd >= 0) { close(w->fd); unlink(w->tmp); w->fd = -1; }
    }
    free(path);
}

static void handle_wdata(uint32_t chan, const uint8_t *p, uint32_t len) {
    struct writer *w = find_writer(chan);
    if (!w || w->err) return;
    while (len > 0) {
        ssize_t n = write(w->fd, p, len);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) { w->err = errno; return; }
        p += n;
        len -= (uint32_t)n;
    }
}

/* A payload of 0x01 aborts the write: the temporary file goes, the target is untouched. */
static void handle_wend(uint32_t chan, const uint8_t *p, uint32_t len) {
    struct writer *w = find_writer(chan);
    if (!w) return send_error(chan, EINVAL, "no write in progress");
    if (w->fd >= 0 && close(w->fd) && !w->err) w->err = errno;
    if (len == 1 && p[0] == 1 && !w->err) w->err = ECANCELED;
    if (!w->err && rename(w->tmp, w->dst)) w->err = errno;
    if (w->err) {
        if (w->fd >= 0) unlink(w->tmp);
        send_error(chan, w->err, "%s: %s", w->dst, strerror(w->err));
    } else {
        send_ok(chan);
    }
    struct writer **pp = &writers;
    while (*pp != w) pp = &(*pp)->next;
    *pp = w->next;
    free(w);
}

/* entry: kind u8, mode u32, size u64, mtime_ns u64, uid u32, gid u32, name, target */
static size_t encode_entry(uint8_t *out, size_t cap, const char *name, const char *full,
                           const struct stat *st) {
    char target[4096] = "";
    if (S_ISLNK(st->st_mode)) {
        ssize_t t = readlink(full, target, sizeof target - 1);
        target[t > 0 ? t : 0] = 0;
    }
    size_t nl = strlen(name), tl = strlen(target);
    size_t need = 1 + 4 + 8 + 8 + 4 + 4 + 2 + nl + 2 + tl;
    if (need > cap) return 0;
    uint8_t *q = out;
    *q++ = S_ISREG(st->st_mode) ? 'f' : S_ISDIR(st->st_mode) ? 'd' : S_ISLNK(st->st_mode) ? 'l' : 'o';
    put32(q, st->st_mode & 07777); q += 4;
    put64(q, (uint64_t)st->st_size); q += 8;
    put64(q, (uint64_t)st->st_mtim.tv_sec * 1000000000ull + (uint64_t)st->st_mtim.tv_nsec); q += 8;
    put32(q, st->st_uid); q += 4;
    put32(q, st->st_gid); q += 4;
    q[0] = (uint8_t)(nl >> 8); q[1] = (uint8_t)nl; q += 2;
    memcpy(q, name, nl); q += nl;
    q[0] = (uint8_t)(tl >> 8); q[1] = (uint8_t)tl; q += 2;
    memcpy(q, target, tl); q += tl;
    return (size_t)(q - out);
}

/* The entry's metadata (XATTR_PREFIX attributes, the prefix taken off) as records after
   it: kind 'x', zeros, the key as the name and the value as the target. What does not fit
   in `cap` is left out. */
static size_t encode_xattrs(uint8_t *out, size_t cap, const char *full) {
    char names[8192];
    ssize_t nl = llistxattr(full, names, sizeof names);
    size_t used = 0;
    for (ssize_t off = 0; nl > 0 && off < nl; off += (ssize_t)strlen(names + off) + 1) {
        const char *name = names + off;
        if (strncmp(name, XATTR_PREFIX, strlen(XATTR_PREFIX))) continue;
        char value[4096];
        ssize_t vl = lgetxattr(full, name, value, sizeof value);
        if (vl < 0) continue;
        const char *key = name + strlen(XATTR_PREFIX);
        size_t kl = strlen(key);
        size_t need = 1 + 4 + 8 + 8 + 4 + 4 + 2 + kl + 2 + (size_t)vl;
        if (used + need > cap) break;
        uint8_t *q = out + used;
        *q++ = 'x';
        memset(q, 0, 28); q += 28;
        q[0] = (uint8_t)(kl >> 8); q[1] = (uint8_t)kl; q += 2;
        memcpy(q, key, kl); q += kl;
        q[0] = (uint8_t)((size_t)vl >> 8); q[1] = (uint8_t)vl; q += 2;
        memcpy(q, value, (size_t)vl); q += vl;
        used += need;
    }
    return used;
}

static void handle_stat(uint32_t chan, const uint8_t *p, uint32_t len) {
    PARSE_OR_FAIL();
    struct stat st;
    static uint8_t buf[16384];
    if (lstat(path, &st)) {
        send_error(chan, errno, "%s: %s", path, strerror(errno));
    } else {
        const char *base = strrchr(path, '/') + 1;
        size_t m = encode_entry(buf, sizeof buf, *base ? base : "/", path, &st);
        if (find_field(fs, n, F_XATTRS)) m += encode_xattrs(buf + m, sizeof buf - m, path);
        send_frame(chan, M_OK, buf, m, NULL, 0);
    }
    free(path);
}

static void handle_list(uint32_t chan, const uint8_t *p, uint32_t len) {
    PARSE_OR_FAIL();
    DIR *d = opendir(path);
    if (!d) {
        send_error(chan, errno, "%s: %s", path, strerror(errno));
        free(path);
        return;
    }
    static uint8_t buf[MAX_FRAME];
    static uint8_t one[16384]; /* an entry and its metadata: never split between frames */
    int xattrs = find_field(fs, n, F_XATTRS) != NULL;
    size_t used = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        char full[8192];
        snprintf(full, sizeof full, "%s/%s", strcmp(path, "/") ? path : "", de->d_name);
        struct stat st;
        if (lstat(full, &st)) continue;
        size_t m = encode_entry(one, sizeof one, de->d_name, full, &st);
        if (m == 0) continue;
        if (xattrs) m += encode_xattrs(one + m, sizeof one - m, full);
        if (used + m > sizeof buf) { /* frame full: send what we have, keep going */
            send_frame(chan, M_DATA, buf, used, NULL, 0);
            used = 0;
        }
        memcpy(buf + used, one, m);
        used += m;
    }
    closedir(d);
    if (used) send_frame(chan, M_DATA, buf, used, NULL, 0);
    send_frame(chan, M_END, NULL, 0, NULL, 0);
    free(path);
}

static void handle_mkdir(uint32_t chan, const uint8_t *p, uint32_t len) {
    PARSE_OR_FAIL();
    const struct field *fm = find_field(fs, n, F_MODE);
    mode_t mode = fm ? (mode_t)field_u64(fm) & 07777 : 0755;
    int rc = find_field(fs, n, F_PARENTS) ? mkdirs(path, mode) : mkdir(path, mode);
    if (rc) send_error(chan, errno, "%s: %s", path, strerror(errno));
    else send_ok(chan);
    free(path);
}

static int remove_tree(const char *path) {
    struct stat st;
    if (lstat(path, &st)) return -1;
    if (!S_ISDIR(st.st_mode)) return unlink(path);
    DIR *d = opendir(path);
    if (!d) return -1;
    struct dirent *de;
    int rc = 0;
    while ((de = readdir(d)) && rc == 0) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        char full[8192];
        snprintf(full, sizeof full, "%s/%s", path, de->d_name);
        rc = remove_tree(full);
    }
    closedir(d);
    return rc ? rc : rmdir(path);
}

static void handle_remove(uint32_t chan, const uint8_t *p, uint32_t len) {
    PARSE_OR_FAIL();
    int rc;
    if (!strcmp(path, "/")) {
        errno = EPERM;
        rc = -1;
    } else if (find_field(fs, n, F_RECURSIVE)) {
        rc = remove_tree(path);
    } else {
        rc = remove(path);
    }
    if (rc) send_error(chan, errno, "%s: %s", path, strerror(errno));
    else send_ok(chan);
    free(path);
}

static void handle_chmod(uint32_t chan, const uint8_t *p, uint32_t len) {
    PARSE_OR_FAIL();
    const struct field *fm = find_field(fs, n, F_MODE);
    if (!fm) send_error(chan, EINVAL, "mode required");
    else if (chmod(path, (mode_t)field_u64(fm) & 07777))
        send_error(chan, errno, "%s: %s", path, strerror(errno));
    else send_ok(chan);
    free(path);
}

/* Fresh identity after a restore or fork: hostname, wall clock, entropy. */
static void handle_identity(uint32_t chan, const uint8_t *p, uint32_t len) {
    static struct field fs[16];
    int n = parse_fields(p, len, fs, 16);
    if (n < 0) return send_error(chan, EINVAL, "malformed request");
    const struct field *f;
    if ((f = find_field(fs, n, F_HOSTNAME)) && sethostname((const char *)f->val, f->len))
        return send_error(chan, errno, "sethostname: %s", strerror(errno));
    if ((f = find_field(fs, n, F_TIME_NS))) {
        uint64_t ns = field_u64(f);
        struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000ull), .tv_nsec = (long)(ns % 1000000000ull)};
        if (clock_settime(CLOCK_REALTIME, &ts))
            return send_error(chan, errno, "clock_settime: %s", strerror(errno));
    }
    if ((f = find_field(fs, n, F_SANDBOX_ID)) && f->len < sizeof sandbox_id) {
        memcpy(sandbox_id, f->val, f->len);
        sandbox_id[f->len] = 0;
        if (sandbox_id_fd >= 0 && (pwrite(sandbox_id_fd, sandbox_id, f->len, 0) < 0 ||
                                   ftruncate(sandbox_id_fd, (off_t)f->len))) {
            /* best effort: the variable in every exec's environment is what counts */
        }
    }
    if ((f = find_field(fs, n, F_PIDS_MAX)) && pids_max_fd >= 0) {
        char v[24];
        uint64_t max = field_u64(f);
        if (max) snprintf(v, sizeof v, "%llu", (unsigned long long)max);
        else snprintf(v, sizeof v, "max");
        if (pwrite(pids_max_fd, v, strlen(v), 0) < 0)
            return send_error(chan, errno, "pids.max: %s", strerror(errno));
    }
    if ((f = find_field(fs, n, F_SEED)) && f->len > 0 && f->len <= 512) {
        struct { int entropy_count; int buf_size; uint8_t buf[512]; } ent;
        ent.entropy_count = (int)f->len * 8;
        ent.buf_size = (int)f->len;
        memcpy(ent.buf, f->val, f->len);
        int fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
        /* mix the host's bytes in, then force a reseed: a restored CRNG must not repeat */
        int rc = fd < 0 ? -1 : ioctl(fd, RNDADDENTROPY, &ent);
        if (rc == 0) rc = ioctl(fd, RNDRESEEDCRNG);
        int err = errno;
        if (fd >= 0) close(fd);
        if (rc) return send_error(chan, err, "reseed: %s", strerror(err));
    }
    send_ok(chan);
}

static void set_addr(int s, unsigned long req, const char *ifname, const char *addr);

/* ---- streams: guest connections carried to the host ------------------------------------ */

struct stream {
    uint32_t chan;
    int fd;
    uint8_t *out;      /* host data not yet written to the socket */
    size_t outlen;
    uint32_t inflight; /* socket data sent to the host, not yet acknowledged */
    int rd_eof;        /* the guest side closed its writing half (sent as an empty frame) */
    int wr_eof;        /* the host closed its writing half: shut ours once `out` is empty */
    int connecting;    /* opened by the host: OK (or the error) once the connect completes */
    struct stream *next;
};
static struct stream *streams;
static int n_streams;
static uint32_t next_stream = 1;
static const int egress_ports[] = {80, 443, 3128};
#define N_LISTEN (sizeof egress_ports / sizeof egress_ports[0])
static int listen_fds[N_LISTEN] = {-1, -1, -1};

static struct stream *stream_by_fd(int fd) {
    for (struct stream *t = streams; t; t = t->next)
        if (t->fd == fd) return t;
    return NULL;
}

static struct stream *find_stream(uint32_t chan) {
    for (struct stream *t = streams; t; t = t->next)
        if (t->chan == chan) return t;
    return NULL;
}

static void drop_stream(struct stream *t, int tell_host) {
    if (tell_host) send_frame(t->chan, M_SCLOSE, NULL, 0, NULL, 0);
    close(t->fd);
    struct stream **pp = &streams;
    while (*pp != t) pp = &(*pp)->next;
    *pp = t->next;
    free(t->out);
    free(t);
    n_streams--;
}

/* The host went away (a daemon restart): every connection it carried is closed, so the
   guest's programs see them end (and connect again) instead of waiting forever for a host
   end that is gone; a new host cannot resume them. */
static void host_gone(void) {
    if (!port_hup) logf_("host disconnected: closing %d carried connections", n_streams);
    port_hup = 1;
    while (streams) drop_stream(streams, 0);
}

/* The egress address on loopback (the VM has no NIC), and a listener per egress port. */
static void open_listeners(void) {
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s >= 0) {
        struct ifreq ifr = {0};
        set_addr(s, SIOCSIFADDR, "lo:1", EGRESS_ADDR);
        set_addr(s, SIOCSIFNETMASK, "lo:1", "255.255.255.255");
        strcpy(ifr.ifr_name, "lo:1");
        if (ioctl(s, SIOCGIFFLAGS, &ifr) == 0) {
            ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
            ioctl(s, SIOCSIFFLAGS, &ifr);
        }
        close(s);
    }
    for (size_t i = 0; i < N_LISTEN; i++) {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        int one = 1;
        struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(egress_ports[i])};
        inet_pton(AF_INET, EGRESS_ADDR, &sa.sin_addr);
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof sa) || listen(fd, 128)) {
            logf_("egress listener :%d: %s", egress_ports[i], strerror(errno));
            if (fd >= 0) close(fd);
            fd = -1;
        }
        listen_fds[i] = fd;
    }
}

static void accept_streams(int lfd, int dport) {
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) return;
        if (n_streams >= MAX_STREAMS || port_hup) { /* no host to carry it, or too many */
            close(fd);
            continue;
        }
        struct stream *t = calloc(1, sizeof *t);
        t->chan = STREAM_BIT | next_stream++;
        if (next_stream >= STREAM_BIT) next_stream = 1;
        t->fd = fd;
        t->next = streams;
        streams = t;
        n_streams++;
        pt_stream_owner(fd, t->chan);
        uint8_t p[4];
        put32(p, (uint32_t)dport);
        send_frame(t->chan, M_SOPEN, p, 4, NULL, 0);
    }
}

/* The host opens a connection to a port inside the guest (port forwarding): the stream is
   the host's channel; it is answered with OK, or the errno of the failed connect. */
static void handle_connect(uint32_t chan, const uint8_t *p, uint32_t len) {
    if (len < 4) return send_error(chan, EINVAL, "connect: no port");
    if (find_stream(chan)) return send_error(chan, EINVAL, "channel %u already in use", chan);
    if (n_streams >= MAX_STREAMS) return send_error(chan, EMFILE, "too many streams");
    uint32_t port_no = get32(p);
    if (port_no == 0 || port_no > 65535) return send_error(chan, EINVAL, "bad port %u", port_no);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port_no)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || (connect(fd, (struct sockaddr *)&sa, sizeof sa) && errno != EINPROGRESS)) {
        int err = errno;
        if (fd >= 0) close(fd);
        return send_error(chan, err, "connect to port %u: %s", port_no, strerror(err));
    }
    struct stream *t = calloc(1, sizeof *t);
    t->chan = chan;
    t->fd = fd;
    t->connecting = 1;
    t->next = streams;
    streams = t;
    n_streams++;
}

static void stream_connected(struct stream *t) {
    int err = 0;
    socklen_t el = sizeof err;
    getsockopt(t->fd, SOL_SOCKET, SO_ERROR, &err, &el);
    if (err) {
        send_error(t->chan, err, "connect: %s", strerror(err));
        drop_stream(t, 0);
        return;
    }
    t->connecting = 0;
    send_ok(t->chan);
}

static void stream_read(struct stream *t) {
    static uint8_t buf[64 << 10];
    if (t->rd_eof) return; /* a hang-up after our EOF: the write side will notice */
    size_t want = WINDOW - t->inflight < sizeof buf ? WINDOW - t->inflight : sizeof buf;
    ssize_t n = read(t->fd, buf, want);
    if (n > 0) {
        send_frame(t->chan, M_SDATA, buf, (size_t)n, NULL, 0);
        t->inflight += (uint32_t)n;
    } else if (n == 0) {
        t->rd_eof = 1;
        send_frame(t->chan, M_SDATA, NULL, 0, NULL, 0);
    } else if (errno != EAGAIN && errno != EINTR) {
        drop_stream(t, 1);
        return;
    }
    if (t->rd_eof && t->wr_eof && t->outlen == 0) drop_stream(t, 1);
}

static void stream_write(struct stream *t) {
    size_t done = 0;
    while (done < t->outlen) {
        ssize_t n = write(t->fd, t->out + done, t->outlen - done);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno == EAGAIN) break;
        if (n < 0) {
            drop_stream(t, 1);
            return;
        }
        done += (size_t)n;
    }
    if (done) {
        memmove(t->out, t->out + done, t->outlen - done);
        t->outlen -= done;
        uint8_t p[4];
        put32(p, (uint32_t)done);
        send_frame(t->chan, M_ACK, p, 4, NULL, 0);
    }
    if (t->outlen == 0 && t->wr_eof) {
        shutdown(t->fd, SHUT_WR);
        if (t->rd_eof) drop_stream(t, 1);
    }
}

static void handle_sdata(uint32_t chan, const uint8_t *p, uint32_t len) {
    struct stream *t = find_stream(chan);
    if (!t) { /* a stream this agent does not know (e.g. from before a snapshot) */
        send_frame(chan, M_SCLOSE, NULL, 0, NULL, 0);
        return;
    }
    if (len == 0) {
        t->wr_eof = 1;
    } else {
        t->out = realloc(t->out, t->outlen + len);
        memcpy(t->out + t->outlen, p, len);
        t->outlen += len;
    }
    stream_write(t);
}

static void handle_ack(uint32_t chan, const uint8_t *p, uint32_t len) {
    if (len < 4) return;
    uint32_t n = get32(p);
    struct exec *e;
    struct stream *t;
    if ((t = find_stream(chan))) {
        t->inflight = n > t->inflight ? 0 : t->inflight - n;
    } else if ((e = find_exec(chan))) {
        e->inflight = n > e->inflight ? 0 : e->inflight - n;
    } else {
        for (struct reader *r = readers; r; r = r->next)
            if (r->chan == chan) r->inflight = n > r->inflight ? 0 : r->inflight - n;
    }
}

/* ---- dispatch ---------------------------------------------------------------------------- */

static void dispatch(uint32_t chan, uint8_t type, const uint8_t *p, uint32_t len) {
    switch (type) {
    case T_PING: send_frame(chan, M_PONG, AGENT_VERSION, strlen(AGENT_VERSION), NULL, 0); break;
    case T_EXEC: handle_exec(chan, p, len); break;
    case T_STDIN: handle_stdin(chan, p, len); break;
    case T_KILL: {
        struct exec *e = find_exec(chan);
        int sig = len >= 4 ? (int)get32(p) : SIGKILL;
        if (e && sig > 0 && sig < 65) kill_tree(e, sig);
        break;
    }
    case T_READ: handle_read(chan, p, len); break;
    case T_WRITE: handle_write(chan, p, len); break;
    case T_WDATA: handle_wdata(chan, p, len); break;
    case T_WEND: handle_wend(chan, p, len); break;
    case T_LIST: handle_list(chan, p, len); break;
    case T_STAT: handle_stat(chan, p, len); break;
    case T_MKDIR: handle_mkdir(chan, p, len); break;
    case T_REMOVE: handle_remove(chan, p, len); break;
    case T_CHMOD: handle_chmod(chan, p, len); break;
    case T_IDENTITY: handle_identity(chan, p, len); break;
    case T_CONNECT: handle_connect(chan, p, len); break;
    case T_RESIZE: handle_resize(chan, p, len); break;
    case T_POLICY: handle_policy(chan, p, len); break;
    case T_ACK: handle_ack(chan, p, len); break;
    case T_SDATA: handle_sdata(chan, p, len); break;
    case T_SCLOSE: {
        struct stream *t = find_stream(chan);
        if (t) drop_stream(t, 0);
        break;
    }
    case T_SHUTDOWN:
        send_ok(chan);
        halt_with("shutdown requested");
        break;
    default: send_error(chan, EINVAL, "unknown message type 0x%02x", type);
    }
}

static uint8_t *rbuf;
static size_t rlen;

static void read_port(void) {
    ssize_t n = read(port, rbuf + rlen, HDR + MAX_FRAME - rlen);
    if (n == 0) { /* host end disconnected: back off until it returns */
        host_gone();
        rlen = 0;
        return;
    }
    if (n < 0) {
        if (errno != EINTR && errno != EAGAIN) host_gone();
        return;
    }
    rlen += (size_t)n;
    size_t off = 0;
    while (rlen - off >= HDR) {
        uint32_t flen = get32(rbuf + off);
        if (flen > MAX_FRAME) { /* out of sync: drop everything buffered */
            logf_("oversize frame (%u bytes), resetting", flen);
            rlen = off = 0;
            break;
        }
        if (rlen - off < HDR + flen) break;
        dispatch(get32(rbuf + off + 4), rbuf[off + 8], rbuf + off + HDR, flen);
        off += HDR + flen;
    }
    memmove(rbuf, rbuf + off, rlen - off);
    rlen -= off;
}

static int open_port(void) {
    for (int attempt = 0; attempt < 500; attempt++) {
        DIR *d = opendir("/sys/class/virtio-ports");
        struct dirent *de;
        while (d && (de = readdir(d))) {
            char p[512], name[64] = "";
            snprintf(p, sizeof p, "/sys/class/virtio-ports/%s/name", de->d_name);
            FILE *f = fopen(p, "re");
            if (!f) continue;
            if (fgets(name, sizeof name, f)) name[strcspn(name, "\n")] = 0;
            fclose(f);
            if (strcmp(name, PORT_NAME) == 0) {
                snprintf(p, sizeof p, "/dev/%s", de->d_name);
                closedir(d);
                int fd = open(p, O_RDWR | O_CLOEXEC);
                if (fd >= 0) return fd;
                logf_("open %s: %s", p, strerror(errno));
                d = NULL;
                break;
            }
        }
        if (d) closedir(d);
        usleep(10000);
    }
    return -1;
}

static void mount_fs(const char *src, const char *dst, const char *type, unsigned long fl,
                     const char *opts) {
    mkdir(dst, 0755);
    if (mount(src, dst, type, fl, opts) && errno != EBUSY)
        logf_("mount %s on %s: %s", type, dst, strerror(errno));
}

static void bring_up_loopback(void) {
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct ifreq ifr = {0};
    strcpy(ifr.ifr_name, "lo");
    if (s >= 0 && ioctl(s, SIOCGIFFLAGS, &ifr) == 0) {
        ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
        ioctl(s, SIOCSIFFLAGS, &ifr);
    }
    if (s >= 0) close(s);
}

static void set_addr(int s, unsigned long req, const char *ifname, const char *addr) {
    struct ifreq ifr = {0};
    snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "%s", ifname);
    struct sockaddr_in *sin = (struct sockaddr_in *)&ifr.ifr_addr;
    sin->sin_family = AF_INET;
    inet_pton(AF_INET, addr, &sin->sin_addr);
    if (ioctl(s, req, &ifr)) logf_("%s address %s: %s", ifname, addr, strerror(errno));
}

/*
 * The VM has no NIC: loopback is its only interface. Names are answered by the DNS stub
 * below; the egress address lives on loopback too (see `open_listeners`), so anything else
 * fails at once with ENETUNREACH.
 */
static void bring_up_network(void) {
    /* resolv.conf may be a dangling symlink in the template (systemd-resolved) */
    unlink("/etc/resolv.conf");
    int fd = open("/etc/resolv.conf", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    const char *conf = "nameserver " DNS_ADDR "\n";
    if (fd < 0 || write(fd, conf, strlen(conf)) < 0) logf_("resolv.conf: %s", strerror(errno));
    if (fd >= 0) close(fd);
}

/*
 * The DNS stub: A queries get the egress proxy's address (the proxy resolves the real name on
 * the host and decides), the guest's own name and localhost get loopback, everything else an
 * empty answer. Names are never resolved inside the guest.
 */
static int dns_fd = -1;

static void open_dns(void) {
    dns_fd = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(53)};
    inet_pton(AF_INET, DNS_ADDR, &sa.sin_addr);
    if (dns_fd >= 0 && bind(dns_fd, (struct sockaddr *)&sa, sizeof sa)) {
        logf_("dns stub: %s", strerror(errno));
        close(dns_fd);
        dns_fd = -1;
    }
}

static void answer_dns(void) {
    unsigned char q[512], r[600];
    struct sockaddr_in from;
    for (;;) {
        socklen_t fl = sizeof from;
        ssize_t n = recvfrom(dns_fd, q, sizeof q, 0, (struct sockaddr *)&from, &fl);
        if (n < 0) return;
        if (n < 12 || (q[2] & 0x80) || q[4] != 0 || q[5] != 1) continue; /* one question */
        char name[256];
        size_t pos = 12, len = 0;
        while (pos < (size_t)n && q[pos] && q[pos] < 64 && len + q[pos] + 1 < sizeof name) {
            if (len) name[len++] = '.';
            memcpy(name + len, q + pos + 1, q[pos]);
            len += q[pos];
            pos += q[pos] + 1;
        }
        if (pos + 5 > (size_t)n || q[pos]) continue;
        name[len] = 0;
        pos += 1;
        unsigned qtype = (unsigned)q[pos] << 8 | q[pos + 1];
        size_t qend = pos + 4;
        memcpy(r, q, qend);
        r[2] = 0x84 | (q[2] & 0x01); /* response, authoritative, keeps RD */
        r[3] = 0x80;                 /* recursion available, NOERROR */
        r[6] = r[7] = r[8] = r[9] = r[10] = r[11] = 0;
        size_t out = qend;
        if (qtype == 1) {
            char host[65] = "";
            gethostname(host, sizeof host - 1);
            int local = !strcasecmp(name, "localhost") || !strcasecmp(name, host);
            struct in_addr a;
            inet_pton(AF_INET, local ? "127.0.0.1" : EGRESS_ADDR, &a);
            unsigned char rr[16] = {0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 5, 0, 4};
            memcpy(rr + 12, &a, 4);
            memcpy(r + out, rr, sizeof rr);
            out += sizeof rr;
            r[7] = 1;
        }
        sendto(dns_fd, r, out, 0, (struct sockaddr *)&from, fl);
    }
}

static int cmdline_has(const char *word) {
    char buf[4096] = "";
    int fd = open("/proc/cmdline", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    buf[n > 0 ? n : 0] = 0;
    for (char *tok = strtok(buf, " \n"); tok; tok = strtok(NULL, " \n"))
        if (!strcmp(tok, word)) return 1;
    return 0;
}

#define MODULE_LIST "/cella-modules" /* a stock kernel's drivers, in load order (images/boot.py) */

/*
 * cella's own kernel has every driver built in; a stock distribution kernel (what serves
 * until that one is compiled) has virtio and the rest as modules, which the initramfs
 * carries with their order. A module that is already there (EEXIST) is fine.
 */
static void load_modules(void) {
    FILE *list = fopen(MODULE_LIST, "re");
    if (!list) return;
    char path[256];
    while (fgets(path, sizeof path, list)) {
        path[strcspn(path, "\n")] = 0;
        if (!path[0]) continue;
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0 || (syscall(SYS_finit_module, fd, "", 0) && errno != EEXIST))
            fprintf(stderr, "cella-agent: cannot load %s: %s\n", path, strerror(errno));
        if (fd >= 0) close(fd);
    }
    fclose(list);
}

/*
 * Stage one, as the initramfs's /init (INITRAMFS_MARK is there): load a stock kernel's
 * drivers if it needs any, mount the root disk and move into it.
 */
static void initramfs_stage(void) {
    mount_fs("proc", "/proc", "proc", 0, NULL);
    mount_fs("sysfs", "/sys", "sysfs", 0, NULL);
    mount_fs("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755");
    int console = open("/dev/console", O_WRONLY | O_CLOEXEC);
    if (console >= 0) { dup2(console, 1); dup2(console, 2); close(console); }
    if (cmdline_has("cella.probe")) { /* accelerator probe: booting this far is the answer */
        printf("CELLA-PROBE-OK\n");
        fflush(stdout);
        halt_with("probe done");
    }
    load_modules();
    struct stat st;
    for (int i = 0; stat("/dev/vda", &st); i++) {
        if (i > 2000) halt_with("no root disk (/dev/vda)");
        usleep(5000);
    }
    mkdir("/newroot", 0755);
    if (mount("/dev/vda", "/newroot", "ext4", MS_NOATIME, NULL))
        halt_with("cannot mount the root disk");
    const char *moves[] = {"/dev", "/proc", "/sys"};
    for (int i = 0; i < 3; i++) {
        char dst[64];
        snprintf(dst, sizeof dst, "/newroot%s", moves[i]);
        mkdir(dst, 0755);
        if (mount(moves[i], dst, NULL, MS_MOVE, NULL)) halt_with("cannot move mounts");
    }
    if (chdir("/newroot") || mount(".", "/", NULL, MS_MOVE, NULL) || chroot(".") || chdir("/"))
        halt_with("cannot switch to the root disk");
}

/*
 * Every exec lives under CGROUP_ROOT; the agent (PID 1) does not. Capping that subtree's
 * memory below the guest's RAM means a memory hog is OOM-killed inside its cgroup while the
 * agent keeps room to answer; pids.max (set per sandbox) stops fork bombs.
 */
static void limit_execs(void) {
    write_file("/sys/fs/cgroup/cgroup.subtree_control", "+pids +memory");
    pids_max_fd = open(CGROUP_ROOT "/pids.max", O_WRONLY | O_CLOEXEC);
    FILE *f = fopen("/proc/meminfo", "re");
    long long total_kb = 0;
    char line[256];
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "MemTotal: %lld kB", &total_kb) == 1) break;
    if (f) fclose(f);
    if (total_kb > 0) {
        long long reserve_kb = total_kb / 8 > 32768 ? total_kb / 8 : 32768;
        char v[32];
        snprintf(v, sizeof v, "%lld", (total_kb - reserve_kb) * 1024);
        write_file(CGROUP_ROOT "/memory.max", v);
        write_file(CGROUP_ROOT "/memory.swap.max", "0");
    }
}

static void init_system(void) {
    const unsigned long nsd = MS_NOSUID | MS_NODEV;
    mount_fs("proc", "/proc", "proc", nsd | MS_NOEXEC, NULL);
    mount_fs("sysfs", "/sys", "sysfs", nsd | MS_NOEXEC, NULL);
    mount_fs("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755");
    mount_fs("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "gid=5,mode=620,ptmxmode=666");
    mount_fs("tmpfs", "/dev/shm", "tmpfs", nsd, "mode=1777");
    mount_fs("cgroup2", "/sys/fs/cgroup", "cgroup2", nsd | MS_NOEXEC, NULL);
    mount_fs("tmpfs", "/run", "tmpfs", nsd, "mode=0755");
    if (access("/dev/ptmx", F_OK)) { if (symlink("pts/ptmx", "/dev/ptmx")) {} }
    if (access("/dev/fd", F_OK)) { if (symlink("/proc/self/fd", "/dev/fd")) {} }
    have_cgroups = mkdir(CGROUP_ROOT, 0755) == 0 || errno == EEXIST;
    if (have_cgroups) {
        char p[128];
        snprintf(p, sizeof p, "%s/cgroup.kill", CGROUP_ROOT);
        have_cgroups = access(p, F_OK) == 0;
    }
    if (have_cgroups) limit_execs();
    sethostname("cella", 5);
    mkdir("/run/cella", 0755);
    sandbox_id_fd = open("/run/cella/sandbox-id", O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    bring_up_loopback();
    bring_up_network();
    struct rlimit rl = {65536, 65536};
    setrlimit(RLIMIT_NOFILE, &rl);
}

int main(void) {
    if (getpid() == 1) {
        if (access(INITRAMFS_MARK, F_OK) == 0) initramfs_stage();
        init_system();
    }
    signal(SIGPIPE, SIG_IGN);
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    int sfd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
    port = open_port();
    if (port < 0) {
        logf_("no virtio port named %s", PORT_NAME);
        if (getpid() == 1) halt_with("no agent port");
        return 1;
    }
    open_dns();
    open_listeners();
    watch_init();
    rbuf = malloc(HDR + MAX_FRAME);
    logf_("ready (%s)", have_cgroups ? "cgroup kill" : "process-group kill");

    struct pollfd *pfds = NULL;
    size_t pcap = 0;
    int64_t last_cg_sweep = now_ms();
    for (;;) {
        size_t need = 3 + N_LISTEN + WATCH_FDS + 1;
        for (struct exec *e = execs; e; e = e->next) need += 3;
        for (struct stream *t = streams; t; t = t->next) need += 1;
        if (need > pcap) {
            pcap = need * 2;
            pfds = realloc(pfds, pcap * sizeof *pfds);
        }
        size_t np = 0;
        pfds[np++] = (struct pollfd){.fd = port_hup ? -1 : port, .events = POLLIN};
        pfds[np++] = (struct pollfd){.fd = sfd, .events = POLLIN};
        pfds[np++] = (struct pollfd){.fd = dns_fd, .events = POLLIN};
        int64_t now = now_ms();
        int timeout = -1;
        for (struct exec *e = execs; e; e = e->next) {
            int room = e->inflight < WINDOW; /* else wait for the host's acknowledgement */
            pfds[np++] = (struct pollfd){.fd = room ? e->out_fd : -1, .events = POLLIN};
            pfds[np++] = (struct pollfd){.fd = room ? e->err_fd : -1, .events = POLLIN};
            pfds[np++] = (struct pollfd){.fd = e->inlen || e->stdin_eof ? e->in_fd : -1,
                                         .events = POLLOUT};
            if (e->deadline && !e->timed_out) {
                int64_t left = e->deadline - now;
                if (left < 0) left = 0;
                if (timeout < 0 || left < timeout) timeout = (int)left;
            }
        }
        size_t first_watch = np;
        np += watch_pollfds(pfds + np);
        size_t first_listener = np;
        for (size_t l = 0; l < N_LISTEN; l++)
            pfds[np++] = (struct pollfd){.fd = listen_fds[l], .events = POLLIN};
        size_t first_stream = np;
        for (struct stream *t = streams; t; t = t->next) {
            short ev = 0;
            if (t->connecting) ev = POLLOUT;
            else if (!t->rd_eof && t->inflight < WINDOW) ev |= POLLIN;
            if (t->outlen) ev |= POLLOUT;
            pfds[np++] = (struct pollfd){.fd = ev ? t->fd : -1, .events = ev};
        }
        size_t pt_index = np;
        pfds[np++] = (struct pollfd){.fd = pt_fd, .events = POLLIN};
        int pt_wait = pt_timeout();
        if (pt_wait >= 0 && (timeout < 0 || pt_wait < timeout)) timeout = pt_wait;
        for (struct exec *e = execs; e; e = e->next)
            if (e->exited && timeout != 0) timeout = 50; /* settle what it left behind */
        if (readers_ready()) timeout = 0;
        if (port_hup && (timeout < 0 || timeout > 20)) timeout = 20;
        if (pending_cgroups && (timeout < 0 || timeout > 1000)) timeout = 1000;
        int rc = poll(pfds, np, timeout);
        if (rc < 0 && errno != EINTR) logf_("poll: %s", strerror(errno));
        if (port_hup) {
            /* the host returns: POLLHUP clears once a reader is connected again (a host
               that has sent nothing yet shows no event at all); data that arrives
               meanwhile is read at once */
            struct pollfd pp = {.fd = port, .events = POLLIN};
            int ready = poll(&pp, 1, 0);
            if (ready == 1 && (pp.revents & POLLIN)) {
                port_hup = 0;
                read_port();
            } else if (ready == 0 || (ready == 1 && !(pp.revents & POLLHUP))) {
                port_hup = 0;
            }
        } else if (pfds[0].revents & POLLIN) {
            read_port();
        } else if (pfds[0].revents & (POLLHUP | POLLERR)) {
            host_gone();
        }
        /* pipes are drained before reaping, so output always precedes the exit frame */
        size_t i = 3;
        for (struct exec *e = execs; e; e = e->next, i += 3) {
            if (i + 2 >= np) break;
            size_t budget = 256u << 10;
            if (pfds[i].revents) pump(e, &e->out_fd, M_STDOUT, &budget);
            budget = 256u << 10;
            if (pfds[i + 1].revents) pump(e, &e->err_fd, M_STDERR, &budget);
            if (pfds[i + 2].revents && e->in_fd >= 0) flush_stdin(e);
        }
        for (size_t l = 0; l < N_LISTEN; l++)
            if (pfds[first_listener + l].revents & POLLIN)
                accept_streams(listen_fds[l], egress_ports[l]);
        /* streams may have been dropped since the poll: find each by its descriptor */
        for (size_t k = first_stream; k < pt_index; k++) {
            short rev = pfds[k].revents;
            struct stream *t = rev ? stream_by_fd(pfds[k].fd) : NULL;
            if (t && t->connecting) {
                stream_connected(t);
                continue;
            }
            if (t && (rev & (POLLIN | POLLHUP | POLLERR))) {
                stream_read(t);
                t = stream_by_fd(pfds[k].fd);
            }
            if (t && (rev & POLLOUT)) stream_write(t);
        }
        if (pfds[pt_index].revents & POLLIN) pt_read();
        pt_tick();
        if (pfds[2].revents & POLLIN) answer_dns();
        watch_events(pfds + first_watch); /* before reaping: writers' cgroups are still known */
        if (pfds[1].revents & POLLIN) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) > 0) {}
        }
        reap();
        settle_execs();
        now = now_ms();
        for (struct exec *e = execs; e; e = e->next)
            if (e->deadline && !e->timed_out && now >= e->deadline) {
                e->timed_out = 1;
                kill_tree(e, SIGKILL);
            }
        if (readers) pump_readers();
        if (pending_cgroups && now - last_cg_sweep >= 1000) {
            last_cg_sweep = now;
            struct pending_cg **pp = &pending_cgroups;
            while (*pp) {
                struct pending_cg *c = *pp;
                if (rmdir(c->path) == 0 || errno == ENOENT) {
                    *pp = c->next;
                    free(c);
                } else {
                    pp = &c->next;
                }
            }
        }
    }
}
