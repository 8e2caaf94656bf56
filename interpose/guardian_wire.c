/* guardian_wire.c: the native `krex`'s side of krexd's socket: who serves it (trust,
 * SO_PEERCRED), its segment (heartbeat, gates; a shrunk file never faults us), the request
 * and reply frames (krex_abi.h) and the admission they carry. */
#define _GNU_SOURCE
#include "guardian.h"
#include "wire.h"
/* ------------------------------------------------------------------ the daemon's socket */


/* Same rules as krex/paths.py socket_path(). Empty string when Python must say why. */
static void socket_path(char *out, size_t n, int *explicit_) {
    const char *s = getenv("KREX_SOCKET"), *d = getenv("KREX_STATE_DIR"), *x = getenv("XDG_RUNTIME_DIR");
    *explicit_ = (s && *s) || (d && *d);
    out[0] = 0;
    if (s && *s) {
        if (strlen(s) <= 100) snprintf(out, n, "%s", s);
    } else if (d && *d) {
        snprintf(out, n, "%s/krexd.sock", d);
    } else if (geteuid() == 0) {
        snprintf(out, n, "/run/krex/krexd.sock");
    } else if (x && *x) {
        snprintf(out, n, "%s/krex/krexd.sock", x);
    } else {
        snprintf(out, n, "/tmp/krex-%u/krexd.sock", (unsigned)getuid());
    }
}

/* paths.check_for_client(): the socket's directory is a real directory of ours or root's
 * (any owner if the user named it) that others may not write. Fails closed: Python then
 * gives the precise refusal. */
static int dir_trusted(const char *sock, int explicit_, uid_t *dir_uid) {
    char d[PATH_MAX];
    snprintf(d, sizeof d, "%s", sock);
    char *slash = strrchr(d, '/');
    if (!slash) snprintf(d, sizeof d, ".");
    else if (slash == d) d[1] = 0;
    else *slash = 0;
    struct stat st;
    if (lstat(d, &st) || !S_ISDIR(st.st_mode)) return 0;
    *dir_uid = st.st_uid;
    if (!explicit_ && st.st_uid != geteuid() && st.st_uid != 0) return 0;
    return !(st.st_mode & (explicit_ ? S_IWOTH : S_IWOTH | S_IWGRP));
}

/* A segment shrunk under us (`truncate -s 0` by anyone who may write it) faults every
 * read past its new end with SIGBUS. The handler maps the file again at the same address
 * once its size is back (krexd and every shim give it back when they touch it), else zero
 * pages, which read as "no daemon" (heartbeat unknown: the process state still tells a
 * stopped krexd); the watch loop maps the file again later (seg_remap). */
#define SEG_MAPS 4
static struct {
    void *addr;
    char path[160];
} g_maps[SEG_MAPS];
static volatile sig_atomic_t g_seg_zeroed;

static int map_file_at(void *base, const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return 0;
    struct stat st;
    void *m = MAP_FAILED;
    if (fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof(struct krex_shm))
        m = mmap(base, sizeof(struct krex_shm), PROT_READ, MAP_SHARED | MAP_FIXED, fd, 0);
    close(fd);
    return m != MAP_FAILED;
}

static void on_sigbus(int sig, siginfo_t *si, void *uc) {
    (void)uc;
    int saved = errno;
    char *a = si->si_addr;
    for (int i = 0; si->si_code > 0 && i < SEG_MAPS; i++) {
        char *base = g_maps[i].addr;
        if (!base || a < base || a >= base + sizeof(struct krex_shm)) continue;
        if (!map_file_at(base, g_maps[i].path)) {
            mmap(base, sizeof(struct krex_shm), PROT_READ, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            g_seg_zeroed = 1;
        }
        errno = saved;
        return;
    }
    signal(sig, SIG_DFL); /* not ours: what SIGBUS would have done */
    if (si->si_code <= 0) raise(sig);
    errno = saved;
}

static void seg_guard(void *m, const char *path) {
    static int installed;
    if (!installed) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_sigbus;
        sa.sa_flags = SA_SIGINFO | SA_RESTART;
        sigfillset(&sa.sa_mask);
        installed = sigaction(SIGBUS, &sa, NULL) == 0;
    }
    for (int i = 0; i < SEG_MAPS; i++)
        if (!g_maps[i].addr) {
            snprintf(g_maps[i].path, sizeof g_maps[i].path, "%s", path);
            g_maps[i].addr = m;
            return;
        }
}

/* After a fault found no file to map: try again (the watch loop, every poll). */
void seg_remap(void) {
    if (!g_seg_zeroed) return;
    g_seg_zeroed = 0;
    for (int i = 0; i < SEG_MAPS; i++)
        if (g_maps[i].addr && !map_file_at(g_maps[i].addr, g_maps[i].path)) g_seg_zeroed = 1;
}

