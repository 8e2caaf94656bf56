/* See krex_core.h. Everything here is a slow path: the submission fast path
 * lives inline in shim_fastpath.h and only touches words this file sets up. */
#define _GNU_SOURCE
#include "krex_core.h"
#include "krex_env.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define SEQ __ATOMIC_SEQ_CST

uint64_t krex_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t krex_shm_size(void) { return sizeof(struct krex_shm); }

int krex_chunk_bytes(const char *text, uint64_t *out) {
    *out = KREX_COPY_CHUNK_BYTES;
    if (!text || *text < '0' || *text > '9') return KREX_CHUNK_BAD; /* strtoull takes "-1" */
    char *end;
    errno = 0;
    unsigned long long v = strtoull(text, &end, 10);
    if (errno || *end) return KREX_CHUNK_BAD;
    if (v == 0) {
        *out = UINT64_MAX;
        return KREX_CHUNK_OK;
    }
    *out = v < KREX_COPY_CHUNK_MIN_BYTES ? KREX_COPY_CHUNK_MIN_BYTES : v;
    return v < KREX_COPY_CHUNK_MIN_BYTES ? KREX_CHUNK_CLAMPED : KREX_CHUNK_OK;
}

static uint64_t fnv(uint64_t h, uint64_t v) {
    for (int i = 0; i < 8; i++) {
        h ^= (v >> (8 * i)) & 0xff;
        h *= 1099511628211ull;
    }
    return h;
}

/* Over the header fields that never change after creation. */
uint64_t krex_hdr_check(struct krex_shm *shm) {
    struct krex_header *h = &shm->hdr;
    uint64_t x = 14695981039346656037ull;
    x = fnv(x, h->magic);
    x = fnv(x, h->abi_version);
    x = fnv(x, h->n_gpus);
    x = fnv(x, h->size);
    x = fnv(x, h->instance);
    x = fnv(x, h->created_ns);
    return x ? x : 1;
}

uint32_t krex_shm_verify(struct krex_shm *shm, uint32_t n_gpus) {
    struct krex_header *h = &shm->hdr;
    uint32_t bad = 0;
    if (__atomic_load_n(&h->magic, SEQ) != (uint32_t)KREX_MAGIC) bad |= KREX_BAD_MAGIC;
    if (h->abi_version != KREX_ABI_VERSION) bad |= KREX_BAD_ABI;
    if (h->n_gpus < 1 || h->n_gpus > KREX_MAX_GPUS || (n_gpus && h->n_gpus != n_gpus)) bad |= KREX_BAD_GPUS;
    if (h->size != sizeof(struct krex_shm)) bad |= KREX_BAD_SIZE;
    if (h->check != krex_hdr_check(shm)) bad |= KREX_BAD_CHECK;
    return bad;
}

/* The controller rewrites a damaged header, every field, from its own copy `want` (the
 * header as it last read it whole): the pid and heartbeat that guardians, the watchdog and
 * shims judge krexd by among them. The beat is now (the caller is krexd, alive); the magic
 * is published last and the check recomputed, as at creation. */
void krex_hdr_restore(struct krex_shm *shm, const struct krex_header *want) {
    struct krex_header *h = &shm->hdr;
    __atomic_store_n(&h->magic, 0u, SEQ);
    h->abi_version = KREX_ABI_VERSION;
    h->n_gpus = want->n_gpus;
    __atomic_store_n(&h->flags, want->flags & ~(uint32_t)KREX_HF_RESTORED, SEQ);
    h->size = sizeof(struct krex_shm);
    __atomic_store_n(&h->daemon_pid, want->daemon_pid, SEQ);
    h->heartbeat_timeout_ns = want->heartbeat_timeout_ns;
    h->created_ns = want->created_ns;
    __atomic_store_n(&h->proc_overflows, want->proc_overflows, SEQ);
    h->instance = want->instance;
    h->pidns = want->pidns;
    memset(h->reserved, 0, sizeof h->reserved);
    __atomic_store_n(&h->ctx_token, 0ull, SEQ); /* whatever it held: free (a holder's give-back then misses) */
    __atomic_store_n(&h->heartbeat_ns, krex_now_ns(), SEQ);
    __atomic_store_n(&h->magic, (uint32_t)KREX_MAGIC, SEQ);
    h->check = krex_hdr_check(shm);
}


const char *krex_daemon_env_names(void) { return KREX_DAEMON_ENV; }
const char *krex_daemon_cmd_head(void) { return KREX_DAEMON_CMD_HEAD; }
const char *krex_daemon_cmd_module(void) { return KREX_DAEMON_CMD_MODULE; }
const char *krex_daemon_cmd_safe_path(void) { return KREX_DAEMON_CMD_SAFE_PATH; }
const char *krex_shell_safe(void) { return KREX_SHELL_SAFE; }

static uint64_t random_u64(void) {
    uint64_t v = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        ssize_t n = read(fd, &v, sizeof v);
        (void)n;
        close(fd);
    }
    return v ^ krex_now_ns() ^ ((uint64_t)getpid() << 32);
}

uint32_t krex_proc_check(struct krex_proc *p) {
    uint64_t x = 14695981039346656037ull;
    x = fnv(x, (uint64_t)p->pid);
    x = fnv(x, (uint64_t)(uint32_t)p->slot);
    x = fnv(x, (uint64_t)(uint32_t)p->gpu);
    x = fnv(x, p->start_ticks);
    uint32_t c = (uint32_t)(x ^ (x >> 32));
    return c ? c : 1;
}

/* Why a record looks damaged (0: it does not): 1 check, 2 gpu, 4 drain ack ahead of the
 * GPU's sequence, 8 slot, 16 counters out of range (or a drain stamp ahead of them). */
