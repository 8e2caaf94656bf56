/* One simulated vendor library, built three times: -DSIM_API=0 libcudart.so.13,
 * 1 libcuda.so.1, 2 libamdhip64.so. The table's entries are generated; the few
 * functions that only order or wait (synchronise, events, devices) are written
 * out below. Link with -Bsymbolic so &name means this library's function even
 * when the shim interposes the same name. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../krex_tables.h"
#include "sim_samples.h"
#include "simgpu.h"

#define EXPORT __attribute__((visibility("default")))

static int sim_is_sync(const char *name, int cls) {
    return (cls == KREX_CLS_COPY || cls == KREX_CLS_MEMSET) && !strstr(name, "Async");
}

/* 1-D copies and memsets (the tables' chunk column) move real bytes when
 * KREX_SIM_MOVE_BYTES=1: "device" memory is host memory here, so a test can check
 * that a call split into chunks leaves the same bytes as one call. Off by default:
 * the tables' samples pass sizes larger than their buffers. */
#define SIM_MOVE_NONE()
#define SIM_MOVE_COPY(cnt, esz, val, dst, src) \
    if (simgpu_moves_bytes()) memmove((void *)(uintptr_t)(dst), (const void *)(uintptr_t)(src), (size_t)(cnt));
#define SIM_MOVE_SET(cnt, esz, val, dst) \
    if (simgpu_moves_bytes()) sim_fill((void *)(uintptr_t)(dst), (uint32_t)(val), esz, (size_t)(cnt));
