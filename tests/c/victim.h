/* What the small C victims of the tests share: a monotonic clock and a simulated kernel
 * launch (the simulator runs a kernel for gridDim.x microseconds). */
#ifndef KREX_TEST_VICTIM_H
#define KREX_TEST_VICTIM_H
#include <stdio.h>
#include <time.h>
#include <unistd.h>

#include "krex_cuda_types.h"

extern cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim, void **args,
                                    size_t sharedMem, cudaStream_t stream);
extern cudaError_t cudaDeviceSynchronize(void);

static inline unsigned long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ull + (unsigned long long)ts.tv_nsec;
}

/* The files a victim and its test talk through: DIR/NAME.SUFFIX, written atomically. */
static inline void victim_put(const char *dir, const char *name, const char *suffix, const char *text) {
    char p[512], tmp[520];
    snprintf(p, sizeof p, "%s/%s.%s", dir, name, suffix);
    snprintf(tmp, sizeof tmp, "%s.tmp", p);
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    fputs(text, f);
    fclose(f);
    rename(tmp, p);
}
static inline int victim_has(const char *dir, const char *name, const char *suffix) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s.%s", dir, name, suffix);
    return access(p, F_OK) == 0;
}

/* A kernel of `us` simulated microseconds on the default stream; returns the CUDA status. */
static inline int launch(unsigned us) {
    dim3 grid = {us, 1, 1}, block = {1, 1, 1};
    return (int)cudaLaunchKernel((const void *)0x1234, grid, block, NULL, 0, NULL);
}
#endif
