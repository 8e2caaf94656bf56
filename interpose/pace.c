/* Bounded queues: while other commands share its GPU, a process keeps no more GPU work
 * queued than its share of the GPU's drain budget (`budget_us`, krex_abi.h), or, with no
 * budget published, than the GPU gets through in about `queue_cap_us` (a cap per process).
 *
 * Why: a region's entry waits for the work siblings had queued when its gate closed (the
 * drain); on the H200 a sibling's queue held up to 0.52 s of it. The gate cannot shorten
 * work already queued, so the queue itself is kept short, outside regions only.
 *
 * How: every few counted submissions of a thread (a TLS counter in the wrapper: nothing
 * else on the fast path), pace() records an event on that call's stream in a small ring,
 * with the process's submission count. It waits, polling the oldest event, while
 *   - the oldest unfinished event is older than the cap (work queued that long ago is not
 *     done), or
 *   - more events are pending than fit in the cap, at `s`, the wall time the GPU took per
 *     submission between two completions it was seen reach while the queue stayed busy
 *     (two, before any was seen: a burst of launches is bounded before the first result).
 * On a GPU shared by n submitting processes both measures count everyone's work: an event
 * waits behind all of it, and `s` is about n times a submission's own GPU time. So with the
 * budget as the cap, each process keeps about budget/n of its own work queued and the GPU
 * about the budget; no count of submitters is needed. With a budget, a process whose two
 * check intervals of work are already more than that (2 x s x every > budget) waits after
 * recording until the event it just recorded has finished (the floor): it never has more
 * than one interval in flight while it submits, and always that one.
 * The same `s` spaces the checks (KREX_PACE_EVERY submissions at most, 1 for kernels that
 * each take a quarter of the cap; 1 while `s` is unknown under a budget).
 * A region about to begin (krex_pending: another command's BEGIN queued, or announced):
 * announced, the check takes the floor above whatever the cap; queued, it then also waits
 * until that region's gate has closed (krex_hold_pending, at most KREX_PENDING_HOLD_MS),
 * so the gate closes on short queues. Nothing is reordered or dropped; a thread only
 * submits later. Skipped when no command shares the GPU (cap and budget 0), the gate is
 * closed (by a region of ours, which must never be slowed, or of another command, whose
 * drain empties the queue anyway), a graph capture runs in the process (an event would join
 * the graph), the call was nested, or the call is HIP's (its event calls would set the
 * error hipGetLastError reports).
 *
 * Long work takes turns (krex_abi.h, KREX_PACE_TOKENS): on the floor under a budget, a
 * process returns to submit its next interval only once it holds one of the GPU's turns, so
 * what a drain waits for is at most that many long intervals, not one per sibling. A command
 * whose own region is announced or queued skips them (its warm-up precedes the region).
 *
 * Every vendor call here is the driver's real one (never a wrapper), in relaxed capture
 * mode, so another thread's capture is not invalidated, and none touches the CUDA
 * runtime's last error. A wait that reaches KREX_PACE_GIVEUP_MS (work that waits for the
 * host, a stream wait on a flag this thread sets later) turns pacing off in the process,
 * flagged `pace-off`: slower once, never stuck. */
#define _GNU_SOURCE
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include "shim_fastpath.h"

typedef void *pace_event;  /* CUevent */
typedef int (*fn_ctxcur)(CUcontext *);
typedef int (*fn_evnew)(pace_event *, unsigned int);
typedef int (*fn_evrec)(pace_event, CUstream);
typedef int (*fn_ev)(pace_event);
typedef int (*fn_capq)(CUstream, int *);
typedef int (*fn_xmode)(CUstreamCaptureMode *);
#define PACE_NOT_READY 600         /* CUDA_ERROR_NOT_READY */
#define PACE_DISABLE_TIMING 2      /* CU_EVENT_DISABLE_TIMING: the cheapest event */
#define PACE_PER_THREAD ((CUstream)(uintptr_t)2) /* CU_STREAM_PER_THREAD */
#define PACE_RING 32
#define PACE_COLD_PENDING 2        /* events pending before any completion was timed */
#define PACE_POLL_NS 100000        /* how often a waiting thread looks again */

