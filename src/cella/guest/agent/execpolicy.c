/*
 * The exec policy, included by agent.c after fswatch.c (one translation unit).
 *
 * The host sets a default (allow or deny) and ordered rules (a path glob or a sha256, each
 * allow or deny; the first that matches decides). While any rule or a default deny is set,
 * a fanotify group of the content class holds FAN_OPEN_EXEC_PERM on every mounted file
 * system (and, where the kernel allows it, on its own tmpfs behind memfd_create), so
 * every execve, the interpreter a script names, and a binary written at run time wait for
 * the agent's answer;
 * FAN_DENY makes the execve fail with EPERM. The path is the file's real path (symlinks
 * resolved: a link to a denied binary under another name is the same file); the sha256 is
 * of its contents, cached by (dev, inode, size, mtime, ctime).
 *
 * Never checked: the agent itself (PID 1); the dynamic loader a binary this process was
 * just allowed to run names (PT_INTERP: it is part of that exec; run by path as a program
 * it is checked like any other); the wrapper shell of a command given as a string (its
 * first execve only: what the shell then runs is checked); and execs the host marks as its
 * own upkeep (their whole tree). Refusals go to the host as M_EXECDENIED frames on channel
 * 0: u32 pid, u32 channel of the exec it belongs to (0: none known), u32 refusals left out
 * before it (more than POL_RATE a second), 32-byte sha256, path and the caller's command
 * line (NUL-separated), u16 length each.
 */
#include <elf.h>
#include <fnmatch.h>
#include <sys/mman.h>

#define T_POLICY 0x28
#define M_EXECDENIED 0x91
#define F_WRAPPER 30     /* exec: argv[0] is the host's wrapper shell for a string command */
#define F_EXEMPT 31      /* exec: the host's own upkeep, not held to the policy */
#define F_POL_DEFAULT 32 /* policy: 1 deny, 0 allow */
#define F_POL_RULE 33    /* policy: action 'a'|'d', kind 'p' (glob) | 'h' (32-byte sha256), value */
#define POL_RULES 256
#define POL_RATE 50

struct pol_rule { uint8_t deny, by_hash; char *glob; uint8_t sha[32]; };
static struct pol_rule pol_rules[POL_RULES];
static int n_pol_rules, pol_deny_default;
static int pol_fd = -1;
static pid_t spawning_pid;  /* an exec's child between fork and its first execve */
static int spawning_free;   /* 1: that first execve is the wrapper's; 2: the tree is exempt */
static struct { pid_t pid; dev_t dev; ino_t ino; } pol_interp[64];
static unsigned pol_interp_next;
static int64_t pol_window;
static uint32_t pol_sent, pol_suppressed;

static int policy_fd(void) { return pol_fd; }

/* ---- sha256 ------------------------------------------------------------------------------ */

static const uint32_t SHA_K[64] = {
    0x428a2f98,0x71374491,0xb5c0fbcf,0xe9b5dba5,0x3956c25b,0x59f111f1,0x923f82a4,0xab1c5ed5,
    0xd807aa98,0x12835b01,0x243185be,0x550c7dc3,0x72be5d74,0x80deb1fe,0x9bdc06a7,0xc19bf174,
    0xe49b69c1,0xefbe4786,0x0fc19dc6,0x240ca1cc,0x2de92c6f,0x4a7484aa,0x5cb0a9dc,0x76f988da,
    0x983e5152,0xa831c66d,0xb00327c8,0xbf597fc7,0xc6e00bf3,0xd5a79147,0x06ca6351,0x14292967,
    0x27b70a85,0x2e1b2138,0x4d2c6dfc,0x53380d13,0x650a7354,0x766a0abb,0x81c2c92e,0x92722c85,
    0xa2bfe8a1,0xa81a664b,0xc24b8b70,0xc76c51a3,0xd192e819,0xd6990624,0xf40e3585,0x106aa070,
    0x19a4c116,0x1e376c08,0x2748774c,0x34b0bcb5,0x391c0cb3,0x4ed8aa4a,0x5b9cca4f,0x682e6ff3,
    0x748f82ee,0x78a5636f,0x84c87814,0x8cc70208,0x90befffa,0xa4506ceb,0xbef9a3f7,0xc67178f2};

