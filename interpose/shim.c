/* libkrex_interpose.so: the data plane, loaded with LD_PRELOAD.
 *
 * Every intercepted entry point comes from the api_*.def tables. For each entry
 * there are KREX_NSLOT wrappers; wrapper 0 is exported under the real name
 * (the PLT path), wrappers 1..3 are handed out by dlsym / GetProcAddress when
 * those return a *different* real pointer for the same name (a _ptsz variant,
 * another library copy). Each wrapper is bound to exactly one real pointer.
 *
 * Outside KREX (no KREX_SHM/KREX_SLOT) every wrapper is a pass-through: no
 * threads, no output, dlsym returns real pointers.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <link.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include "krex_core.h"
#include "krex_tables.h"

#define KREX_NSLOT 4
#define KREX_EXPORT __attribute__((visibility("default")))
#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)

enum { MODE_OFF = 0, MODE_ON = 1 };

/* Everything the fast path reads, set once by krex_register(). */
static struct {
    uint32_t *gate;     /* NULL until this process registered */
    uint32_t *inflight;
    uint64_t *submits;
    uint32_t owner_byte;
} g_fast;

static int g_mode = MODE_OFF;
static int g_log;
static char g_shm_name[128];
static int g_slot = -1;
static int g_gpu = -1;
static struct krex_shm *g_shm;
static struct krex_proc *g_proc;
static uint32_t g_failed_gate;            /* gate word we already failed open on */
static uint64_t g_local_submits[KREX_NGATED];
static uint32_t g_pending_flags;
static pthread_mutex_t g_reg_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_helper_started;
static char g_sock_path[108];
static char g_daemon_cmd[1024];
static int g_conn = -1;                  /* connection to krexd (registration + regions) */
static pthread_mutex_t g_conn_lock = PTHREAD_MUTEX_INITIALIZER;
static __thread int t_region_depth;
extern char **environ;
static __thread int t_depth __attribute__((tls_model("initial-exec")));

static void *krex_real[KREX_N_IDS][KREX_NSLOT];

static void klog(const char *fmt, ...) {
    if (!g_log) return;
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    int n = snprintf(buf, sizeof buf, "[krex %d] ", (int)getpid());
    n += vsnprintf(buf + n, sizeof buf - (size_t)n, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof buf - 2) n = (int)sizeof buf - 2;
    buf[n++] = '\n';
    ssize_t w = write(2, buf, (size_t)n);
    (void)w;
}

static void set_flag(uint32_t f) {
    if (g_proc) __atomic_or_fetch(&g_proc->flags, f, __ATOMIC_RELAXED);
    else __atomic_or_fetch(&g_pending_flags, f, __ATOMIC_RELAXED);
}

/* ------------------------------------------------------------------ gate */

static int krex_register(void);
static int krex_wait_gate(uint32_t word);

/* Fast path: a TLS depth check, one seq_cst increment, one seq_cst load. */
static inline int krex_enter(int cls) {
    if (UNLIKELY(t_depth++ != 0)) return 0; /* nested (a library calling itself) */
    uint32_t *gate = g_fast.gate;
    if (UNLIKELY(gate == NULL)) {
        if (g_mode == MODE_OFF || !krex_register()) return 0;
        gate = g_fast.gate;
    }
    uint32_t *inflight = g_fast.inflight;
    for (;;) {
        __atomic_fetch_add(inflight, 1, __ATOMIC_SEQ_CST);
        uint32_t w = __atomic_load_n(gate, __ATOMIC_SEQ_CST);
        if (LIKELY(w == KREX_GATE_OPEN || (w & 0xff) == g_fast.owner_byte)) break;
        __atomic_fetch_sub(inflight, 1, __ATOMIC_SEQ_CST);
        if (krex_wait_gate(w)) { /* holder is gone: fail open */
            __atomic_fetch_add(inflight, 1, __ATOMIC_SEQ_CST);
            break;
        }
    }
    __atomic_fetch_add(&g_fast.submits[cls], 1, __ATOMIC_RELAXED);
    return 1;
}