/* A thread's first counted submission is checked: a process new to a shared GPU (its `s`
 * unknown) must not queue a whole interval of kernels before its first check. */
__thread unsigned t_pace __attribute__((tls_model("initial-exec"))) = KREX_PACE_EVERY - 1;

struct pace_ev {
    pace_event ev;
    CUcontext ctx;
    uint64_t t;    /* when it was recorded */
    uint64_t subs; /* the process's submissions then */
};
static pthread_mutex_t g_pace_lock = PTHREAD_MUTEX_INITIALIZER;
static struct pace_ev g_ring[PACE_RING]; /* recorded, oldest at g_head */
static unsigned g_head, g_n;
static struct pace_ev g_pool[PACE_RING]; /* created, not recorded: reused per context */
static unsigned g_npool;
static uint32_t g_pace_off;               /* atomic: gave up, or the driver lacks what pacing needs */
static unsigned g_every = KREX_PACE_EVERY; /* submissions between two checks of a thread */
static uint64_t g_s_ns;                   /* wall ns per submission to drain (0: not seen yet) */
static uint64_t g_done_t, g_done_subs;    /* the last completion seen as it happened */
static struct {
    fn_ctxcur ctxcur;
    fn_evnew evnew;
    fn_evrec evrec;
    fn_ev evquery, evdel;
    fn_capq capq;
    fn_xmode xmode;
    int looked;
} g_pfn;

static void pace_fns(void) {
    if (g_pfn.looked) return;
    g_pfn.looked = 1;
    g_pfn.ctxcur = (fn_ctxcur)vendor_sym(KREX_API_DRIVER, "cuCtxGetCurrent");
    g_pfn.evnew = (fn_evnew)vendor_sym(KREX_API_DRIVER, "cuEventCreate");
    g_pfn.evrec = (fn_evrec)vendor_sym(KREX_API_DRIVER, "cuEventRecord");
    g_pfn.evquery = (fn_ev)vendor_sym(KREX_API_DRIVER, "cuEventQuery");
    g_pfn.evdel = (fn_ev)vendor_sym(KREX_API_DRIVER, "cuEventDestroy_v2");
    g_pfn.capq = (fn_capq)vendor_sym(KREX_API_DRIVER, "cuStreamIsCapturing");
    g_pfn.xmode = (fn_xmode)vendor_sym(KREX_API_DRIVER, "cuThreadExchangeStreamCaptureMode");
    if (!g_pfn.ctxcur || !g_pfn.evnew || !g_pfn.evrec || !g_pfn.evquery || !g_pfn.evdel || !g_pfn.capq) {
        klog("pacing off: the driver lacks an event call");
        __atomic_store_n(&g_pace_off, 1, RELAXED);
    }
}

static uint64_t proc_submits(void) {
    uint64_t n = 0;
    for (int c = KREX_CLS_KERNEL; c <= KREX_CLS_PREFETCH; c++) n += __atomic_load_n(&g_fast.submits[c], RELAXED);
    return n;
}

/* An event of context `ctx` to record: from the pool, else a new one (NULL: none). */
static pace_event pool_take(CUcontext ctx) {
    for (unsigned i = 0; i < g_npool; i++)
        if (g_pool[i].ctx == ctx) {
            pace_event ev = g_pool[i].ev;
            g_pool[i] = g_pool[--g_npool];
            return ev;
        }
    pace_event ev = NULL;
    return g_pfn.evnew(&ev, PACE_DISABLE_TIMING) == CUDA_SUCCESS ? ev : NULL;
}

static void ring_pop(void) {
    struct pace_ev e = g_ring[g_head];
    if (g_npool < PACE_RING) g_pool[g_npool++] = e;
    else g_pfn.evdel(e.ev);
    g_head = (g_head + 1) % PACE_RING;
    g_n--;
}

/* The oldest event: 1 finished (or failed: nothing to wait for), 0 still pending. */
static int oldest_done(void) { return g_pfn.evquery(g_ring[g_head].ev) != PACE_NOT_READY; }

