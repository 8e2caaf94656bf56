/* One context creation at a time into the driver (krex_abi.h, KREX_CTX_TOKEN_LEASE_MS): the
 * shim's side of the node's token (ctx_token.c holds the word's rules).
 *
 * A call that makes a context (krex_ctx_makes: the tables' CTXNEW and GREENNEW rows and
 * primary-context retains) takes the token before the gate counts it in flight, and gives it
 * back once the vendor call has returned. Waiting for it, a thread is in no call: a region's drain does not
 * wait for it and a freezer may stop it; so a drain waits for the one creation inside the
 * driver, not for every one queued behind the driver's lock.
 *   - A call made inside another of this thread's calls (the CUDA runtime retains its primary
 *     context inside cudaSetDevice, cudaMalloc, ...) is already counted by that outer call. It
 *     takes a free token at once; if the outer call is a LIFE call of ours, it otherwise
 *     steps out of the outer call's count while it waits (nothing of that call reached the
 *     GPU yet: the context does not exist), then enters the gate again as the outer call did.
 *     Inside any other call it goes on without the token, as before.
 *   - It never parks at a closed gate holding the token (krex_wait_gate gives it back and
 *     takes it again after), and never waits for it while its own command's region holds the
 *     gate: a region's owner makes contexts straight through.
 *   - Off (KREX_CTX_TOKEN=0), without a segment, or with krexd no longer beating: no token.
 * Only these calls touch the token: the submission fast path is unchanged. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "shim_fastpath.h"

unsigned char krex_ctx_makes[KREX_N_IDS];
__thread int t_life_counted __attribute__((tls_model("initial-exec")));
static __thread uint64_t t_ctx_held;      /* the token word this thread stored (0: none) */
static __thread int t_ctx_parked;         /* it gave the token back to park at the gate */
static int g_ctx_on = 1;

/* The longest a thread waits for the token before it goes on without (slower, never stuck):
 * many leases, so only a token passed among more creators than that many leases' worth. */
#define CTX_TOKEN_WAIT_NS (30ull * 1000000000ull)

void krex_ctx_init(void) {
    for (int i = 0; i < KREX_N_IDS; i++)
        krex_ctx_makes[i] = krex_entries[i].name &&
                            (krex_entries[i].cls == KREX_CLS_CTXNEW || krex_entries[i].cls == KREX_CLS_GREENNEW ||
                             strstr(krex_entries[i].name, "PrimaryCtxRetain"));
    const char *v = getenv("KREX_CTX_TOKEN");
    g_ctx_on = !(v && !strcmp(v, "0"));
}

void krex_ctx_after_fork(void) {
    /* The token (if this thread held it) is the parent's: the child never gives it back. */
    t_ctx_held = 0;
    t_ctx_parked = 0;
    t_life_counted = 0;
}

/* Our own command's region holds the gate: its creations go straight through. */
static int own_region(void) {
    uint32_t *gate = __atomic_load_n(&g_fast.gate, ACQUIRE);
    if (!gate) return 0;
    uint32_t w = __atomic_load_n(gate, __ATOMIC_SEQ_CST);
    return w != KREX_GATE_OPEN && (w & KREX_GATE_OWNER_MASK) == g_fast.owner_byte;
}

/* Wait for the token, polling with backoff. 0: went on without it (our own region holds the
 * gate, krexd stopped beating, or the wait reached CTX_TOKEN_WAIT_NS). */
static uint64_t take_wait(void) {
    struct krex_shm *shm = __atomic_load_n(&g_shm, ACQUIRE);
    if (!shm) return 0;
    int same_ns = krex_in_krexds_pid_ns();
    int64_t pid = same_ns ? (int64_t)getpid() : 0;
    uint64_t t0 = krex_now_ns(), now = t0, sleep_us = 50;
    for (;;) {
        uint64_t w = krex_ctx_token_try(shm, pid, now, same_ns);
        if (w) {
            if (now - t0 > 1000000) klog("waited %.1f ms for the context-creation token", (double)(now - t0) / 1e6);
            return w;
        }
        if (own_region() || krex_heartbeat_stale(shm, now, 1) || now - t0 > CTX_TOKEN_WAIT_NS) return 0;
        struct timespec ts = {0, (long)sleep_us * 1000};
        nanosleep(&ts, NULL);
        sleep_us = sleep_us * 2 > KREX_CTX_TOKEN_POLL_MAX_US ? KREX_CTX_TOKEN_POLL_MAX_US : sleep_us * 2;
        now = krex_now_ns();
    }
}

