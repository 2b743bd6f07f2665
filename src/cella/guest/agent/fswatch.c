/*
 * File changes per exec, included by agent.c (one translation unit; see images/boot.py).
 *
 * One fanotify group (FAN_REPORT_DFID_NAME, FAN_MARK_FILESYSTEM on every mounted file system
 * that can report file ids) sees creates, deletes, renames and writes anywhere in the guest.
 * Each event is attributed to the exec whose cgroup holds the writing process (every exec
 * has one of its own); when that cannot be told (the writer is gone, or there are no
 * cgroups) it goes to every exec running. Writes by the agent itself (the API's file
 * writes, PID 1) and by processes a finished exec left behind are not any exec's.
 *
 * Each exec keeps the net change per path (created then deleted: nothing; deleted then
 * created: modified; a rename keeps where the file came from), bounded by FSW_MAX; past it
 * changes are counted, not kept. Before the exit frame the list goes to the host as
 * M_FSCHANGES frames: u32 dropped, then records of kind u8 ('c' created, 'm' modified, 'd'
 * deleted, 'r' renamed), is_dir u8, size u64 (as the file is at the end), path and from
 * (u16 length each).
 */
#include <sys/fanotify.h>
#include <sys/statfs.h>

#define M_FSCHANGES 0x90
#define FSW_MAX 1000      /* changes kept per exec */
#define FSW_PATH 1024     /* longer paths are left out (counted as dropped) */
#define FSW_MOUNTS 32

struct fsw_change { char *path; char *from; uint8_t kind; };
struct fsw_log { struct fsw_change *v; uint32_t n, cap, dropped; };

static int fsw_fd = -1;
static int mounts_fd = -1; /* /proc/self/mounts: POLLPRI when something is mounted */
static struct { fsid_t fsid; int fd; } fsw_mounts[FSW_MOUNTS];
static int n_fsw_mounts;

/* The exec whose cgroup holds `pid`: 1 found (in *out), 0 a process of no running exec,
   -1 unknown (gone, or no cgroups). */
static int exec_of_pid(pid_t pid, struct exec **out) {
    *out = NULL;
    if (!have_cgroups) return -1;
    char p[64], buf[512];
    snprintf(p, sizeof p, "/proc/%d/cgroup", (int)pid);
    int fd = open(p, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = 0;
    char *cg = strstr(buf, "0::");
    if (!cg) return -1;
    cg += 3;
    cg[strcspn(cg, "\n")] = 0;
    for (struct exec *e = execs; e; e = e->next) {
        if (!e->cgroup[0]) continue;
        const char *rel = e->cgroup + strlen("/sys/fs/cgroup");
        size_t rl = strlen(rel);
        if (!strncmp(cg, rel, rl) && (cg[rl] == 0 || cg[rl] == '/')) {
            *out = e;
            return 1;
        }
    }
    return 0;
}

/* the kernel's own file systems, which hold no files a command writes or runs */
static const char *skip_fs[] = {"proc", "sysfs", "cgroup2", "cgroup", "devpts", "mqueue",
                                "securityfs", "debugfs", "tracefs", "bpf", "pstore",
                                "configfs", "fusectl", "hugetlbfs", "autofs", NULL};

/* Calls `mark(path)` for every mount but the kernel's own (`devices`: /dev's too). */
static void each_mount(void (*mark)(const char *), int devices) {
    FILE *f = fopen("/proc/self/mounts", "re");
    char line[4096];
    while (f && fgets(line, sizeof line, f)) {
        char src[1024], raw[2048], dir[2048], type[64];
        if (sscanf(line, "%1023s %2047s %63s", src, raw, type) != 3) continue;
        int skip = !devices && !strcmp(type, "devtmpfs");
        for (int i = 0; skip_fs[i]; i++) skip |= !strcmp(type, skip_fs[i]);
        /* a FUSE mount (volumes, buckets) is served by a guest process whose requests travel
           through this agent: a statfs or mark the agent makes on it would wait for itself */
        skip |= !strncmp(type, "fuse", 4);
        if (skip) continue;
        size_t k = 0; /* the kernel writes a space, tab, newline or backslash as \ooo */
        for (char *c = raw; *c && k < sizeof dir - 1; c++) {
            unsigned o;
            if (c[0] == '\\' && sscanf(c + 1, "%3o", &o) == 1 && strlen(c) >= 4) {
                dir[k++] = (char)o;
                c += 3;
            } else {
                dir[k++] = *c;
            }
        }
        dir[k] = 0;
        mark(dir);
    }
    if (f) fclose(f);
}

static void fsw_mark(const char *dir) {
    struct statfs sfs;
    if (fsw_fd < 0 || n_fsw_mounts >= FSW_MOUNTS || statfs(dir, &sfs)) return;
    for (int i = 0; i < n_fsw_mounts; i++)
        if (!memcmp(&fsw_mounts[i].fsid, &sfs.f_fsid, sizeof sfs.f_fsid)) return;
    uint64_t mask = FAN_CREATE | FAN_DELETE | FAN_RENAME | FAN_MODIFY | FAN_ONDIR;
    if (fanotify_mark(fsw_fd, FAN_MARK_ADD | FAN_MARK_FILESYSTEM, mask, AT_FDCWD, dir))
        return; /* a file system without file ids (tmpfs on this kernel): not watched */
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC); /* open_by_handle_at: no O_PATH */
    if (fd < 0) return;
    fsw_mounts[n_fsw_mounts].fsid = sfs.f_fsid;
    fsw_mounts[n_fsw_mounts++].fd = fd;
}

