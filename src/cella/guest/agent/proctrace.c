/*
 * Process trace and connection owners: included by agent.c (images/boot.py inlines it), so
 * it shares the agent's one thread, its frames and its exec records.
 *
 * Processes come from the kernel's proc connector (NETLINK_CONNECTOR, CN_IDX_PROC): fork,
 * exec, uid and exit events, read in the agent's poll loop, never by polling /proc. A
 * process belongs to the exec whose root process it descends from (forks of a traced
 * process are traced, including those of processes the command left running). What each
 * record holds, and where it comes from:
 *   argv  /proc/PID/cmdline at the exec event (bounded; a process that exited before the
 *         agent read it has its name from /proc/PID/stat while a zombie, else keeps what it
 *         ran before: its parent's argv, inherited at the fork)
 *   cwd   /proc/PID/cwd at the exec event (else the parent's)
 *   uid   the exec's user, then the proc connector's uid events (effective uid)
 *   start the fork event's time, end the exit event's (the kernel's monotonic clock, turned
 *         into wall-clock milliseconds)
 *   exit  the exit event's status: exit code or terminating signal
 *   cpu   utime + stime from /proc/PID/stat read at the exit event, while the process is a
 *         zombie not yet reaped: always for an exec's own process (the agent reads its
 *         events before it reaps), for others when their parent had not reaped them yet;
 *         unknown (all ones) once gone (the guest kernel has neither taskstats nor BSD
 *         process accounting)
 * Bounded: past the exec's limit (its TRACE field; PT_MAX_PER_EXEC when it gives none, at
 * most 50 times that) an exec's processes are counted only (`dropped`), and the
 * live table holds at most the processes alive (the sandbox's pids.max bounds it). Records
 * are batched into PROCS frames on channel 0: at most PT_BATCH bytes, sent when full, every
 * PT_FLUSH_MS, and before an exec's exit frame (so an exec's processes that ended with it
 * arrive before its exit status).
 *
 * Wire format of a PROCS frame: records one after another, each kind (u8) and the exec's
 * channel (u32), then
 *   'x' (exited) / 'r' (still running when its exec ended): pid, ppid, uid (u32 each),
 *       start_ms, end_ms (u64, 0: running), exit code, signal (u32 each), cpu_us (u64),
 *       argv (u16 length, NUL-separated), cwd (u16 length)
 *   's' (summary, once the exec and every process it left are gone): total, recorded,
 *       dropped (u32 each), lost (u8: the kernel dropped events, counts are low)
 *
 * Connection owners: for each guest connection to an egress port the agent asks the kernel
 * (sock_diag, INET_DIAG) for the inode of the connecting socket, finds the process holding
 * it in /proc/PID/fd, and sends an OWNER frame on the stream's channel before its SOPEN:
 * pid, uid, the exec's channel (0: not a traced exec's), argv.
 */
#include <linux/cn_proc.h>
#include <linux/connector.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>

#define M_PROCS 0xA0 /* guest -> host, channel 0: process records */
#define M_OWNER 0xA1 /* guest -> host, a stream's channel, before its SOPEN */
#define F_TRACE 34   /* exec request: trace this command's processes, at most N in full */

#define PT_MAX_PER_EXEC 2000
#define PT_ARGV_MAX 1024
#define PT_CWD_MAX 256
#define PT_BATCH (60u << 10)
#define PT_FLUSH_MS 100
#define PT_BUCKETS 4096

struct pt_exec {
    uint32_t chan;
    uint32_t max; /* recorded in full, the rest counted */
    uint32_t total, recorded, dropped, live;
    int finished, lost;
    struct pt_exec *next;
};

struct pt_proc {
    pid_t pid, ppid;
    struct pt_exec *x;
    uint64_t start_ms;
    uint32_t uid;
    int detail;     /* recorded in full (else counted only) */
    int seen_fork;  /* the root's own fork event was read: its exit is this process's */
    int reported;   /* sent as running when its exec ended */
    char *argv;     /* NUL-separated */
    uint16_t argv_len;
    char *cwd;
    struct pt_proc *next;
};

static int pt_fd = -1;
static struct pt_exec *pt_execs;
static struct pt_proc *pt_tab[PT_BUCKETS];
static uint8_t pt_buf[PT_BATCH];
static size_t pt_len;
static int64_t pt_since; /* when the oldest unsent record was made */
static int64_t pt_wall_offset_ms; /* wall clock minus monotonic, for event times */

