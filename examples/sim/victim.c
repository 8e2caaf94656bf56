/* victim.c: the "C victim program" of KREX. It times back-to-back kernels of a
 * chosen length with GPU events and prints one JSON line. Written against the
 * simulated GPU (krex/_lib), but it only uses the public CUDA/HIP entry points,
 * so the same source is a valid program for the real libraries too.
 *
 * Build (no CUDA headers needed; the prototypes are declared below):
 *   gcc -O2 -I interpose examples/sim/victim.c -L krex/_lib -Wl,-rpath,$PWD/krex/_lib \
 *       -lcudart -lcuda -l:libamdhip64.so -ldl -o victim
 *
 * Usage:
 *   victim [--api rt|drv|drv-dlsym|drv-gpa|drv-entry|hip] [--us N] [--iters N]
 *          [--seconds S] [--region]
 *
 *   --api      how the kernel is launched:
 *                rt         cudaLaunchKernel, called directly
 *                drv        cuLaunchKernel, called directly
 *                drv-dlsym  cuLaunchKernel from dlsym(dlopen("libcuda.so.1"))
 *                drv-gpa    cuLaunchKernel from cuGetProcAddress_v2 (default flags)
 *                drv-entry  cuLaunchKernel from cudaGetDriverEntryPoint (default flags)
 *                hip        hipLaunchKernel, timed with hipEvent*
 *              The driver paths are timed with the runtime's events on the
 *              default stream, which is the stream the kernels run on.
 *   --us       kernel length in microseconds (simulated GPU: gridDim.x = N)
 *   --iters    kernels per timed batch
 *   --seconds  hammer mode: repeat batches until S seconds have passed, keeping
 *              up to two batches queued so the device never idles
 *   --region   wrap the timed part in KREX_REGION_BEGIN()/KREX_REGION_END()
 *              (no-ops unless the KREX shim is preloaded)
 *
 * Output: {"api":..,"us":..,"iters":..,"mean_us":..,"pid":..,"batches":..,"region":..}
 * mean_us is the event-timed time per kernel, averaged over all batches. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "include/krex.h"      /* KREX_REGION_BEGIN / KREX_REGION_END */
#include "krex_cuda_types.h"   /* ABI-compatible CUDA/HIP types */

/* ---- the few prototypes we use (same signatures as cuda.h / cuda_runtime_api.h / hip_runtime_api.h) */
typedef struct CUevent_st *cudaEvent_t;
cudaError_t cudaSetDevice(int device);
cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim, void **args, size_t sharedMem,
                             cudaStream_t stream);
cudaError_t cudaEventCreate(cudaEvent_t *event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaGetDriverEntryPoint(const char *symbol, void **funcPtr, unsigned long long flags,
                                    enum cudaDriverEntryPointQueryResult *driverStatus);

CUresult cuInit(unsigned int flags);
CUresult cuDeviceGet(CUdevice *device, int ordinal);
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev);
CUresult cuCtxPushCurrent_v2(CUcontext ctx);
CUresult cuCtxPopCurrent_v2(CUcontext *pctx);
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *symbolStatus);
CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                        unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                        unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra);
typedef CUresult (*cuLaunchKernel_fn)(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int,
                                      unsigned int, unsigned int, unsigned int, CUstream, void **, void **);

hipError_t hipSetDevice(int device);
hipError_t hipLaunchKernel(const void *function_address, dim3 numBlocks, dim3 dimBlocks, void **args,
                           size_t sharedMemBytes, hipStream_t stream);
hipError_t hipEventCreate(hipEvent_t *event);
hipError_t hipEventRecord(hipEvent_t event, hipStream_t stream);
hipError_t hipEventSynchronize(hipEvent_t event);
hipError_t hipEventElapsedTime(float *ms, hipEvent_t start, hipEvent_t stop);
hipError_t hipEventDestroy(hipEvent_t event);