int krex_proc_why(struct krex_shm *shm, struct krex_proc *p, uint32_t n_gpus) {
    uint32_t c = __atomic_load_n(&p->check, SEQ);
    if (c == 0) return 0; /* being filled in (or freed): writers clear the check first */
    if (c != krex_proc_check(p)) return 1;
    if (p->gpu < 0 || (uint32_t)p->gpu >= n_gpus) return 2;
    /* A helper acks only drain requests it has seen: an ack ahead of the GPU's sequence
     * was written by something else, and would make the controller skip this drain. */
    if ((int32_t)(__atomic_load_n(&p->drain_ack, SEQ) - __atomic_load_n(&shm->gpus[p->gpu].drain_seq, SEQ)) > 0)
        return 4;
    if (p->slot != KREX_PROC_STALE && (p->slot < 0 || p->slot >= KREX_MAX_SLOTS)) return 8;
    if (p->has_ctx > 1 || p->inflight > 65536 || p->life_inflight > 65536 || p->free_inflight > 65536) return 16;
    /* A drain is stamped with a count it had reached: one ahead would make a drain skip it. */
    if (__atomic_load_n(&p->drained_at, SEQ) > 1 + krex_proc_submits(p)) return 16;
    return 0;
}

static int proc_bad(struct krex_shm *shm, struct krex_proc *p, uint32_t n_gpus) {
    return krex_proc_why(shm, p, n_gpus) != 0;
}

/* Records whose identity fields no longer match their check: damaged, or written by
 * something that is not a shim. A record being filled in right now can look bad for a
 * moment, so a suspect counts only if it still looks bad, for the same pid, 2 ms later. */
int krex_proc_audit(struct krex_shm *shm, uint32_t n_gpus, int *bad, int max_bad) {
    static __thread int cand[KREX_MAX_PROCS];
    static __thread int64_t cpid[KREX_MAX_PROCS];
    int nc = 0, n = 0;
    for (int i = 0; i < KREX_MAX_PROCS; i++) {
        struct krex_proc *p = &shm->procs[i];
        int64_t pid = __atomic_load_n(&p->pid, SEQ);
        if (pid == 0 || !proc_bad(shm, p, n_gpus)) continue;
        cand[nc] = i;
        cpid[nc++] = pid;
    }
    if (nc == 0) return n;
    usleep(2000);
    for (int k = 0; k < nc; k++) {
        struct krex_proc *p = &shm->procs[cand[k]];
        if (__atomic_load_n(&p->pid, SEQ) != cpid[k] || !proc_bad(shm, p, n_gpus)) continue;
        if (bad && n < max_bad) bad[n] = cand[k];
        n++;
    }
    return n;
}

/* A segment someone else planted must never be used: another user who pre-creates
 * /dev/shm/krex-<uid> could otherwise pause our GPU or fake our gates. A creator
 * (krexd) accepts only its own; anyone refuses one that "others" may open. */
static int shm_trusted(const struct stat *st, int creator) {
    if (!S_ISREG(st->st_mode) || (st->st_mode & 0007)) return 0;
    return !creator || st->st_uid == geteuid();
}

/* create: 0 attach only, 1 create if missing, 2 create fresh (fail if it exists).
 * Creation is exclusive (O_EXCL), so an existing segment is always inspected:
 * EPERM when it is not trustworthy (see shm_trusted). */
struct krex_shm *krex_shm_open(const char *name, int create, int n_gpus, int *err) {
    int fd = create ? shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0660) : -1;
    int made = fd >= 0;
    if (made) {
        fchmod(fd, 0660); /* exactly: the umask must not widen nor starve the sharing group */
    } else if (create == 2 || (create && errno != EEXIST)) {
        *err = errno;
        return NULL;
    } else {
        fd = shm_open(name, O_RDWR, 0);
    }
    if (fd < 0) {
        *err = errno;
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) < 0) {
        *err = errno;
        close(fd);
        return NULL;
    }
    if (!made && !shm_trusted(&st, create != 0)) {
        *err = EPERM;
        close(fd);
        return NULL;
    }
    int fresh = st.st_size == 0;
    if (fresh) {
        if (!create || ftruncate(fd, sizeof(struct krex_shm)) < 0) {
            *err = create ? errno : ENOENT;
            close(fd);
            return NULL;
        }
    } else if ((uint64_t)st.st_size < sizeof(struct krex_shm)) {
        *err = EPROTO;
        close(fd);
        return NULL;
    }
    void *p = mmap(NULL, sizeof(struct krex_shm), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        *err = errno;
        close(fd);
        return NULL;
    }
    krex_shm_guard(p, fd, name);
    struct krex_shm *shm = p;
    if (fresh) {
        /* ftruncate zero-fills; publish magic last so attachers never see half a header. */
        shm->hdr.abi_version = KREX_ABI_VERSION;
        shm->hdr.n_gpus = (uint32_t)(n_gpus > 0 && n_gpus <= KREX_MAX_GPUS ? n_gpus : 1);
        shm->hdr.size = sizeof(struct krex_shm);
        shm->hdr.heartbeat_timeout_ns = KREX_HEARTBEAT_TIMEOUT_NS;
        shm->hdr.created_ns = krex_now_ns();
        shm->hdr.instance = random_u64();
        for (int g = 0; g < KREX_MAX_GPUS; g++) shm->gpus[g].owner_slot = -1;
        for (int s = 0; s < KREX_MAX_SLOTS; s++) shm->slots[s].gpu = -1;
        __atomic_store_n(&shm->hdr.magic, (uint32_t)KREX_MAGIC, SEQ);
        shm->hdr.check = krex_hdr_check(shm);
    } else {
        /* A creator may still be initialising: wait briefly for the magic. */
        for (int i = 0; i < 1000 && __atomic_load_n(&shm->hdr.magic, SEQ) == 0; i++) usleep(1000);
        /* The check is stored right after the magic: give it the same moment. */
        for (int i = 0; i < 100 && krex_shm_verify(shm, 0) == KREX_BAD_CHECK; i++) usleep(1000);
        if (krex_shm_verify(shm, 0) != 0) {
            krex_shm_close(p);
            *err = EPROTO;
            return NULL;
        }
    }
    *err = 0;
    return shm;
}

void krex_shm_close(struct krex_shm *shm) {
    if (!shm) return;
    krex_shm_unguard(shm);
    munmap(shm, sizeof(struct krex_shm));
}