/* The oldest event was seen to finish at `t` (a poll found it pending just before). With
 * the last such completion, and the queue busy between them (this event was recorded
 * before that one finished), that is the wall time of the submissions in between. One
 * recorded after that completion (nothing of ours was queued before the submissions it
 * covers: the floor) took from its record to `t` for those: a lower bound of theirs. */
static void timed_completion(uint64_t t) {
    const struct pace_ev *e = &g_ring[g_head];
    uint64_t s = 0;
    if (g_done_t && e->t <= g_done_t && e->subs > g_done_subs && t > g_done_t)
        s = (t - g_done_t) / (e->subs - g_done_subs);
    else if (g_done_t && e->t > g_done_t && e->subs > g_done_subs && t > e->t)
        s = (t - e->t) / (e->subs - g_done_subs);
    if (s) g_s_ns = g_s_ns ? (g_s_ns + s) / 2 : s;
    g_done_t = t;
    g_done_subs = e->subs;
}

static unsigned clampu(uint64_t v, unsigned lo, unsigned hi) { return v < lo ? lo : v > hi ? hi : (unsigned)v; }

/* ------------------------------------------------------------ turns for long work */

#define TURN_MASK ((1ull << 40) - 1)
static uint64_t *g_turn; /* the turn this process holds (the GPU's word), or NULL */
static uint64_t g_turn_word; /* what we stored there */
static uint64_t g_turn_pid;  /* our pid (0: not looked up yet, or a fork child's) */
static int g_on_floor;        /* atomic: the last check put this process on the floor under a budget */

/* A lease taken or renewed now covers the interval we submit next: its own GPU time, a
 * quarter of KREX_TURN_LEASE_US more, at least KREX_TURN_LEASE_US, at most
 * KREX_TURN_LEASE_MAX_US. Its own time is the wall time we measured for it (`s` per
 * submission, g_every of them) over the GPU's turns in use: `s` counts all the long work
 * queued, one interval per busy turn. A holder doing host work before it launches thus keeps
 * its turn for up to its own interval (the turn idles at most as long as it then runs: with
 * two turns, the GPU stays busy), longer host work lets it lapse, and one that stops, frozen
 * or dead, holds the others back no longer than its interval would have occupied the GPU. */
static uint32_t g_turn_n = 1; /* the GPU's turns in use, as turn_take last saw them */
static uint64_t turn_lease_us(void) {
    uint64_t us = g_s_ns * __atomic_load_n(&g_every, RELAXED) / g_turn_n / 1000 + KREX_TURN_LEASE_US / 4;
    return us < KREX_TURN_LEASE_US ? KREX_TURN_LEASE_US : us > KREX_TURN_LEASE_MAX_US ? KREX_TURN_LEASE_MAX_US : us;
}

static uint64_t turn_word(uint64_t now_ns) {
    if (!g_turn_pid) g_turn_pid = (uint64_t)getpid();
    return g_turn_pid << 40 | ((now_ns / 1000 + turn_lease_us()) & TURN_MASK);
}

/* A turn word whose lease has ended (mod 2^40 us), or that no holder could have written
 * (a lease ending further off than KREX_TURN_LEASE_MAX_US: a stray write, never waited for). */
static int turn_lapsed(uint64_t w, uint64_t now_ns) {
    return w == 0 || ((w & TURN_MASK) - now_ns / 1000 & TURN_MASK) > KREX_TURN_LEASE_MAX_US;
}

/* Renew the lease of the turn we hold while our own work runs (a holder that stops
 * renewing, frozen or dead, loses it within a lease). Lost meanwhile: we no longer hold it. */
static void turn_renew(uint64_t now_ns) {
    if (!g_turn) return;
    uint64_t w = turn_word(now_ns);
    if (__atomic_compare_exchange_n(g_turn, &g_turn_word, w, 0, RELEASE, RELAXED)) g_turn_word = w;
    else g_turn = NULL;
}

static void turn_release(void) {
    if (g_turn) __atomic_compare_exchange_n(g_turn, &g_turn_word, 0, 0, RELEASE, RELAXED);
    g_turn = NULL;
}