/* ---- helpers */
enum api { API_RT, API_DRV, API_DRV_DLSYM, API_DRV_GPA, API_DRV_ENTRY, API_HIP };
static const char *const api_names[] = {"rt", "drv", "drv-dlsym", "drv-gpa", "drv-entry", "hip"};

static enum api g_api;
static unsigned g_us = 100;
static cuLaunchKernel_fn g_cu_launch; /* resolved cuLaunchKernel for the lookup paths */

/* The kernel. The simulated GPU ignores the function; a real program would pass
 * its __global__ stub (runtime) or a CUfunction from cuModuleGetFunction (driver). */
static void victim_kernel(void) {}

#define CHECK(call)                                                                \
    do {                                                                           \
        int rc_ = (int)(call);                                                     \
        if (rc_ != 0) {                                                            \
            fprintf(stderr, "victim: %s failed with error %d\n", #call, rc_);      \
            exit(1);                                                               \
        }                                                                          \
    } while (0)

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Events: HIP's for --api hip, the runtime's (default stream) for everything else. */
static void ev_create(void **e) {
    if (g_api == API_HIP) CHECK(hipEventCreate((hipEvent_t *)e));
    else CHECK(cudaEventCreate((cudaEvent_t *)e));
}
static void ev_record(void *e) {
    if (g_api == API_HIP) CHECK(hipEventRecord((hipEvent_t)e, NULL));
    else CHECK(cudaEventRecord((cudaEvent_t)e, NULL));
}
static double ev_elapsed_sync_ms(void *start, void *stop) {
    float ms = 0;
    if (g_api == API_HIP) {
        CHECK(hipEventSynchronize((hipEvent_t)stop));
        CHECK(hipEventElapsedTime(&ms, (hipEvent_t)start, (hipEvent_t)stop));
    } else {
        CHECK(cudaEventSynchronize((cudaEvent_t)stop));
        CHECK(cudaEventElapsedTime(&ms, (cudaEvent_t)start, (cudaEvent_t)stop));
    }
    return ms;
}
static void ev_destroy(void *e) {
    if (g_api == API_HIP) CHECK(hipEventDestroy((hipEvent_t)e));
    else CHECK(cudaEventDestroy((cudaEvent_t)e));
}

/* One kernel of g_us microseconds on the default stream. */
static void launch(void) {
    dim3 grid = {g_us, 1, 1}, block = {1, 1, 1};
    CUfunction f = (CUfunction)(void *)victim_kernel;
    switch (g_api) {
    case API_RT: CHECK(cudaLaunchKernel((const void *)victim_kernel, grid, block, NULL, 0, NULL)); break;
    case API_DRV: CHECK(cuLaunchKernel(f, g_us, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL)); break;
    case API_DRV_DLSYM:
    case API_DRV_GPA:
    case API_DRV_ENTRY: CHECK(g_cu_launch(f, g_us, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL)); break;
    case API_HIP: CHECK(hipLaunchKernel((const void *)victim_kernel, grid, block, NULL, 0, NULL)); break;
    }
}

static CUcontext g_ctx;

static void setup(void) {
    if (g_api == API_HIP) {
        CHECK(hipSetDevice(0));
        return;
    }
    CHECK(cudaSetDevice(0));
    if (g_api == API_RT) return;
    CUdevice dev;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&g_ctx, dev));
    CHECK(cuCtxPushCurrent_v2(g_ctx));
    void *p = NULL;
    if (g_api == API_DRV_DLSYM) {
        void *h = dlopen("libcuda.so.1", RTLD_NOW);
        if (!h || !(p = dlsym(h, "cuLaunchKernel"))) {
            fprintf(stderr, "victim: dlsym(cuLaunchKernel): %s\n", dlerror());
            exit(1);
        }
    } else if (g_api == API_DRV_GPA) {
        CUdriverProcAddressQueryResult st = 0;
        CHECK(cuGetProcAddress_v2("cuLaunchKernel", &p, 13000, 0 /* CU_GET_PROC_ADDRESS_DEFAULT */, &st));
    } else if (g_api == API_DRV_ENTRY) {
        enum cudaDriverEntryPointQueryResult st = cudaDriverEntryPointSuccess;
        CHECK(cudaGetDriverEntryPoint("cuLaunchKernel", &p, 0 /* cudaEnableDefault */, &st));
    }
    if (g_api != API_DRV && !p) {
        fprintf(stderr, "victim: cuLaunchKernel lookup returned NULL\n");
        exit(1);
    }
    g_cu_launch = (cuLaunchKernel_fn)p;
}