static struct pt_proc **pt_slot(pid_t pid) {
    struct pt_proc **pp = &pt_tab[(uint32_t)pid % PT_BUCKETS];
    while (*pp && (*pp)->pid != pid) pp = &(*pp)->next;
    return pp;
}

static void pt_clock(void) {
    struct timespec w, m;
    clock_gettime(CLOCK_REALTIME, &w);
    clock_gettime(CLOCK_MONOTONIC, &m);
    pt_wall_offset_ms = ((int64_t)w.tv_sec - m.tv_sec) * 1000 + (w.tv_nsec - m.tv_nsec) / 1000000;
}

static uint64_t pt_wall(uint64_t mono_ns) {
    return (uint64_t)((int64_t)(mono_ns / 1000000) + pt_wall_offset_ms);
}

/* Subscribes to process events; the socket is opened by the first traced exec, so a
   sandbox that never traces pays nothing. */
static int pt_open(void) {
    if (pt_fd >= 0) return 0;
    int fd = socket(PF_NETLINK, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, NETLINK_CONNECTOR);
    if (fd < 0) return -1;
    struct sockaddr_nl sa = {.nl_family = AF_NETLINK, .nl_groups = CN_IDX_PROC, .nl_pid = 0};
    int big = 8 << 20;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &big, sizeof big);
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa)) {
        close(fd);
        return -1;
    }
    struct {
        struct nlmsghdr nl;
        struct cn_msg cn;
        enum proc_cn_mcast_op op;
    } __attribute__((packed)) req = {0};
    req.nl.nlmsg_len = sizeof req;
    req.nl.nlmsg_type = NLMSG_DONE;
    req.nl.nlmsg_pid = (uint32_t)getpid();
    req.cn.id.idx = CN_IDX_PROC;
    req.cn.id.val = CN_VAL_PROC;
    req.cn.len = sizeof req.op;
    req.op = PROC_CN_MCAST_LISTEN;
    if (send(fd, &req, sizeof req, 0) < 0) {
        logf_("proc connector: %s", strerror(errno));
        close(fd);
        return -1;
    }
    pt_fd = fd;
    pt_clock();
    return 0;
}

/* ---- records to the host ---- */

static void pt_flush(void) {
    if (pt_len) send_frame(0, M_PROCS, pt_buf, pt_len, NULL, 0);
    pt_len = 0;
}

static uint8_t *pt_room(size_t n) {
    if (pt_len + n > sizeof pt_buf) pt_flush();
    if (pt_len == 0) pt_since = now_ms();
    uint8_t *p = pt_buf + pt_len;
    pt_len += n;
    return p;
}

static void pt_emit(struct pt_proc *p, char kind, uint64_t end_ms, int status, uint64_t cpu_us) {
    size_t alen = p->argv_len, clen = p->cwd ? strlen(p->cwd) : 0;
    uint8_t *b = pt_room(1 + 4 + 12 + 16 + 8 + 8 + 2 + alen + 2 + clen);
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    int sig = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    if (kind == 'r') code = sig = 0;
    *b++ = (uint8_t)kind;
    put32(b, p->x->chan); b += 4;
    put32(b, (uint32_t)p->pid); b += 4;
    put32(b, (uint32_t)p->ppid); b += 4;
    put32(b, p->uid); b += 4;
    put64(b, p->start_ms); b += 8;
    put64(b, end_ms); b += 8;
    put32(b, (uint32_t)code); b += 4;
    put32(b, (uint32_t)sig); b += 4;
    put64(b, cpu_us); b += 8;
    b[0] = (uint8_t)(alen >> 8); b[1] = (uint8_t)alen; b += 2;
    if (alen) memcpy(b, p->argv, alen);
    b += alen;
    b[0] = (uint8_t)(clen >> 8); b[1] = (uint8_t)clen; b += 2;
    if (clen) memcpy(b, p->cwd, clen);
}

static void pt_summary(struct pt_exec *x) {
    uint8_t *b = pt_room(1 + 4 + 12 + 1);
    *b++ = 's';
    put32(b, x->chan);
    put32(b + 4, x->total);
    put32(b + 8, x->recorded);
    put32(b + 12, x->dropped);
    b[16] = (uint8_t)x->lost;
}