/* Our own command's region is announced or queued on GPU `g`. */
static int own_region_near(struct krex_gpu *g) {
    uint64_t me = g_slot >= 0 && g_slot < KREX_MAX_SLOTS ? 1ull << g_slot : 0;
    return (__atomic_load_n(&g->soon_slots, RELAXED) | __atomic_load_n(&g->pending_slots, RELAXED)) & me ? 1 : 0;
}

/* Take one of the GPU's `n` turns before submitting the next interval: wait, polling, while
 * all are held and leased, the gate open (a closed gate holds our next call anyway), turns
 * still in use, our own command's region not near (its owner must never wait for one), at
 * most KREX_TURN_WAIT_MS. Counted in the GPU's `turn_waiters` meanwhile (a releaser lets
 * them go first). 1 when it waited. */
static int turn_take(struct krex_gpu *g, uint32_t *gate, uint64_t now) {
    const uint64_t t0 = now, most = (uint64_t)KREX_TURN_WAIT_MS * 1000000ull;
    int counted = 0;
    for (;;) {
        uint32_t n = __atomic_load_n(&g->pace_tokens, RELAXED);
        if (n == 0 || __atomic_load_n(gate, ACQUIRE) != KREX_GATE_OPEN || now - t0 >= most || own_region_near(g))
            break;
        if (n > KREX_TURNS_MAX) n = KREX_TURNS_MAX;
        g_turn_n = n;
        for (uint32_t i = 0; i < n; i++) {
            uint64_t w = __atomic_load_n(&g->turns[i], ACQUIRE), mine = turn_word(now);
            if (turn_lapsed(w, now) && __atomic_compare_exchange_n(&g->turns[i], &w, mine, 0, __ATOMIC_ACQ_REL, RELAXED)) {
                g_turn = &g->turns[i];
                g_turn_word = mine;
                goto out;
            }
        }
        if (!counted) __atomic_fetch_add(&g->turn_waiters, 1, RELAXED);
        counted = 1;
        struct timespec ts = {0, PACE_POLL_NS};
        nanosleep(&ts, NULL);
        now = krex_now_ns();
    }
out:
    if (counted) __atomic_fetch_sub(&g->turn_waiters, 1, RELAXED);
    return now != t0;
}

/* Wait, polling the oldest event, until `done` says so or the ring is empty; a completion
 * seen as it happens is timed. 0, or 1 when KREX_PACE_GIVEUP_MS ran out (pacing is off). */
static int wait_ring(uint64_t t0, uint64_t *now, int *waited, unsigned most, uint64_t cap_ns) {
    int polled = 0; /* the oldest was pending at the last look */
    for (;;) {
        if (!g_n || (g_n < most && *now - g_ring[g_head].t <= cap_ns)) return 0;
        if (oldest_done()) {
            if (polled) timed_completion(*now);
            ring_pop();
            polled = 0;
            continue;
        }
        if (*now - t0 >= (uint64_t)KREX_PACE_GIVEUP_MS * 1000000ull) {
            klog("pacing off: queued work did not finish in %d ms (it may wait for the host)", KREX_PACE_GIVEUP_MS);
            __atomic_store_n(&g_pace_off, 1, RELAXED);
            set_flag(KREX_PF_PACE_OFF);
            return 1;
        }
        *waited = polled = 1;
        struct timespec ts = {0, PACE_POLL_NS};
        nanosleep(&ts, NULL);
        *now = krex_now_ns();
        turn_renew(*now);
    }
}

/* Record an event after the work this thread just submitted (none: not ours to pace, or a
 * capture under way on the stream). */
static void record(int variant, CUstream stream) {
    CUcontext ctx = NULL;
    int capturing = 0;
    if (__atomic_load_n(&g_pace_off, RELAXED) || g_n >= PACE_RING || g_pfn.ctxcur(&ctx) != CUDA_SUCCESS || !ctx)
        return;
    if (stream == NULL && variant == KREX_VAR_PT) stream = PACE_PER_THREAD;
    /* This stream capturing (begun by another thread just now): the event would join it. */
    if (g_pfn.capq(stream, &capturing) != CUDA_SUCCESS || capturing) return;
    pace_event ev = pool_take(ctx);
    if (ev && g_pfn.evrec(ev, stream) == CUDA_SUCCESS) {
        g_ring[(g_head + g_n) % PACE_RING] = (struct pace_ev){ev, ctx, krex_now_ns(), proc_submits()};
        g_n++;
    } else if (ev) {
        g_pfn.evdel(ev); /* another context's stream, or a broken one: not ours to pace */
    }
}