struct sha256 { uint32_t h[8]; uint64_t len; uint8_t buf[64]; size_t n; };

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha_block(struct sha256 *s, const uint8_t *b) {
    uint32_t w[64], v[8];
    for (int i = 0; i < 16; i++) w[i] = get32(b + 4 * i);
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    memcpy(v, s->h, sizeof v);
    for (int i = 0; i < 64; i++) {
        uint32_t S1 = ROR(v[4], 6) ^ ROR(v[4], 11) ^ ROR(v[4], 25);
        uint32_t ch = (v[4] & v[5]) ^ (~v[4] & v[6]);
        uint32_t t1 = v[7] + S1 + ch + SHA_K[i] + w[i];
        uint32_t S0 = ROR(v[0], 2) ^ ROR(v[0], 13) ^ ROR(v[0], 22);
        uint32_t mj = (v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]);
        memmove(v + 1, v, 7 * sizeof *v);
        v[4] += t1;
        v[0] = t1 + S0 + mj;
    }
    for (int i = 0; i < 8; i++) s->h[i] += v[i];
}

static void sha_init(struct sha256 *s) {
    static const uint32_t H0[8] = {0x6a09e667,0xbb67ae85,0x3c6ef372,0xa54ff53a,
                                   0x510e527f,0x9b05688c,0x1f83d9ab,0x5be0cd19};
    memcpy(s->h, H0, sizeof H0);
    s->len = 0;
    s->n = 0;
}

static void sha_update(struct sha256 *s, const uint8_t *p, size_t len) {
    s->len += len;
    while (len > 0) {
        size_t take = 64 - s->n < len ? 64 - s->n : len;
        memcpy(s->buf + s->n, p, take);
        s->n += take;
        p += take;
        len -= take;
        if (s->n == 64) {
            sha_block(s, s->buf);
            s->n = 0;
        }
    }
}

static void sha_final(struct sha256 *s, uint8_t out[32]) {
    uint64_t bits = s->len * 8;
    uint8_t pad = 0x80, zero = 0, lenb[8];
    sha_update(s, &pad, 1);
    while (s->n != 56) sha_update(s, &zero, 1);
    put64(lenb, bits);
    sha_update(s, lenb, 8);
    for (int i = 0; i < 8; i++) put32(out + 4 * i, s->h[i]);
}

/* The file's sha256, from the cache when the same inode has not changed since. */
static int file_sha256(int fd, const struct stat *st, uint8_t out[32]) {
    static struct {
        dev_t dev; ino_t ino; off_t size; struct timespec mtime, ctime; uint8_t sha[32];
    } cache[256];
    static unsigned next;
    for (unsigned i = 0; i < 256; i++)
        if (cache[i].ino == st->st_ino && cache[i].dev == st->st_dev &&
            cache[i].size == st->st_size && !memcmp(&cache[i].mtime, &st->st_mtim, sizeof st->st_mtim) &&
            !memcmp(&cache[i].ctime, &st->st_ctim, sizeof st->st_ctim)) {
            memcpy(out, cache[i].sha, 32);
            return 0;
        }
    static uint8_t buf[256 << 10];
    struct sha256 s;
    sha_init(&s);
    off_t off = 0;
    for (;;) {
        ssize_t n = pread(fd, buf, sizeof buf, off);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return -1;
        if (n == 0) break;
        sha_update(&s, buf, (size_t)n);
        off += n;
    }
    sha_final(&s, out);
    unsigned i = next++ % 256;
    cache[i].dev = st->st_dev;
    cache[i].ino = st->st_ino;
    cache[i].size = st->st_size;
    cache[i].mtime = st->st_mtim;
    cache[i].ctime = st->st_ctim;
    memcpy(cache[i].sha, out, 32);
    return 0;
}

/* ---- marks -------------------------------------------------------------------------------- */

static void pol_mark(const char *dir) {
    if (pol_fd >= 0)
        fanotify_mark(pol_fd, FAN_MARK_ADD | FAN_MARK_FILESYSTEM, FAN_OPEN_EXEC_PERM, AT_FDCWD, dir);
}

static void policy_mark_mounts(void) {
    if (pol_fd < 0) return;
    each_mount(pol_mark, 1);
    /* memfd_create's files live on a tmpfs mounted nowhere: mark it through one of them
       (a kernel that refuses marks on its internal mounts leaves memfd execs unchecked) */
    int m = (int)syscall(SYS_memfd_create, "cella-policy", MFD_CLOEXEC);
    if (m >= 0) {
        fanotify_mark(pol_fd, FAN_MARK_ADD | FAN_MARK_FILESYSTEM, FAN_OPEN_EXEC_PERM, m, NULL);
        close(m);
    }
}

/* ---- deciding ------------------------------------------------------------------------------ */

