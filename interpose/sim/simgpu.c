/* See simgpu.h. One timeline word per simulated GPU in a shared segment,
 * advanced with compare-and-swap: no locks, so freezing or killing a process in
 * the middle of a call cannot wedge the device for everyone else. */
#define _GNU_SOURCE
#include "simgpu.h"
#include "../krex_abi.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

struct sim_dev_shm {
    uint32_t magic;
    uint32_t ndev;
    uint64_t busy_until[SIMGPU_MAX];
};

static struct sim_dev_shm *g_dev;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_trace_fd = -2;
static int g_rc;
static long g_rc_after;  /* KREX_SIM_RC_AFTER: gated calls that succeed before g_rc applies */
static long g_gated_calls;
static int g_move_bytes;
static int g_life_ms;
static int g_stall_ms; /* KREX_SIM_STALL_MS (submit_stall) */
static int g_visible[SIMGPU_MAX];
static int g_nvisible = -1;
static __thread int t_device;
static int g_ctx_active[SIMGPU_MAX];

#define NSTREAMS 256
static struct { const void *s; int dev; uint64_t tail; } g_streams[NSTREAMS];
static uint64_t g_proc_tail;
/* Streams of green contexts (simgpu_stream_bind) and when each green context's work ends:
 * that work is not the process's other contexts' (g_proc_tail). */
#define NBOUND 256
static struct { const void *s; int green; } g_bound[NBOUND];
static uint64_t g_green_tail[SIMGPU_GREENS + 1];
static int g_primary_syncs_green; /* KREX_SIM_PRIMARY_SYNCS_GREEN (CUDA 13's cuCtxSynchronize) */

EXPORT uint64_t simgpu_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

EXPORT void simgpu_sleep_until(uint64_t t) {
    for (;;) {
        uint64_t now = simgpu_now();
        if (now >= t) return;
        uint64_t d = t - now;
        struct timespec ts = {(time_t)(d / 1000000000ull), (long)(d % 1000000000ull)};
        nanosleep(&ts, NULL);
    }
}

static int env_int(const char *name, int dflt) {
    const char *v = getenv(name);
    return v && *v ? atoi(v) : dflt;
}

static void init_visible(void) {
    int phys = env_int("KREX_SIM_GPUS", 1);
    if (phys < 1) phys = 1;
    if (phys > SIMGPU_MAX) phys = SIMGPU_MAX;
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    if (!vis) vis = getenv("HIP_VISIBLE_DEVICES");
    g_nvisible = 0;
    if (vis) {
        char buf[256];
        snprintf(buf, sizeof buf, "%s", vis);
        for (char *tok = strtok(buf, ","); tok && g_nvisible < SIMGPU_MAX; tok = strtok(NULL, ",")) {
            char *end;
            long v = strtol(tok, &end, 10);
            if (*end || v < 0 || v >= phys) break; /* like CUDA: stop at the first invalid id */
            g_visible[g_nvisible++] = (int)v;
        }
    } else {
        for (int i = 0; i < phys; i++) g_visible[g_nvisible++] = i;
    }
}

/* The node-wide shared memory named KREX_SIM_SHM (or per user) plus `suffix`, `size` bytes,
 * mapped once; a private zeroed block where it cannot be (a lone process still runs).
 * The node's GPU serves every user's processes (as /dev/nvidia* does): a process of another
 * user, or one that dropped root, shares this timeline too. Only its creator can widen the
 * mode past the umask; for the others the fchmod fails harmlessly. Called under g_lock. */
static void *map_node_shm(const char *suffix, size_t size) {
    char name[160];
    const char *n = getenv("KREX_SIM_SHM");
    if (n && *n && strlen(n) < 120) snprintf(name, sizeof name, "%s%s", n, suffix);
    else snprintf(name, sizeof name, "/krex-sim-%d%s", (int)getuid(), suffix);
    void *out = NULL;
    int fd = shm_open(name, O_RDWR | O_CREAT, 0666);
    if (fd >= 0) (void)fchmod(fd, 0666);
    if (fd >= 0 && ftruncate(fd, (off_t)size) == 0) {
        void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p != MAP_FAILED) out = p;
    }
    if (fd >= 0) close(fd);
    return out ? out : calloc(1, size);
}