/* `budget`: cap_ns is the GPU's drain budget (else a cap per process); `pend`: krex_pending(). */
static void pace_locked(struct krex_gpu *g, uint32_t *gate, int variant, CUstream stream, uint64_t cap_ns, int budget,
                        int pend) {
    pace_fns();
    if (__atomic_load_n(&g_pace_off, RELAXED)) return;
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    if (g_pfn.xmode) g_pfn.xmode(&mode);
    while (g_n && oldest_done()) ring_pop();
    uint64_t t0 = krex_now_ns(), now = t0;
    int waited = 0;
    /* After a check a process has up to `most` events pending and then submits one interval
     * more: under a budget, `most` leaves room for that interval, and where two intervals of
     * its work are more than its share it takes the floor instead. Before `s` is known, two
     * events (of one submission each under a budget) may be pending: a process's first
     * submissions still overlap its host work. */
    int long_work = budget && g_s_ns && 2 * g_s_ns * g_every > cap_ns; /* takes turns */
    int floor = pend != 0 || long_work;
    unsigned most = !g_s_ns  ? PACE_COLD_PENDING
                    : budget ? clampu(cap_ns / (g_s_ns * g_every) - 1, 1, PACE_RING - 1)
                             : clampu(cap_ns / (g_s_ns * g_every), 1, PACE_RING - 1);
    int off = floor ? 0 : wait_ring(t0, &now, &waited, most, cap_ns);
    /* Checks spaced so that what a thread queues between two stays under a quarter cap. */
    unsigned every = g_s_ns ? clampu(cap_ns / (4 * g_s_ns), 1, KREX_PACE_EVERY) : budget ? 1 : KREX_PACE_EVERY;
    __atomic_store_n(&g_every, every, RELAXED);
    if (!off) record(variant, stream);
    if (!off && floor) wait_ring(t0, &now, &waited, 1, 0); /* until all of ours, this one too, is done */
    /* The interval a turn covered has finished (or we are off the floor): give it back, and
     * let a process that waits for one take it before we try again (a releaser polling at
     * once would keep it, and starve the others). */
    int had = g_turn != NULL;
    turn_release();
    if (__atomic_load_n(&g_pace_off, RELAXED)) off = 1;
    /* A command whose own region is announced or queued skips the turns: its warm-up comes
     * just before it takes the whole GPU anyway, and waiting behind every sibling would only
     * delay the region. */
    int own = own_region_near(g);
    __atomic_store_n(&g_on_floor, long_work, RELAXED);
    if (!off && long_work && !own) {
        if (had && __atomic_load_n(&g->turn_waiters, RELAXED)) {
            struct timespec ts = {0, 2 * PACE_POLL_NS};
            nanosleep(&ts, NULL);
        }
        waited |= turn_take(g, gate, krex_now_ns()) | had;
    }
    if (waited) {
        now = krex_now_ns();
        struct krex_proc *p = __atomic_load_n(&g_proc, ACQUIRE);
        if (p) {
            __atomic_fetch_add(&p->paced, 1, RELAXED);
            __atomic_fetch_add(&p->paced_ns, now - t0, RELAXED);
        }
    }
    if (g_pfn.xmode) g_pfn.xmode(&mode); /* back to the thread's own mode */
    /* A region queued: wait for its gate to close, as a call parked at it would. */
    if (pend & KREX_PEND_QUEUED) krex_hold_pending(KREX_PEND_QUEUED, krex_now_ns());
}