/* An exec is forgotten once it and every process it left are gone. */
static void pt_maybe_done(struct pt_exec *x) {
    if (!x->finished || x->live) return;
    pt_summary(x);
    struct pt_exec **pp = &pt_execs;
    while (*pp && *pp != x) pp = &(*pp)->next;
    if (*pp) *pp = x->next;
    free(x);
}

/* ---- the live table ---- */

static void pt_free(struct pt_proc *p) {
    free(p->argv);
    free(p->cwd);
    free(p);
}

static struct pt_proc *pt_add(pid_t pid, pid_t ppid, struct pt_exec *x, uint64_t start_ms,
                              uint32_t uid) {
    struct pt_proc **slot = pt_slot(pid);
    if (*slot) { /* a stale entry (its exit was lost): the pid was reused */
        struct pt_proc *old = *slot;
        *slot = old->next;
        struct pt_exec *ox = old->x;
        ox->live--;
        pt_free(old);
        pt_maybe_done(ox); /* never x: its parent is alive in it */
        slot = pt_slot(pid);
    }
    struct pt_proc *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->pid = pid;
    p->ppid = ppid;
    p->x = x;
    p->start_ms = start_ms;
    p->uid = uid;
    x->total++;
    x->live++;
    if (x->recorded < x->max) {
        x->recorded++;
        p->detail = 1;
    } else {
        x->dropped++;
    }
    *slot = p;
    return p;
}

static void pt_remove(struct pt_proc *p) {
    struct pt_proc **slot = pt_slot(p->pid);
    if (*slot == p) *slot = p->next;
    p->x->live--;
    struct pt_exec *x = p->x;
    pt_free(p);
    pt_maybe_done(x);
}

static ssize_t pt_read_file(const char *path, char *buf, size_t cap) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, cap);
    close(fd);
    return n;
}

/* The text between the parentheses of /proc/PID/stat, and what follows them. */
static const char *pt_stat(pid_t pid, char *buf, size_t cap, char *comm, size_t comm_cap) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    ssize_t n = pt_read_file(path, buf, cap - 1);
    if (n <= 0) return NULL;
    buf[n] = 0;
    char *open_ = strchr(buf, '('), *close_ = strrchr(buf, ')');
    if (!open_ || !close_ || close_ < open_) return NULL;
    if (comm) {
        size_t len = (size_t)(close_ - open_ - 1);
        if (len >= comm_cap) len = comm_cap - 1;
        memcpy(comm, open_ + 1, len);
        comm[len] = 0;
    }
    return close_ + 1;
}

static uint64_t pt_cpu_us(pid_t pid) {
    char buf[1024];
    const char *rest = pt_stat(pid, buf, sizeof buf, NULL, 0);
    unsigned long long ut = 0, st = 0;
    /* after the name: state ppid pgrp session tty tpgid flags minflt cminflt majflt
       cmajflt utime stime */
    if (!rest || sscanf(rest, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu",
                        &ut, &st) != 2)
        return UINT64_MAX;
    long hz = sysconf(_SC_CLK_TCK);
    return (ut + st) * 1000000ull / (unsigned long long)(hz > 0 ? hz : 100);
}

static void pt_set_argv(struct pt_proc *p, const char *argv, size_t len) {
    if (len > PT_ARGV_MAX) len = PT_ARGV_MAX;
    while (len && argv[len - 1] == 0) len--; /* the last NUL is implied */
    char *copy = malloc(len ? len : 1);
    if (!copy) return;
    if (len) memcpy(copy, argv, len);
    free(p->argv);
    p->argv = copy;
    p->argv_len = (uint16_t)len;
}

static void pt_set_cwd(struct pt_proc *p, const char *cwd) {
    free(p->cwd);
    p->cwd = cwd ? strndup(cwd, PT_CWD_MAX) : NULL;
}

