/* Several threads of one process take regions (krex.h) at the same time.
 *
 *   region_threads THREADS REGIONS
 *
 * Each thread does REGIONS times: KREX_REGION_BEGIN, a kernel, synchronise,
 * KREX_REGION_END. Prints {"pid","begin_errors","end_errors","regions"}: every
 * region of every thread must be granted (krexd queues them), none refused
 * because another thread of the process was waiting for its own grant. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "include/krex.h"
#include "krex_cuda_types.h"

extern cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim, void **args,
                                    size_t sharedMem, cudaStream_t stream);
extern cudaError_t cudaDeviceSynchronize(void);

static int g_regions;
static unsigned long g_begin_errors, g_end_errors, g_done;

static void *worker(void *arg) {
    (void)arg;
    dim3 grid = {2000, 1, 1}, block = {1, 1, 1};
    for (int i = 0; i < g_regions; i++) {
        if (KREX_REGION_BEGIN() != 0) {
            __atomic_fetch_add(&g_begin_errors, 1, __ATOMIC_RELAXED);
            continue;
        }
        cudaLaunchKernel((const void *)0x1234, grid, block, NULL, 0, NULL);
        cudaDeviceSynchronize();
        if (KREX_REGION_END() != 0) __atomic_fetch_add(&g_end_errors, 1, __ATOMIC_RELAXED);
        __atomic_fetch_add(&g_done, 1, __ATOMIC_RELAXED);
    }
    return NULL;
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 3;
    g_regions = argc > 2 ? atoi(argv[2]) : 5;
    pthread_t t[32];
    if (n > 32) n = 32;
    for (long i = 0; i < n; i++) pthread_create(&t[i], NULL, worker, (void *)i);
    for (int i = 0; i < n; i++) pthread_join(t[i], NULL);
    printf("{\"pid\":%d,\"begin_errors\":%lu,\"end_errors\":%lu,\"regions\":%lu}\n", (int)getpid(),
           g_begin_errors, g_end_errors, g_done);
    return 0;
}