void krex_pace(int id, const void *stream) {
    /* The next check after g_every more submissions (the wrapper compares with a constant). */
    t_pace = KREX_PACE_EVERY - __atomic_load_n(&g_every, RELAXED);
    const struct krex_entry *e = &krex_entries[id];
    struct krex_shm *shm = __atomic_load_n(&g_shm, ACQUIRE);
    uint32_t *gate = __atomic_load_n(&g_fast.gate, ACQUIRE);
    if (e->api == KREX_API_HIP || !shm || !gate || g_gpu < 0 || g_gpu >= KREX_MAX_GPUS || t_depth != 0 ||
        __atomic_load_n(&g_pace_off, RELAXED) || __atomic_load_n(&g_captures, RELAXED) != 0)
        return;
    uint64_t budget_ns = (uint64_t)__atomic_load_n(&shm->gpus[g_gpu].budget_us, RELAXED) * 1000ull;
    uint64_t cap_ns = budget_ns ? budget_ns : (uint64_t)__atomic_load_n(&shm->gpus[g_gpu].queue_cap_us, RELAXED) * 1000ull;
    if (__atomic_load_n(gate, ACQUIRE) != KREX_GATE_OPEN) return;
    int pend = krex_pending();
    if (cap_ns == 0 && !pend) return;
    if (pthread_mutex_trylock(&g_pace_lock) != 0) { /* another thread paces for us */
        if (pend & KREX_PEND_QUEUED) krex_hold_pending(KREX_PEND_QUEUED, krex_now_ns());
        return;
    }
    pace_locked(&shm->gpus[g_gpu], gate, e->variant, (CUstream)(uintptr_t)stream, cap_ns, budget_ns != 0, pend);
    pthread_mutex_unlock(&g_pace_lock);
}

/* A call parked at another command's closed gate, now open: a process on the floor takes a
 * turn before it submits, as after a pacing check. Without this every sibling parked at a
 * region's gate submitted its long kernel the moment it opened, and the next region's entry
 * drained one per sibling. */
void krex_pace_gate_opened(void) {
    struct krex_shm *shm = __atomic_load_n(&g_shm, ACQUIRE);
    uint32_t *gate = __atomic_load_n(&g_fast.gate, ACQUIRE);
    if (!__atomic_load_n(&g_on_floor, RELAXED) || !shm || !gate || g_gpu < 0 || g_gpu >= KREX_MAX_GPUS || t_depth != 0 ||
        __atomic_load_n(&g_pace_off, RELAXED) || __atomic_load_n(&g_captures, RELAXED) != 0)
        return;
    struct krex_gpu *g = &shm->gpus[g_gpu];
    if (!__atomic_load_n(&g->budget_us, RELAXED) || own_region_near(g) || pthread_mutex_trylock(&g_pace_lock) != 0)
        return;
    uint64_t t0 = krex_now_ns();
    turn_renew(t0); /* a turn we took before parking counts only if its lease still holds */
    if (!g_turn && turn_take(g, gate, t0)) {
        struct krex_proc *p = __atomic_load_n(&g_proc, ACQUIRE);
        if (p) {
            __atomic_fetch_add(&p->paced, 1, RELAXED);
            __atomic_fetch_add(&p->paced_ns, krex_now_ns() - t0, RELAXED);
        }
    }
    pthread_mutex_unlock(&g_pace_lock);
}

/* A fork child: its parent's events and lock are not its own (CUDA is unusable in a fork
 * child anyway until it execs). */
void krex_pace_after_fork(void) {
    pthread_mutex_init(&g_pace_lock, NULL);
    g_head = g_n = g_npool = 0;
    __atomic_store_n(&g_every, KREX_PACE_EVERY, RELAXED);
    g_s_ns = g_done_t = g_done_subs = 0;
    g_turn = NULL; /* the parent's turn, leased under its pid */
    g_turn_pid = 0;
    g_turn_n = 1;
    __atomic_store_n(&g_on_floor, 0, RELAXED);
    t_pace = KREX_PACE_EVERY - 1;
}

/* For tests: pacing is on in this process (0: gave up, or the driver lacks event calls). */
KREX_EXPORT int krex_shim_pacing(void) { return !__atomic_load_n(&g_pace_off, RELAXED); }