/* Remembers the dynamic loader (PT_INTERP) of an ELF file `pid` may now run. */
static void note_interp(int fd, pid_t pid) {
    unsigned char id[EI_NIDENT + 64];
    if (pread(fd, id, sizeof id, 0) < (ssize_t)sizeof(Elf32_Ehdr) || memcmp(id, ELFMAG, SELFMAG))
        return;
    int wide = id[EI_CLASS] == ELFCLASS64;
    uint64_t phoff;
    unsigned phnum, phsize;
    if (wide) {
        Elf64_Ehdr *h = (Elf64_Ehdr *)id;
        phoff = h->e_phoff, phnum = h->e_phnum, phsize = h->e_phentsize;
    } else {
        Elf32_Ehdr *h = (Elf32_Ehdr *)id;
        phoff = h->e_phoff, phnum = h->e_phnum, phsize = h->e_phentsize;
    }
    if (phnum > 64 || phsize > 128) return;
    for (unsigned i = 0; i < phnum; i++) {
        unsigned char ph[128];
        if (pread(fd, ph, phsize, (off_t)(phoff + (uint64_t)i * phsize)) != (ssize_t)phsize) return;
        uint64_t off, size;
        uint32_t type;
        if (wide) {
            Elf64_Phdr *p = (Elf64_Phdr *)ph;
            type = p->p_type, off = p->p_offset, size = p->p_filesz;
        } else {
            Elf32_Phdr *p = (Elf32_Phdr *)ph;
            type = p->p_type, off = p->p_offset, size = p->p_filesz;
        }
        if (type != PT_INTERP) continue;
        char path[256];
        if (size == 0 || size >= sizeof path || pread(fd, path, size, (off_t)off) != (ssize_t)size)
            return;
        path[size] = 0;
        struct stat st;
        if (stat(path, &st)) return;
        unsigned k = pol_interp_next++ % 64;
        pol_interp[k].pid = pid;
        pol_interp[k].dev = st.st_dev;
        pol_interp[k].ino = st.st_ino;
        return;
    }
}

/* Whether `pid` may run the file open at `fd`; a refusal's path and sha256 are filled in. */
static int policy_allows(int fd, pid_t pid, char *path, size_t cap, uint8_t sha[32], int *hashed) {
    *hashed = 0;
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, cap - 1);
    path[n > 0 ? n : 0] = 0;
    struct stat st;
    if (pid == 1 || fstat(fd, &st)) return 1;
    for (unsigned i = 0; i < 64; i++)
        if (pol_interp[i].pid == pid) {
            pol_interp[i].pid = 0;
            if (pol_interp[i].dev == st.st_dev && pol_interp[i].ino == st.st_ino) return 1;
        }
    int allow = !pol_deny_default;
    struct exec *e;
    if (pid == spawning_pid && spawning_free) {
        if (spawning_free == 1) spawning_free = 0;
        allow = 2;
    } else if (exec_of_pid(pid, &e) == 1 && e->exempt) {
        allow = 2;
    }
    for (int i = 0; i < n_pol_rules && allow != 2; i++) {
        struct pol_rule *r = &pol_rules[i];
        if (r->by_hash) {
            if (!*hashed) *hashed = file_sha256(fd, &st, sha) == 0;
            if (!*hashed || memcmp(r->sha, sha, 32)) continue;
        } else if (fnmatch(r->glob, path, 0)) {
            continue;
        }
        allow = !r->deny;
        break;
    }
    if (allow) note_interp(fd, pid);
    else if (!*hashed) *hashed = file_sha256(fd, &st, sha) == 0;
    return allow;
}

static void report_denial(pid_t pid, const char *path, const uint8_t sha[32], int hashed) {
    int64_t now = now_ms();
    if (now - pol_window >= 1000) {
        pol_window = now;
        pol_sent = 0;
    }
    if (pol_sent >= POL_RATE) {
        pol_suppressed++;
        return;
    }
    pol_sent++;
    static uint8_t buf[8192];
    char argv[2048];
    ssize_t an = 0;
    char p[64];
    snprintf(p, sizeof p, "/proc/%d/cmdline", (int)pid);
    int fd = open(p, O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        an = read(fd, argv, sizeof argv);
        close(fd);
    }
    if (an < 0) an = 0;
    struct exec *e;
    uint32_t chan = exec_of_pid(pid, &e) == 1 ? e->chan : 0;
    size_t pl = strnlen(path, 4096);
    put32(buf, (uint32_t)pid);
    put32(buf + 4, chan);
    put32(buf + 8, pol_suppressed);
    if (hashed) memcpy(buf + 12, sha, 32);
    else memset(buf + 12, 0, 32);
    put16(buf + 44, pl);
    memcpy(buf + 46, path, pl);
    put16(buf + 46 + pl, (size_t)an);
    memcpy(buf + 48 + pl, argv, (size_t)an);
    send_frame(0, M_EXECDENIED, buf, 48 + pl + (size_t)an, NULL, 0);
    pol_suppressed = 0;
}