static void policy_mark_mounts(void);

static void watch_init(void) {
    fsw_fd = fanotify_init(FAN_CLASS_NOTIF | FAN_CLOEXEC | FAN_NONBLOCK | FAN_REPORT_DFID_NAME,
                           O_RDONLY | O_CLOEXEC | O_LARGEFILE);
    if (fsw_fd < 0) logf_("file changes: fanotify: %s", strerror(errno));
    else each_mount(fsw_mark, 0);
    mounts_fd = open("/proc/self/mounts", O_RDONLY | O_CLOEXEC);
}

/* ---- one exec's changes -------------------------------------------------------------- */

static struct fsw_change *fsw_find(struct fsw_log *l, const char *path) {
    for (uint32_t i = 0; i < l->n; i++)
        if (!strcmp(l->v[i].path, path)) return &l->v[i];
    return NULL;
}

static void fsw_drop(struct fsw_log *l, struct fsw_change *c) {
    free(c->path);
    free(c->from);
    *c = l->v[--l->n];
}

static void fsw_add(struct fsw_log *l, const char *path, uint8_t kind, const char *from) {
    if (l->n >= FSW_MAX) { l->dropped++; return; }
    if (l->n == l->cap) {
        l->cap = l->cap ? l->cap * 2 : 16;
        l->v = realloc(l->v, l->cap * sizeof *l->v);
    }
    l->v[l->n++] = (struct fsw_change){strdup(path), from ? strdup(from) : NULL, kind};
}

