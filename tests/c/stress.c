/* Concurrency stress for the shim, built with ThreadSanitizer and AddressSanitizer
 * by `make sanitize` (scripts/sanitize.py) and run under a real krexd.
 *
 *   stress SECONDS
 *
 * Threads, all at once, until SECONDS pass:
 *   4 submitters  kernels through the three paths: the exported symbol (PLT),
 *                 dlopen + dlsym (each call a fresh dlsym), cuGetProcAddress
 *   1 region      KREX_REGION_BEGIN, three kernels, synchronise, KREX_REGION_END
 *   1 capture     cudaStreamBeginCapture / EndCapture on streams of its own
 *   1 forker      fork(); the child submits once (not under TSan, which does not
 *                 support threads in a child of a threaded process) and _exits
 * then exit() with the drain helper still running (the shim stops it at exit).
 * Prints {"pid","kernels","regions","region_errors","captures","forks","errors"}. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "include/krex.h"
#include "krex_cuda_types.h"

#if defined(__SANITIZE_THREAD__)
#define UNDER_TSAN 1
#else
#define UNDER_TSAN 0
#endif

extern cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim, void **args,
                                    size_t sharedMem, cudaStream_t stream);
extern cudaError_t cudaDeviceSynchronize(void);
extern cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode);
extern cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t *pGraph);
extern CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *symbolStatus);
extern CUresult cuStreamSynchronize(CUstream s);

typedef CUresult (*cu_launch_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                unsigned, CUstream, void **, void **);

static int g_stop;
static unsigned long long g_kernels, g_regions, g_region_errors, g_captures, g_forks, g_errors;

static void add(unsigned long long *c, unsigned long long n) { __atomic_fetch_add(c, n, __ATOMIC_RELAXED); }
static int stopping(void) { return __atomic_load_n(&g_stop, __ATOMIC_ACQUIRE); }

static int launch(int path, CUstream s) {
    dim3 grid = {20, 1, 1}, block = {1, 1, 1};
    if (path == 0) return cudaLaunchKernel((const void *)0x1234, grid, block, NULL, 0, (cudaStream_t)s);
    cu_launch_t f = NULL;
    if (path == 1) {
        void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (!h) h = dlopen("libcuda.so.1", RTLD_NOW);
        f = h ? (cu_launch_t)dlsym(h, "cuLaunchKernel") : NULL;
        if (h) dlclose(h);
    } else {
        void *fp = NULL;
        if (cuGetProcAddress_v2("cuLaunchKernel", &fp, 13000, 0, NULL) == 0) f = (cu_launch_t)fp;
    }
    return f ? (int)f((CUfunction)0x1234, 20, 1, 1, 1, 1, 1, 0, s, NULL, NULL) : -1;
}

static void *submitter(void *arg) {
    long idx = (long)arg;
    CUstream s = (CUstream)(uintptr_t)(0x7000 + 16 * idx);
    unsigned long long n = 0, err = 0;
    for (unsigned i = 0; !stopping(); i++) {
        err += launch((int)((i + (unsigned)idx) % 3), s) != 0;
        n++;
        if (i % 8 == 0) cuStreamSynchronize(s);
        usleep(200);
    }
    add(&g_kernels, n);
    add(&g_errors, err);
    return NULL;
}

static void *regions(void *arg) {
    (void)arg;
    while (!stopping()) {
        if (KREX_REGION_BEGIN() != 0) {
            add(&g_region_errors, 1);
            usleep(10000);
            continue;
        }
        for (int k = 0; k < 3; k++) add(&g_errors, launch(k, NULL) != 0);
        cudaDeviceSynchronize();
        if (KREX_REGION_END() != 0) add(&g_region_errors, 1);
        add(&g_regions, 1);
        usleep(5000);
    }
    return NULL;
}

static void *captures(void *arg) {
    (void)arg;
    for (uintptr_t i = 0; !stopping(); i++) {
        cudaStream_t s = (cudaStream_t)(0x9000 + 16 * (i % 4));
        cudaGraph_t g = NULL;
        if (cudaStreamBeginCapture(s, 0) == 0) add(&g_captures, 1);
        usleep(500);
        cudaStreamEndCapture(s, &g);
        usleep(2000);
    }
    return NULL;
}

static void *forker(void *arg) {
    (void)arg;
    while (!stopping()) {
        pid_t p = fork();
        if (p == 0) {
            if (!UNDER_TSAN) launch(0, NULL);
            _exit(0);
        }
        if (p > 0) {
            int st = 0;
            waitpid(p, &st, 0);
            add(&g_forks, 1);
            if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) add(&g_errors, 1);
        }
        usleep(20000);
    }
    return NULL;
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 3.0;
    /* No submission before the threads start: they race to register (the gate
     * pointer's release/acquire publication is what TSan checks there). */
    pthread_t t[7];
    int n = 0;
    for (long i = 0; i < 4; i++) pthread_create(&t[n++], NULL, submitter, (void *)i);
    pthread_create(&t[n++], NULL, regions, NULL);
    pthread_create(&t[n++], NULL, captures, NULL);
    pthread_create(&t[n++], NULL, forker, NULL);
    struct timespec d = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    nanosleep(&d, NULL);
    __atomic_store_n(&g_stop, 1, __ATOMIC_RELEASE);
    for (int i = 0; i < n; i++) pthread_join(t[i], NULL);
    printf("{\"pid\":%d,\"kernels\":%llu,\"regions\":%llu,\"region_errors\":%llu,\"captures\":%llu,"
           "\"forks\":%llu,\"errors\":%llu}\n",
           (int)getpid(), g_kernels, g_regions, g_region_errors, g_captures, g_forks, g_errors);
    fflush(stdout);
    exit(0); /* exit(), not _exit(): the shim's exit handler stops its drain helper */
}
