/* A library of GPU calls for escape.c's dlmopen mode: loaded into a link-map namespace
 * of its own, its calls go to that namespace's copy of the CUDA runtime, which the shim
 * (preloaded into the base namespace only) does not hook. Built as libnsgpu.so. */
#include "victim.h"

int nsgpu_run(double seconds, unsigned us, unsigned depth) {
    unsigned long long end = now_ns() + (unsigned long long)(seconds * 1e9);
    unsigned long n = 0;
    while (now_ns() < end) {
        for (unsigned i = 0; i < depth; i++) launch(us);
        cudaDeviceSynchronize();
        n += depth;
    }
    printf("{\"launches\": %lu}\n", n);
    return 0;
}
