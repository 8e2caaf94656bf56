/* sim_candidate.c: a benchmark candidate of known speed for `krex compare` on the
 * simulated GPU. One run times --iters back-to-back "kernels" of --us * --ratio
 * microseconds each, every one scaled by the same noise factor exp(--noise * Z),
 * Z ~ N(0, 1) drawn once per run (run-to-run noise: clocks, placement, caches).
 * So the true ratio of two candidates' medians is the ratio of their --us * --ratio,
 * and their log figures differ by a constant plus noise: the shift model the
 * comparison's interval assumes.
 *
 * Build (no CUDA headers needed):
 *   gcc -O2 -I interpose examples/compare/sim_candidate.c -L krex/_lib \
 *       -Wl,-rpath,$PWD/krex/_lib -lcudart -lm -ldl -o sim_candidate
 *
 * Usage: sim_candidate [--us N] [--ratio R] [--noise SIGMA] [--iters N] [--seed S] [--region]
 * Output: one JSON line {"mean_us":..,"factor":..,...} and a line "time: X ms"
 * (the per-kernel time in ms: what the do_bench preset reads). With --region the
 * timed part is a KREX region (krex.h): the markers' return value is "region_rc"
 * (non-zero: see krex.h), and a refused region is exit status 3. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "include/krex.h"
#include "krex_cuda_types.h"

typedef struct CUevent_st *cudaEvent_t;
cudaError_t cudaSetDevice(int device);
cudaError_t cudaMalloc(void **p, size_t n);
cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim, void **args, size_t sharedMem,
                             cudaStream_t stream);
cudaError_t cudaMemsetAsync(void *p, int value, size_t n, cudaStream_t stream);
cudaError_t cudaEventCreate(cudaEvent_t *event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);

#define CHECK(call)                                                              \
    do {                                                                         \
        int rc_ = (int)(call);                                                   \
        if (rc_ != 0) {                                                          \
            fprintf(stderr, "sim_candidate: %s failed with error %d\n", #call, rc_); \
            exit(1);                                                             \
        }                                                                        \
    } while (0)

static void kernel(void) {}

/* splitmix64: a seeded stream of uniform doubles in (0, 1). */
static uint64_t g_state;
static double uniform(void) {
    uint64_t z = (g_state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return ((double)(z >> 11) + 0.5) / 9007199254740992.0;
}

int main(int argc, char **argv) {
    double us = 1000, ratio = 1, noise = 0;
    unsigned iters = 10;
    int region = 0, seeded = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--region")) region = 1;
        else if (v && !strcmp(a, "--us")) us = atof(argv[++i]);
        else if (v && !strcmp(a, "--ratio")) ratio = atof(argv[++i]);
        else if (v && !strcmp(a, "--noise")) noise = atof(argv[++i]);
        else if (v && !strcmp(a, "--iters")) iters = (unsigned)atoi(argv[++i]);
        else if (v && !strcmp(a, "--seed")) g_state = strtoull(argv[++i], NULL, 10), seeded = 1;
        else {
            fprintf(stderr, "usage: %s [--us N] [--ratio R] [--noise SIGMA] [--iters N] [--seed S] [--region]\n",
                    argv[0]);
            return 2;
        }
    }
    if (!(us > 0) || !(ratio > 0) || noise < 0 || iters < 1) {
        fprintf(stderr, "sim_candidate: need --us > 0, --ratio > 0, --noise >= 0, --iters >= 1\n");
        return 2;
    }
    if (!seeded) {
        int fd = open("/dev/urandom", O_RDONLY);
        if (fd < 0 || read(fd, &g_state, sizeof g_state) != (ssize_t)sizeof g_state) {
            fprintf(stderr, "sim_candidate: cannot read /dev/urandom\n");
            return 1;
        }
        close(fd);
    }
    double z = sqrt(-2 * log(uniform())) * cos(2 * M_PI * uniform());  /* Box-Muller */
    double factor = exp(noise * z);
    double each_ns = us * ratio * factor * 1e3;
    unsigned whole_us = (unsigned)(each_ns / 1e3);
    size_t rest_ns = (size_t)llround(each_ns - whole_us * 1e3);

    void *buf;
    cudaEvent_t start, stop;
    CHECK(cudaSetDevice(0));
    CHECK(cudaMalloc(&buf, rest_ns + 1));
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    dim3 grid = {whole_us, 1, 1}, block = {1, 1, 1};
    int rc_begin = region ? KREX_REGION_BEGIN() : 0;
    CHECK(cudaEventRecord(start, NULL));
    for (unsigned i = 0; i < iters; i++) {
        /* one kernel of the whole microseconds, the rest as a memset (1 ns per byte) */
        if (whole_us) CHECK(cudaLaunchKernel((const void *)kernel, grid, block, NULL, 0, NULL));
        if (rest_ns) CHECK(cudaMemsetAsync(buf, 0, rest_ns, NULL));
    }
    CHECK(cudaEventRecord(stop, NULL));
    CHECK(cudaEventSynchronize(stop));
    int rc_end = region ? KREX_REGION_END() : 0;
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    double mean_us = ms * 1e3 / iters;
    printf("{\"mean_us\":%.4f,\"us\":%g,\"ratio\":%g,\"noise\":%g,\"factor\":%.6f,\"iters\":%u,"
           "\"region\":%d,\"region_rc\":%d}\n",
           mean_us, us, ratio, noise, factor, iters, region, rc_begin ? rc_begin : rc_end);
    printf("time: %.6f ms\n", mean_us / 1e3);
    return rc_begin < 0 ? 3 : 0;
}
