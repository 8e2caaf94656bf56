/* Submission hammer for tests/integration/test_race.py.
 *
 *   hammer SECONDS THREADS US [PAUSE_US]
 *
 * THREADS threads each launch US-microsecond simulated kernels in a loop,
 * rotating through three entry paths:
 *   0  cudaLaunchKernel                      (exported symbol, through the PLT)
 *   1  cuLaunchKernel via dlopen + dlsym     (what cuBLAS / Inductor do)
 *   2  cuLaunchKernelEx via cuGetProcAddress (what Triton does)
 * then wait for the kernel (cuStreamSynchronize on the thread's own stream)
 * and sleep PAUSE_US (default 50). They stop at EOF on stdin or after SECONDS.
 * Prints {"ready":pid} once every path is resolved, and at the end
 * {"pid","launches":[n0,n1,n2],"errors"}. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "krex_cuda_types.h"

extern cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim, void **args,
                                    size_t sharedMem, cudaStream_t stream);
extern CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                    CUdriverProcAddressQueryResult *symbolStatus);
extern CUresult cuStreamSynchronize(CUstream s);

typedef CUresult (*cu_launch_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                unsigned, CUstream, void **, void **);
typedef CUresult (*cu_launch_ex_t)(const CUlaunchConfig *, CUfunction, void **, void **);

static cu_launch_t p_cu_launch;
static cu_launch_ex_t p_cu_launch_ex;
static unsigned g_us, g_pause_us;
static volatile int g_stop;
static unsigned long long g_launches[3], g_errors;

static void *worker(void *arg) {
    long idx = (long)arg;
    CUstream s = (CUstream)(uintptr_t)(0x7000 + 16 * idx);
    dim3 grid = {g_us, 1, 1}, block = {1, 1, 1};
    CUlaunchConfig cfg = {g_us, 1, 1, 1, 1, 1, 0, s, NULL, 0};
    unsigned long long n[3] = {0, 0, 0}, err = 0;
    for (unsigned long i = (unsigned long)idx; !__atomic_load_n(&g_stop, __ATOMIC_RELAXED); i++) {
        int which = (int)(i % 3), rc;
        if (which == 0) rc = cudaLaunchKernel((const void *)0x1234, grid, block, NULL, 0, (cudaStream_t)s);
        else if (which == 1) rc = p_cu_launch((CUfunction)0x1234, g_us, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
        else rc = p_cu_launch_ex(&cfg, (CUfunction)0x1234, NULL, NULL);
        n[which]++;
        err += rc != 0;
        cuStreamSynchronize(s);
        if (g_pause_us) usleep(g_pause_us);
    }
    for (int k = 0; k < 3; k++) __atomic_fetch_add(&g_launches[k], n[k], __ATOMIC_RELAXED);
    __atomic_fetch_add(&g_errors, err, __ATOMIC_RELAXED);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s SECONDS THREADS US [PAUSE_US]\n", argv[0]);
        return 2;
    }
    double seconds = atof(argv[1]);
    int nthreads = atoi(argv[2]);
    g_us = (unsigned)atoi(argv[3]);
    g_pause_us = argc > 4 ? (unsigned)atoi(argv[4]) : 50;
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (h) p_cu_launch = (cu_launch_t)dlsym(h, "cuLaunchKernel");
    void *fp = NULL;
    if (cuGetProcAddress_v2("cuLaunchKernelEx", &fp, 13000, 0, NULL) == 0) p_cu_launch_ex = (cu_launch_ex_t)fp;
    if (!p_cu_launch || !p_cu_launch_ex) {
        fprintf(stderr, "hammer: cannot resolve cuLaunchKernel / cuLaunchKernelEx\n");
        return 3;
    }
    printf("{\"ready\":%d}\n", (int)getpid());
    fflush(stdout);
    pthread_t t[64];
    if (nthreads > 64) nthreads = 64;
    for (long i = 0; i < nthreads; i++) pthread_create(&t[i], NULL, worker, (void *)i);
    struct pollfd pfd = {0, POLLIN, 0};
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    char buf[256];
    for (;;) {
        clock_gettime(CLOCK_MONOTONIC, &now);
        double left = seconds - ((double)(now.tv_sec - t0.tv_sec) + (double)(now.tv_nsec - t0.tv_nsec) / 1e9);
        if (left <= 0) break;
        int r = poll(&pfd, 1, (int)(left * 1000) + 1);
        if (r > 0 && read(0, buf, sizeof buf) <= 0) break; /* EOF: the test says stop */
    }
    g_stop = 1;
    for (int i = 0; i < nthreads; i++) pthread_join(t[i], NULL);
    printf("{\"pid\":%d,\"launches\":[%llu,%llu,%llu],\"errors\":%llu}\n", (int)getpid(), g_launches[0],
           g_launches[1], g_launches[2], g_errors);
    return 0;
}
