/* What the small C victims of the tests share: a monotonic clock and a simulated kernel
 * launch (the simulator runs a kernel for gridDim.x microseconds). */
#ifndef KREX_TEST_VICTIM_H
#define KREX_TEST_VICTIM_H
#include <time.h>

#include "krex_cuda_types.h"

extern cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim, void **args,
                                    size_t sharedMem, cudaStream_t stream);
extern cudaError_t cudaDeviceSynchronize(void);

static inline unsigned long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ull + (unsigned long long)ts.tv_nsec;
}

/* A kernel of `us` simulated microseconds on the default stream; returns the CUDA status. */
static inline int launch(unsigned us) {
    dim3 grid = {us, 1, 1}, block = {1, 1, 1};
    return (int)cudaLaunchKernel((const void *)0x1234, grid, block, NULL, 0, NULL);
}
#endif