/* Answers every permission event waiting (an unanswered one holds its execve). */
static void policy_events(void) {
    static uint8_t buf[16 << 10] __attribute__((aligned(8)));
    while (pol_fd >= 0) {
        ssize_t n = read(pol_fd, buf, sizeof buf);
        if (n <= 0) return;
        const struct fanotify_event_metadata *md = (const void *)buf;
        for (; FAN_EVENT_OK(md, n); md = FAN_EVENT_NEXT(md, n)) {
            if (md->fd < 0) continue;
            char path[4096];
            uint8_t sha[32];
            int hashed;
            int allow = !(md->mask & FAN_OPEN_EXEC_PERM) ||
                        policy_allows(md->fd, md->pid, path, sizeof path, sha, &hashed);
            struct fanotify_response r = {.fd = md->fd, .response = allow ? FAN_ALLOW : FAN_DENY};
            if (write(pol_fd, &r, sizeof r) < 0) logf_("exec policy: answer: %s", strerror(errno));
            if (!allow) report_denial(md->pid, path, sha, hashed);
            close(md->fd);
        }
    }
}

/* An exec's child between fork and its first execve: the agent answers the permission
   events of that execve (and any other) while it waits to hear whether it started. */
static void policy_wait_child(int ep_fd, pid_t pid, int wrapper, int exempt) {
    spawning_pid = pid;
    spawning_free = exempt ? 2 : wrapper ? 1 : 0;
    for (;;) {
        struct pollfd p[2] = {{.fd = ep_fd, .events = POLLIN}, {.fd = pol_fd, .events = POLLIN}};
        int rc = poll(p, 2, -1);
        if (rc < 0 && errno == EINTR) continue;
        if (rc < 0 || p[0].revents) break;
        if (p[1].revents & POLLIN) policy_events();
    }
    spawning_pid = 0;
    spawning_free = 0;
}

/* ---- the host's request ---------------------------------------------------------------------- */

static void handle_policy(uint32_t chan, const uint8_t *p, uint32_t len) {
    static struct field fs[POL_RULES + 8];
    int n = parse_fields(p, len, fs, POL_RULES + 8);
    if (n < 0) return send_error(chan, EINVAL, "malformed exec policy");
    struct pol_rule rules[POL_RULES];
    int count = 0, deny = 0;
    for (int i = 0; i < n; i++) {
        if (fs[i].tag == F_POL_DEFAULT) {
            deny = field_u64(&fs[i]) != 0;
        } else if (fs[i].tag == F_POL_RULE) {
            const struct field *f = &fs[i];
            struct pol_rule r = {0};
            int ok = count < POL_RULES && f->len > 2 && (f->val[0] == 'a' || f->val[0] == 'd');
            r.deny = f->len > 0 && f->val[0] == 'd';
            r.by_hash = f->len > 1 && f->val[1] == 'h';
            if (ok && r.by_hash) {
                ok = f->len == 34;
                if (ok) memcpy(r.sha, f->val + 2, 32);
            } else if (ok) {
                ok = f->val[1] == 'p' && !memchr(f->val + 2, 0, f->len - 2);
                if (ok) r.glob = strndup((const char *)f->val + 2, f->len - 2);
            }
            if (!ok) {
                for (int k = 0; k < count; k++) free(rules[k].glob);
                return send_error(chan, EINVAL, "malformed exec policy rule");
            }
            rules[count++] = r;
        }
    }
    for (int k = 0; k < n_pol_rules; k++) free(pol_rules[k].glob);
    memcpy(pol_rules, rules, (size_t)count * sizeof *rules);
    n_pol_rules = count;
    pol_deny_default = deny;
    if ((deny || count) && pol_fd < 0) {
        pol_fd = fanotify_init(FAN_CLASS_CONTENT | FAN_CLOEXEC | FAN_NONBLOCK,
                               O_RDONLY | O_CLOEXEC | O_LARGEFILE);
        if (pol_fd < 0) {
            int err = errno;
            n_pol_rules = pol_deny_default = 0;
            return send_error(chan, err, "exec policy: fanotify: %s", strerror(err));
        }
        policy_mark_mounts();
    } else if (!deny && !count && pol_fd >= 0) { /* nothing to hold: every exec runs freely */
        policy_events();
        close(pol_fd);
        pol_fd = -1;
    }
    send_ok(chan);
}