int krex_shm_unlink(const char *name) { return shm_unlink(name) == 0 ? 0 : errno; }

int krex_futex_wait(uint32_t *addr, uint32_t expected, uint64_t timeout_ns) {
    struct timespec ts = {(time_t)(timeout_ns / 1000000000ull), (long)(timeout_ns % 1000000000ull)};
    /* Shared (not PRIVATE) futex: waiters and wakers live in different processes. */
    long r = syscall(SYS_futex, addr, FUTEX_WAIT, expected, timeout_ns ? &ts : NULL, NULL, 0);
    return r == 0 ? 0 : errno;
}

int krex_futex_wake(uint32_t *addr) {
    return (int)syscall(SYS_futex, addr, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
}

uint32_t krex_load32(uint32_t *addr) { return __atomic_load_n(addr, SEQ); }

/* One read of /proc/<pid>/stat: its start time (field 22) and state letter. 0 when
 * the process is not there (or the file cannot be read). */
static uint64_t pid_stat_flags(int64_t pid, char *state, unsigned *flags);
static uint64_t pid_stat(int64_t pid, char *state) {
    unsigned flags;
    return pid_stat_flags(pid, state, &flags);
}

/* /proc/PID/FILE into buf (NUL-terminated), one read; 0 when it cannot be read. */
static int read_proc(int64_t pid, const char *file, char *buf, size_t size) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%lld/%s", (long long)pid, file);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, size - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    return 1;
}

/* The same, and the kernel's PF_* flags (field 9). */
static uint64_t pid_stat_flags(int64_t pid, char *state, unsigned *flags) {
    char buf[1024];
    if (!read_proc(pid, "stat", buf, sizeof buf)) return 0;
    /* comm may hold spaces and parens: fields restart after the last ')'. */
    char *p = strrchr(buf, ')');
    if (!p || !p[1] || !p[2]) return 0;
    unsigned long long v = 0;
    /* After ") " come fields 3..; start time is field 22. */
    if (sscanf(p + 2, "%c %*d %*d %*d %*d %*d %u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d %llu", state,
               flags, &v) != 3)
        return 0;
    return v;
}

uint64_t krex_pid_start_ticks(int64_t pid) {
    char state;
    return pid_stat(pid, &state);
}

/* Threads of a thread group (/proc/pid/status `Threads:`, which counts a zombie leader until
 * the last thread ends); 0 when unknown. */
static int group_threads(int64_t pid) {
    char buf[2048];
    if (!read_proc(pid, "status", buf, sizeof buf)) return 0;
    const char *t = strstr(buf, "\nThreads:");
    return t ? (int)strtol(t + 9, NULL, 10) : 0;
}

/* Alive: the process `start_ticks` names (0: any) runs, and is no zombie (a zombie
 * submits nothing and holds no context any more). One /proc read. */
int krex_pid_alive(int64_t pid, uint64_t start_ticks) {
    if (pid <= 0) return 0;
    if (kill((pid_t)pid, 0) != 0 && errno == ESRCH) return 0;
    char state = 0;
    uint64_t now = pid_stat(pid, &state);
    if (now == 0) return 1; /* not readable here (another pid namespace's /proc): as before, alive */
    if (start_ticks && now != start_ticks) return 0; /* pid was reused */
    if (state == 'X') return 0;
    /* A zombie leader whose other threads run on (it called pthread_exit) is alive. */
    return state != 'Z' || group_threads(pid) > 1;
}

/* Gate ownership is the gate word itself: (epoch24 << 8) | owner byte. Taking the
 * gate is ONE compare-and-swap from the word the caller expects (KREX_GATE_OPEN, or
 * a lapsed pause it may take over) to a closed word of a new epoch, so a region and
 * a pause can never both believe they hold it. The side fields (holder, pid, lease)
 * are written by the winner after the CAS and published by storing their epoch
 * last: a reader trusts them only when pub_epoch matches the word it saw. */
uint32_t krex_gate_acquire(struct krex_shm *shm, int gpu, uint32_t expect, int owner_slot, uint32_t holder,
                           int64_t holder_pid, uint64_t lease_deadline_ns, uint32_t *cur) {
    struct krex_gpu *g = &shm->gpus[gpu];
    uint32_t owner = owner_slot >= 0 ? (uint32_t)owner_slot + 1 : KREX_OWNER_NONE;
    uint64_t epoch = __atomic_load_n(&g->epoch, SEQ) + 1;
    uint32_t word = (uint32_t)((epoch & KREX_GATE_EPOCH_MASK) << KREX_GATE_EPOCH_SHIFT) | owner;
    uint32_t seen = expect;
    if (!__atomic_compare_exchange_n(&g->gate, &seen, word, 0, SEQ, SEQ)) {
        if (cur) *cur = seen;
        return 0;
    }
    __atomic_store_n(&g->epoch, epoch, SEQ);
    g->owner_slot = owner_slot;
    g->holder = holder;
    g->holder_pid = holder_pid;
    g->lease_deadline_ns = lease_deadline_ns;
    g->closed_ns = krex_now_ns();
    __atomic_add_fetch(&g->regions, 1, SEQ);
    __atomic_store_n(&g->pub_epoch, epoch, SEQ);
    if (cur) *cur = word;
    return word;
}

/* Open the gate only if it still holds `word` (one CAS). Returns 1 if opened. */
int krex_gate_release(struct krex_shm *shm, int gpu, uint32_t word) {
    struct krex_gpu *g = &shm->gpus[gpu];
    uint32_t seen = word;
    if (word == KREX_GATE_OPEN || !__atomic_compare_exchange_n(&g->gate, &seen, KREX_GATE_OPEN, 0, SEQ, SEQ))
        return 0;
    __atomic_add_fetch(&g->epoch, 1, SEQ);
    krex_futex_wake(&g->gate);
    return 1;
}

