/* An exit whose last drain cannot run (another thread stays inside a long synchronous copy)
 * and whose teardown then makes 10 stream-ordered allocations and frees: each of those must
 * not wait for a last drain again. Prints how long the teardown took, as JSON. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "victim.h"

extern cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, int kind);
extern cudaError_t cudaMallocAsync(void **p, size_t n, cudaStream_t s);
extern cudaError_t cudaFreeAsync(void *p, cudaStream_t s);

static void teardown(void) {
    unsigned long long t0 = now_ns();
    for (int i = 0; i < 10; i++) {
        void *p = NULL;
        cudaMallocAsync(&p, 64, NULL);
        cudaFreeAsync(p, NULL);
    }
    printf("{\"act\": \"teardown\", \"ms\": %.1f}\n", (now_ns() - t0) / 1e6);
    fflush(stdout);
}

static char a[64], b[64];
static void *copier(void *x) {
    (void)x;
    cudaMemcpy(a, b, 20000000000ull, 1); /* 20 s on the simulated GPU */
    return NULL;
}

int main(void) {
    atexit(teardown); /* registered before the shim's exit handler: runs after it */
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("{\"act\": \"start\", \"rc\": %d}\n", launch(5));
    pthread_t t;
    pthread_create(&t, NULL, copier, NULL);
    usleep(200000);
    exit(0);
}