static void fsw_record(struct exec *e, uint64_t mask, const char *path, const char *to) {
    if (!e->fs) e->fs = calloc(1, sizeof(struct fsw_log));
    struct fsw_log *l = e->fs;
    if (!path || strlen(path) >= FSW_PATH || (to && strlen(to) >= FSW_PATH)) {
        l->dropped++;
        return;
    }
    struct fsw_change *c = fsw_find(l, path);
    if (mask & FAN_RENAME) {
        if (!to) return;
        char *origin = NULL;
        uint8_t kind = 'r';
        if (c && c->kind == 'c') kind = 'c';
        else if (c && c->kind == 'r') origin = c->from ? strdup(c->from) : NULL;
        if (c) fsw_drop(l, c);
        if (kind == 'r' && !origin) origin = strdup(path);
        struct fsw_change *t = fsw_find(l, to);
        if (t) fsw_drop(l, t); /* the rename replaced what the command had made there */
        if (kind == 'r' && !strcmp(origin, to)) kind = 'm'; /* moved back where it was */
        fsw_add(l, to, kind, kind == 'r' ? origin : NULL);
        free(origin);
    } else if (mask & FAN_CREATE) {
        if (c && c->kind == 'd') c->kind = 'm'; /* deleted, then made again: replaced */
        else if (!c) fsw_add(l, path, 'c', NULL);
    } else if (mask & FAN_DELETE) {
        if (c && c->kind == 'c') fsw_drop(l, c);
        else if (c && c->kind == 'r') {
            char *origin = c->from ? strdup(c->from) : NULL;
            fsw_drop(l, c);
            if (origin && !fsw_find(l, origin)) fsw_add(l, origin, 'd', NULL);
            free(origin);
        } else if (c) c->kind = 'd';
        else fsw_add(l, path, 'd', NULL);
    } else if (mask & FAN_MODIFY) {
        if (!c) fsw_add(l, path, 'm', NULL);
    }
}

/* ---- reading events -------------------------------------------------------------------- */

/* The path of `name` in the directory a file handle names (NULL if it cannot be found). */
static char *fsw_path(const struct fanotify_event_info_fid *fid, const char **name_out) {
    struct file_handle *fh = (struct file_handle *)fid->handle;
    const char *name = (const char *)(fh->f_handle + fh->handle_bytes);
    if (name_out) *name_out = name;
    int mfd = -1;
    for (int i = 0; i < n_fsw_mounts; i++)
        if (!memcmp(&fsw_mounts[i].fsid, &fid->fsid, sizeof fid->fsid)) mfd = fsw_mounts[i].fd;
    if (mfd < 0) return NULL;
    int fd = open_by_handle_at(mfd, fh, O_PATH | O_CLOEXEC);
    if (fd < 0) return NULL;
    char link[64], dir[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, dir, sizeof dir - 1);
    close(fd);
    if (n <= 0) return NULL;
    dir[n] = 0;
    char *out;
    if (!strcmp(name, ".")) return strdup(dir);
    if (asprintf(&out, "%s/%s", strcmp(dir, "/") ? dir : "", name) < 0) return NULL;
    return out;
}

static void fsw_event(const struct fanotify_event_metadata *md) {
    struct exec *owner = NULL;
    int known = md->pid == 1 ? 0 : exec_of_pid(md->pid, &owner);
    if (known == 0) return; /* the agent's own writes, or a finished exec's leftovers */
    char *path = NULL, *to = NULL;
    const uint8_t *p = (const uint8_t *)md + md->metadata_len;
    const uint8_t *end = (const uint8_t *)md + md->event_len;
    while (p + sizeof(struct fanotify_event_info_header) <= end) {
        const struct fanotify_event_info_header *h = (const void *)p;
        if (h->len < sizeof *h || p + h->len > end) break;
        const struct fanotify_event_info_fid *fid = (const void *)p;
        if (h->info_type == FAN_EVENT_INFO_TYPE_DFID_NAME ||
            h->info_type == FAN_EVENT_INFO_TYPE_OLD_DFID_NAME) {
            free(path);
            path = fsw_path(fid, NULL);
        } else if (h->info_type == FAN_EVENT_INFO_TYPE_NEW_DFID_NAME) {
            free(to);
            to = fsw_path(fid, NULL);
        }
        p += h->len;
    }
    if (known == 1) {
        fsw_record(owner, md->mask, path, to);
    } else {
        for (struct exec *e = execs; e; e = e->next)
            if (!e->exited) fsw_record(e, md->mask, path, to);
    }
    free(path);
    free(to);
}

