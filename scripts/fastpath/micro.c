/* ns per cuLaunchKernel call (or, with `copy`, per 4 KiB cuMemcpyHtoD_v2) through whatever
 * resolves the symbol (the shim or libfakecu). */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
int cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                   void **, void **);
int cuMemcpyHtoD_v2(unsigned long long, const void *, unsigned long);
static char buf[4096];
#define CALL() (copy ? cuMemcpyHtoD_v2(0x1000, buf, sizeof buf) : cuLaunchKernel(0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0))
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}
int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 10000000;
    int rc = 0, copy = argc > 2 && argv[2][0] == 'c';
    for (long i = 0; i < 100000; i++) rc |= CALL();
    double best = 1e30;
    for (int r = 0; r < 5; r++) {
        double t0 = now();
        for (long i = 0; i < n; i++) rc |= CALL();
        double ns = (now() - t0) / n;
        if (ns < best) best = ns;
    }
    printf("{\"ns_per_call\":%.2f,\"rc\":%d}\n", best, rc);
    return 0;
}
