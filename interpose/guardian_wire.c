/* guardian_wire.c: the native `krex`'s side of krexd's socket: who serves it (trust,
 * SO_PEERCRED), its segment (heartbeat, gates; a shrunk file never faults us), the request
 * and reply frames (krex_abi.h) and the admission they carry. */
#define _GNU_SOURCE
#include "guardian.h"
#include "wire.h"
/* ------------------------------------------------------------------ JSON (replies only)
 * krexd's replies are one JSON object (krex/protocol.py). A strict reader: a tree of
 * values; anything malformed is an error. Strings are decoded (escapes, \u to UTF-8);
 * a NUL inside one is refused (it could not reach an environment). */


struct jparse {
    const char *p, *end;
    int depth;
};

void jfree(struct jv *v) {
    while (v) {
        struct jv *n = v->next;
        jfree(v->kid);
        free(v->s);
        free(v->key);
        free(v);
        v = n;
    }
}

static void jws(struct jparse *j) {
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r')) j->p++;
}

static int hex4(const char *p, unsigned *out) {
    *out = 0;
    for (int i = 0; i < 4; i++) {
        char c = p[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return -1;
        *out = *out << 4 | (unsigned)d;
    }
    return 0;
}

static void put_utf8(struct buf *b, unsigned cp) {
    char u[4];
    size_t n;
    if (cp < 0x80) u[0] = (char)cp, n = 1;
    else if (cp < 0x800) u[0] = (char)(0xC0 | cp >> 6), u[1] = (char)(0x80 | (cp & 63)), n = 2;
    else if (cp < 0x10000)
        u[0] = (char)(0xE0 | cp >> 12), u[1] = (char)(0x80 | (cp >> 6 & 63)), u[2] = (char)(0x80 | (cp & 63)), n = 3;
    else
        u[0] = (char)(0xF0 | cp >> 18), u[1] = (char)(0x80 | (cp >> 12 & 63)), u[2] = (char)(0x80 | (cp >> 6 & 63)),
        u[3] = (char)(0x80 | (cp & 63)), n = 4;
    buf_add(b, u, n);
}

static char *jstring(struct jparse *j) { /* at the opening quote */
    struct buf b = {0};
    buf_str(&b, "");
    for (j->p++; j->p < j->end; j->p++) {
        unsigned char c = (unsigned char)*j->p;
        if (c == '"') {
            j->p++;
            return b.p;
        }
        if (c < 0x20) break;
        if (c != '\\') {
            buf_add(&b, j->p, 1);
            continue;
        }
        if (++j->p >= j->end) break;
        const char *simple = strchr("\"\\/bfnrt", *j->p);
        if (simple && *j->p) {
            static const char to[] = "\"\\/\b\f\n\r\t";
            buf_add(&b, &to[simple - "\"\\/bfnrt"], 1);
            continue;
        }
        unsigned cp, lo;
        if (*j->p != 'u' || j->end - j->p < 5 || hex4(j->p + 1, &cp)) break;
        j->p += 4;
        if (cp >= 0xD800 && cp < 0xDC00) { /* a surrogate pair */
            if (j->end - j->p < 7 || j->p[1] != '\\' || j->p[2] != 'u' || hex4(j->p + 3, &lo) || lo < 0xDC00 || lo > 0xDFFF)
                break;
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            j->p += 6;
        } else if ((cp >= 0xDC00 && cp < 0xE000) || cp == 0) {
            break;
        }
        put_utf8(&b, cp);
    }
    free(b.p);
    return NULL;
}

static struct jv *jvalue(struct jparse *j);

static struct jv *jcontainer(struct jparse *j, struct jv *v, char close) {
    struct jv **tail = &v->kid;
    j->p++;
    jws(j);
    if (j->p < j->end && *j->p == close) {
        j->p++;
        return v;
    }
    for (;;) {
        char *key = NULL;
        jws(j);
        if (close == '}') {
            if (j->p >= j->end || *j->p != '"' || !(key = jstring(j))) return NULL;
            jws(j);
            if (j->p >= j->end || *j->p++ != ':') {
                free(key);
                return NULL;
            }
        }
        struct jv *k = jvalue(j);
        if (!k) {
            free(key);
            return NULL;
        }
        k->key = key;
        *tail = k;
        tail = &k->next;
        jws(j);
        if (j->p < j->end && *j->p == ',') {
            j->p++;
            continue;
        }
        if (j->p < j->end && *j->p == close) {
            j->p++;
            return v;
        }
        return NULL;
    }
}

static int jnumber(struct jparse *j, struct jv *v) {
    const char *s = j->p;
    if (j->p < j->end && *j->p == '-') j->p++;
    if (j->p >= j->end || *j->p < '0' || *j->p > '9') return -1;
    if (*j->p == '0') j->p++;
    else
        while (j->p < j->end && *j->p >= '0' && *j->p <= '9') j->p++;
    if (j->p < j->end && *j->p == '.') {
        if (++j->p >= j->end || *j->p < '0' || *j->p > '9') return -1;
        while (j->p < j->end && *j->p >= '0' && *j->p <= '9') j->p++;
    }
    if (j->p < j->end && (*j->p == 'e' || *j->p == 'E')) {
        j->p++;
        if (j->p < j->end && (*j->p == '+' || *j->p == '-')) j->p++;
        if (j->p >= j->end || *j->p < '0' || *j->p > '9') return -1;
        while (j->p < j->end && *j->p >= '0' && *j->p <= '9') j->p++;
    }
    char tmp[64];
    size_t n = (size_t)(j->p - s);
    if (n >= sizeof tmp) n = sizeof tmp - 1; /* precision beyond this is never needed */
    memcpy(tmp, s, n);
    tmp[n] = 0;
    v->num = strtod(tmp, NULL);
    return 0;
}

static struct jv *jvalue(struct jparse *j) {
    struct jv *v = calloc(1, sizeof *v);
    if (!v) return NULL;
    jws(j);
    struct jv *ok = v;
    if (++j->depth > 32 || j->p >= j->end) {
        ok = NULL;
    } else if (*j->p == '{') {
        v->t = J_OBJ;
        ok = jcontainer(j, v, '}');
    } else if (*j->p == '[') {
        v->t = J_ARR;
        ok = jcontainer(j, v, ']');
    } else if (*j->p == '"') {
        v->t = J_STR;
        ok = (v->s = jstring(j)) ? v : NULL;
    } else if (j->end - j->p >= 4 && !memcmp(j->p, "true", 4)) {
        v->t = J_BOOL, v->b = 1, j->p += 4;
    } else if (j->end - j->p >= 5 && !memcmp(j->p, "false", 5)) {
        v->t = J_BOOL, j->p += 5;
    } else if (j->end - j->p >= 4 && !memcmp(j->p, "null", 4)) {
        v->t = J_NULL, j->p += 4;
    } else {
        v->t = J_NUM;
        ok = jnumber(j, v) ? NULL : v;
    }
    j->depth--;
    if (!ok) jfree(v);
    return ok;
}

/* The whole text as one JSON object, or NULL. */
struct jv *jparse_object(const char *s, size_t n) {
    struct jparse j = {s, s + n, 0};
    jws(&j);
    if (j.p >= j.end || *j.p != '{') return NULL;
    struct jv *v = jvalue(&j);
    jws(&j);
    if (v && j.p != j.end) {
        jfree(v);
        return NULL;
    }
    return v;
}

struct jv *jget(const struct jv *obj, const char *key) {
    if (!obj || obj->t != J_OBJ) return NULL;
    for (struct jv *k = obj->kid; k; k = k->next)
        if (!strcmp(k->key, key)) return k; /* the last one would win in Python; krexd never repeats */
    return NULL;
}

const char *jstr(const struct jv *obj, const char *key) {
    struct jv *v = jget(obj, key);
    return v && v->t == J_STR ? v->s : NULL;
}

/* An integer member in [lo, hi], or -1 (the callers' values are never negative). */
static long long jint(const struct jv *obj, const char *key, long long lo, long long hi) {
    struct jv *v = jget(obj, key);
    if (!v || v->t != J_NUM || v->num != (double)(long long)v->num || v->num < lo || v->num > hi) return -1;
    return (long long)v->num;
}

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
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct timeval tv = {KREX_CONNECT_TIMEOUT_MS / 1000, (KREX_CONNECT_TIMEOUT_MS % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_un a;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    memcpy(a.sun_path, path, strlen(path) + 1);
    struct ucred cr;
    socklen_t len = sizeof cr;
    if (connect(fd, (struct sockaddr *)&a, sizeof a) || getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len)) {
        close(fd);
        return -1;
    }
    if (cr.uid != geteuid() && cr.uid != 0) {
        close(fd); /* another user's daemon: Python refuses it with the reason */
        return -1;
    }
    c->fd = fd;
    c->daemon_pid = cr.pid;
    const char *shm = getenv("KREX_SHM"); /* shm.default_name(), as the Python client */
    if (shm && *shm) snprintf(c->seg_name, sizeof c->seg_name, "%s", shm);
    else snprintf(c->seg_name, sizeof c->seg_name, "/krex-%u", (unsigned)getuid());
    c->seg = seg_map(c->seg_name);
    return 0;
}

/* One request: header (op, no fixed body) and its JSON object (krex/protocol.py). */
int send_request(struct conn *c, enum krex_op op, const struct buf *json) {
    return krex_wire_send(c->fd, op, NULL, 0, json->p, (uint32_t)json->n) ? -1 : 0;
}

/* A wait for krexd's bytes: given up when krexd is gone, hung or stopped (daemon_stuck), or
 * past `end` (0: never; admission may queue). `why` says which. */
struct wait {
    struct conn *c;
    uint64_t end;
    char *why;
    size_t why_n;
    void (*on_event)(const struct jv *);
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

/* The JSON object after a header (none: an empty object), or NULL with `why` set. */
static struct jv *recv_object(struct wait *w, const struct krex_msg_hdr *h) {
    char *js = malloc((size_t)h->json_len + 1);
    if (!js || recv_bytes(w, js, h->json_len)) {
        free(js);
        return NULL;
    }
    struct jv *v = h->json_len ? jparse_object(js, h->json_len) : calloc(1, sizeof *v);
    free(js);
    if (!v) snprintf(w->why, w->why_n, "krexd's reply is not a JSON object");
    else if (!h->json_len) v->t = J_OBJ;
    return v;
}

static int on_event_frame(int fd, const struct krex_msg_hdr *h, void *arg) {
    struct wait *w = arg;
    (void)fd;
    if (h->body_len) return -EPROTO;
    struct jv *v = recv_object(w, h);
    if (!v) return -EIO;
    if (w->on_event) w->on_event(v);
    jfree(v);
    return 0;
}

/* The reply to `op`: its JSON object (events go to on_event). Returns 0 (ok reply), 1 (an
 * error reply: `out` holds its object) or -1 (no usable reply: `why`). `cap_ns` bounds the
 * whole exchange: events do not restart it (a krexd that sends events forever would hold
 * us for ever); 0: no bound (admission may queue). */
int recv_reply(struct conn *c, enum krex_op op, uint64_t cap_ns, struct jv **out, char *why, size_t why_n,
               void (*on_event)(const struct jv *)) {
    struct wait w = {c, cap_ns ? now_ns() + cap_ns : 0, why, why_n, on_event};
    struct krex_msg_hdr h;
    memset(&h, 0, sizeof h);
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
    if (rc == -EPROTO || (!rc && (h.body_len != 0 || (h.status != KREX_ST_OK && h.status != KREX_ST_ERROR) ||
                                  (h.op != op && h.op != KREX_OP_NONE)))) {
        snprintf(why, why_n, "krexd's reply is not a frame of this KREX version (op %u, status %u, %u+%u bytes)",
                 h.op, h.status, h.body_len, h.json_len);
        return -1;
    }
    if (rc) return -1;
    if (!(*out = recv_object(&w, &h))) return -1;
    return h.status == KREX_ST_OK && h.op == op ? 0 : 1;
}

/* ------------------------------------------------------------------ admission */

void on_queue_event(const struct jv *ev) {
    static int told;
    const char *text = jstr(ev, "note"); /* optin.queue_note, rendered by krexd */
    if (!told && text) note(text);
    told = 1;
}


int read_admission(const struct jv *r, struct admission *a) {
    a->slot = (int)jint(r, "slot", 0, KREX_MAX_SLOTS - 1);
    a->gpu = (int)jint(r, "gpu", 0, KREX_MAX_GPUS - 1);
    a->shm = jstr(r, "shm");
    a->group = jstr(r, "group");
    a->freezer = jstr(r, "freezer");
    a->env_set = jget(r, "env_set");
    a->env_prepend = jget(r, "env_prepend");
    a->cpus = jget(r, "shared_cpus");
    a->notes = jget(r, "notes");
    if (a->slot < 0 || a->gpu < 0 || !a->shm || !a->group || !a->freezer) return -1;
    if (!a->env_set || a->env_set->t != J_OBJ || !a->env_prepend || a->env_prepend->t != J_OBJ) return -1;
    for (struct jv *k = a->env_set->kid; k; k = k->next)
        if (k->t != J_STR || !k->key[0] || strchr(k->key, '=')) return -1;
    for (struct jv *k = a->env_prepend->kid; k; k = k->next) {
        struct jv *v = k->kid; /* [value, separators] */
        if (k->t != J_ARR || !k->key[0] || strchr(k->key, '=') || !v || v->t != J_STR || !v->next ||
            v->next->t != J_STR || v->next->next)
            return -1;
    }
    if (a->cpus && a->cpus->t != J_NULL) {
        if (a->cpus->t != J_ARR) return -1;
        for (struct jv *k = a->cpus->kid; k; k = k->next)
            if (k->t != J_NUM || k->num < 0 || k->num >= CPU_SETSIZE || k->num != (int)k->num) return -1;
    }
    if (a->notes && a->notes->t != J_ARR) return -1;
    return 0;
}

void print_notes(const struct jv *notes) {
    for (const struct jv *k = notes ? notes->kid : NULL; k; k = k->next)
        if (k->t == J_STR) note(k->s);
}