/* The outer LIFE call's count, given up while this thread waits (the leave of krex_leave:
 * a count on the slot's shared counter, which krexd waits for, wakes it). */
static void step_out(uint32_t *life) {
    __atomic_fetch_sub(life, 1, __ATOMIC_SEQ_CST);
    if (life != g_fast.inflight) return;
    uint32_t w = __atomic_load_n(g_fast.gate, __ATOMIC_SEQ_CST);
    if (w != KREX_GATE_OPEN && (w & KREX_GATE_OWNER_MASK) != g_fast.owner_byte) krex_left_closed();
}

/* ... and taken again at the gate, as krex_enter takes it (parking gives the token back). */
static void step_in(uint32_t *life) {
    for (;;) {
        __atomic_fetch_add(life, 1, __ATOMIC_SEQ_CST);
        uint32_t w = __atomic_load_n(g_fast.gate, __ATOMIC_SEQ_CST);
        if (w == KREX_GATE_OPEN || (w & KREX_GATE_OWNER_MASK) == g_fast.owner_byte) return;
        __atomic_fetch_sub(life, 1, __ATOMIC_SEQ_CST);
        if (krex_wait_gate(w)) {
            __atomic_fetch_add(life, 1, __ATOMIC_SEQ_CST);
            return;
        }
    }
}

int krex_ctx_begin(void) {
    if (!__atomic_load_n(&g_ctx_on, RELAXED) || t_ctx_held || t_ctx_parked) return 0;
    if (t_depth == 0) {
        if (!__atomic_load_n(&g_fast.gate, ACQUIRE) && (!mode_on() || !krex_register())) return 0;
        if (own_region()) return 0;
        t_ctx_held = take_wait();
        return 1;
    }
    struct krex_shm *shm = __atomic_load_n(&g_shm, ACQUIRE);
    uint32_t *life = g_fast.life_inflight;
    if (!shm || !__atomic_load_n(&g_fast.gate, ACQUIRE) || own_region()) return 0;
    int same_ns = krex_in_krexds_pid_ns();
    t_ctx_held = krex_ctx_token_try(shm, same_ns ? (int64_t)getpid() : 0, krex_now_ns(), same_ns);
    if (t_ctx_held) return 1;
    if (t_life_counted != g_fork_gen + 1 || !life) return 0;
    /* Out of the call meanwhile, depth too: a signal handler's GPU call on this thread is then
     * gated as any other, not passed as nested while no count covers it. */
    int depth = t_depth;
    t_depth = 0;
    step_out(life);
    t_ctx_held = take_wait();
    step_in(life);
    t_depth = depth;
    return 1;
}

void krex_ctx_end(int began) {
    if (!began) return;
    struct krex_shm *shm = __atomic_load_n(&g_shm, ACQUIRE);
    if (shm && t_ctx_held) krex_ctx_token_give(shm, t_ctx_held);
    t_ctx_held = 0;
    t_ctx_parked = 0;
}

int krex_ctx_gate_park(void) {
    if (!t_ctx_held) return 0;
    struct krex_shm *shm = __atomic_load_n(&g_shm, ACQUIRE);
    if (shm) krex_ctx_token_give(shm, t_ctx_held);
    t_ctx_held = 0;
    t_ctx_parked = 1;
    return 1;
}

void krex_ctx_gate_unpark(int parked) {
    if (!parked) return;
    t_ctx_held = take_wait();
    t_ctx_parked = 0;
}