/* The segment read-only, for krexd's heartbeat and gates (krex_abi.h's layout). */
const struct krex_shm *seg_map(const char *name) {
    char path[160];
    if (!name || name[0] != '/' || strchr(name + 1, '/') || strlen(name) > 100) return NULL;
    snprintf(path, sizeof path, "/dev/shm%s", name);
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return NULL;
    struct stat st;
    void *m = MAP_FAILED;
    if (fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof(struct krex_shm))
        m = mmap(NULL, sizeof(struct krex_shm), PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return NULL;
    seg_guard(m, path); /* before the first read: the file may shrink at any time */
    const struct krex_shm *s = m;
    if (s->hdr.magic != KREX_MAGIC || s->hdr.abi_version != KREX_ABI_VERSION) {
        for (int i = 0; i < SEG_MAPS; i++)
            if (g_maps[i].addr == m) g_maps[i].addr = NULL;
        munmap(m, sizeof(struct krex_shm));
        return NULL;
    }
    return s;
}

/* Seconds since krexd's last beat, or -1 when unknown (Segment.heartbeat_age). */
double heartbeat_age(const struct conn *c) {
    if (!c->seg || __atomic_load_n(&c->seg->hdr.daemon_pid, __ATOMIC_ACQUIRE) != c->daemon_pid) return -1;
    uint64_t hb = __atomic_load_n(&c->seg->hdr.heartbeat_ns, __ATOMIC_ACQUIRE);
    return hb ? (double)(int64_t)(now_ns() - hb) / 1e9 : -1;
}

static char proc_state(pid_t pid) {
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *r = strrchr(buf, ')');
    return r && r[1] == ' ' ? r[2] : 0;
}

/* Why krexd will not answer (gone, hung, stopped past the heartbeat timeout), or NULL
 * (client.py Client._stuck). */
static const char *daemon_stuck(struct conn *c, char *why, size_t n) {
    char st = proc_state(c->daemon_pid);
    if (!st || st == 'Z' || st == 'X') {
        snprintf(why, n, "the KREX daemon (pid %d) is gone", (int)c->daemon_pid);
        return why;
    }
    double age = heartbeat_age(c);
    if (st == 'T' || st == 't') {
        if (!c->stopped_since) c->stopped_since = now_ns();
    } else {
        c->stopped_since = 0;
    }
    if (age > KREX_HEARTBEAT_TIMEOUT_NS / 1e9) {
        snprintf(why, n, "the KREX daemon (pid %d) is not responding: no heartbeat for %.1f s", (int)c->daemon_pid, age);
        return why;
    }
    if (c->stopped_since && now_ns() - c->stopped_since > (uint64_t)KREX_HEARTBEAT_TIMEOUT_NS) {
        snprintf(why, n, "the KREX daemon (pid %d) is stopped (state %c)", (int)c->daemon_pid, st);
        return why;
    }
    return NULL;
}

/* Connect and check who serves the socket (client.py _connect, _check_daemon_identity).
 * -1 when Python must handle it (nobody listens, not trusted, timeouts). */
int daemon_connect(struct conn *c) {
    char path[PATH_MAX];
    int explicit_;
    uid_t dir_uid = (uid_t)-1;
    socket_path(path, sizeof path, &explicit_);
    if (!path[0] || strlen(path) >= sizeof(((struct sockaddr_un *)0)->sun_path)) return -1;
    if (!dir_trusted(path, explicit_, &dir_uid)) return -1;
    pid_t peer = 0;
    int fd = krex_wire_connect(path, &peer, NULL);
    if (fd < 0) return -1; /* none, or another user's daemon: Python refuses it with the reason */
    c->fd = fd;
    c->daemon_pid = peer;
    const char *shm = getenv("KREX_SHM"); /* shm.default_name(), as the Python client */
    if (shm && *shm) snprintf(c->seg_name, sizeof c->seg_name, "%s", shm);
    else snprintf(c->seg_name, sizeof c->seg_name, "/krex-%u", (unsigned)getuid());
    c->seg = seg_map(c->seg_name);
    return 0;
}

/* One request: the op's struct and its text tail (krex_abi.h), no JSON. */
int send_request(struct conn *c, enum krex_op op, const void *body, uint32_t len, const struct krex_tail *tail) {
    return krex_wire_send(c->fd, op, body, len, tail) ? -1 : 0;
}

/* A wait for krexd's bytes: given up when krexd is gone, hung or stopped (daemon_stuck), or
 * past `end` (0: never; admission may queue). `why` says which. */
struct wait {
    struct conn *c;
    uint64_t end;
    char *why;
    size_t why_n;
    void (*on_event)(const char *note);
};

static int stuck(void *arg) {
    struct wait *w = arg;
    if (daemon_stuck(w->c, w->why, w->why_n)) return 1;
    if (w->end && now_ns() > w->end) {
        snprintf(w->why, w->why_n, "the KREX daemon (pid %d) did not answer within %d s", (int)w->c->daemon_pid,
                 KREX_REPLY_TIMEOUT_MS / 1000);
        return 1;
    }
    return 0;
}

/* Exactly n bytes (wire.c), or -1 with `why` set. */
static int recv_bytes(struct wait *w, void *buf, size_t n) {
    int rc = krex_wire_recv(w->c->fd, buf, n, stuck, w);
    if (rc && rc != -ETIMEDOUT)
        snprintf(w->why, w->why_n, "the KREX daemon (pid %d) closed the connection", (int)w->c->daemon_pid);
    return rc ? -1 : 0;
}

/* The body after a header (malloc'd, NUL-ended past it), its JSON part dropped unread; NULL
 * with `why` set. */
static char *recv_body(struct wait *w, const struct krex_msg_hdr *h) {
    char *b = malloc((size_t)h->body_len + 1);
    if (!b) snprintf(w->why, w->why_n, "out of memory for krexd's reply");
    if (!b || recv_bytes(w, b, h->body_len) || recv_bytes(w, NULL, h->json_len)) {
        free(b);
        return NULL;
    }
    b[h->body_len] = 0;
    return b;
}

static int on_event_frame(int fd, const struct krex_msg_hdr *h, void *arg) {
    struct wait *w = arg;
    (void)fd;
    char *b = recv_body(w, h);
    if (!b) return -EIO;
    struct krex_rep_event e;
    int ok = h->body_len >= sizeof e;
    if (ok) {
        memcpy(&e, b, sizeof e);
        const char *at = b + sizeof e, *end = b + h->body_len;
        krex_wire_text(&at, end, e.event_str, &ok);
        const char *text = krex_wire_text(&at, end, e.note_str, &ok);
        if (ok && at == end && text && w->on_event) w->on_event(text);
    }
    free(b);
    return 0;
}

/* The reply to `op`: its header and body (events go to on_event). Returns 0 (ok reply), 1
 * (an error reply) or -1 (no usable reply: `why`). `cap_ns` bounds the whole exchange:
 * events do not restart it (a krexd that sends events forever would hold us for ever); 0: no
 * bound (admission may queue). */
int recv_reply(struct conn *c, enum krex_op op, uint64_t cap_ns, struct reply *out, char *why, size_t why_n,
               void (*on_event)(const char *note)) {
    struct wait w = {c, cap_ns ? now_ns() + cap_ns : 0, why, why_n, on_event};
    struct krex_msg_hdr h;
    memset(&h, 0, sizeof h);
    memset(out, 0, sizeof *out);
    int rc;
    for (;;) { /* a late reply to a request given up on (krexd was stopped) is not this one's */
        rc = krex_wire_header(c->fd, &h, stuck, &w, on_event_frame);
        if (rc || !c->owed || h.op != c->owed_op || h.op == op) break;
        c->owed--;
        if ((rc = krex_wire_recv(c->fd, NULL, (size_t)h.body_len + h.json_len, stuck, &w))) break;
    }
    if (rc == -ETIMEDOUT) { /* krexd may still answer it: the next reply skips that answer */
        if (c->owed && c->owed_op != (int)op) c->owed = 0;
        c->owed_op = (int)op;
        c->owed++;
    }
    if (rc == -EPIPE || (rc && rc != -EPROTO && rc != -ETIMEDOUT && !why[0]))
        snprintf(why, why_n, "the KREX daemon (pid %d) closed the connection", (int)c->daemon_pid);
    if (rc == -EPROTO ||
        (!rc && ((h.status != KREX_ST_OK && h.status != KREX_ST_ERROR) || (h.op != op && h.op != KREX_OP_NONE)))) {
        snprintf(why, why_n, "krexd's reply is not a frame of this KREX version (op %u, status %u, %u+%u bytes)",
                 h.op, h.status, h.body_len, h.json_len);
        return -1;
    }
    if (rc) return -1;
    out->h = h;
    if (!(out->body = recv_body(&w, &h))) return -1;
    return h.status == KREX_ST_OK && h.op == op ? 0 : 1;
}

/* An error reply's texts (krex_rep_error); each NULL where it has none or it is malformed. */
void reply_error(const struct reply *r, struct error_texts *e) {
    struct krex_rep_error b;
    memset(e, 0, sizeof *e);
    if (r->h.status != KREX_ST_ERROR || r->h.body_len < sizeof b) return;
    memcpy(&b, r->body, sizeof b);
    const char *at = r->body + sizeof b, *end = r->body + r->h.body_len;
    int ok = 1;
    const char *error = krex_wire_text(&at, end, b.error_str, &ok), *fix = krex_wire_text(&at, end, b.fix_str, &ok),
               *kind = krex_wire_text(&at, end, b.kind_str, &ok);
    if (!ok || at != end) return;
    e->error = error, e->fix = fix, e->kind = kind;
}

/* A reply's one string (a NAME_str text): one NUL, at its end. */
static int one_string(const char *s, uint32_t n) { return !s || strlen(s) + 1 == n; }

/* The release reply: its notes and report (NULL: none). -1 when it is malformed. */
int read_release(const struct reply *r, struct text *notes, const char **report_json) {
    struct krex_rep_release b;
    if (r->h.body_len < sizeof b) return -1;
    memcpy(&b, r->body, sizeof b);
    const char *at = r->body + sizeof b, *end = r->body + r->h.body_len;
    int ok = 1;
    notes->p = krex_wire_text(&at, end, b.notes_strs, &ok);
    notes->n = b.notes_strs;
    *report_json = krex_wire_text(&at, end, b.report_json_str, &ok);
    return ok && at == end && one_string(*report_json, b.report_json_str) ? 0 : -1;
}

/* ------------------------------------------------------------------ admission */

void on_queue_event(const char *text) {
    static int told;
    if (!told && text) note(text); /* optin.queue_note, rendered by krexd */
    told = 1;
}

/* A CPU number of shared_cpus: decimal, below CPU_SETSIZE. */
static int cpu_number(const char *s) {
    char *e;
    errno = 0;
    long v = strtol(s, &e, 10);
    return *s >= '0' && *s <= '9' && !*e && !errno && v < CPU_SETSIZE ? (int)v : -1;
}

/* The admit reply's body (krex_rep_admit); -1 when it is malformed. */
int read_admission(const struct reply *r, struct admission *a) {
    struct krex_rep_admit b;
    memset(a, 0, sizeof *a);
    if (r->h.status != KREX_ST_OK || r->h.body_len < sizeof b) return -1;
    memcpy(&b, r->body, sizeof b);
    const char *at = r->body + sizeof b, *end = r->body + r->h.body_len;
    int ok = 1;
    a->slot = b.slot;
    a->gpu = b.gpu;
    a->wait_s = b.admission_wait_s;
    a->device = krex_wire_text(&at, end, b.device_str, &ok);
    a->shm = krex_wire_text(&at, end, b.shm_str, &ok);
    a->group = krex_wire_text(&at, end, b.group_str, &ok);
    a->freezer = krex_wire_text(&at, end, b.freezer_str, &ok);
    struct text *lists[] = {&a->env_set, &a->env_prepend, &a->cpus, &a->notes};
    uint32_t lens[] = {b.env_set_strs, b.env_prepend_strs, b.shared_cpus_strs, b.notes_strs};
    for (int i = 0; i < 4; i++) {
        lists[i]->p = krex_wire_text(&at, end, lens[i], &ok);
        lists[i]->n = lens[i];
    }
    if (!ok || at != end || a->slot < 0 || a->slot >= KREX_MAX_SLOTS || a->gpu < 0 || a->gpu >= KREX_MAX_GPUS)
        return -1;
    if (!a->shm || !a->group || !a->freezer || !one_string(a->device, b.device_str) ||
        !one_string(a->shm, b.shm_str) || !one_string(a->group, b.group_str) || !one_string(a->freezer, b.freezer_str))
        return -1;
    int k = 0; /* env_set: NAME, value; env_prepend: NAME, value, separators */
    TEXT_EACH(s, a->env_set) if (k++ % 2 == 0 && (!*s || strchr(s, '='))) return -1;
    if (k % 2) return -1;
    k = 0;
    TEXT_EACH(s, a->env_prepend) if (k++ % 3 == 0 && (!*s || strchr(s, '='))) return -1;
    if (k % 3) return -1;
    TEXT_EACH(s, a->cpus) if (cpu_number(s) < 0) return -1;
    return 0;
}

void print_notes(struct text notes) {
    TEXT_EACH(s, notes) note(s);
}

/* The CPUs of the admission's shared_cpus (read_admission checked each). */
int admission_cpus(const struct admission *a, cpu_set_t *set) {
    int any = 0;
    CPU_ZERO(set);
    TEXT_EACH(s, a->cpus) {
        CPU_SET(cpu_number(s), set);
        any = 1;
    }
    return any;
}