static inline void sim_fill(void *dst, uint32_t v, int esz, size_t n) {
    if (esz == 1) memset(dst, (int)(v & 0xff), n);
    else if (esz == 2) for (size_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = (uint16_t)v;
    else for (size_t i = 0; i < n; i++) ((uint32_t *)dst)[i] = v;
}
#define SIM_MOVE(kind, spec) SIM_MOVE_##kind spec

#define SIM_GATED(name, cls, params, args, stream, cost, ck)                                   \
    EXPORT SIM_RET name params {                                                               \
        int sim_rc = simgpu_gated_rc();                                                        \
        if (sim_rc == 0) { KREX_CALL(SIM_MOVE, KREX_UNPAREN ck) }                              \
        simgpu_submit(#name, cls, (const void *)(stream), (uint64_t)(cost), KREX_HASH_ARGS args, \
                      sim_is_sync(#name, cls));                                                \
        return (SIM_RET)sim_rc;                                                                \
    }
#define SIM_BODY_KERNEL(n, p, a, s, c, ck) SIM_GATED(n, KREX_CLS_KERNEL, p, a, s, c, ck)
#define SIM_BODY_COPY(n, p, a, s, c, ck) SIM_GATED(n, KREX_CLS_COPY, p, a, s, c, ck)
#define SIM_BODY_MEMSET(n, p, a, s, c, ck) SIM_GATED(n, KREX_CLS_MEMSET, p, a, s, c, ck)
#define SIM_BODY_GRAPH(n, p, a, s, c, ck) SIM_GATED(n, KREX_CLS_GRAPH, p, a, s, c, ck)
#define SIM_BODY_PREFETCH(n, p, a, s, c, ck) SIM_GATED(n, KREX_CLS_PREFETCH, p, a, s, c, ck)
/* The runtime's first LIFE call on a device makes its primary context. With the driver lock
 * modelled (KREX_SIM_CTX_MS), through the driver's retain, as the real runtime does: a call it
 * looks up, so a preloaded shim sees it, nested inside the runtime's call. */
typedef int (*sim_retain_fn)(void **, int);
static inline void sim_rt_context(int dev) {
    if (simgpu_ctx_ms() <= 0 || simgpu_ctx_active(dev)) return;
    sim_retain_fn retain = (sim_retain_fn)dlsym(RTLD_DEFAULT, "cuDevicePrimaryCtxRetain");
    void *ctx = NULL;
    if (retain) retain(&ctx, dev);
}
/* A LIFE call occupies the GPU (SIM_LIFE_NS, like a context or module load on a real one),
 * and returns once that is done, as the real ones do (but the stream-ordered allocators),
 * then does what the call does: sim_life_<name>, written out below for every LIFE row (a
 * row without one does not link). */
#define SIM_BODY_LIFE(n, p, a, s, c, ck)                                                           \
    static SIM_RET sim_life_##n p;                                                                 \
    EXPORT SIM_RET n p {                                                                           \
        if (SIM_API == 0) sim_rt_context(simgpu_get_device());                                     \
        int sim_rc = simgpu_gated_rc();                                                            \
        uint64_t sim_ns = (uint64_t)(c);                                                           \
        simgpu_submit(#n, KREX_CLS_LIFE, (const void *)(s), sim_ns, KREX_HASH_ARGS a,              \
                      sim_ns && !strstr(#n, "Async"));                                             \
        if (strstr(#n, "ModuleLoad")) simgpu_life_host_time(); /* a JIT's host time */          \
        return sim_rc ? (SIM_RET)sim_rc : sim_life_##n a;                                       \
    }
#define SIM_BODY_LOOKUP(n, p, a, s, c, ck) \
    EXPORT SIM_RET n p { return (SIM_RET)sim_lookup(symbol, pfn, (uint64_t)flags); }
#define SIM_BODY_CTXNEW(n, p, a, s, c, ck)                                 \
    EXPORT SIM_RET n p {                                               \
        static char fake_ctx[KREX_MAX_GPUS];                           \
        simgpu_submit(#n, KREX_CLS_LIFE, NULL, SIM_LIFE_NS, 0, 0);     \
        if (pctx) *pctx = (CUcontext)(void *)&fake_ctx[0];             \
        simgpu_ctx_activate(0);                                        \
        return (SIM_RET)simgpu_rc();                                   \
    }
/* Green contexts: made and destroyed as a LIFE call is (sim_life_<name>, below); a conversion
 * only answers (sim_do_<name>). */
#define SIM_BODY_GREENNEW(n, p, a, s, c, ck) SIM_BODY_LIFE(n, p, a, s, c, ck)
#define SIM_BODY_GREENDEL(n, p, a, s, c, ck) SIM_BODY_LIFE(n, p, a, s, c, ck)
#define SIM_BODY_GREENCTX(n, p, a, s, c, ck) \
    static SIM_RET sim_do_##n p;             \
    EXPORT SIM_RET n p { return sim_do_##n a; }
#define SIM_BODY_CAPBEGIN(n, p, a, s, c, ck) \
    EXPORT SIM_RET n p { return (SIM_RET)simgpu_rc(); }
#define SIM_BODY_CAPEND(n, p, a, s, c, ck) \
    EXPORT SIM_RET n p { return (SIM_RET)simgpu_rc(); }
#define SIM_BODY_CTXDEL(n, p, a, s, c, ck)                             \
    EXPORT SIM_RET n p {                                           \
        (void)ctx;                                                 \
        simgpu_submit(#n, KREX_CLS_LIFE, NULL, SIM_LIFE_NS, 0, 0); \
        return (SIM_RET)simgpu_rc();                               \
    }

#if SIM_API == 0
#define SIM_RET cudaError_t
#define SIM_TABLE "../api_cudart.def"
#define SIM_FIRST 0
#define SIM_LAST KREX_ID__END_CUDART
#elif SIM_API == 1
#define SIM_RET CUresult
#define SIM_TABLE "../api_driver.def"
#define SIM_FIRST (KREX_ID__END_CUDART + 1)
#define SIM_LAST KREX_ID__END_DRIVER
#else
#define SIM_RET hipError_t
#define SIM_TABLE "../api_hip.def"
#define SIM_FIRST (KREX_ID__END_DRIVER + 1)
#define SIM_LAST KREX_ID__END_HIP
#endif

static int sim_lookup(const char *symbol, void **pfn, uint64_t flags);

#define X(name, lookup, variant, cls, params, args, stream, cost, sample, chunk) \
    SIM_BODY_##cls(name, params, args, stream, cost, (KREX_CK_##chunk))
#include SIM_TABLE
#undef X

/* This library's own functions, by entry id. -Bsymbolic makes these addresses ours. */
static void *const sim_fns[KREX_N_IDS] = {
#define X(name, ...) [KREX_ID_##name] = (void *)name,
#include SIM_TABLE
#undef X
};

static int version_of(const char *name) {
    const char *v = strstr(name, "_v");
    return v ? atoi(v + 2) : 1;
}

/* What a vendor GetProcAddress does: pick the variant by flags and version. */
__attribute__((unused)) static int sim_table_lookup(const char *symbol, void **pfn, uint64_t flags) {
    int best = -1, want_pt = (flags & 2) != 0;
    for (int i = SIM_FIRST; i < SIM_LAST; i++) {
        const struct krex_entry *e = &krex_entries[i];
        if (strcmp(e->lookup, symbol) != 0 || e->variant == KREX_VAR_V1) continue;
        if ((e->variant == KREX_VAR_PT) != want_pt) continue;
        if (best < 0 || version_of(e->name) > version_of(krex_entries[best].name)) best = i;
    }
    if (best < 0) {
        /* Not in the table (e.g. a synchronise call): plain dynamic lookup. */
        void *p = dlsym(RTLD_DEFAULT, symbol);
        if (!p) return 500; /* CUDA_ERROR_NOT_FOUND */
        *pfn = p;
        return 0;
    }
    *pfn = sim_fns[best];
    return 0;
}

/* ----------------------------------------------------------- CUDA runtime */
#if SIM_API == 0
int simgpu_cu_gpa(const char *symbol, void **pfn, uint64_t flags); /* from sim libcuda */

static int sim_lookup(const char *symbol, void **pfn, uint64_t flags) {
    /* cudaGetDriverEntryPoint hands out *driver* functions, via the driver. */
    if (!pfn || !symbol) return 1;
    return simgpu_cu_gpa(symbol, pfn, flags) == 0 ? 0 : 500;
}

struct sim_event { uint64_t t; };
EXPORT cudaError_t cudaGetDeviceCount(int *n) { *n = simgpu_device_count(); return 0; }
EXPORT cudaError_t cudaGetDevice(int *d) { *d = simgpu_get_device(); return 0; }
/* The LIFE rows' effects ("device" memory is host memory here). */
static cudaError_t sim_alloc(void **p, size_t n) {
    simgpu_ctx_activate(simgpu_get_device());
    if (!p) return 1;
    *p = simgpu_alloc(n ? n : 1);
    return *p ? 0 : 2;
}
static cudaError_t sim_life_cudaSetDevice(int d) { return simgpu_set_device(d); }
static cudaError_t sim_life_cudaInitDevice(int d, unsigned int df, unsigned int f) {
    int rc = simgpu_set_device(d);
    if (!rc) simgpu_ctx_activate(d);
    return rc;
}
static cudaError_t sim_life_cudaMalloc(void **p, size_t n) { return sim_alloc(p, n); }
static cudaError_t sim_life_cudaMallocManaged(void **p, size_t n, unsigned int f) { return sim_alloc(p, n); }
static cudaError_t sim_life_cudaMallocPitch(void **p, size_t *pitch, size_t w, size_t h) {
    if (pitch) *pitch = w;
    return sim_alloc(p, w * h);
}
static cudaError_t sim_life_cudaFree(void *p) { simgpu_free(p); return 0; }
static cudaError_t sim_life_cudaMallocAsync(void **p, size_t n, cudaStream_t s) { return sim_alloc(p, n); }
static cudaError_t sim_life_cudaMallocAsync_ptsz(void **p, size_t n, cudaStream_t s) { return sim_alloc(p, n); }
static cudaError_t sim_life_cudaMallocFromPoolAsync(void **p, size_t n, cudaMemPool_t m, cudaStream_t s) {
    return sim_alloc(p, n);
}
static cudaError_t sim_life_cudaMallocFromPoolAsync_ptsz(void **p, size_t n, cudaMemPool_t m, cudaStream_t s) {
    return sim_alloc(p, n);
}
static cudaError_t sim_life_cudaMalloc3D(struct cudaPitchedPtr *p, struct cudaExtent e) {
    if (!p) return 1;
    size_t n = e.width * (e.height ? e.height : 1) * (e.depth ? e.depth : 1);
    void *d = NULL;
    cudaError_t rc = sim_alloc(&d, n);
    *p = (struct cudaPitchedPtr){d, e.width, e.width, e.height};
    return rc;
}
static cudaError_t sim_life_cudaFreeArray(cudaArray_t a) { return 0; } /* arrays are never made here */
static cudaError_t sim_life_cudaMemPoolTrimTo(cudaMemPool_t m, size_t keep) { return 0; }
static cudaError_t sim_life_cudaFreeAsync(void *p, cudaStream_t s) { simgpu_free(p); return 0; }
static cudaError_t sim_life_cudaFreeAsync_ptsz(void *p, cudaStream_t s) { simgpu_free(p); return 0; }
EXPORT cudaError_t cudaDeviceSynchronize(void) { simgpu_sync_all("cudaDeviceSynchronize"); return 0; }
EXPORT cudaError_t cudaStreamSynchronize(cudaStream_t s) { simgpu_sync_stream(s); return 0; }
EXPORT cudaError_t cudaStreamCreate(cudaStream_t *s) {
    static uintptr_t next = 0x6000;
    *s = (cudaStream_t)__atomic_add_fetch(&next, 16, __ATOMIC_RELAXED);
    return 0;
}
EXPORT cudaError_t cudaStreamDestroy(cudaStream_t s) { (void)s; return 0; }
EXPORT cudaError_t cudaEventCreate(void **e) { *e = calloc(1, sizeof(struct sim_event)); return 0; }
EXPORT cudaError_t cudaEventDestroy(void *e) { free(e); return 0; }
EXPORT cudaError_t cudaEventRecord(void *e, cudaStream_t s) {
    /* The GPU stamps an event when the work queued before it has finished. */
    uint64_t now = simgpu_now(), tail = simgpu_stream_tail(s);
    ((struct sim_event *)e)->t = tail > now ? tail : now;
    return 0;
}
EXPORT cudaError_t cudaEventSynchronize(void *e) { simgpu_sleep_until(((struct sim_event *)e)->t); return 0; }
EXPORT cudaError_t cudaEventElapsedTime(float *ms, void *a, void *b) {
    *ms = (float)((double)((int64_t)(((struct sim_event *)b)->t - ((struct sim_event *)a)->t)) / 1e6);
    return 0;
}
EXPORT cudaError_t cudaGetLastError(void) { return 0; }
EXPORT const char *cudaGetErrorString(cudaError_t e) { return e ? "simulated error" : "no error"; }
EXPORT cudaError_t cudaRuntimeGetVersion(int *v) { *v = 13000; return 0; }

/* What nvcc's host stubs call, so a real `nvcc -cudart shared` program runs on
 * the simulator: <<<grid, block>>> pushes a configuration, the stub pops it and
 * calls __cudaLaunchKernel (a gated, table-generated entry). */
static __thread struct { dim3 grid, block; size_t shmem; void *stream; } t_cfg;
EXPORT void **__cudaRegisterFatBinary(void *fatbin) { static void *h; (void)fatbin; return &h; }
EXPORT void __cudaRegisterFatBinaryEnd(void **h) { (void)h; }
EXPORT void __cudaUnregisterFatBinary(void **h) { (void)h; }
EXPORT void __cudaRegisterFunction(void **h, const char *hostFun, char *deviceFun, const char *deviceName,
                                   int threadLimit, void *tid, void *bid, dim3 *bDim, dim3 *gDim, int *wSize) {
    (void)h; (void)hostFun; (void)deviceFun; (void)deviceName; (void)threadLimit;
    (void)tid; (void)bid; (void)bDim; (void)gDim; (void)wSize;
}
EXPORT void __cudaRegisterVar(void **h, char *hostVar, char *deviceAddress, const char *deviceName, int ext,
                              size_t size, int constant, int global) {
    (void)h; (void)hostVar; (void)deviceAddress; (void)deviceName; (void)ext; (void)size; (void)constant; (void)global;
}
EXPORT unsigned __cudaPushCallConfiguration(dim3 grid, dim3 block, size_t shmem, void *stream) {
    t_cfg.grid = grid;
    t_cfg.block = block;
    t_cfg.shmem = shmem;
    t_cfg.stream = stream;
    return 0;
}
EXPORT cudaError_t __cudaPopCallConfiguration(dim3 *grid, dim3 *block, size_t *shmem, void *stream) {
    *grid = t_cfg.grid;
    *block = t_cfg.block;
    *shmem = t_cfg.shmem;
    *(void **)stream = t_cfg.stream;
    return 0;
}
EXPORT cudaError_t __cudaGetKernel(cudaKernel_t *k, const void *fn) { *k = (cudaKernel_t)fn; return 0; }
EXPORT cudaError_t cudaDriverGetVersion(int *v) { *v = 13000; return 0; }
#endif

/* ------------------------------------------------------------ CUDA driver */
#if SIM_API == 1
static int sim_lookup(const char *symbol, void **pfn, uint64_t flags) {
    if (!pfn || !symbol) return 1;
    return sim_table_lookup(symbol, pfn, flags);
}
EXPORT int simgpu_cu_gpa(const char *symbol, void **pfn, uint64_t flags) {
    return sim_table_lookup(symbol, pfn, flags);
}

static __thread CUcontext t_ctx_stack[8];
static __thread int t_ctx_depth;
static char g_primary[KREX_MAX_GPUS];

EXPORT CUresult cuInit(unsigned int flags) { (void)flags; return 0; }
EXPORT CUresult cuDriverGetVersion(int *v) { *v = 13000; return 0; }
EXPORT CUresult cuDeviceGetCount(int *n) { *n = simgpu_device_count(); return 0; }
EXPORT CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    if (ordinal < 0 || ordinal >= simgpu_device_count()) return 101;
    *d = ordinal;
    return 0;
}
EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice d, unsigned int *flags, int *active) {
    simgpu_ctx_query();
    *flags = 0;
    *active = simgpu_ctx_active(d);
    return 0;
}
/* The LIFE rows' effects ("device" memory is host memory here). */
static CUresult sim_life_cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice d) {
    if (d < 0 || d >= simgpu_device_count() || !pctx) return 101;
    simgpu_ctx_activate(d); /* retaining creates the context, as on a real GPU */
    *pctx = (CUcontext)(void *)&g_primary[d];
    return 0;
}
static CUresult sim_life_cuDevicePrimaryCtxRelease_v2(CUdevice d) { return 0; }
static CUresult sim_life_cuDevicePrimaryCtxRelease(CUdevice d) { return 0; }
static CUresult sim_life_cuDevicePrimaryCtxReset_v2(CUdevice d) { return 0; }
static CUresult sim_life_cuDevicePrimaryCtxReset(CUdevice d) { return 0; }
static char g_module;
#define SIM_HANDLE(T, out) ((out) ? (*(out) = (T)(void *)&g_module, 0) : 1)
static CUresult sim_life_cuModuleLoad(CUmodule *m, const char *f) { return SIM_HANDLE(CUmodule, m); }
static CUresult sim_life_cuModuleLoadData(CUmodule *m, const void *i) { return SIM_HANDLE(CUmodule, m); }
static CUresult sim_life_cuModuleLoadDataEx(CUmodule *m, const void *i, unsigned int n, CUjit_option *o, void **v) {
    return SIM_HANDLE(CUmodule, m);
}
static CUresult sim_life_cuModuleLoadFatBinary(CUmodule *m, const void *i) { return SIM_HANDLE(CUmodule, m); }
static CUresult sim_life_cuModuleUnload(CUmodule m) { return 0; }
static CUresult sim_life_cuLibraryLoadData(CUlibrary *l, const void *c, CUjit_option *jo, void **jv, unsigned int nj,
                                           CUlibraryOption *lo, void **lv, unsigned int nl) {
    return SIM_HANDLE(CUlibrary, l);
}
static CUresult sim_life_cuLibraryLoadFromFile(CUlibrary *l, const char *f, CUjit_option *jo, void **jv,
                                               unsigned int nj, CUlibraryOption *lo, void **lv, unsigned int nl) {
    return SIM_HANDLE(CUlibrary, l);
}
static CUresult sim_life_cuLibraryUnload(CUlibrary l) { return 0; }
static CUresult sim_alloc(CUdeviceptr *p, size_t n) {
    simgpu_ctx_activate(simgpu_get_device());
    if (!p) return 1;
    *p = (CUdeviceptr)(uintptr_t)simgpu_alloc(n ? n : 1);
    return *p ? 0 : 2;
}
static CUresult sim_life_cuMemAlloc_v2(CUdeviceptr *p, size_t n) { return sim_alloc(p, n); }
static CUresult sim_life_cuMemAlloc(CUdeviceptr_v1 *p, unsigned int n) { /* a legacy 32-bit pointer: made up */
    if (!p) return 1;
    *p = 0x1000;
    return 0;
}
static CUresult sim_life_cuMemAllocPitch_v2(CUdeviceptr *p, size_t *pitch, size_t w, size_t h, unsigned int e) {
    if (pitch) *pitch = w;
    return sim_alloc(p, w * h);
}
static CUresult sim_life_cuMemAllocManaged(CUdeviceptr *p, size_t n, unsigned int f) { return sim_alloc(p, n); }
static CUresult sim_life_cuMemFree_v2(CUdeviceptr p) {
    simgpu_free((void *)(uintptr_t)p);
    return 0;
}
static CUresult sim_life_cuMemFree(CUdeviceptr_v1 p) { return 0; }
static CUresult sim_life_cuMemCreate(CUmemGenericAllocationHandle *h, size_t n, const CUmemAllocationProp *pr,
                                     unsigned long long f) {
    if (!h) return 1;
    *h = 1;
    return 0;
}
static CUresult sim_life_cuMemRelease(CUmemGenericAllocationHandle h) { return 0; }
static CUresult sim_life_cuMemMap(CUdeviceptr p, size_t n, size_t o, CUmemGenericAllocationHandle h,
                                  unsigned long long f) {
    return 0;
}
static CUresult sim_life_cuMemUnmap(CUdeviceptr p, size_t n) { return 0; }
static CUresult sim_life_cuArrayDestroy(CUarray a) { return 0; } /* arrays are never made here */
static CUresult sim_life_cuMemPoolTrimTo(CUmemoryPool m, size_t keep) { return 0; }
static CUresult sim_life_cuMemAllocAsync(CUdeviceptr *p, size_t n, CUstream s) { return sim_alloc(p, n); }
static CUresult sim_life_cuMemAllocAsync_ptsz(CUdeviceptr *p, size_t n, CUstream s) { return sim_alloc(p, n); }
static CUresult sim_life_cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t n, CUmemoryPool m, CUstream s) {
    return sim_alloc(p, n);
}
static CUresult sim_life_cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *p, size_t n, CUmemoryPool m, CUstream s) {
    return sim_alloc(p, n);
}
static CUresult sim_life_cuMemFreeAsync(CUdeviceptr p, CUstream s) { return sim_life_cuMemFree_v2(p); }
static CUresult sim_life_cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { return sim_life_cuMemFree_v2(p); }
static int green_of_ctx(const void *c);
EXPORT CUresult cuCtxPushCurrent_v2(CUcontext c) {
    if (t_ctx_depth >= 8) return 1;
    if (green_of_ctx(c) == -2) return 201; /* a destroyed green context's: CUDA_ERROR_INVALID_CONTEXT */
    /* KREX_SIM_GREEN_PUSH_FAILS=RC: a live green context cannot be made current here (current
     * to another thread: cuda.h lets a green context be current to one thread at a time). */
    static int fail = -1;
    if (fail < 0) {
        const char *v = getenv("KREX_SIM_GREEN_PUSH_FAILS");
        fail = v ? atoi(v) : 0;
    }
    if (fail > 0 && green_of_ctx(c) >= 0) return (CUresult)fail;
    t_ctx_stack[t_ctx_depth++] = c;
    return 0;
}
EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *c) {
    if (t_ctx_depth <= 0) return 201;
    *c = t_ctx_stack[--t_ctx_depth];
    return 0;
}
/* Green contexts (one process's; a fork child's are the parent's, never valid in CUDA).
 * Making one retains the device's primary context, as the real call does. Its handle and the
 * CUcontext it converts to are two addresses in its slot; its number on the timeline is the
 * slot's index + 1: work on its streams is its own (simgpu_stream_bind), and a sync of its
 * CUcontext waits for that work only. */
static struct sim_green { int used, dev; char ctx; } g_green[SIMGPU_GREENS];
static pthread_mutex_t g_green_lock = PTHREAD_MUTEX_INITIALIZER;
static int green_index(const void *h) {
    for (int i = 0; i < SIMGPU_GREENS; i++)
        if (h == (const void *)&g_green[i] && __atomic_load_n(&g_green[i].used, __ATOMIC_ACQUIRE)) return i;
    return -1;
}
/* Its index, -1 if `c` is not a green context's, -2 if it is a destroyed one's. */
static int green_of_ctx(const void *c) {
    for (int i = 0; i < SIMGPU_GREENS; i++)
        if (c == (const void *)&g_green[i].ctx) return __atomic_load_n(&g_green[i].used, __ATOMIC_ACQUIRE) ? i : -2;
    return -1;
}
static CUresult sim_life_cuGreenCtxCreate(CUgreenCtx *ph, CUdevResourceDesc desc, CUdevice dev, unsigned int flags) {
    (void)desc;
    (void)flags;
    if (!ph) return 1; /* CUDA_ERROR_INVALID_VALUE */
    if (dev < 0 || dev >= simgpu_device_count()) return 101;
    simgpu_ctx_activate(dev);
    int i = 0;
    pthread_mutex_lock(&g_green_lock);
    while (i < SIMGPU_GREENS && g_green[i].used) i++;
    if (i < SIMGPU_GREENS) {
        g_green[i].dev = dev;
        __atomic_store_n(&g_green[i].used, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&g_green_lock);
    if (i == SIMGPU_GREENS) return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
    *ph = (CUgreenCtx)(void *)&g_green[i];
    return 0;
}
static CUresult sim_life_cuGreenCtxDestroy(CUgreenCtx h) {
    int i = green_index(h);
    if (i < 0) return 201; /* CUDA_ERROR_INVALID_CONTEXT */
    __atomic_store_n(&g_green[i].used, 0, __ATOMIC_RELEASE);
    return 0;
}
static CUresult sim_do_cuCtxFromGreenCtx(CUcontext *pc, CUgreenCtx h) {
    int i = green_index(h);
    if (!pc) return 1;
    if (i < 0) return 201;
    *pc = (CUcontext)(void *)&g_green[i].ctx;
    return 0;
}
EXPORT CUresult cuGreenCtxStreamCreate(CUstream *ps, CUgreenCtx h, unsigned int flags, int priority) {
    (void)flags;
    (void)priority;
    static uintptr_t next = 0x900000;
    int i = green_index(h);
    if (!ps) return 1;
    if (i < 0) return 201;
    CUstream s = (CUstream)__atomic_add_fetch(&next, 16, __ATOMIC_RELAXED);
    if (simgpu_stream_bind(s, i + 1)) return 2;
    *ps = s;
    return 0;
}
EXPORT CUresult cuCtxGetCurrent(CUcontext *c);
/* The current context's tasks: a green context's own, else the process's others. */
EXPORT CUresult cuCtxSynchronize(void) {
    CUcontext c = NULL;
    cuCtxGetCurrent(&c);
    int i = green_of_ctx(c);
    if (i >= 0) simgpu_sync_green(i + 1, "cuCtxSynchronize");
    else simgpu_sync_all("cuCtxSynchronize");
    return 0;
}
/* A context by its handle (CUDA 12.8+): a green context's work only, else the process's.
 * KREX_SIM_NO_CTX_SYNC_V2=1 answers as a driver without it (CUDA_ERROR_NOT_SUPPORTED). */
EXPORT CUresult cuCtxSynchronize_v2(CUcontext c) {
    static int off = -1;
    if (off < 0) {
        const char *v = getenv("KREX_SIM_NO_CTX_SYNC_V2");
        off = v && *v == '1';
    }
    if (off) return 801;
    if (!c) return cuCtxSynchronize();
    int i = green_of_ctx(c);
    if (i == -2) return 201; /* CUDA_ERROR_INVALID_CONTEXT */
    if (i >= 0) simgpu_sync_green(i + 1, "cuCtxSynchronize_v2");
    else simgpu_sync_all("cuCtxSynchronize_v2");
    return 0;
}
EXPORT CUresult cuStreamSynchronize(CUstream s) { simgpu_sync_stream(s); return 0; }
EXPORT CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *m) {
    static __thread CUstreamCaptureMode cur;
    CUstreamCaptureMode old = cur;
    cur = *m;
    *m = old;
    return 0;
}
/* What the shim's pacing (pace.c) calls. The current context: the pushed one, else the
 * current device's primary context once it exists. */
EXPORT CUresult cuCtxGetCurrent(CUcontext *c) {
    if (!c) return 1;
    int d = simgpu_get_device();
    *c = t_ctx_depth > 0 ? t_ctx_stack[t_ctx_depth - 1]
         : simgpu_ctx_active(d) ? (CUcontext)(void *)&g_primary[d] : NULL;
    return 0;
}
/* What the shim asks before a free, to size its settle time (shim.c, free_settle_ns). */
EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
    void *b = NULL;
    size_t n = 0;
    if (simgpu_alloc_range((const void *)(uintptr_t)p, &b, &n) != 0) return 1; /* CUDA_ERROR_INVALID_VALUE */
    if (base) *base = (CUdeviceptr)(uintptr_t)b;
    if (size) *size = n;
    return 0;
}
struct sim_cu_event { uint64_t t; };
EXPORT CUresult cuEventCreate(void **e, unsigned int flags) {
    (void)flags;
    *e = calloc(1, sizeof(struct sim_cu_event));
    return *e ? 0 : 2;
}
EXPORT CUresult cuEventDestroy_v2(void *e) { free(e); return 0; }
EXPORT CUresult cuEventRecord(void *e, CUstream s) {
    /* The legacy (1) and per-thread (2) handles: this simulator runs both as the NULL stream. */
    const void *st = (uintptr_t)s <= 2 ? NULL : (const void *)s;
    uint64_t now = simgpu_now(), tail = simgpu_stream_tail(st);
    ((struct sim_cu_event *)e)->t = tail > now ? tail : now;
    return 0;
}
EXPORT CUresult cuGreenCtxRecordEvent(CUgreenCtx h, void *e) {
    /* Stamped when the green context's work queued before it has finished. */
    int i = green_index(h);
    if (i < 0) return 201;
    uint64_t now = simgpu_now(), tail = simgpu_green_tail(i + 1);
    ((struct sim_cu_event *)e)->t = tail > now ? tail : now;
    return 0;
}
EXPORT CUresult cuEventQuery(void *e) { return simgpu_now() >= ((struct sim_cu_event *)e)->t ? 0 : 600; }
EXPORT CUresult cuStreamIsCapturing(CUstream s, int *status) {
    (void)s;
    *status = 0; /* captures are tracked by the shim; the simulator runs none */
    return 0;
}
#endif

/* -------------------------------------------------------------------- HIP */
#if SIM_API == 2
static int sim_lookup(const char *symbol, void **pfn, uint64_t flags) {
    if (!pfn || !symbol) return 1;
    return sim_table_lookup(symbol, pfn, flags);
}
struct sim_event { uint64_t t; };
EXPORT hipError_t hipGetDeviceCount(int *n) { *n = simgpu_device_count(); return 0; }
EXPORT hipError_t hipGetDevice(int *d) { *d = simgpu_get_device(); return 0; }
EXPORT hipError_t hipDevicePrimaryCtxGetState(int d, unsigned int *flags, int *active) {
    simgpu_ctx_query();
    *flags = 0;
    *active = simgpu_ctx_active(d);
    return 0;
}
/* The LIFE rows' effects ("device" memory is host memory here). */
static hipError_t sim_alloc(void **p, size_t n) {
    simgpu_ctx_activate(simgpu_get_device());
    if (!p) return 1;
    *p = simgpu_alloc(n ? n : 1);
    return *p ? 0 : 2;
}
static char g_primary[KREX_MAX_GPUS], g_module;
static hipError_t sim_life_hipSetDevice(int d) { return simgpu_set_device(d); }
static hipError_t sim_life_hipMalloc(void **p, size_t n) { return sim_alloc(p, n); }
static hipError_t sim_life_hipMallocManaged(void **p, size_t n, unsigned int f) { return sim_alloc(p, n); }
static hipError_t sim_life_hipFree(void *p) { simgpu_free(p); return 0; }
static hipError_t sim_life_hipDevicePrimaryCtxRetain(hipCtx_t *pctx, hipDevice_t d) {
    if (d < 0 || d >= simgpu_device_count() || !pctx) return 101;
    simgpu_ctx_activate(d);
    *pctx = (hipCtx_t)(void *)&g_primary[d];
    return 0;
}
static hipError_t sim_life_hipDevicePrimaryCtxRelease(hipDevice_t d) { return 0; }
static hipError_t sim_life_hipDevicePrimaryCtxReset(hipDevice_t d) { return 0; }
#define SIM_MODULE(m) ((m) ? (*(m) = (hipModule_t)(void *)&g_module, 0) : 1)
static hipError_t sim_life_hipModuleLoad(hipModule_t *m, const char *f) { return SIM_MODULE(m); }
static hipError_t sim_life_hipModuleLoadData(hipModule_t *m, const void *i) { return SIM_MODULE(m); }
static hipError_t sim_life_hipModuleLoadDataEx(hipModule_t *m, const void *i, unsigned int n, hipJitOption *o,
                                               void **v) {
    return SIM_MODULE(m);
}
static hipError_t sim_life_hipModuleUnload(hipModule_t m) { return 0; }
EXPORT hipError_t hipDeviceSynchronize(void) { simgpu_sync_all("hipDeviceSynchronize"); return 0; }
EXPORT hipError_t hipStreamSynchronize(hipStream_t s) { simgpu_sync_stream(s); return 0; }
EXPORT hipError_t hipEventCreate(void **e) { *e = calloc(1, sizeof(struct sim_event)); return 0; }
EXPORT hipError_t hipEventDestroy(void *e) { free(e); return 0; }
EXPORT hipError_t hipEventRecord(void *e, hipStream_t s) {
    uint64_t now = simgpu_now(), tail = simgpu_stream_tail(s);
    ((struct sim_event *)e)->t = tail > now ? tail : now;
    return 0;
}
EXPORT hipError_t hipEventSynchronize(void *e) { simgpu_sleep_until(((struct sim_event *)e)->t); return 0; }
EXPORT hipError_t hipEventElapsedTime(float *ms, void *a, void *b) {
    *ms = (float)((double)((int64_t)(((struct sim_event *)b)->t - ((struct sim_event *)a)->t)) / 1e6);
    return 0;
}
#endif