/* Reads every queued event (before an exit frame: they were queued by the syscalls the
   command made, so all of them are there by the time it was reaped). */
static void fsw_drain(void) {
    static uint8_t buf[64 << 10] __attribute__((aligned(8)));
    if (fsw_fd < 0) return;
    for (;;) {
        ssize_t n = read(fsw_fd, buf, sizeof buf);
        if (n <= 0) return;
        const struct fanotify_event_metadata *md = (const void *)buf;
        for (; FAN_EVENT_OK(md, n); md = FAN_EVENT_NEXT(md, n)) {
            if (md->vers != FANOTIFY_METADATA_VERSION) continue;
            if (md->mask & FAN_Q_OVERFLOW) { /* lost some: every running exec is incomplete */
                for (struct exec *e = execs; e; e = e->next) {
                    if (!e->fs) e->fs = calloc(1, sizeof(struct fsw_log));
                    ((struct fsw_log *)e->fs)->dropped++;
                }
                continue;
            }
            if (execs) fsw_event(md);
        }
    }
}

static void put16(uint8_t *p, size_t v) { p[0] = (uint8_t)(v >> 8); p[1] = (uint8_t)v; }

/* Sends the exec's changes (its channel, before its exit frame) and forgets them. */
static void watch_exec_finished(struct exec *e) {
    if (fsw_fd < 0) return; /* not watching: the host hears nothing, not "no changes" */
    fsw_drain();
    static uint8_t buf[256 << 10];
    size_t used = 4;
    struct fsw_log *l = e->fs;
    put32(buf, 0);
    if (!l) {
        send_frame(e->chan, M_FSCHANGES, buf, used, NULL, 0);
        return;
    }
    put32(buf, l->dropped);
    for (uint32_t i = 0; i < l->n; i++) {
        struct fsw_change *c = &l->v[i];
        struct stat st;
        int have = c->kind != 'd' && lstat(c->path, &st) == 0;
        size_t pl = strlen(c->path), fl = c->from ? strlen(c->from) : 0;
        if (used + 14 + pl + fl > sizeof buf) {
            send_frame(e->chan, M_FSCHANGES, buf, used, NULL, 0);
            used = 4;
        }
        uint8_t *q = buf + used;
        q[0] = c->kind;
        q[1] = have && S_ISDIR(st.st_mode);
        put64(q + 2, have && !S_ISDIR(st.st_mode) ? (uint64_t)st.st_size : 0);
        put16(q + 10, pl);
        memcpy(q + 12, c->path, pl);
        put16(q + 12 + pl, fl);
        if (fl) memcpy(q + 14 + pl, c->from, fl);
        used += 14 + pl + fl;
        free(c->path);
        free(c->from);
    }
    send_frame(e->chan, M_FSCHANGES, buf, used, NULL, 0);
    free(l->v);
    free(l);
    e->fs = NULL;
}

/* ---- the poll loop's share ------------------------------------------------------------- */

static int policy_fd(void);
static void policy_events(void);

#define WATCH_FDS 3

static size_t watch_pollfds(struct pollfd *p) {
    p[0] = (struct pollfd){.fd = fsw_fd, .events = POLLIN};
    p[1] = (struct pollfd){.fd = mounts_fd, .events = POLLPRI};
    p[2] = (struct pollfd){.fd = policy_fd(), .events = POLLIN};
    return WATCH_FDS;
}

static void watch_events(const struct pollfd *p) {
    if (p[2].revents & POLLIN) policy_events();
    if (p[0].revents & POLLIN) fsw_drain();
    if (p[1].revents & (POLLPRI | POLLERR)) { /* a new mount: watch it too */
        each_mount(fsw_mark, 0);
        policy_mark_mounts();
        char tmp[4096];
        lseek(mounts_fd, 0, SEEK_SET);
        while (read(mounts_fd, tmp, sizeof tmp) > 0) {}
    }
}