static void teardown(void) {
    if (g_api == API_HIP || g_api == API_RT) return;
    CUcontext c;
    CHECK(cuCtxPopCurrent_v2(&c));
    CHECK(cuDevicePrimaryCtxRelease_v2(0));
}

static void usage(const char *argv0) {
    fprintf(stderr,
            "usage: %s [--api rt|drv|drv-dlsym|drv-gpa|drv-entry|hip] [--us N] [--iters N] "
            "[--seconds S] [--region]\n",
            argv0);
    exit(2);
}

int main(int argc, char **argv) {
    unsigned iters = 100;
    double seconds = 0;
    int region = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int has = i + 1 < argc;
        if (!strcmp(a, "--api") && has) {
            const char *v = argv[++i];
            unsigned k;
            for (k = 0; k < sizeof api_names / sizeof *api_names; k++)
                if (!strcmp(v, api_names[k])) break;
            if (k == sizeof api_names / sizeof *api_names) usage(argv[0]);
            g_api = (enum api)k;
        } else if (!strcmp(a, "--us") && has) {
            g_us = (unsigned)strtoul(argv[++i], NULL, 10);
        } else if (!strcmp(a, "--iters") && has) {
            iters = (unsigned)strtoul(argv[++i], NULL, 10);
        } else if (!strcmp(a, "--seconds") && has) {
            seconds = strtod(argv[++i], NULL);
        } else if (!strcmp(a, "--region")) {
            region = 1;
        } else {
            usage(argv[0]);
        }
    }
    if (g_us == 0 || iters == 0) usage(argv[0]);

    setup();
    void *start[2], *stop[2];
    for (int k = 0; k < 2; k++) {
        ev_create(&start[k]);
        ev_create(&stop[k]);
    }
    /* Warm-up: one kernel, waited for. */
    launch();
    ev_record(stop[0]);
    ev_elapsed_sync_ms(stop[0], stop[0]);

    int region_rc = region ? KREX_REGION_BEGIN() : 0;
    double total_ms = 0, deadline = now_s() + seconds;
    unsigned long batches = 0;
    int pending = 0; /* batches recorded but not yet read back */
    do {
        int k = (int)(batches % 2);
        ev_record(start[k]);
        for (unsigned i = 0; i < iters; i++) launch();
        ev_record(stop[k]);
        batches++;
        /* Hammer mode reads back the previous batch while this one is queued. */
        if (pending) total_ms += ev_elapsed_sync_ms(start[1 - k], stop[1 - k]);
        pending = seconds > 0;
        if (!pending) total_ms += ev_elapsed_sync_ms(start[k], stop[k]);
    } while (now_s() < deadline);
    if (pending) {
        int k = (int)((batches - 1) % 2);
        total_ms += ev_elapsed_sync_ms(start[k], stop[k]);
    }
    if (region) {
        int rc = KREX_REGION_END();
        if (!region_rc) region_rc = rc;
    }

    for (int k = 0; k < 2; k++) {
        ev_destroy(start[k]);
        ev_destroy(stop[k]);
    }
    teardown();
    double mean_us = total_ms * 1000.0 / ((double)iters * (double)batches);
    printf("{\"api\":\"%s\",\"us\":%u,\"iters\":%u,\"mean_us\":%.3f,\"pid\":%d,\"batches\":%lu,"
           "\"region\":%s,\"region_rc\":%d}\n",
           api_names[g_api], g_us, iters, mean_us, (int)getpid(), batches, region ? "true" : "false",
           region_rc);
    return 0;
}
