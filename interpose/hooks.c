/* The wrappers, generated from the api_*.def tables (one X-macro expansion per
 * table; no entry is listed anywhere else).
 *
 * For each entry there are KREX_NSLOT wrappers; wrapper 0 is exported under the
 * real name (the PLT path), wrappers 1..3 are handed out by dlsym / GetProcAddress
 * when those return a *different* real pointer for the same name (a _ptsz variant,
 * another library copy). Each wrapper is bound to exactly one real pointer. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "shim_fastpath.h"
#include "sim/sim_samples.h" /* the names the tables' `stream` column uses (SIM_NULL_STREAM, ...) */

#define KREX_GET_FN(name, k)                                                           \
    krex_fn_##name fn = (krex_fn_##name)__atomic_load_n(&krex_real[KREX_ID_##name][k], \
                                                         __ATOMIC_ACQUIRE);            \
    if (UNLIKELY(!fn)) fn = (krex_fn_##name)krex_resolve(KREX_ID_##name, k);           \
    if (UNLIKELY(!fn)) return KREX_NOTFOUND;

/* After a counted submission: one TLS increment; every KREX_PACE_EVERY-th, pace.c bounds
 * the process's queued work (krex_st_NAME: the call's stream, from the table's column). */
#define KREX_PACE_TICK(name, counted, args) \
    if (UNLIKELY((counted) && ++t_pace >= KREX_PACE_EVERY)) krex_pace(KREX_ID_##name, krex_st_##name args)
#define KREX_GATED(fname, name, k, cls, params, args) \
    KREX_RET fname params {                           \
        KREX_GET_FN(name, k)                          \
        int krex_counted = krex_enter(cls);           \
        KREX_RET krex_rc = fn args;                   \
        krex_leave(krex_counted, cls);                \
        KREX_PACE_TICK(name, krex_counted, args);     \
        return krex_rc;                               \
    }
#define KREX_BODY_KERNEL(f, n, k, p, a) KREX_GATED(f, n, k, KREX_CLS_KERNEL, p, a)
#define KREX_BODY_COPY(f, n, k, p, a) KREX_GATED(f, n, k, KREX_CLS_COPY, p, a)
#define KREX_BODY_MEMSET(f, n, k, p, a) KREX_GATED(f, n, k, KREX_CLS_MEMSET, p, a)
#define KREX_BODY_GRAPH(f, n, k, p, a) KREX_GATED(f, n, k, KREX_CLS_GRAPH, p, a)
#define KREX_BODY_PREFETCH(f, n, k, p, a) KREX_GATED(f, n, k, KREX_CLS_PREFETCH, p, a)
/* Contexts, modules and device memory: gated; a free is stamped before and after the call
 * (the driver may free as soon as it is called), and a success arms the exit hold (shim.c).
 * A call that makes a context takes the node's token first (ctx_gate.c), and gives it back
 * once the vendor call has returned; t_life_counted tells a creation nested inside this call
 * that it may step out of this call's count while it waits for the token. */
#define KREX_LIFE_CALL_OR(fname, name, k, params, args, before, after, failed) \
    KREX_RET fname params {                                        \
        KREX_GET_FN(name, k)                                       \
        krex_life_defer();                                         \
        int krex_ct = krex_ctx_makes[KREX_ID_##name] ? krex_ctx_begin() : 0; \
        int krex_counted = krex_enter(KREX_CLS_LIFE);              \
        if (krex_counted) t_life_counted = krex_counted;           \
        uint32_t krex_lt = krex_counted ? krex_life_thread() : 0;  \
        before;                                                    \
        uintptr_t krex_a0 = (uintptr_t)KREX_FIRST(args);           \
        uint64_t krex_fs = krex_life_free(KREX_ID_##name, krex_a0, 0, 0); \
        krex_life_ordered(KREX_ID_##name, 0);                      \
        KREX_RET krex_rc = fn args;                                \
        krex_life_free(KREX_ID_##name, krex_a0, 1, krex_fs);       \
        krex_life_thread_end(krex_lt);                             \
        if (krex_counted) t_life_counted = 0;                      \
        krex_leave(krex_counted, KREX_CLS_LIFE);                   \
        krex_ctx_end(krex_ct);                                     \
        krex_life_ordered(KREX_ID_##name, 1);                      \
        if (krex_rc == 0) {                                        \
            krex_life_done();                                      \
            after;                                                 \
        } else {                                                   \
            failed;                                                \
        }                                                          \
        return krex_rc;                                            \
    }
#define KREX_LIFE_CALL(f, n, k, p, a, before, after) KREX_LIFE_CALL_OR(f, n, k, p, a, before, after, (void)0)
#define KREX_BODY_LIFE(f, n, k, p, a) KREX_LIFE_CALL(f, n, k, p, a, (void)0, (void)0)

/* Large 1-D copies and memsets (the `chunk` column): above g_chunk_bytes the call is
 * issued as a sequence of calls of at most that many bytes, in order, on the same
 * stream, each through the gate, so a closing gate stops the sequence between two
 * chunks and a region waits for one chunk, not a GB-scale copy. Same bytes, same
 * order, no added synchronisation; the first error ends it and is returned. A small
 * call pays one compare. Not while a graph capture runs in the process (a captured
 * copy stays one node), nor in a nested call (the outer call holds the gate). */
static inline int krex_may_chunk(void) {
    return t_depth == 0 && __atomic_load_n(&g_captures, RELAXED) == 0;
}
#define KREX_ADV1(p) p = (__typeof__(p))((uintptr_t)(p) + krex_bytes);
#define KREX_CHUNKED(fname, name, k, cls, params, args, cnt, esz, val, ...)          \
    KREX_RET fname params {                                                          \
        KREX_GET_FN(name, k)                                                         \
        if (UNLIKELY((uint64_t)(cnt) > g_chunk_bytes / (esz)) && krex_may_chunk()) { \
            const uint64_t krex_step = g_chunk_bytes / (esz);                        \
            uint64_t krex_left = (uint64_t)(cnt);                                    \
            KREX_RET krex_rc;                                                        \
            do {                                                                     \
                uint64_t krex_n = krex_left < krex_step ? krex_left : krex_step;     \
                cnt = (__typeof__(cnt))krex_n;                                       \
                int krex_counted = krex_enter(cls);                                  \
                krex_rc = fn args;                                                   \
                krex_leave(krex_counted, cls);                                       \
                KREX_PACE_TICK(name, krex_counted, args);                            \
                uint64_t krex_bytes = krex_n * (esz);                                \
                KREX_FOR_EACH(KREX_ADV1, __VA_ARGS__)                                \
                krex_left -= krex_n;                                                 \
            } while (krex_rc == 0 && krex_left != 0);                                \
            return krex_rc;                                                          \
        }                                                                            \
        int krex_counted = krex_enter(cls);                                          \
        KREX_RET krex_rc = fn args;                                                  \
        krex_leave(krex_counted, cls);                                               \
        KREX_PACE_TICK(name, krex_counted, args);                                    \
        return krex_rc;                                                              \
    }
/* One wrapper: by class, or chunked when the row's chunk column says so. */
#define KREX_WRAP(ck, ...) KREX_WRAP_(ck, __VA_ARGS__)
#define KREX_WRAP_(kind, spec, cls, f, n, k, p, a) KREX_WRAP_##kind(spec, cls, f, n, k, p, a)
#define KREX_WRAP_NONE(spec, cls, f, n, k, p, a) KREX_BODY_##cls(f, n, k, p, a)
#define KREX_WRAP_COPY(spec, cls, f, n, k, p, a) KREX_CALL(KREX_CHUNKED, f, n, k, KREX_CLS_##cls, p, a, KREX_UNPAREN spec)
#define KREX_WRAP_SET KREX_WRAP_COPY

static void *krex_redirect(int lookup_id, const char *symbol, void *realp, uint64_t flags);

/* Lookups are not gated: call the real one, then swap in our wrapper. */
#define KREX_BODY_LOOKUP(fname, name, k, params, args)                          \
    KREX_RET fname params {                                                     \
        KREX_GET_FN(name, k)                                                    \
        KREX_RET krex_rc = fn args;                                             \
        if (krex_rc == 0 && pfn && *pfn)                                        \
            *pfn = krex_redirect(KREX_ID_##name, symbol, *pfn, (uint64_t)flags); \
        return krex_rc;                                                         \
    }
/* Contexts: LIFE calls, also tracked so the drain helper can synchronise non-primary ones. */
#define KREX_BODY_CTXNEW(f, n, k, p, a) KREX_LIFE_CALL(f, n, k, p, a, (void)0, if (pctx) krex_ctx_add((void *)*pctx))
/* A context leaves the drain's tables before its destruction, and comes back if that fails
 * (it lives on: its work must still be synchronised). */
#define KREX_BODY_CTXDEL(f, n, k, p, a)                                                          \
    KREX_LIFE_CALL_OR(f, n, k, p, a, int krex_held = krex_ctx_del((void *)ctx), (void)0,          \
                      if (krex_held) krex_ctx_add((void *)ctx))
/* Green contexts: the same, by the CUcontext each converts to (drain.c, krex_green_add); an
 * application's own conversion (GREENCTX, not gated: no GPU work) records it too. */
#define KREX_BODY_GREENNEW(f, n, k, p, a) KREX_LIFE_CALL(f, n, k, p, a, (void)0, if (phCtx) krex_green_add((void *)*phCtx))
#define KREX_BODY_GREENDEL(f, n, k, p, a)                                                        \
    KREX_LIFE_CALL_OR(f, n, k, p, a, void *krex_gc = krex_green_del((void *)hCtx), (void)0,       \
                      krex_green_restore((void *)hCtx, krex_gc))
#define KREX_BODY_GREENCTX(fname, name, k, params, args)                                        \
    KREX_RET fname params {                                                                     \
        KREX_GET_FN(name, k)                                                                    \
        KREX_RET krex_rc = fn args;                                                             \
        if (krex_rc == 0 && pContext && *pContext) krex_green_note((void *)hCtx, (void *)*pContext); \
        return krex_rc;                                                                         \
    }

#define KREX_FIRST_(a, ...) a
#define KREX_FIRST(args) KREX_FIRST_ args /* a capture row's first argument is the stream, a LIFE row's its pointer or handle */
#define KREX_BODY_CAPBEGIN(fname, name, k, params, args)               \
    KREX_RET fname params {                                            \
        KREX_GET_FN(name, k)                                           \
        KREX_RET krex_rc = fn args;                                    \
        if (krex_rc == 0) krex_capture_begin((void *)KREX_FIRST(args)); \
        return krex_rc;                                                \
    }
#define KREX_BODY_CAPEND(fname, name, k, params, args)                                      \
    KREX_RET fname params {                                                                 \
        KREX_GET_FN(name, k)                                                                \
        KREX_RET krex_rc = fn args;                                                         \
        krex_capture_end(krex_entries[KREX_ID_##name].api, (void *)KREX_FIRST(args));      \
        return krex_rc;                                                                     \
    }

#define X(name, lookup, variant, cls, params, args, stream, cost, sample, chunk)      \
    typedef KREX_RET(*krex_fn_##name) params;                                       \
    static inline const void *krex_st_##name params {                               \
        return (const void *)(uintptr_t)(stream);                                   \
    }                                                                               \
    KREX_EXPORT KREX_WRAP(KREX_CK_##chunk, cls, name, name, 0, params, args)        \
    static KREX_WRAP(KREX_CK_##chunk, cls, krex_w1_##name, name, 1, params, args)   \
    static KREX_WRAP(KREX_CK_##chunk, cls, krex_w2_##name, name, 2, params, args)   \
    static KREX_WRAP(KREX_CK_##chunk, cls, krex_w3_##name, name, 3, params, args)

#define KREX_RET cudaError_t
#define KREX_NOTFOUND cudaErrorInitializationError
#include "api_cudart.def"
#undef KREX_RET
#undef KREX_NOTFOUND
#define KREX_RET CUresult
#define KREX_NOTFOUND CUDA_ERROR_NOT_FOUND
#include "api_driver.def"
#undef KREX_RET
#undef KREX_NOTFOUND
#define KREX_RET hipError_t
#define KREX_NOTFOUND hipErrorNotInitialized
#include "api_hip.def"
#undef KREX_RET
#undef KREX_NOTFOUND
#undef X

void *const krex_wrappers[KREX_N_IDS][KREX_NSLOT] = {
#define X(name, ...) \
    [KREX_ID_##name] = {(void *)name, (void *)krex_w1_##name, (void *)krex_w2_##name, (void *)krex_w3_##name},
#include "api_cudart.def"
#include "api_driver.def"
#include "api_hip.def"
#undef X
};

int is_own_wrapper(void *p) {
    /* Slow path only (dlsym / lookups): a linear scan is fine. */
    for (int i = 0; i < KREX_N_IDS; i++)
        for (int k = 0; k < KREX_NSLOT; k++)
            if (krex_wrappers[i][k] == p) return 1;
    return 0;
}

/* Bind `realp` to a wrapper of entry `id`: reuse the slot that already holds it
 * or claim an empty one. If all slots hold other pointers the call escapes the
 * gate; that is flagged, never silent. */
void *krex_bind(int id, void *realp) {
    if (is_own_wrapper(realp)) return realp;
    for (int k = 0; k < KREX_NSLOT; k++) {
        void *cur = __atomic_load_n(&krex_real[id][k], __ATOMIC_ACQUIRE);
        if (cur == NULL && k == 0) cur = krex_resolve(id, 0);
        if (cur == realp) return krex_wrappers[id][k];
        if (cur == NULL) {
            void *expect = NULL;
            if (__atomic_compare_exchange_n(&krex_real[id][k], &expect, realp, 0, __ATOMIC_ACQ_REL,
                                            __ATOMIC_ACQUIRE)) {
                __atomic_add_fetch(&krex_real_gen, 1, __ATOMIC_RELEASE);
                return krex_wrappers[id][k];
            }
            if (expect == realp) return krex_wrappers[id][k];
        }
    }
    set_flag(KREX_PF_LOOKUP_FALLBACK);
    klog("all %d wrapper slots of %s are taken; passing a real pointer", KREX_NSLOT,
         krex_entries[id].name);
    return realp;
}

/* Name -> entry id, by binary search over a sorted index built at load time. */
static int g_sorted[KREX_N_IDS];
static int g_nsorted;

static int cmp_ids(const void *a, const void *b) {
    return strcmp(krex_entries[*(const int *)a].name, krex_entries[*(const int *)b].name);
}

/* LIFE rows that free GPU memory, by name: 2 for a *Free* (its first argument is the
 * pointer: NULL frees nothing, cudaFree(NULL) is the idiom that makes a context), 3 for
 * those of them whose allocation the driver can size (cudaFree, cuMemFree), 1 for a
 * release, unmap, unload, reset, destroy or pool trim. */
unsigned char krex_frees[KREX_N_IDS];
/* LIFE calls that are stream-ordered (cuMemAllocAsync, cudaFreeAsync, hipMallocFromPoolAsync:
 * "Async" in the name): they queue work on a stream rather than finish inside the call. */
unsigned char krex_ordered[KREX_N_IDS];

void krex_hooks_init(void) {
    static const char *const free_words[] = {"Release", "Unmap", "Unload", "Reset", "Destroy", "Trim"};
    for (int i = 0; i < KREX_N_IDS; i++) {
        if (!krex_entries[i].name) continue;
        g_sorted[g_nsorted++] = i;
        for (unsigned w = 0; w < sizeof free_words / sizeof *free_words; w++)
            if (strstr(krex_entries[i].name, free_words[w])) krex_frees[i] = 1;
        if (strstr(krex_entries[i].name, "Free")) krex_frees[i] = 2;
        if (!strcmp(krex_entries[i].name, "cudaFree") || !strcmp(krex_entries[i].name, "cuMemFree_v2") ||
            !strcmp(krex_entries[i].name, "cuMemFree"))
            krex_frees[i] = 3;
        krex_ordered[i] = krex_entries[i].cls == KREX_CLS_LIFE && strstr(krex_entries[i].name, "Async") != NULL;
    }
    qsort(g_sorted, (size_t)g_nsorted, sizeof(int), cmp_ids);
}

KREX_NO_SANITIZE int krex_find(const char *name) {
    int lo = 0, hi = g_nsorted - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        int c = strcmp(name, krex_entries[g_sorted[mid]].name);
        if (c == 0) return g_sorted[mid];
        if (c < 0) hi = mid - 1;
        else lo = mid + 1;
    }
    return -1;
}

static int version_of(const char *name) {
    const char *v = strstr(name, "_v");
    return v ? atoi(v + 2) : 1;
}

/* GetProcAddress redirection. The lookup returns the real pointer for the
 * variant it chose (default or per-thread stream, ABI version); find the table
 * entry with that exact pointer, or else the best match by flags and version. */
static void *krex_redirect(int lookup_id, const char *symbol, void *realp, uint64_t flags) {
    if (!mode_on() || !symbol || is_own_wrapper(realp)) return realp;
    int api = krex_entries[lookup_id].api == KREX_API_HIP ? KREX_API_HIP : KREX_API_DRIVER;
    int best = -1;
    int want_pt = (flags & 2) != 0; /* *_PER_THREAD_DEFAULT_STREAM is 2 in all three APIs */
    for (int i = 0; i < KREX_N_IDS; i++) {
        const struct krex_entry *e = &krex_entries[i];
        if (!e->name || e->api != api || strcmp(e->lookup, symbol) != 0) continue;
        void *r = __atomic_load_n(&krex_real[i][0], __ATOMIC_ACQUIRE);
        if (!r) r = krex_resolve(i, 0);
        if (r == realp) return krex_bind(i, realp);
        if (e->variant == KREX_VAR_V1 || (e->variant == KREX_VAR_PT) != want_pt) continue;
        if (best < 0 || version_of(e->name) > version_of(krex_entries[best].name)) best = i;
    }
    if (best < 0) return realp; /* not something we gate */
    set_flag(KREX_PF_LOOKUP_FALLBACK);
    return krex_bind(best, realp);
}