/* Holder side fields of the word now in the gate; 0 if they are not published yet. */
int krex_gate_holder(struct krex_shm *shm, int gpu, uint32_t word, uint32_t *holder, int64_t *holder_pid,
                     uint64_t *lease_deadline_ns) {
    struct krex_gpu *g = &shm->gpus[gpu];
    uint64_t e = __atomic_load_n(&g->pub_epoch, SEQ);
    if (word == KREX_GATE_OPEN || (uint32_t)(e & KREX_GATE_EPOCH_MASK) != (word >> KREX_GATE_EPOCH_SHIFT))
        return 0;
    *holder = g->holder;
    *holder_pid = g->holder_pid;
    *lease_deadline_ns = g->lease_deadline_ns;
    /* Still the same word: the fields were not rewritten by a later holder meanwhile. */
    return __atomic_load_n(&g->gate, SEQ) == word && __atomic_load_n(&g->pub_epoch, SEQ) == e;
}

/* Force the gate open whoever holds it: only for recovery of a dead holder and teardown. */
void krex_gate_open(struct krex_shm *shm, int gpu) {
    struct krex_gpu *g = &shm->gpus[gpu];
    __atomic_add_fetch(&g->epoch, 1, SEQ);
    __atomic_store_n(&g->gate, KREX_GATE_OPEN, SEQ);
    krex_futex_wake(&g->gate);
}

/* A live process whose drain helper thread is gone: it exec'd (exec ends every other
 * thread), and its old image's calls and contexts went with it. It owes no drain, and an
 * in-flight count it left (exec from inside a gated call) is no call. Until the helper
 * has started (tid 0) this cannot be told, and the process counts as it is. */
static int image_gone(struct krex_proc *p, int64_t pid) {
    uint32_t tid = __atomic_load_n(&p->helper_tid, SEQ);
    if (tid == 0) return 0;
    char path[64];
    snprintf(path, sizeof path, "/proc/%lld/task/%u", (long long)pid, tid);
    return access(path, F_OK) != 0 && errno == ENOENT;
}

/* What record `p`, found for process `pid`, proves (krex_proc_trust). */
static int trust_code(struct krex_shm *shm, struct krex_proc *p, int64_t pid, int slot, uint64_t generation) {
    if (__atomic_load_n(&p->check, SEQ) == 0) return KREX_TRUST_FILLING;
    if (krex_proc_why(shm, p, shm->hdr.n_gpus)) return KREX_TRUST_DAMAGED;
    int32_t s = __atomic_load_n(&p->slot, SEQ);
    if (s == KREX_PROC_STALE) return KREX_TRUST_STALE;
    if (s != slot) return KREX_TRUST_OTHER_SLOT;
    if (__atomic_load_n(&p->slot_gen, SEQ) != (uint32_t)generation) return KREX_TRUST_STALE;
    uint32_t flags = __atomic_load_n(&p->flags, SEQ);
    /* At exit the shim stops its helper on purpose (flagged first): still gated, drained. */
    if (__atomic_load_n(&p->helper_tid, SEQ) == 0) {
        if (!(flags & KREX_PF_IN_EXIT)) return KREX_TRUST_NO_HELPER;
    } else if (image_gone(p, pid)) {
        return KREX_TRUST_EXECD;
    }
    if (flags & KREX_PF_FOREIGN_NS) return KREX_TRUST_FOREIGN_NS;
    if (flags & KREX_PF_UNSEEN) return KREX_TRUST_UNSEEN;
    return KREX_TRUST_HELD;
}

/* Whether the record of process `pid` (started at `start_ticks`) proves that the gate of
 * slot `slot`, generation `generation`, holds it (KREX_TRUST_HELD), or why not. */
int krex_proc_trust(struct krex_shm *shm, int64_t pid, uint64_t start_ticks, int slot, uint64_t generation) {
    int32_t code = KREX_TRUST_NONE;
    krex_proc_trust_n(shm, &pid, &start_ticks, 1, slot, generation, &code);
    return code;
}

/* krex_proc_trust for the `n` processes of one slot at once, into codes[]: one pass over
 * the records (and, for each record found, one access() of its helper thread), cheap
 * enough for every sibling process of every region (krexd's freeze policy reads it
 * before anything else). */
void krex_proc_trust_n(struct krex_shm *shm, const int64_t *pids, const uint64_t *starts, int n, int slot,
                       uint64_t generation, int32_t *codes) {
    for (int k = 0; k < n; k++) codes[k] = KREX_TRUST_NONE;
    for (int i = 0; i < KREX_MAX_PROCS; i++) {
        struct krex_proc *p = &shm->procs[i];
        int64_t pid = __atomic_load_n(&p->pid, SEQ);
        if (pid == 0) continue;
        for (int k = 0; k < n; k++) {
            if (pids[k] != pid) continue;
            if (p->start_ticks == starts[k]) codes[k] = trust_code(shm, p, pid, slot, generation);
            break;
        }
    }
}

/* A record of another command's process on `gpu` (or of a slot handed on, whose GPU is
 * not known): its pid, else 0. */
static int64_t sibling_pid(struct krex_proc *p, int gpu, int owner_slot) {
    int64_t pid = __atomic_load_n(&p->pid, SEQ);
    if (pid == 0 || p->slot == owner_slot) return 0;
    return p->slot == KREX_PROC_STALE || p->gpu == gpu ? pid : 0;
}

/* The live GPU-using processes (records) of the other commands on `gpu`, and of
 * released slots' leftovers (their GPU is not known). krexd takes this at a region's
 * entry and end: a process in only one of them started or ended its GPU work meanwhile
 * (context set-up and teardown run on the GPU outside any gated call). An exec changes
 * the helper thread (a GPU image) or leaves none (image gone: not live). Returns the
 * count, which may exceed `max`. */
int krex_sibling_procs(struct krex_shm *shm, int gpu, int owner_slot, struct krex_proc_id *out, int max) {
    int n = 0;
    for (int i = 0; i < KREX_MAX_PROCS; i++) {
        struct krex_proc *p = &shm->procs[i];
        int64_t pid = sibling_pid(p, gpu, owner_slot);
        if (!pid) continue;
        uint64_t st = p->start_ticks;
        if (!krex_pid_alive(pid, st) || image_gone(p, pid)) continue;
        if (out && n < max) {
            out[n].pid = pid;
            out[n].start_ticks = st;
            out[n].helper_tid = __atomic_load_n(&p->helper_tid, SEQ);
            out[n].pad0 = 0;
        }
        n++;
    }
    return n;
}