static inline void krex_leave(int counted) {
    if (counted) __atomic_fetch_sub(g_fast.inflight, 1, __ATOMIC_RELEASE);
    t_depth--;
}

static int holder_gone(struct krex_gpu *g, uint64_t now) {
    switch (__atomic_load_n(&g->holder, __ATOMIC_SEQ_CST)) {
    case KREX_HOLDER_PAUSE: {
        uint64_t dl = g->lease_deadline_ns;
        return dl != 0 && now > dl;
    }
    case KREX_HOLDER_REGION: {
        uint64_t hb = __atomic_load_n(&g_shm->hdr.heartbeat_ns, __ATOMIC_SEQ_CST);
        uint64_t to = g_shm->hdr.heartbeat_timeout_ns ? g_shm->hdr.heartbeat_timeout_ns
                                                      : KREX_HEARTBEAT_TIMEOUT_NS;
        return now > hb && now - hb > to;
    }
    default: /* closed with no holder recorded: only a crashed closer does that */
        return now - g->closed_ns > KREX_HEARTBEAT_TIMEOUT_NS;
    }
}

/* Slow path: wait until the gate word changes. Returns 1 to fail open. */
static int krex_wait_gate(uint32_t w) {
    if (w == __atomic_load_n(&g_failed_gate, __ATOMIC_RELAXED)) return 1;
    struct krex_gpu *g = &g_shm->gpus[g_gpu];
    uint64_t t0 = krex_now_ns();
    if (g_proc) __atomic_fetch_add(&g_proc->blocked, 1, __ATOMIC_RELAXED);
    int failed = 0;
    for (;;) {
        krex_futex_wait(g_fast.gate, w, 20 * 1000 * 1000);
        if (__atomic_load_n(g_fast.gate, __ATOMIC_SEQ_CST) != w) break;
        uint64_t now = krex_now_ns();
        if (holder_gone(g, now)) {
            __atomic_store_n(&g_failed_gate, w, __ATOMIC_RELAXED);
            __atomic_fetch_add(&g->fail_opens, 1, __ATOMIC_RELAXED);
            if (g_proc) __atomic_fetch_add(&g_proc->fail_opens, 1, __ATOMIC_RELAXED);
            set_flag(KREX_PF_FAILED_OPEN);
            klog("gate 0x%x on gpu %d: holder gone, failing open", w, g_gpu);
            failed = 1;
            break;
        }
    }
    if (g_proc) __atomic_fetch_add(&g_proc->blocked_ns, krex_now_ns() - t0, __ATOMIC_RELAXED);
    return failed;
}

/* ------------------------------------------------------------ real symbols */

static void *(*g_real_dlsym)(void *, const char *);

static void *real_dlsym(void *h, const char *name) {
    if (UNLIKELY(!g_real_dlsym)) {
        void *p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
        if (!p) p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5"); /* x86_64 base */
        if (!p) p = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.17");  /* aarch64 base (Grace Hopper) */
        g_real_dlsym = (void *(*)(void *, const char *))p;
        if (!g_real_dlsym) return NULL;
    }
    return g_real_dlsym(h, name);
}

static const char *const krex_sonames[KREX_N_APIS][4] = {
    {"libcudart.so.13", "libcudart.so.12", "libcudart.so", NULL},
    {"libcuda.so.1", "libcuda.so", NULL, NULL},
    {"libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6", NULL},
};

/* Find `name` in an already-loaded vendor library; never loads one. */
static void *vendor_sym(int api, const char *name) {
    for (int i = 0; krex_sonames[api][i]; i++) {
        void *h = dlopen(krex_sonames[api][i], RTLD_LAZY | RTLD_NOLOAD);
        if (!h) continue;
        void *p = real_dlsym(h, name);
        dlclose(h);
        if (p) return p;
    }
    return NULL;
}

static int is_own_wrapper(void *p);