static void pt_on_fork(pid_t parent, pid_t child, uint64_t ts) {
    struct pt_proc *c = *pt_slot(child);
    if (c && c->x && !c->seen_fork && c->ppid == parent) { /* an exec's root, registered */
        c->seen_fork = 1;
        c->start_ms = pt_wall(ts); /* before any of its children's */
        return;
    }
    struct pt_proc *pp = *pt_slot(parent);
    if (!pp) return; /* not a traced process's child */
    c = pt_add(child, parent, pp->x, pt_wall(ts), pp->uid);
    if (!c) return;
    c->seen_fork = 1;
    if (c->detail) { /* until it execs it runs its parent's program */
        if (pp->argv) pt_set_argv(c, pp->argv, pp->argv_len);
        pt_set_cwd(c, pp->cwd);
    }
}

static void pt_on_exec(pid_t pid) {
    struct pt_proc *p = *pt_slot(pid);
    if (!p || !p->detail) return;
    char path[64], buf[PT_ARGV_MAX], cwd[PT_CWD_MAX + 1];
    snprintf(path, sizeof path, "/proc/%d/cmdline", pid);
    ssize_t n = pt_read_file(path, buf, sizeof buf);
    if (n > 0) {
        pt_set_argv(p, buf, (size_t)n);
    } else { /* gone already, or a zombie: its name at least */
        char stat[1024], comm[64];
        if (pt_stat(pid, stat, sizeof stat, comm, sizeof comm)) pt_set_argv(p, comm, strlen(comm));
    }
    snprintf(path, sizeof path, "/proc/%d/cwd", pid);
    ssize_t c = readlink(path, cwd, PT_CWD_MAX);
    if (c > 0) {
        cwd[c] = 0;
        pt_set_cwd(p, cwd);
    }
}

static void pt_on_exit(pid_t pid, int status, uint64_t ts) {
    struct pt_proc *p = *pt_slot(pid);
    if (!p) return;
    if (!p->seen_fork) return; /* the previous owner of a root's pid */
    if (p->detail) pt_emit(p, 'x', pt_wall(ts), status, pt_cpu_us(pid));
    pt_remove(p);
}

/* Reads every event queued now. */
static void pt_read(void) {
    if (pt_fd < 0) return;
    pt_clock();
    for (;;) {
        uint8_t buf[8192] __attribute__((aligned(NLMSG_ALIGNTO)));
        ssize_t n = recv(pt_fd, buf, sizeof buf, 0);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == ENOBUFS) { /* the kernel dropped events: say so */
                for (struct pt_exec *x = pt_execs; x; x = x->next) x->lost = 1;
                continue;
            }
            return;
        }
        if (n == 0) return;
        for (struct nlmsghdr *nh = (struct nlmsghdr *)buf; NLMSG_OK(nh, (size_t)n);
             nh = NLMSG_NEXT(nh, n)) {
            if (nh->nlmsg_type != NLMSG_DONE) continue;
            struct cn_msg *cn = NLMSG_DATA(nh);
            if (cn->id.idx != CN_IDX_PROC || cn->id.val != CN_VAL_PROC) continue;
            struct proc_event *ev = (struct proc_event *)cn->data;
            switch (ev->what) {
            case PROC_EVENT_FORK:
                if (ev->event_data.fork.child_pid == ev->event_data.fork.child_tgid) /* not a thread */
                    pt_on_fork(ev->event_data.fork.parent_tgid, ev->event_data.fork.child_pid,
                               ev->timestamp_ns);
                break;
            case PROC_EVENT_EXEC:
                pt_on_exec(ev->event_data.exec.process_tgid);
                break;
            case PROC_EVENT_UID: {
                struct pt_proc *p = *pt_slot(ev->event_data.id.process_tgid);
                if (p) p->uid = ev->event_data.id.e.euid;
                break;
            }
            case PROC_EVENT_EXIT:
                if (ev->event_data.exit.process_pid == ev->event_data.exit.process_tgid)
                    pt_on_exit(ev->event_data.exit.process_pid, (int)ev->event_data.exit.exit_code,
                               ev->timestamp_ns);
                break;
            default: break;
            }
        }
    }
}

/* ---- hooks for agent.c ---- */

/* Before the exec's fork: the connector must be listening when its processes start. */
static void pt_prepare(void) {
    static int failed; /* a kernel without the proc connector: said once */
    if (pt_fd < 0 && !failed && pt_open()) {
        failed = 1;
        logf_("process trace unavailable: %s", strerror(errno));
    }
}