/* Live sibling processes of `gpu` (not in `owner_slot`) inside a LIFE call (or exiting
 * after one): krexd freezes their slots, since the gate cannot stop such a call midway.
 * Fills their pids and slots (KREX_PROC_STALE for a process of a slot handed on), and
 * if `tids` is not NULL the thread that last began a LIFE call in each (0: unknown). */
int krex_life_busy(struct krex_shm *shm, int gpu, int owner_slot, int64_t *pids, int32_t *slots, uint32_t *tids,
                   int max) {
    int n = 0;
    for (int i = 0; i < KREX_MAX_PROCS; i++) {
        struct krex_proc *p = &shm->procs[i];
        int64_t pid = sibling_pid(p, gpu, owner_slot);
        if (!pid || __atomic_load_n(&p->life_inflight, SEQ) == 0) continue;
        if (!krex_pid_alive(pid, p->start_ticks) || image_gone(p, pid)) continue;
        if (n < max) {
            pids[n] = pid;
            slots[n] = p->slot;
            if (tids) tids[n] = __atomic_load_n(&p->life_tid, SEQ);
        }
        n++;
    }
    return n;
}

/* Processes of `gpu`'s other slots inside the kernel's exit (PF_EXITING, not yet a zombie)
 * whose exit the freezer cannot stop: those whose helper thread is gone (exit_group killed
 * it) or that hold a LIFE count (the exit hold). One /proc read for each such record only. */
#define LINUX_PF_EXITING 4u /* include/linux/sched.h */
int krex_sibling_exiting(struct krex_shm *shm, int gpu, int owner_slot, int64_t *pids, int max) {
    int n = 0;
    for (int i = 0; i < KREX_MAX_PROCS; i++) {
        struct krex_proc *p = &shm->procs[i];
        int64_t pid = sibling_pid(p, gpu, owner_slot);
        if (!pid || (__atomic_load_n(&p->life_inflight, SEQ) == 0 && !image_gone(p, pid))) continue;
        char state = 0;
        unsigned flags = 0;
        uint64_t st = pid_stat_flags(pid, &state, &flags);
        if (st == 0 || (p->start_ticks && st != p->start_ticks) || state == 'Z' || state == 'X') continue;
        if (!(flags & LINUX_PF_EXITING)) continue;
        if (n < max) pids[n] = pid;
        n++;
    }
    return n;
}

/* Live processes of `gpu`'s other slots inside a free (krex_proc.free_inflight): a free they
 * made may have just ended without its closing stamp (frozen right after the driver call). */
int krex_frees_inflight(struct krex_shm *shm, int gpu, int owner_slot) {
    int n = 0;
    for (int i = 0; i < KREX_MAX_PROCS; i++) {
        struct krex_proc *p = &shm->procs[i];
        int64_t pid = sibling_pid(p, gpu, owner_slot);
        if (pid && __atomic_load_n(&p->free_inflight, SEQ) != 0 && krex_pid_alive(pid, p->start_ticks)) n++;
    }
    return n;
}

/* Slots of `gpu` other than `owner_slot` whose processes freed GPU memory (or exited
 * after a LIFE call) at or after `since_ns` (CLOCK_MONOTONIC): their numbers, and how long
 * ago (ns). The stamps outlive the processes, their records and the slot's command. */
int krex_recent_frees(struct krex_shm *shm, int gpu, int owner_slot, uint64_t owner_gen, uint64_t since_ns,
                      int32_t *slots, uint64_t *ago_ns, int max) {
    int n = 0;
    uint64_t now = krex_now_ns();
    for (int s = 0; s < KREX_MAX_SLOTS; s++) {
        uint64_t t = __atomic_load_n(&shm->gpus[gpu].slot_free_ns[s], SEQ);
        /* A stamp ahead of the clock is damage (the segment is writable by every process of
         * the user): it would read as a free just now at every grant, for good. Count it as
         * one now, once: it ages out after a settle. */
        if (t > now + 1000000000ull && __atomic_compare_exchange_n(&shm->gpus[gpu].slot_free_ns[s], &t, now, 0, SEQ, SEQ))
            t = now;
        if (t == 0 || t < since_ns) continue;
        /* The owner's own command's frees are its own business; not those of the command
         * that had its slot number before it (the next one in a queue usually gets it). */
        if (s == owner_slot && __atomic_load_n(&shm->gpus[gpu].slot_free_gen[s], SEQ) == owner_gen) continue;
        if (n < max) {
            slots[n] = s;
            ago_ns[n] = now > t ? now - t : 0;
        }
        n++;
    }
    return n;
}

static void atomic_max_u64(uint64_t *w, uint64_t v) {
    uint64_t cur = __atomic_load_n(w, SEQ);
    while (cur < v && !__atomic_compare_exchange_n(w, &cur, v, 0, SEQ, SEQ)) {
    }
}

/* A process of `slot` freed GPU memory, or is about to (its exit): raise the slot's stamp,
 * and the time until which the GPU may still clear that memory (`settle_ns` from now:
 * sized by the bytes freed where known, else KREX_FREE_SETTLE_NS). The deadline first: a
 * reader that sees the new stamp sees a deadline at least as late. */
void krex_note_free(struct krex_shm *shm, int gpu, int slot, uint64_t gen, uint64_t settle_ns) {
    if (gpu < 0 || gpu >= KREX_MAX_GPUS || slot < 0 || slot >= KREX_MAX_SLOTS) return;
    __atomic_store_n(&shm->gpus[gpu].slot_free_gen[slot], gen, SEQ); /* before the time: seen with it */
    uint64_t now = krex_now_ns();
    atomic_max_u64(&shm->gpus[gpu].slot_free_until_ns[slot], now + settle_ns);
    atomic_max_u64(&shm->gpus[gpu].slot_free_ns[slot], now);
}