/* Resolve slot 0 (the exported wrapper's target) by name. */
static void *krex_resolve(int id, int k) {
    if (k != 0) return NULL; /* other slots are only ever bound, never resolved */
    const struct krex_entry *e = &krex_entries[id];
    void *p = real_dlsym(RTLD_NEXT, e->name);
    if (!p || is_own_wrapper(p)) p = vendor_sym(e->api, e->name);
    if (!p || is_own_wrapper(p)) {
        set_flag(KREX_PF_NO_REAL);
        klog("no real %s found", e->name);
        return NULL;
    }
    void *expect = NULL;
    if (!__atomic_compare_exchange_n(&krex_real[id][0], &expect, p, 0, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE))
        return expect;
    return p;
}

/* ---------------------------------------------------------------- wrappers */

#define KREX_GET_FN(name, k)                                                           \
    krex_fn_##name fn = (krex_fn_##name)__atomic_load_n(&krex_real[KREX_ID_##name][k], \
                                                         __ATOMIC_ACQUIRE);            \
    if (UNLIKELY(!fn)) fn = (krex_fn_##name)krex_resolve(KREX_ID_##name, k);           \
    if (UNLIKELY(!fn)) return KREX_NOTFOUND;

#define KREX_GATED(fname, name, k, cls, params, args) \
    KREX_RET fname params {                           \
        KREX_GET_FN(name, k)                          \
        int krex_counted = krex_enter(cls);           \
        KREX_RET krex_rc = fn args;                   \
        krex_leave(krex_counted);                     \
        return krex_rc;                               \
    }
#define KREX_BODY_KERNEL(f, n, k, p, a) KREX_GATED(f, n, k, KREX_CLS_KERNEL, p, a)
#define KREX_BODY_COPY(f, n, k, p, a) KREX_GATED(f, n, k, KREX_CLS_COPY, p, a)
#define KREX_BODY_MEMSET(f, n, k, p, a) KREX_GATED(f, n, k, KREX_CLS_MEMSET, p, a)
#define KREX_BODY_GRAPH(f, n, k, p, a) KREX_GATED(f, n, k, KREX_CLS_GRAPH, p, a)
#define KREX_BODY_PREFETCH(f, n, k, p, a) KREX_GATED(f, n, k, KREX_CLS_PREFETCH, p, a)

static void *krex_redirect(int lookup_id, const char *symbol, void *realp, uint64_t flags);
static void krex_ctx_add(void *ctx);
static void krex_ctx_del(void *ctx);

/* Lookups are not gated: call the real one, then swap in our wrapper. */
#define KREX_BODY_LOOKUP(fname, name, k, params, args)                          \
    KREX_RET fname params {                                                     \
        KREX_GET_FN(name, k)                                                    \
        KREX_RET krex_rc = fn args;                                             \
        if (krex_rc == 0 && pfn && *pfn)                                        \
            *pfn = krex_redirect(KREX_ID_##name, symbol, *pfn, (uint64_t)flags); \
        return krex_rc;                                                         \
    }
/* Contexts are tracked so the drain helper can synchronise non-primary ones. */
#define KREX_BODY_CTXNEW(fname, name, k, params, args)                \
    KREX_RET fname params {                                           \
        KREX_GET_FN(name, k)                                          \
        KREX_RET krex_rc = fn args;                                   \
        if (krex_rc == 0 && pctx) krex_ctx_add((void *)*pctx);        \
        return krex_rc;                                               \
    }
#define KREX_BODY_CTXDEL(fname, name, k, params, args) \
    KREX_RET fname params {                            \
        KREX_GET_FN(name, k)                           \
        krex_ctx_del((void *)ctx);                     \
        return fn args;                                \
    }

/* Graph captures are counted so the drain helper never synchronises a context
 * while one of this process's streams is capturing (that would invalidate it). */
static uint32_t g_captures;
static void krex_capture_note(int delta) {
    if (delta > 0) __atomic_add_fetch(&g_captures, 1, __ATOMIC_SEQ_CST);
    else if (__atomic_load_n(&g_captures, __ATOMIC_SEQ_CST) > 0) __atomic_sub_fetch(&g_captures, 1, __ATOMIC_SEQ_CST);
    if (g_proc) __atomic_store_n(&g_proc->captures, __atomic_load_n(&g_captures, __ATOMIC_SEQ_CST), __ATOMIC_RELAXED);
}
#define KREX_BODY_CAPBEGIN(fname, name, k, params, args) \
    KREX_RET fname params {                              \
        KREX_GET_FN(name, k)                             \
        KREX_RET krex_rc = fn args;                      \
        if (krex_rc == 0) krex_capture_note(1);          \
        return krex_rc;                                  \
    }
#define KREX_BODY_CAPEND(fname, name, k, params, args)                            \
    KREX_RET fname params {                                                       \
        KREX_GET_FN(name, k)                                                      \
        KREX_RET krex_rc = fn args;                                               \
        if (krex_rc == 0 || krex_rc == KREX_ERR_CAPTURE_INVALIDATED) krex_capture_note(-1); \
        return krex_rc;                                                           \
    }

#define X(name, lookup, variant, cls, params, args, stream, cost, sample) \
    typedef KREX_RET(*krex_fn_##name) params;                             \
    KREX_EXPORT KREX_BODY_##cls(name, name, 0, params, args)              \
    static KREX_BODY_##cls(krex_w1_##name, name, 1, params, args)         \
    static KREX_BODY_##cls(krex_w2_##name, name, 2, params, args)         \
    static KREX_BODY_##cls(krex_w3_##name, name, 3, params, args)

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

static void *const krex_wrappers[KREX_N_IDS][KREX_NSLOT] = {
#define X(name, ...) \
    [KREX_ID_##name] = {(void *)name, (void *)krex_w1_##name, (void *)krex_w2_##name, (void *)krex_w3_##name},
#include "api_cudart.def"
#include "api_driver.def"
#include "api_hip.def"
#undef X
};

static int is_own_wrapper(void *p) {
    /* Slow path only (dlsym / lookups): a linear scan is fine. */
    for (int i = 0; i < KREX_N_IDS; i++)
        for (int k = 0; k < KREX_NSLOT; k++)
            if (krex_wrappers[i][k] == p) return 1;
    return 0;
}

/* Bind `realp` to a wrapper of entry `id`: reuse the slot that already holds it
 * or claim an empty one. If all slots hold other pointers the call escapes the
 * gate; that is flagged, never silent. */
static void *krex_bind(int id, void *realp) {
    if (is_own_wrapper(realp)) return realp;
    for (int k = 0; k < KREX_NSLOT; k++) {
        void *cur = __atomic_load_n(&krex_real[id][k], __ATOMIC_ACQUIRE);
        if (cur == NULL && k == 0) cur = krex_resolve(id, 0);
        if (cur == realp) return krex_wrappers[id][k];
        if (cur == NULL) {
            void *expect = NULL;
            if (__atomic_compare_exchange_n(&krex_real[id][k], &expect, realp, 0, __ATOMIC_ACQ_REL,
                                            __ATOMIC_ACQUIRE) ||
                expect == realp)
                return krex_wrappers[id][k];
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

static int krex_find(const char *name) {
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
    if (g_mode == MODE_OFF || !symbol || is_own_wrapper(realp)) return realp;
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

KREX_EXPORT void *dlsym(void *handle, const char *name) {
    void *p;
    if (handle == RTLD_NEXT) {
        /* RTLD_NEXT is relative to the caller, which real dlsym would take to be
         * us: search the objects loaded after the caller ourselves. */
        Dl_info info;
        struct link_map *lm = NULL;
        p = NULL;
        if (dladdr1(__builtin_return_address(0), &info, (void **)&lm, RTLD_DL_LINKMAP) && lm) {
            for (struct link_map *l = lm->l_next; l && !p; l = l->l_next) {
                if (!l->l_name || !l->l_name[0]) continue;
                void *h = dlopen(l->l_name, RTLD_LAZY | RTLD_NOLOAD);
                if (!h) continue;
                p = real_dlsym(h, name);
                dlclose(h);
            }
        }
    } else {
        p = real_dlsym(handle, name);
    }
    if (!p || g_mode == MODE_OFF) return p;
    int id = krex_find(name);
    return id < 0 ? p : krex_bind(id, p);
}

/* ------------------------------------------------------------ drain helper */

#define KREX_MAX_CTX 32
static void *g_ctxs[KREX_MAX_CTX];

static void krex_ctx_add(void *ctx) {
    for (int i = 0; i < KREX_MAX_CTX; i++) {
        void *expect = NULL;
        if (__atomic_compare_exchange_n(&g_ctxs[i], &expect, ctx, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            return;
    }
}

static void krex_ctx_del(void *ctx) {
    for (int i = 0; i < KREX_MAX_CTX; i++) {
        void *expect = ctx;
        __atomic_compare_exchange_n(&g_ctxs[i], &expect, NULL, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    }
}

typedef CUresult (*fn_i_p)(void *);
typedef CUresult (*fn_dev_state)(CUdevice, unsigned int *, int *);
typedef CUresult (*fn_retain)(CUcontext *, CUdevice);
typedef CUresult (*fn_release)(CUdevice);
typedef CUresult (*fn_void)(void);
typedef CUresult (*fn_setdev)(int);

/* Synchronise the CUDA contexts this process already has; never create one. */
static void drain_cuda(void) {
    fn_i_p count = (fn_i_p)vendor_sym(KREX_API_DRIVER, "cuDeviceGetCount");
    fn_dev_state state = (fn_dev_state)vendor_sym(KREX_API_DRIVER, "cuDevicePrimaryCtxGetState");
    fn_retain retain = (fn_retain)vendor_sym(KREX_API_DRIVER, "cuDevicePrimaryCtxRetain");
    fn_release release = (fn_release)vendor_sym(KREX_API_DRIVER, "cuDevicePrimaryCtxRelease_v2");
    fn_i_p push = (fn_i_p)vendor_sym(KREX_API_DRIVER, "cuCtxPushCurrent_v2");
    fn_i_p pop = (fn_i_p)vendor_sym(KREX_API_DRIVER, "cuCtxPopCurrent_v2");
    fn_void sync = (fn_void)vendor_sym(KREX_API_DRIVER, "cuCtxSynchronize");
    if (!count || !state || !retain || !release || !push || !pop || !sync) return;
    int n = 0;
    if (count(&n) != CUDA_SUCCESS) return;
    for (int d = 0; d < n; d++) {
        unsigned int fl = 0;
        int active = 0;
        if (state(d, &fl, &active) != CUDA_SUCCESS || !active) continue;
        CUcontext ctx = NULL;
        if (retain(&ctx, d) != CUDA_SUCCESS) continue;
        if (push(ctx) == CUDA_SUCCESS) {
            sync();
            CUcontext old;
            pop(&old);
        }
        release(d);
    }
    for (int i = 0; i < KREX_MAX_CTX; i++) {
        void *ctx = __atomic_load_n(&g_ctxs[i], __ATOMIC_ACQUIRE);
        if (!ctx || push(ctx) != CUDA_SUCCESS) continue;
        sync();
        CUcontext old;
        pop(&old);
    }
}

static void drain_hip(void) {
    fn_i_p count = (fn_i_p)vendor_sym(KREX_API_HIP, "hipGetDeviceCount");
    fn_dev_state state = (fn_dev_state)vendor_sym(KREX_API_HIP, "hipDevicePrimaryCtxGetState");
    fn_setdev setdev = (fn_setdev)vendor_sym(KREX_API_HIP, "hipSetDevice");
    fn_void sync = (fn_void)vendor_sym(KREX_API_HIP, "hipDeviceSynchronize");
    if (!count || !state || !setdev || !sync) return;
    int n = 0;
    if (count(&n) != hipSuccess) return;
    for (int d = 0; d < n; d++) {
        unsigned int fl = 0;
        int active = 0;
        if (state(d, &fl, &active) != hipSuccess || !active) continue;
        if (setdev(d) == hipSuccess) sync();
    }
}

static void *krex_helper(void *arg) {
    (void)arg;
    prctl(PR_SET_NAME, "krex-drain", 0, 0, 0);
    /* Relaxed capture mode on this thread: a context synchronise here must not
     * invalidate a graph another thread is capturing (DESIGN.md consequence 7). */
    typedef CUresult (*fn_xmode)(CUstreamCaptureMode *);
    fn_xmode xmode = (fn_xmode)vendor_sym(KREX_API_DRIVER, "cuThreadExchangeStreamCaptureMode");
    if (xmode) {
        CUstreamCaptureMode m = CU_STREAM_CAPTURE_MODE_RELAXED;
        xmode(&m);
    }
    struct krex_gpu *g = &g_shm->gpus[g_gpu];
    struct krex_proc *p = g_proc;
    uint32_t seen = __atomic_load_n(&p->drain_ack, __ATOMIC_SEQ_CST);
    for (;;) {
        uint32_t cur = __atomic_load_n(&g->drain_seq, __ATOMIC_SEQ_CST);
        if (cur == seen) {
            krex_futex_wait(&g->drain_seq, cur, 1000ull * 1000 * 1000);
            continue;
        }
        /* A context synchronise would invalidate a capture in progress: give
         * the capture a moment to end, else ack as partial so the controller
         * marks the grant contaminated instead of silently clean. */
        uint64_t t0 = krex_now_ns();
        while (__atomic_load_n(&g_captures, __ATOMIC_SEQ_CST) > 0 && krex_now_ns() - t0 < 100000000ull)
            usleep(1000);
        if (__atomic_load_n(&g_captures, __ATOMIC_SEQ_CST) > 0) {
            __atomic_store_n(&p->drain_partial, cur, __ATOMIC_SEQ_CST);
            __atomic_or_fetch(&p->flags, KREX_PF_DRAIN_PARTIAL, __ATOMIC_RELAXED);
        } else {
            drain_cuda();
            drain_hip();
        }
        __atomic_fetch_add(&p->drains, 1, __ATOMIC_RELAXED);
        __atomic_store_n(&p->drain_ack, cur, __ATOMIC_SEQ_CST);
        seen = cur;
    }
    return NULL;
}

static void start_helper(void) {
    sigset_t all, old;
    sigfillset(&all);
    /* The helper inherits a full mask, so process signals go to app threads. */
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_t t;
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&a, 256 * 1024);
    if (pthread_create(&t, &a, krex_helper, NULL) == 0) g_helper_started = 1;
    else set_flag(KREX_PF_HELPER_FAILED);
    pthread_attr_destroy(&a);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

/* ------------------------------------------------------------ krexd client */

/* One JSON line each way over the daemon's Unix socket. The daemon learns who
 * we are from SO_PEERCRED; the message carries only what it cannot know. */
static int conn_open(void) {
    if (g_conn >= 0) return 0;
    if (!g_sock_path[0]) return -1;
    for (int attempt = 0; attempt < 100; attempt++) {
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) return -1;
        struct sockaddr_un a;
        memset(&a, 0, sizeof a);
        a.sun_family = AF_UNIX;
        memcpy(a.sun_path, g_sock_path, strlen(g_sock_path) + 1); /* length checked at init */
        if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0) {
            g_conn = fd;
            return 0;
        }
        int e = errno;
        close(fd);
        if (e != ENOENT && e != ECONNREFUSED) return -1;
        if (attempt == 0 && g_daemon_cmd[0]) {
            /* Nobody listens: start krexd on demand, in its own session. */
            posix_spawnattr_t at;
            posix_spawnattr_init(&at);
            posix_spawnattr_setflags(&at, POSIX_SPAWN_SETSID);
            char *argv[] = {"/bin/sh", "-c", g_daemon_cmd, NULL};
            pid_t pid;
            posix_spawn(&pid, "/bin/sh", NULL, &at, argv, environ);
            posix_spawnattr_destroy(&at);
            klog("started krexd: %s", g_daemon_cmd);
        }
        if (!g_daemon_cmd[0]) return -1;
        usleep(100000);
    }
    return -1;
}

/* Send a request and read one reply line into buf (events are skipped). */
static int conn_call(const char *req, char *buf, size_t n) {
    if (conn_open() != 0) return -1;
    size_t len = strlen(req);
    if (write(g_conn, req, len) != (ssize_t)len) goto broken;
    for (;;) {
        size_t got = 0;
        while (got + 1 < n) {
            ssize_t r = read(g_conn, buf + got, 1);
            if (r <= 0) goto broken;
            if (buf[got] == '\n') break;
            got++;
        }
        buf[got] = 0;
        if (!strstr(buf, "\"event\"")) return 0;
    }
broken:
    close(g_conn);
    g_conn = -1;
    return -1;
}

static int json_int(const char *buf, const char *key, int *out) {
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = strstr(buf, pat);
    if (!p) return -1;
    return sscanf(p + strlen(pat), "%d", out) == 1 ? 0 : -1;
}

static int first_visible_gpu(void) {
    return g_gpu >= 0 ? g_gpu : 0;
}

/* Opt-in processes (krex env, no KREX_SLOT) ask krexd for a slot on first use. */
static int krex_self_register(void) {
    char req[128], rep[4096];
    snprintf(req, sizeof req, "{\"op\":\"register\",\"gpu\":%d}\n", first_visible_gpu());
    pthread_mutex_lock(&g_conn_lock);
    int rc = conn_call(req, rep, sizeof rep);
    pthread_mutex_unlock(&g_conn_lock);
    if (rc != 0 || !strstr(rep, "\"ok\":true")) return -1;
    int slot = -1, gpu = -1;
    if (json_int(rep, "slot", &slot) != 0 || json_int(rep, "gpu", &gpu) != 0) return -1;
    g_slot = slot;
    g_gpu = gpu;
    return 0;
}

/* The C/C++ region markers (krex.h) resolve these at run time. 0 = granted or
 * not under KREX; negative = refused. A nested begin on the same thread is a no-op. */
KREX_EXPORT int krex_region_begin(void) {
    if (g_mode == MODE_OFF || !g_sock_path[0]) return 0;
    if (t_region_depth++ > 0) return 0;
    char req[160], rep[8192];
    snprintf(req, sizeof req, "{\"op\":\"begin\",\"tid\":%ld,\"gpu\":%d}\n", (long)syscall(SYS_gettid),
             first_visible_gpu());
    pthread_mutex_lock(&g_conn_lock);
    int rc = conn_call(req, rep, sizeof rep);
    pthread_mutex_unlock(&g_conn_lock);
    if (rc != 0 || !strstr(rep, "\"ok\":true")) {
        t_region_depth = 0;
        klog("region refused: %s", rc ? "no daemon" : rep);
        return -EIO;
    }
    return 0;
}

KREX_EXPORT int krex_region_end(void) {
    if (g_mode == MODE_OFF || !g_sock_path[0]) return 0;
    if (t_region_depth <= 0) return -EINVAL;
    if (--t_region_depth > 0) return 0;
    char rep[8192];
    pthread_mutex_lock(&g_conn_lock);
    int rc = conn_call("{\"op\":\"end\"}\n", rep, sizeof rep);
    pthread_mutex_unlock(&g_conn_lock);
    return rc == 0 && strstr(rep, "\"ok\":true") ? 0 : -EIO;
}

/* ------------------------------------------------------------ registration */

static int krex_self_register(void);

static int krex_register(void) {
    pthread_mutex_lock(&g_reg_lock);
    if (g_fast.gate || g_mode == MODE_OFF) goto out;
    /* Self-registration first: it may have to start krexd, which creates the segment. */
    if (g_slot < 0 && krex_self_register() != 0) {
        klog("self-registration with krexd failed; passing through");
        g_mode = MODE_OFF;
        goto out;
    }
    if (!g_shm) {
        int err = 0;
        g_shm = krex_shm_open(g_shm_name, 0, 0, &err);
        if (!g_shm) {
            klog("cannot attach %s (%s); passing through", g_shm_name, strerror(err));
            g_mode = MODE_OFF;
            goto out;
        }
    }
    if (g_slot < 0 || g_slot >= KREX_MAX_SLOTS) {
        g_mode = MODE_OFF;
        goto out;
    }
    if (g_gpu < 0) g_gpu = g_shm->slots[g_slot].gpu;
    if (g_gpu < 0 || g_gpu >= KREX_MAX_GPUS) g_gpu = 0;
    int idx = krex_proc_register(g_shm, g_slot, g_gpu, (int64_t)getpid());
    if (idx >= 0) {
        g_proc = &g_shm->procs[idx];
        g_proc->flags |= g_pending_flags;
        g_fast.inflight = &g_proc->inflight;
        g_fast.submits = g_proc->submits;
        __atomic_store_n(&g_proc->has_ctx, 1, __ATOMIC_SEQ_CST);
    } else {
        /* No record left: still gated, through the slot's shared counter. */
        g_fast.inflight = &g_shm->slots[g_slot].inflight;
        g_fast.submits = g_local_submits;
    }
    g_fast.owner_byte = (uint32_t)g_slot + 1;
    __atomic_store_n(&g_fast.gate, &g_shm->gpus[g_gpu].gate, __ATOMIC_RELEASE);
    if (g_proc && !g_helper_started) start_helper();
    klog("registered: slot %d gpu %d record %d", g_slot, g_gpu, idx);
out:
    pthread_mutex_unlock(&g_reg_lock);
    return g_fast.gate != NULL;
}

static void atfork_child(void) {
    /* The child is a new process: re-register (own record, own helper) lazily. */
    pthread_mutex_init(&g_reg_lock, NULL);
    g_fast.gate = NULL;
    g_proc = NULL;
    g_helper_started = 0;
    g_failed_gate = 0;
    g_captures = 0;
    g_conn = -1; /* the parent's socket stays the parent's */
    pthread_mutex_init(&g_conn_lock, NULL);
    t_region_depth = 0;
    for (int i = 0; i < KREX_MAX_CTX; i++) g_ctxs[i] = NULL;
}

static int parse_int(const char *s, int *out) {
    if (!s || !*s) return 0;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < 0 || v > 1 << 20) return 0;
    *out = (int)v;
    return 1;
}

__attribute__((constructor)) static void krex_init(void) {
    for (int i = 0; i < KREX_N_IDS; i++)
        if (krex_entries[i].name) g_sorted[g_nsorted++] = i;
    qsort(g_sorted, (size_t)g_nsorted, sizeof(int), cmp_ids);
    const char *lg = getenv("KREX_LOG");
    g_log = lg && *lg && strcmp(lg, "0") != 0;
    const char *name = getenv("KREX_SHM");
    const char *slot = getenv("KREX_SLOT");
    if (!name || !*name || strlen(name) >= sizeof g_shm_name) return;
    const char *sock = getenv("KREX_SOCKET");
    if (sock && strlen(sock) < sizeof g_sock_path) strcpy(g_sock_path, sock);
    const char *dcmd = getenv("KREX_DAEMON_CMD");
    if (dcmd && strlen(dcmd) < sizeof g_daemon_cmd) strcpy(g_daemon_cmd, dcmd);
    if (slot && *slot && !parse_int(slot, &g_slot)) {
        klog("KREX_SLOT=%s is not a slot number; passing through", slot);
        return;
    }
    if (!slot || !*slot) {
        g_slot = -1;
        if (!g_sock_path[0]) {
            klog("KREX_SHM set without KREX_SLOT or KREX_SOCKET; passing through");
            return;
        }
    }
    if (!parse_int(getenv("KREX_GPU"), &g_gpu)) {
        /* An opt-in process names its GPU through CUDA_VISIBLE_DEVICES. */
        const char *vis = getenv("CUDA_VISIBLE_DEVICES");
        if (!vis || !parse_int(vis, &g_gpu)) g_gpu = -1;
    }
    strcpy(g_shm_name, name);
    pthread_atfork(NULL, NULL, atfork_child);
    g_mode = MODE_ON;
}

/* Exposed for tests and `krex doctor`: is this process under KREX? */
KREX_EXPORT int krex_shim_active(void) { return g_mode == MODE_ON; }
KREX_EXPORT int krex_shim_registered(void) { return g_fast.gate != NULL; }
KREX_EXPORT int krex_shim_helper_running(void) { return g_helper_started; }