/* The exec's root process, known before its own events are read. */
static void pt_exec_started(uint32_t chan, uint64_t max, pid_t pid, uint32_t uid, char **argv,
                            const char *cwd) {
    if (pt_fd < 0) return;
    struct pt_exec *x = calloc(1, sizeof *x);
    if (!x) return;
    x->chan = chan;
    x->max = max && max < PT_MAX_PER_EXEC * 50 ? (uint32_t)max : PT_MAX_PER_EXEC;
    x->next = pt_execs;
    pt_execs = x;
    pt_clock();
    struct pt_proc *p = pt_add(pid, getpid(), x, (uint64_t)(now_ms() + pt_wall_offset_ms), uid);
    if (!p) return;
    char joined[PT_ARGV_MAX];
    size_t len = 0;
    for (char **a = argv; *a && len < sizeof joined; a++) {
        size_t k = strlen(*a) + 1;
        if (k > sizeof joined - len) k = sizeof joined - len;
        memcpy(joined + len, *a, k);
        len += k;
    }
    pt_set_argv(p, joined, len);
    pt_set_cwd(p, cwd);
}

static struct pt_exec *pt_exec_of(uint32_t chan) {
    for (struct pt_exec *x = pt_execs; x; x = x->next)
        if (x->chan == chan && !x->finished) return x;
    return NULL;
}

/* Before the exec's exit frame: every event so far is read, the processes it leaves
   running are reported as such, and the batch goes out. */
static void pt_exec_finished(uint32_t chan) {
    struct pt_exec *x = pt_exec_of(chan);
    if (!x) return;
    pt_read();
    x->finished = 1;
    for (int b = 0; b < PT_BUCKETS; b++) {
        struct pt_proc *p = pt_tab[b];
        while (p) {
            struct pt_proc *next = p->next;
            if (p->x == x) {
                if (kill(p->pid, 0) && errno == ESRCH) { /* its exit was lost */
                    x->lost = 1;
                    p->x->live--;
                    *pt_slot(p->pid) = next;
                    pt_free(p);
                } else if (p->detail && !p->reported) {
                    p->reported = 1;
                    pt_emit(p, 'r', 0, 0, UINT64_MAX);
                }
            }
            p = next;
        }
    }
    pt_maybe_done(x);
    pt_flush();
}

/* After the kernel dropped events, processes whose exit was lost would keep their exec
   open forever: once a second, those gone are forgotten (and their exec may close). */
static int64_t pt_last_sweep;

static int pt_needs_sweep(void) {
    for (struct pt_exec *x = pt_execs; x; x = x->next)
        if (x->lost && x->finished && x->live) return 1;
    return 0;
}

static void pt_sweep(void) {
    for (int b = 0; b < PT_BUCKETS; b++) {
        struct pt_proc **pp = &pt_tab[b];
        while (*pp) {
            struct pt_proc *p = *pp;
            if (p->x->lost && kill(p->pid, 0) && errno == ESRCH) {
                struct pt_exec *x = p->x;
                *pp = p->next;
                x->live--;
                pt_free(p);
                pt_maybe_done(x);
            } else {
                pp = &p->next;
            }
        }
    }
}

/* Milliseconds until the batch (or a sweep) is due (-1: nothing waiting). */
static int pt_timeout(void) {
    int64_t now = now_ms(), left = -1;
    if (pt_len) left = pt_since + PT_FLUSH_MS - now;
    if (pt_needs_sweep()) {
        int64_t sweep = pt_last_sweep + 1000 - now;
        if (left < 0 || sweep < left) left = sweep;
    }
    if (left == -1) return -1;
    return left < 0 ? 0 : (int)left;
}

static void pt_tick(void) {
    int64_t now = now_ms();
    if (now - pt_last_sweep >= 1000 && pt_needs_sweep()) {
        pt_last_sweep = now;
        pt_read();
        pt_sweep();
    }
    if (pt_len && now - pt_since >= PT_FLUSH_MS) pt_flush();
}

static uint32_t pt_chan_of(pid_t pid) {
    struct pt_proc *p = *pt_slot(pid);
    return p ? p->x->chan : 0;
}

/* ---- connection owners ---- */