/* The latest time until which the GPU may still clear memory that `gpu`'s other slots
 * freed (0: none), from the stamps made at or after `since_ns`; *latest gets the newest
 * such stamp. A deadline older than its stamp (never set: a segment's first stamp of a
 * slot) or more than a settle time plus an hour of bytes after it is damage: read as the
 * stamp plus KREX_FREE_SETTLE_NS. The owner's own command's frees are skipped as in
 * krex_recent_frees. */
uint64_t krex_settle_until(struct krex_shm *shm, int gpu, int owner_slot, uint64_t owner_gen, uint64_t since_ns,
                           uint64_t *latest) {
    uint64_t until = 0, newest = 0, now = krex_now_ns();
    const uint64_t most = (uint64_t)KREX_FREE_SETTLE_NS + 3600ull * 1000000000ull;
    for (int s = 0; s < KREX_MAX_SLOTS; s++) {
        uint64_t t = __atomic_load_n(&shm->gpus[gpu].slot_free_ns[s], SEQ);
        if (t > now + 1000000000ull) t = now; /* damage, as krex_recent_frees reads it */
        if (t == 0 || t < since_ns) continue;
        if (s == owner_slot && __atomic_load_n(&shm->gpus[gpu].slot_free_gen[s], SEQ) == owner_gen) continue;
        uint64_t u = __atomic_load_n(&shm->gpus[gpu].slot_free_until_ns[s], SEQ);
        if (u < t || u - t > most) u = t + (uint64_t)KREX_FREE_SETTLE_NS;
        if (u > until) until = u;
        if (t > newest) newest = t;
    }
    if (latest) *latest = newest;
    return until;
}

/* Threads of non-owner slots on this GPU that are inside a gated call. Dead
 * processes are skipped: a SIGKILLed submitter must not stall every region. */
int krex_gate_inflight(struct krex_shm *shm, int gpu, int owner_slot, int64_t *pids, int max_pids) {
    int total = 0, np = 0;
    for (int i = 0; i < KREX_MAX_PROCS; i++) {
        struct krex_proc *p = &shm->procs[i];
        int64_t pid = __atomic_load_n(&p->pid, SEQ);
        if (pid == 0 || p->gpu != gpu || p->slot == owner_slot) continue;
        uint32_t n = __atomic_load_n(&p->inflight, SEQ);
        if (n == 0 || !krex_pid_alive(pid, p->start_ticks) || image_gone(p, pid)) continue;
        total += n > 65536 ? 1 : (int)n; /* (a count out of range is damage: still in flight) */
        if (pids && np < max_pids) pids[np++] = pid;
    }
    for (int s = 0; s < KREX_MAX_SLOTS; s++) {
        struct krex_slot *sl = &shm->slots[s];
        if (sl->gpu != gpu || s == owner_slot || sl->state != KREX_SLOT_ACTIVE) continue;
        total += (int)__atomic_load_n(&sl->inflight, SEQ);
    }
    return total;
}

uint32_t krex_drain_request(struct krex_shm *shm, int gpu) {
    struct krex_gpu *g = &shm->gpus[gpu];
    uint32_t seq = __atomic_add_fetch(&g->drain_seq, 1, SEQ);
    krex_futex_wake(&g->drain_seq);
    return seq;
}

/* A process's calls that queue GPU work: its gated submissions (kernels, copies, memsets,
 * graphs, prefetches) and its stream-ordered LIFE calls (not the other LIFE calls, which
 * are done when they return: a teardown makes many). */
uint64_t krex_proc_submits(struct krex_proc *p) {
    uint64_t n = __atomic_load_n(&p->ordered_life, SEQ);
    for (int k = 0; k < KREX_CLS_LIFE; k++) n += __atomic_load_n(&p->submits[k], SEQ);
    return n;
}

/* 1 if nothing of `p` can be queued on the GPU: no call in flight, every stream-ordered
 * LIFE call ended, and no GPU-work call since it began its last full drain (drained_at).
 * In-flight first, then the counts (seq_cst): a call that had left by then is counted. */
int krex_proc_quiet(struct krex_proc *p) {
    uint64_t at = __atomic_load_n(&p->drained_at, SEQ);
    uint32_t fl = __atomic_load_n(&p->flags, SEQ);
    if (!at || (fl & (KREX_PF_UNSEEN | KREX_PF_LOOKUP_FALLBACK)) || __atomic_load_n(&p->inflight, SEQ) != 0) return 0;
    /* Inside a context, module or memory call: the GPU side of it may still be queued (a
     * full drain's sync waits for it). Not so once its exit has drained for the last time:
     * its teardown holds that count for good. */
    if (__atomic_load_n(&p->life_inflight, SEQ) != 0 && !__atomic_load_n(&p->exit_drained, SEQ)) return 0;
    uint64_t ord = __atomic_load_n(&p->ordered_life, SEQ);
    if ((uint32_t)ord != (uint32_t)(ord >> 32)) return 0;
    return at == 1 + krex_proc_submits(p);
}

/* 1 if all `p` may have queued on the GPU is what the context, module or memory call it is
 * inside does (krexd may freeze it inside the call rather than wait for it: a freeze lands
 * between two of the call's ioctls): quiet but for that call. Not a free (its memory's
 * scrubbing is the settle step's) and not a process the hooks may not see whole. */
int krex_proc_life_only(struct krex_proc *p) {
    uint64_t at = __atomic_load_n(&p->drained_at, SEQ);
    uint32_t fl = __atomic_load_n(&p->flags, SEQ);
    if (!at || (fl & (KREX_PF_UNSEEN | KREX_PF_LOOKUP_FALLBACK | KREX_PF_FOREIGN_NS)) ||
        __atomic_load_n(&p->inflight, SEQ) != 0)
        return 0;
    if (__atomic_load_n(&p->life_inflight, SEQ) == 0 || __atomic_load_n(&p->free_inflight, SEQ) != 0) return 0;
    uint64_t ord = __atomic_load_n(&p->ordered_life, SEQ);
    if ((uint32_t)ord != (uint32_t)(ord >> 32)) return 0;
    return at == 1 + krex_proc_submits(p);
}

