/* The submission fast path, inlined into every gated wrapper (hooks.c): a TLS depth
 * check, one seq_cst increment, one seq_cst load, the depth increment. No locks, no
 * syscalls, no allocation; everything slow is behind krex_register / krex_wait_gate. */
#ifndef KREX_SHIM_FASTPATH_H
#define KREX_SHIM_FASTPATH_H
#include "shim.h"

#pragma GCC visibility push(hidden)
/* Everything the fast path reads, set once by krex_register(). `gate` is
 * published last with a release store and read with an acquire load, so a thread
 * that sees it also sees the other fields (this matters on aarch64, e.g. GH200). */
struct krex_fast {
    uint32_t *gate;     /* NULL until this process registered */
    uint32_t *inflight;
    uint32_t *life_inflight; /* LIFE calls (krex_abi.h): krexd freezes, never waits for, them */
    uint64_t *submits;
    uint32_t owner_byte;
};
extern struct krex_fast g_fast;
extern int g_fork_gen; /* bumped in each fork child: a counted call's token is g_fork_gen + 1 */
extern __thread int t_depth __attribute__((tls_model("initial-exec")));
#pragma GCC visibility pop

/* t_depth counts this thread's calls that are past the gate (krex_leave undoes it on
 * every path). A call made inside one (a library calling itself) is nested: it passes
 * uncounted, covered by the outer call's in-flight count. A thread parked at the gate
 * is NOT inside a call yet, so a signal handler's call on it is gated like any other.
 * Returns 0 for an uncounted call, else the token krex_leave needs (g_fork_gen + 1). */
static inline int krex_enter(int cls) {
    if (UNLIKELY(t_depth != 0)) { /* nested */
        t_depth++;
        return 0;
    }
    uint32_t *gate = __atomic_load_n(&g_fast.gate, ACQUIRE);
    if (UNLIKELY(gate == NULL)) {
        /* (krex_register blocks signals and marks its own calls as nested) */
        if (!mode_on() || !krex_register()) {
            t_depth++;
            return 0;
        }
        gate = __atomic_load_n(&g_fast.gate, ACQUIRE);
    }
    uint32_t *inflight = cls == KREX_CLS_LIFE ? g_fast.life_inflight : g_fast.inflight; /* folded */
    for (;;) {
        __atomic_fetch_add(inflight, 1, __ATOMIC_SEQ_CST);
        uint32_t w = __atomic_load_n(gate, __ATOMIC_SEQ_CST);
        if (LIKELY(w == KREX_GATE_OPEN || (w & KREX_GATE_OWNER_MASK) == g_fast.owner_byte)) break;
        __atomic_fetch_sub(inflight, 1, __ATOMIC_SEQ_CST);
        if (krex_wait_gate(w)) { /* holder is gone: fail open */
            __atomic_fetch_add(inflight, 1, __ATOMIC_SEQ_CST);
            break;
        }
    }
    t_depth++;
    /* Release: a drain helper that reads this count also sees the in-flight increment
     * before it (krex_proc_quiet; the same instruction as relaxed on x86). */
    __atomic_fetch_add(&g_fast.submits[cls], 1, __ATOMIC_RELEASE);
    return g_fork_gen + 1;
}

/* Slow path of a leave (shim.c): someone else closed the gate while this call ran,
 * so krexd may be waiting for our in-flight count to reach 0. Wake it, never poll. */
void krex_left_closed(void) __attribute__((cold, visibility("hidden")));

/* The decrement, then the gate load (both seq_cst): krexd closes the gate, then waits on
 * its wake word and scans the counters, so either its scan sees the decrement or we see
 * the gate closed and wake it (krex_abi.h). With the gate open: one extra load, no syscall.
 * always_inline: gcc stops inlining it once it grows, which doubles the fast path's cost. */
__attribute__((always_inline)) static inline void krex_leave(int counted, int cls) {
    /* The depth first: a signal handler that runs on this thread after it must not be
     * taken for a nested call, which passes uncounted, while this thread no longer holds
     * its count (it would then slip past a gate closed meanwhile). In the gap the thread
     * still holds its count, so such a handler is gated (and at worst delays a region
     * entry to its bounded in-flight wait, which is flagged). */
    if (LIKELY(t_depth > 0)) t_depth--; /* (0: a fork child that left a call its parent entered) */
    /* A token of another fork generation: a fork child leaving a call its parent entered
     * (a fork from a signal handler inside it). That count is the parent's, in the
     * parent's record: the child must not touch it, nor its own record if it registered. */
    if (counted && LIKELY(counted == g_fork_gen + 1)) {
        uint32_t *inflight = cls == KREX_CLS_LIFE ? g_fast.life_inflight : g_fast.inflight;
        __atomic_fetch_sub(inflight, 1, __ATOMIC_SEQ_CST);
        /* krexd never waits for a LIFE count (it freezes its process): nobody to wake,
         * unless it went to the slot's shared counter (no record), which it waits for. */
        if (cls == KREX_CLS_LIFE && inflight != g_fast.inflight) return;
        uint32_t *gate = g_fast.gate; /* NULL in a fork child until it registers */
        uint32_t w = gate ? __atomic_load_n(gate, __ATOMIC_SEQ_CST) : KREX_GATE_OPEN;
        if (UNLIKELY(w != KREX_GATE_OPEN && (w & KREX_GATE_OWNER_MASK) != g_fast.owner_byte)) krex_left_closed();
    }
}

#endif