/* The inode and uid of the TCP socket from src:sport to dst:dport (network byte order). */
static int pt_sock_inode(uint32_t src, uint16_t sport, uint32_t dst, uint16_t dport,
                         uint32_t *inode, uint32_t *uid) {
    int fd = socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
    if (fd < 0) return -1;
    struct {
        struct nlmsghdr nl;
        struct inet_diag_req_v2 r;
    } req = {0};
    req.nl.nlmsg_len = sizeof req;
    req.nl.nlmsg_type = SOCK_DIAG_BY_FAMILY;
    req.nl.nlmsg_flags = NLM_F_REQUEST;
    req.r.sdiag_family = AF_INET;
    req.r.sdiag_protocol = IPPROTO_TCP;
    req.r.idiag_states = ~0u;
    req.r.id.idiag_sport = sport;
    req.r.id.idiag_dport = dport;
    req.r.id.idiag_src[0] = src;
    req.r.id.idiag_dst[0] = dst;
    req.r.id.idiag_cookie[0] = INET_DIAG_NOCOOKIE;
    req.r.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
    struct sockaddr_nl sa = {.nl_family = AF_NETLINK};
    int rc = -1;
    if (sendto(fd, &req, sizeof req, 0, (struct sockaddr *)&sa, sizeof sa) == sizeof req) {
        uint8_t buf[4096] __attribute__((aligned(NLMSG_ALIGNTO)));
        struct timeval tv = {.tv_sec = 0, .tv_usec = 200000};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        ssize_t n = recv(fd, buf, sizeof buf, 0);
        struct nlmsghdr *nh = (struct nlmsghdr *)buf;
        if (n > 0 && NLMSG_OK(nh, (size_t)n) && nh->nlmsg_type == SOCK_DIAG_BY_FAMILY) {
            struct inet_diag_msg *m = NLMSG_DATA(nh);
            *inode = m->idiag_inode;
            *uid = m->idiag_uid;
            rc = 0;
        }
    }
    close(fd);
    return rc;
}

/* The process holding socket `inode` open (the first found), or 0. */
static pid_t pt_inode_owner(uint32_t inode) {
    char want[48];
    int wlen = snprintf(want, sizeof want, "socket:[%u]", inode);
    DIR *proc = opendir("/proc");
    if (!proc) return 0;
    pid_t found = 0;
    struct dirent *de;
    while (!found && (de = readdir(proc))) {
        pid_t pid = (pid_t)atoi(de->d_name);
        if (pid <= 1) continue; /* the agent holds the accepted end, never the client's */
        char dir[64];
        snprintf(dir, sizeof dir, "/proc/%d/fd", pid);
        DIR *fds = opendir(dir);
        if (!fds) continue;
        struct dirent *fe;
        while ((fe = readdir(fds))) {
            char link[64], path[340];
            if (fe->d_name[0] == '.') continue;
            snprintf(path, sizeof path, "%s/%s", dir, fe->d_name);
            ssize_t n = readlink(path, link, sizeof link - 1);
            if (n == wlen && memcmp(link, want, (size_t)n) == 0) {
                found = pid;
                break;
            }
        }
        closedir(fds);
    }
    closedir(proc);
    return found;
}

/* Tells the host which process opened the connection just accepted on `fd`. */
static void pt_stream_owner(int fd, uint32_t chan) {
    struct sockaddr_in peer, local;
    socklen_t pl = sizeof peer, ll = sizeof local;
    if (getpeername(fd, (struct sockaddr *)&peer, &pl) || getsockname(fd, (struct sockaddr *)&local, &ll) ||
        peer.sin_family != AF_INET)
        return;
    uint32_t inode = 0, uid = 0;
    if (pt_sock_inode(peer.sin_addr.s_addr, peer.sin_port, local.sin_addr.s_addr, local.sin_port,
                      &inode, &uid) || inode == 0)
        return;
    pid_t pid = pt_inode_owner(inode);
    if (!pid) return;
    uint8_t out[12 + PT_ARGV_MAX];
    put32(out, (uint32_t)pid);
    put32(out + 4, uid);
    put32(out + 8, pt_chan_of(pid));
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/cmdline", pid);
    ssize_t n = pt_read_file(path, (char *)out + 12, PT_ARGV_MAX);
    if (n < 0) n = 0;
    while (n > 0 && out[12 + n - 1] == 0) n--;
    send_frame(chan, M_OWNER, out, 12 + (size_t)n, NULL, 0);
}