/* krexd froze process `pid` (of `gpu`) while it owed drain `seq` for nothing but the LIFE
 * call it is inside (krex_proc_life_only): its ack is taken as given, as its frozen helper
 * cannot give it. Returns 1 if the record was found so and acked. The live process's record
 * only: an earlier process that had the pid may have left one the reaper has not freed yet
 * (the drain's scan skips it; its ack is not the one owed). */
int krex_drain_excuse(struct krex_shm *shm, int gpu, int64_t pid, uint32_t seq) {
    for (int i = 0; i < KREX_MAX_PROCS; i++) {
        struct krex_proc *p = &shm->procs[i];
        if (__atomic_load_n(&p->pid, SEQ) != pid || p->gpu != gpu || !krex_pid_alive(pid, p->start_ticks)) continue;
        uint32_t ack = __atomic_load_n(&p->drain_ack, SEQ);
        if ((int32_t)(ack - seq) >= 0) return 1; /* it acked itself */
        if (!krex_proc_life_only(p)) return 0;
        /* A helper thawed meanwhile writes the same sequence: a CAS keeps the newer one. */
        __atomic_compare_exchange_n(&p->drain_ack, &ack, seq, 0, SEQ, SEQ);
        krex_wake_controller(shm, gpu);
        return 1;
    }
    return 0;
}

enum drain_query { DRAIN_PENDING, DRAIN_PARTIAL };

/* Sibling processes of `gpu` (not in `owner_slot`) that hold GPU work and match `q`:
 * PENDING = live and not yet acked `seq`; PARTIAL = acked `seq` without a full sync. */
static int drain_scan(struct krex_shm *shm, int gpu, int owner_slot, uint32_t seq, enum drain_query q,
                      int64_t *pids, int max_pids) {
    int n = 0;
    for (int i = 0; i < KREX_MAX_PROCS; i++) {
        struct krex_proc *p = &shm->procs[i];
        int64_t pid = __atomic_load_n(&p->pid, SEQ);
        if (pid == 0 || p->gpu != gpu || p->slot == owner_slot || !p->has_ctx) continue;
        if (q == DRAIN_PENDING) {
            /* Sequence numbers wrap: compare by signed distance. */
            if ((int32_t)(__atomic_load_n(&p->drain_ack, SEQ) - seq) >= 0) continue;
            /* Nothing queued since its last full drain (a sibling in its CPU work, or exiting
             * after a last drain, its helper gone): nothing owed. No wake-up of its helper to
             * wait for: under a loaded CPU that alone took tens of ms on the H200. */
            if ((__atomic_load_n(&p->exit_drained, SEQ) || !__atomic_load_n(&shm->gpus[gpu].drain_full, SEQ)) &&
                krex_proc_quiet(p))
                continue; /* (an exit's last drain counts even for a full drain: no helper is left to ask) */
            if (!krex_pid_alive(pid, p->start_ticks) || image_gone(p, pid)) continue;
        } else if (__atomic_load_n(&p->drain_partial, SEQ) != seq) {
            continue;
        }
        if (pids && n < max_pids) pids[n] = pid;
        n++;
    }
    return n;
}

int krex_drain_pending(struct krex_shm *shm, int gpu, int owner_slot, uint32_t seq,
                       int64_t *pids, int max_pids) {
    return drain_scan(shm, gpu, owner_slot, seq, DRAIN_PENDING, pids, max_pids);
}

/* A graph capture was running in these siblings, so their earlier work was not drained. */
int krex_drain_partial(struct krex_shm *shm, int gpu, int owner_slot, uint32_t seq,
                       int64_t *pids, int max_pids) {
    return drain_scan(shm, gpu, owner_slot, seq, DRAIN_PARTIAL, pids, max_pids);
}

/* A look-only request: every helper of `gpu` looks at what its process loaded (a CUDA
 * runtime the hooks cannot see, a GPU library in another namespace: the record's flags) and
 * acks in look_ack, without a drain. It is a drain_seq whose value look_seq names, so one
 * futex word wakes the helpers for both; installed with a CAS so that look_seq is never the
 * value of a drain request made meanwhile. Returns its sequence. */
uint32_t krex_look_request(struct krex_shm *shm, int gpu) {
    struct krex_gpu *g = &shm->gpus[gpu];
    uint32_t cur = __atomic_load_n(&g->drain_seq, SEQ);
    for (;;) {
        __atomic_store_n(&g->look_seq, cur + 1, SEQ);
        if (__atomic_compare_exchange_n(&g->drain_seq, &cur, cur + 1, 0, SEQ, SEQ)) break;
    }
    krex_futex_wake(&g->drain_seq);
    return cur + 1;
}

/* Whether record `p` (of `pid`) still owes look `seq`: live, its image the one that
 * registered, and not acked. A helper that stopped at exit owes none once its exit handler
 * looked (exit_looked); a record with no helper and not in its exit never answers, and
 * krexd's freeze policy judges it unheld instead (krex_proc_trust). */
static int look_owed(struct krex_proc *p, int64_t pid, uint32_t seq) {
    if ((int32_t)(__atomic_load_n(&p->look_ack, SEQ) - seq) >= 0) return 0;
    if (!__atomic_load_n(&p->helper_tid, SEQ)) {
        uint32_t fl = __atomic_load_n(&p->flags, SEQ);
        if (!(fl & KREX_PF_IN_EXIT) || __atomic_load_n(&p->exit_looked, SEQ)) return 0;
    } else if (image_gone(p, pid)) {
        return 0;
    }
    return krex_pid_alive(pid, p->start_ticks);
}