static struct sim_dev_shm *dev_shm(void) {
    if (g_dev) return g_dev;
    pthread_mutex_lock(&g_lock);
    if (!g_dev) g_dev = map_node_shm("", sizeof(struct sim_dev_shm));
    pthread_mutex_unlock(&g_lock);
    return g_dev;
}

static void trace_write(const char *line, size_t n) {
    if (g_trace_fd == -2) {
        pthread_mutex_lock(&g_lock);
        if (g_trace_fd == -2) {
            const char *p = getenv("KREX_SIM_TRACE");
            g_trace_fd = p && *p ? open(p, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0666) : -1;
        }
        pthread_mutex_unlock(&g_lock);
    }
    /* One write() with O_APPEND per line: lines from many processes never interleave. */
    if (g_trace_fd >= 0) {
        ssize_t w = write(g_trace_fd, line, n);
        (void)w;
    }
}

EXPORT void simgpu_trace(const char *fields) {
    char line[768];
    int n = snprintf(line, sizeof line, "{\"pid\":%d,\"tid\":%d,%s}\n", (int)getpid(),
                     (int)syscall(SYS_gettid), fields);
    if (n > 0 && n < (int)sizeof line) trace_write(line, (size_t)n);
}

EXPORT int simgpu_device_count(void) {
    if (g_nvisible < 0) init_visible();
    return g_nvisible;
}
EXPORT int simgpu_get_device(void) { return t_device; }
EXPORT int simgpu_set_device(int dev) {
    if (dev < 0 || dev >= simgpu_device_count()) return 101; /* cudaErrorInvalidDevice */
    t_device = dev;
    return 0;
}
/* The driver's resource-manager lock (KREX_SIM_CTX_MS > 0; off by default): a real driver
 * makes contexts one at a time node-wide, in order, and a context query (the drain helper's
 * cuDevicePrimaryCtxGetState) waits in the same queue. Here a ticket lock in a segment of its
 * own (next to the timeline's: `<KREX_SIM_SHM>-rm`): a process's first context on a device
 * holds it KREX_SIM_CTX_MS, a query passes through it. A real creation is many ioctls, each
 * taking the lock: with KREX_SIM_CTX_STEP_MS the creation takes one turn per step of that
 * length (a holder frozen between steps holds nothing). A turn that is not given back within
 * its length + SIM_RM_SLACK_US of its start (its holder killed, stopped or frozen; a real
 * driver finishes the ioctl before a stop takes effect), or not claimed within SIM_RM_SLACK_US
 * (its waiter gone, stopped or frozen in the queue: a real freezer waits for a task blocked in
 * the driver), is skipped, and a ticket whose turn passed meanwhile is drawn again. */
struct sim_rm_shm {
    uint32_t next;     /* tickets drawn (mod 2^23) */
    uint32_t pad;
    uint64_t serving;  /* claimed (bit 63) | ticket served (23 bits) << 40 | when its turn began or
                        * was claimed (us, mod 2^40) */
};
#define SIM_RM_TICKETS 8388607u
#define SIM_RM_US_MASK ((1ull << 40) - 1)
#define SIM_RM_CLAIMED (1ull << 63)
#define SIM_RM_SLACK_US 20000ull
static struct sim_rm_shm *g_rm;
static int g_ctx_ms;
static int g_ctx_step_ms; /* one turn of the lock per step of a creation (0: one turn) */

static struct sim_rm_shm *rm_shm(void) {
    if (g_rm) return g_rm;
    pthread_mutex_lock(&g_lock);
    if (!g_rm) g_rm = map_node_shm("-rm", sizeof(struct sim_rm_shm));
    pthread_mutex_unlock(&g_lock);
    return g_rm;
}

