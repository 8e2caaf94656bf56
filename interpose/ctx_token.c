/* The node's context-creation token (krex_abi.h, KREX_CTX_TOKEN_LEASE_MS): the word's rules,
 * shared by the shim (ctx_gate.c waits for it) and krexd and tests (through cffi). No
 * waiting here: each function is one read or one compare-and-swap. */
#define _GNU_SOURCE
#include <stdint.h>

#include "krex_core.h"

#define TOKEN_MASK ((1ull << 40) - 1)
#define SEQ __ATOMIC_SEQ_CST

uint64_t krex_ctx_token_word(int64_t pid, uint64_t now_ns) {
    uint64_t p = pid > 0 && pid < (1ll << 24) ? (uint64_t)pid : 0;
    uint64_t end = (now_ns / 1000 + (uint64_t)KREX_CTX_TOKEN_LEASE_MS * 1000) & TOKEN_MASK;
    return p << 40 | (end ? end : 1); /* never 0: 0 is free */
}

/* The lease of `w` has ended at `now_ns`, or `w` is no lease a holder could have written (its
 * end further off than one lease: a word from another clock or garbage). */
int krex_ctx_token_lapsed(uint64_t w, uint64_t now_ns) {
    uint64_t left = ((w & TOKEN_MASK) - now_ns / 1000) & TOKEN_MASK;
    return left == 0 || left > (uint64_t)KREX_CTX_TOKEN_LEASE_MS * 1000;
}

int64_t krex_ctx_token_pid(uint64_t w) { return (int64_t)(w >> 40); }

/* Who holds the token now: its pid (0: a holder outside krexd's pid namespace), -1 when it
 * is free (0, or its lease ended). A holder that died still counts until a taker notices. */
int64_t krex_ctx_token_holder(struct krex_shm *shm, uint64_t now_ns) {
    uint64_t w = __atomic_load_n(&shm->hdr.ctx_token, SEQ);
    return w == 0 || krex_ctx_token_lapsed(w, now_ns) ? -1 : krex_ctx_token_pid(w);
}

/* Take the token for `pid` if it is free, lapsed, or its holder is dead (`check_alive`: the
 * caller shares krexd's pid namespace, so the word's pid is one it can look up). Returns the
 * word it stored (what krex_ctx_token_give needs), 0 when another holds it. */
uint64_t krex_ctx_token_try(struct krex_shm *shm, int64_t pid, uint64_t now_ns, int check_alive) {
    uint64_t w = __atomic_load_n(&shm->hdr.ctx_token, SEQ);
    if (w != 0 && !krex_ctx_token_lapsed(w, now_ns)) {
        int64_t holder = krex_ctx_token_pid(w);
        if (!check_alive || holder <= 0 || krex_pid_alive(holder, 0)) return 0;
    }
    uint64_t mine = krex_ctx_token_word(pid, now_ns);
    return __atomic_compare_exchange_n(&shm->hdr.ctx_token, &w, mine, 0, SEQ, SEQ) ? mine : 0;
}

/* Give back the token taken as `held`: only if the word is still that one (a taker that found
 * it lapsed or its holder dead owns it now). Returns 1 if it was still ours. */
int krex_ctx_token_give(struct krex_shm *shm, uint64_t held) {
    uint64_t w = held;
    return held != 0 && __atomic_compare_exchange_n(&shm->hdr.ctx_token, &w, 0ull, 0, SEQ, SEQ);
}

/* krexd: drop the token of a process it stops (a freeze): a frozen process never holds it. */
int krex_ctx_token_drop(struct krex_shm *shm, int64_t pid) {
    uint64_t w = __atomic_load_n(&shm->hdr.ctx_token, SEQ);
    if (w == 0 || pid <= 0 || krex_ctx_token_pid(w) != pid) return 0;
    return __atomic_compare_exchange_n(&shm->hdr.ctx_token, &w, 0ull, 0, SEQ, SEQ);
}