/* The processes among want[0..n) with a record on `gpu` that still owe look `seq`. */
int krex_look_pending(struct krex_shm *shm, int gpu, const int64_t *want, int n, uint32_t seq, int64_t *pids,
                      int max_pids) {
    int out = 0;
    for (int i = 0; i < KREX_MAX_PROCS && n > 0; i++) {
        struct krex_proc *p = &shm->procs[i];
        int64_t pid = __atomic_load_n(&p->pid, SEQ);
        if (pid == 0 || p->gpu != gpu) continue;
        int k = 0;
        while (k < n && want[k] != pid) k++;
        if (k == n || !look_owed(p, pid, seq)) continue;
        if (pids && out < max_pids) pids[out] = pid;
        out++;
    }
    return out;
}

/* Records of other commands' processes on `gpu` (as krex_sibling_procs) flagged with a way
 * past the hooks (KREX_PF_UNSEEN, KREX_PF_FOREIGN_NS): their pid, start time and those
 * flags. Returns the count, which may exceed `max`. */
int krex_bypass_procs(struct krex_shm *shm, int gpu, int owner_slot, struct krex_proc_id *out, uint32_t *flags,
                      int max) {
    int n = 0;
    for (int i = 0; i < KREX_MAX_PROCS; i++) {
        struct krex_proc *p = &shm->procs[i];
        int64_t pid = sibling_pid(p, gpu, owner_slot);
        uint32_t fl = pid ? __atomic_load_n(&p->flags, SEQ) & (KREX_PF_UNSEEN | KREX_PF_FOREIGN_NS) : 0;
        if (!fl) continue;
        if (out && n < max) {
            out[n].pid = pid;
            out[n].start_ticks = p->start_ticks;
            out[n].helper_tid = 0;
            out[n].pad0 = 0;
            flags[n] = fl;
        }
        n++;
    }
    return n;
}

void krex_wake_controller(struct krex_shm *shm, int gpu) {
    struct krex_gpu *g = &shm->gpus[gpu];
    __atomic_add_fetch(&g->wake, 1, SEQ);
    if (__atomic_load_n(&g->waiters, SEQ)) krex_futex_wake(&g->wake);
}

enum wait_what { WAIT_INFLIGHT, WAIT_DRAIN, WAIT_LOOK };

struct look_want {
    const int64_t *pids;
    int n;
};

/* Scan, and sleep on the wake word between scans. The word is read before each scan, so
 * a change that the scan missed has moved it and the futex wait returns at once. */
static int wait_loop(struct krex_shm *shm, int gpu, int owner_slot, enum wait_what what, uint32_t seq,
                     uint64_t timeout_ns, uint64_t recheck_ns, int below, int64_t *pids, int max_pids,
                     struct krex_wait_stats *st, const struct look_want *want) {
    struct krex_gpu *g = &shm->gpus[gpu];
    struct krex_wait_stats local;
    if (!st) st = &local;
    memset(st, 0, sizeof *st);
    uint64_t t0 = krex_now_ns(), deadline = t0 + timeout_ns;
    int n;
    __atomic_add_fetch(&g->waiters, 1, SEQ);
    for (;;) {
        uint32_t w = __atomic_load_n(&g->wake, SEQ);
        if (pids) memset(pids, 0, sizeof *pids * (size_t)(max_pids > 0 ? max_pids : 0)); /* this scan's only */
        n = what == WAIT_INFLIGHT ? krex_gate_inflight(shm, gpu, owner_slot, pids, max_pids)
            : what == WAIT_LOOK   ? krex_look_pending(shm, gpu, want->pids, want->n, seq, pids, max_pids)
                                  : drain_scan(shm, gpu, owner_slot, seq, DRAIN_PENDING, pids, max_pids);
        st->scans++;
        uint64_t now = krex_now_ns();
        if (n < below || now >= deadline) break;
        uint64_t left = deadline - now;
        int rechecks = recheck_ns && left > recheck_ns;
        if (rechecks) left = recheck_ns;
        int r = krex_futex_wait(&g->wake, w, left);
        if (r == ETIMEDOUT && rechecks) st->timeouts++; /* (the deadline's own end is no re-check) */
        else if (r == 0 || r == EAGAIN) st->wakeups++;
        else if (r == EINTR) {
            st->interrupted = 1;
            break;
        }
    }
    __atomic_sub_fetch(&g->waiters, 1, SEQ);
    st->waited_ns = krex_now_ns() - t0;
    return n;
}

int krex_wait_inflight(struct krex_shm *shm, int gpu, int owner_slot, uint64_t timeout_ns, uint64_t recheck_ns,
                       int64_t *pids, int max_pids, struct krex_wait_stats *st) {
    return wait_loop(shm, gpu, owner_slot, WAIT_INFLIGHT, 0, timeout_ns, recheck_ns, 1, pids, max_pids, st, NULL);
}

int krex_wait_drain(struct krex_shm *shm, int gpu, int owner_slot, uint32_t seq, int below, uint64_t timeout_ns,
                    uint64_t recheck_ns, int64_t *pids, int max_pids, struct krex_wait_stats *st) {
    return wait_loop(shm, gpu, owner_slot, WAIT_DRAIN, seq, timeout_ns, recheck_ns, below < 1 ? 1 : below, pids,
                     max_pids, st, NULL);
}

int krex_wait_look(struct krex_shm *shm, int gpu, const int64_t *want, int n, uint32_t seq, uint64_t timeout_ns,
                   uint64_t recheck_ns, int64_t *pids, int max_pids, struct krex_wait_stats *st) {
    struct look_want w = {want, n};
    return wait_loop(shm, gpu, -1, WAIT_LOOK, seq, timeout_ns, recheck_ns, 1, pids, max_pids, st, &w);
}

void krex_heartbeat(struct krex_shm *shm) {
    __atomic_store_n(&shm->hdr.heartbeat_ns, krex_now_ns(), SEQ);
}

int krex_heartbeat_stale(struct krex_shm *shm, uint64_t now, int never) {
    uint64_t hb = __atomic_load_n(&shm->hdr.heartbeat_ns, SEQ);
    uint64_t to = __atomic_load_n(&shm->hdr.heartbeat_timeout_ns, __ATOMIC_RELAXED);
    if (!hb) return never;
    return now > hb && now - hb > (to ? to : KREX_HEARTBEAT_TIMEOUT_NS);
}