/* Wait for a turn of the lock, hold it `hold_ns`, give it back. Returns when the turn began. */
static uint64_t rm_turn(uint64_t hold_ns) {
    struct sim_rm_shm *rm = rm_shm();
    if (!rm) return simgpu_now();
    const int turn_ms = g_ctx_step_ms > 0 && g_ctx_step_ms < g_ctx_ms ? g_ctx_step_ms : g_ctx_ms;
    const uint64_t lapse_us = (uint64_t)turn_ms * 1000ull + SIM_RM_SLACK_US;
    uint32_t my = __atomic_fetch_add(&rm->next, 1, __ATOMIC_SEQ_CST) & SIM_RM_TICKETS;
    for (;;) {
        uint64_t s = __atomic_load_n(&rm->serving, __ATOMIC_SEQ_CST), now_us = simgpu_now() / 1000;
        uint32_t st = (uint32_t)(s >> 40) & SIM_RM_TICKETS;
        uint32_t ahead = (my - st) & SIM_RM_TICKETS;
        if (ahead == 0 && !(s & SIM_RM_CLAIMED)) {
            uint64_t mine = SIM_RM_CLAIMED | (uint64_t)my << 40 | (now_us & SIM_RM_US_MASK);
            if (__atomic_compare_exchange_n(&rm->serving, &s, mine, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) break;
            continue;
        }
        if (ahead == 0 || ahead > SIM_RM_TICKETS / 2) { /* our turn passed while we were stopped: draw again */
            my = __atomic_fetch_add(&rm->next, 1, __ATOMIC_SEQ_CST) & SIM_RM_TICKETS;
            continue;
        }
        uint64_t most = s & SIM_RM_CLAIMED ? lapse_us : SIM_RM_SLACK_US;
        if (((now_us - (s & SIM_RM_US_MASK)) & SIM_RM_US_MASK) > most) {
            uint64_t next = (uint64_t)((st + 1) & SIM_RM_TICKETS) << 40 | (now_us & SIM_RM_US_MASK);
            __atomic_compare_exchange_n(&rm->serving, &s, next, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
            continue;
        }
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
    uint64_t began = simgpu_now();
    if (hold_ns) simgpu_sleep_until(began + hold_ns);
    for (;;) { /* give it back, unless it was skipped meanwhile */
        uint64_t s = __atomic_load_n(&rm->serving, __ATOMIC_SEQ_CST);
        if (((uint32_t)(s >> 40) & SIM_RM_TICKETS) != my) break;
        uint64_t next = (uint64_t)((my + 1) & SIM_RM_TICKETS) << 40 | ((simgpu_now() / 1000) & SIM_RM_US_MASK);
        if (__atomic_compare_exchange_n(&rm->serving, &s, next, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) break;
    }
    return began;
}

/* The driver library's own lock, per process: held for a whole creation (all its steps),
 * so this process's other driver calls (its drain helper's query) wait for all of it. */
static pthread_mutex_t g_drv_lock = PTHREAD_MUTEX_INITIALIZER;

/* A context query waits for this process's creation in progress, then for the creations
 * queued before it node-wide (KREX_SIM_CTX_MS > 0). */
EXPORT void simgpu_ctx_query(void) {
    if (g_ctx_ms <= 0) return;
    pthread_mutex_lock(&g_drv_lock);
    pthread_mutex_unlock(&g_drv_lock);
    rm_turn(0);
}
EXPORT int simgpu_ctx_ms(void) { return g_ctx_ms; }

EXPORT int simgpu_ctx_active(int dev) { return dev >= 0 && dev < SIMGPU_MAX && g_ctx_active[dev]; }
EXPORT void simgpu_ctx_activate(int dev) {
    if (dev >= 0 && dev < SIMGPU_MAX && !g_ctx_active[dev]) {
        uint64_t asked = simgpu_now(), began = asked;
        int step = g_ctx_step_ms > 0 && g_ctx_step_ms < g_ctx_ms ? g_ctx_step_ms : g_ctx_ms;
        if (g_ctx_ms > 0) pthread_mutex_lock(&g_drv_lock);
        for (int left = g_ctx_ms; left > 0; left -= step) {
            uint64_t b = rm_turn((uint64_t)(left < step ? left : step) * 1000000ull);
            if (left == g_ctx_ms) began = b;
        }
        if (g_ctx_ms > 0) pthread_mutex_unlock(&g_drv_lock);
        g_ctx_active[dev] = 1;
        char f[128];
        snprintf(f, sizeof f, "\"ev\":\"ctx\",\"dev\":%d,\"t\":%llu,\"asked\":%llu,\"began\":%llu", dev,
                 (unsigned long long)simgpu_now(), (unsigned long long)asked, (unsigned long long)began);
        simgpu_trace(f);
    }
}
EXPORT int simgpu_rc(void) { return g_rc; }
EXPORT void simgpu_set_return(int rc) { g_rc = rc; }

static uint64_t g_null_tail[SIMGPU_MAX];

/* How far back an op may be dated from the moment it was queued (a stop inside the submitting
 * call longer than this is taken out of its start). */
#define SIM_REDATE_NS 1000ull

/* KREX_SIM_STALL_MS: a process's first submission that occupies the device stops this long
 * between reading the clock and queueing its op, as a caller preempted or frozen there does. */
static void submit_stall(void) {
    int ms = g_stall_ms;
    g_stall_ms = 0;
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* Streams belong to a device: the same handle on two devices is two queues. */
static uint64_t *stream_slot(int dev, const void *s) {
    if (!s) return &g_null_tail[dev];
    uintptr_t h = (((uintptr_t)s >> 4) + (uintptr_t)dev * 7919u) % NSTREAMS;
    for (int i = 0; i < NSTREAMS; i++) {
        int k = (int)((h + (uintptr_t)i) % NSTREAMS);
        if (g_streams[k].s == s && g_streams[k].dev == dev) return &g_streams[k].tail;
        if (g_streams[k].s == NULL) {
            g_streams[k].s = s;
            g_streams[k].dev = dev;
            return &g_streams[k].tail;
        }
    }
    return &g_proc_tail; /* table full: treat as the legacy stream */
}

/* The green context a stream belongs to (0: none). Called under g_lock. */
static int stream_green(const void *s) {
    if (!s) return 0;
    for (int i = 0; i < NBOUND && g_bound[i].s; i++)
        if (g_bound[i].s == s) return g_bound[i].green;
    return 0;
}

EXPORT int simgpu_stream_bind(const void *stream, int green) {
    if (!stream || green < 1 || green > SIMGPU_GREENS) return 1;
    int rc = 1;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < NBOUND && rc; i++)
        if (!g_bound[i].s || g_bound[i].s == stream) {
            g_bound[i].s = stream;
            g_bound[i].green = green;
            rc = 0;
        }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

EXPORT uint64_t simgpu_submit(const char *api, int cls, const void *stream, uint64_t cost_ns,
                              uint64_t arghash, int sync) {
    struct sim_dev_shm *d = dev_shm();
    if (g_nvisible < 0) init_visible();
    int dev = t_device < g_nvisible ? t_device : 0;
    int phys = g_nvisible > 0 ? g_visible[dev] : 0;
    simgpu_ctx_activate(dev);
    uint64_t submit = simgpu_now();
    uint64_t start = submit, end = submit;
    /* A LIFE call of no cost (a reference count: a drain helper's retain of a live context)
     * is only recorded: on the timeline it would make the caller's next sync wait for
     * every other process's queued work. */
    if (cls == KREX_CLS_LIFE && cost_ns == 0) goto trace;
    pthread_mutex_lock(&g_lock);
    uint64_t *tail = stream_slot(dev, stream);
    uint64_t old = __atomic_load_n(&d->busy_until[phys], __ATOMIC_SEQ_CST);
    /* An op is queued when the exchange succeeds, not when its call began: the clock is read
     * on every try, so a caller stopped inside the call (preempted, or frozen for another
     * command's region) queues its op where the device stands once it runs again, never
     * into the time that passed meanwhile (where another process's work already ran). */
    int first = 1;
    do { /* time-slicing: the device runs one operation at a time, node-wide */
        submit = simgpu_now();
        if (first && g_stall_ms > 0) submit_stall();
        first = 0;
        uint64_t after = *tail > submit ? *tail : submit;
        start = old > after ? old : after;
        end = start + cost_ns;
    } while (!__atomic_compare_exchange_n(&d->busy_until[phys], &old, end, 0, __ATOMIC_SEQ_CST,
                                          __ATOMIC_SEQ_CST));
    /* A stop between the last read of the clock and the exchange dated the op back into that
     * stop: it moves to now, unless work was queued behind it meanwhile (then it ran first). */
    uint64_t now = simgpu_now();
    if (now > start + SIM_REDATE_NS) {
        uint64_t queued = end, moved = now + cost_ns;
        if (__atomic_compare_exchange_n(&d->busy_until[phys], &queued, moved, 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST)) {
            start = now;
            end = moved;
        }
    }
    *tail = end;
    int green = stream_green(stream);
    uint64_t *ctx_tail = green ? &g_green_tail[green] : &g_proc_tail;
    if (end > *ctx_tail) *ctx_tail = end;
    pthread_mutex_unlock(&g_lock);
trace:;
    char f[600];
    const char *slot = getenv("KREX_SLOT");
    char slotbuf[16] = "-1";
    if (slot && *slot && strspn(slot, "0123456789") == strlen(slot) && strlen(slot) < sizeof slotbuf)
        strcpy(slotbuf, slot); /* only digits reach the JSON */
    /* KREX_SIM_TAG: who this process belongs to, as the test that started it knows it
     * (inherited by every descendant), so a checker needs no help from KREX to tell
     * whose work ran inside a region. */
    const char *tag = getenv("KREX_SIM_TAG");
    char tagbuf[48] = "";
    if (tag && *tag && strlen(tag) < 32 &&
        strspn(tag, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.") == strlen(tag))
        snprintf(tagbuf, sizeof tagbuf, ",\"tag\":\"%s\"", tag);
    snprintf(f, sizeof f,
             "\"ev\":\"op\",\"api\":\"%s\",\"cls\":%d,\"gpu\":%d,\"stream\":%llu,\"submit\":%llu,"
             "\"start\":%llu,\"end\":%llu,\"args\":\"%016llx\",\"slot\":%s%s",
             api, cls, phys, (unsigned long long)(uintptr_t)stream, (unsigned long long)submit,
             (unsigned long long)start, (unsigned long long)end, (unsigned long long)arghash, slotbuf, tagbuf);
    simgpu_trace(f);
    if (sync) simgpu_sleep_until(end);
    return end;
}

EXPORT uint64_t simgpu_stream_tail(const void *stream) {
    pthread_mutex_lock(&g_lock);
    int dev = t_device < SIMGPU_MAX ? t_device : 0;
    uint64_t t = stream ? *stream_slot(dev, stream) : g_null_tail[dev];
    pthread_mutex_unlock(&g_lock);
    return t;
}

EXPORT void simgpu_sync_stream(const void *stream) { simgpu_sleep_until(simgpu_stream_tail(stream)); }

static void sync_until(const char *who, int green, uint64_t until) {
    simgpu_sleep_until(until);
    char f[192];
    snprintf(f, sizeof f, "\"ev\":\"sync\",\"api\":\"%s\",\"green\":%d,\"t\":%llu,\"until\":%llu", who,
             green, (unsigned long long)simgpu_now(), (unsigned long long)until);
    simgpu_trace(f);
}

EXPORT void simgpu_sync_all(const char *who) {
    pthread_mutex_lock(&g_lock);
    uint64_t until = g_proc_tail;
    for (int g = 1; g_primary_syncs_green && g <= SIMGPU_GREENS; g++)
        if (g_green_tail[g] > until) until = g_green_tail[g];
    pthread_mutex_unlock(&g_lock);
    sync_until(who, 0, until);
}

EXPORT uint64_t simgpu_green_tail(int green) {
    if (green < 1 || green > SIMGPU_GREENS) return 0;
    pthread_mutex_lock(&g_lock);
    uint64_t t = g_green_tail[green];
    pthread_mutex_unlock(&g_lock);
    return t;
}

EXPORT void simgpu_sync_green(int green, const char *who) { sync_until(who, green, simgpu_green_tail(green)); }

static void atfork_child(void) {
    /* A child has its own (empty) streams and contexts, like a CUDA child. */
    pthread_mutex_init(&g_lock, NULL);
    pthread_mutex_init(&g_drv_lock, NULL); /* a fork mid-creation: the child makes its own */
    memset(g_streams, 0, sizeof g_streams);
    memset(g_ctx_active, 0, sizeof g_ctx_active);
    g_proc_tail = 0;
    memset(g_null_tail, 0, sizeof g_null_tail);
    memset(g_bound, 0, sizeof g_bound);
    memset(g_green_tail, 0, sizeof g_green_tail);
}

__attribute__((constructor)) static void sim_init(void) {
    pthread_atfork(NULL, NULL, atfork_child);
    g_rc = env_int("KREX_SIM_RC", 0);
    g_rc_after = env_int("KREX_SIM_RC_AFTER", 0);
    g_move_bytes = env_int("KREX_SIM_MOVE_BYTES", 0);
    g_life_ms = env_int("KREX_SIM_LIFE_MS", 0);
    g_ctx_ms = env_int("KREX_SIM_CTX_MS", 0);
    g_ctx_step_ms = env_int("KREX_SIM_CTX_STEP_MS", 0);
    g_stall_ms = env_int("KREX_SIM_STALL_MS", 0);
    g_primary_syncs_green = env_int("KREX_SIM_PRIMARY_SYNCS_GREEN", 0);
}

/* A gated call's return code: KREX_SIM_RC, after the first KREX_SIM_RC_AFTER calls
 * of the process (so a test can fail the 3rd chunk of a split copy). */
EXPORT int simgpu_gated_rc(void) {
    long n = __atomic_add_fetch(&g_gated_calls, 1, __ATOMIC_RELAXED);
    return n > g_rc_after ? g_rc : 0;
}
EXPORT int simgpu_moves_bytes(void) { return g_move_bytes; }
/* "Device" memory: host pages of their own (mmap), a size header in front. Not malloc: a
 * program (or the tables' test driver) that never frees its device memory is no host
 * leak, as on a real GPU, and a leak checker must not say so. */
/* The live allocations, so that cuMemGetAddressRange answers for them and never reads
 * memory behind a pointer it did not hand out (beyond SIM_ALLOCS of them: not found). */
#define SIM_ALLOCS 4096
static struct { void *p; size_t n; } g_allocs[SIM_ALLOCS];
static pthread_mutex_t g_alloc_lock = PTHREAD_MUTEX_INITIALIZER;

/* NORESERVE: a test may "allocate" far more than the machine has; untouched, it costs nothing. */
EXPORT void *simgpu_alloc(size_t n) {
    size_t len = n + 64; /* the header keeps the pointer 64-byte aligned */
    void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return NULL;
    *(size_t *)m = len;
    pthread_mutex_lock(&g_alloc_lock);
    for (int i = 0; i < SIM_ALLOCS; i++)
        if (!g_allocs[i].p) {
            g_allocs[i].p = (char *)m + 64;
            g_allocs[i].n = n;
            break;
        }
    pthread_mutex_unlock(&g_alloc_lock);
    return (char *)m + 64;
}
EXPORT void simgpu_free(void *p) {
    if (!p) return;
    pthread_mutex_lock(&g_alloc_lock);
    for (int i = 0; i < SIM_ALLOCS; i++)
        if (g_allocs[i].p == p) g_allocs[i].p = NULL;
    pthread_mutex_unlock(&g_alloc_lock);
    char *m = (char *)p - 64;
    munmap(m, *(size_t *)m);
}
/* The allocation that holds `p`: 0 and its base and size, else 1 (not one of ours). */
EXPORT int simgpu_alloc_range(const void *p, void **base, size_t *size) {
    int rc = 1;
    pthread_mutex_lock(&g_alloc_lock);
    for (int i = 0; i < SIM_ALLOCS && rc; i++) {
        const char *b = (const char *)g_allocs[i].p;
        if (b && (const char *)p >= b && (const char *)p < b + (g_allocs[i].n ? g_allocs[i].n : 1)) {
            *base = (void *)b;
            *size = g_allocs[i].n;
            rc = 0;
        }
    }
    pthread_mutex_unlock(&g_alloc_lock);
    return rc;
}

/* KREX_SIM_LIFE_MS: a module load spends that long on the host inside the call (a PTX
 * JIT), so a test can catch a process in the middle of one. */
EXPORT void simgpu_life_host_time(void) {
    if (g_life_ms > 0) {
        struct timespec ts = {g_life_ms / 1000, (long)(g_life_ms % 1000) * 1000000L};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
        }
    }
}
