/* Victim: GPU work in an exit handler that was registered before the
 * process's first LIFE call, so it runs AFTER the shim's exit hold (atexit is LIFO).
 *
 *   exitwork DIR NAME US
 * launches one kernel (the drain helper starts: its stop handler is registered),
 * registers cleanup(), makes one cuMemAlloc_v2 (LIFE: arms the exit hold), writes
 * DIR/NAME.ready ({"pid"}), waits for DIR/NAME.go, then exit(0). cleanup() writes
 * DIR/NAME.exiting, then launches a US-us kernel + cudaDeviceSynchronize in a loop
 * until DIR/NAME.stop exists (a 4th argument: 100 cuMemFreeAsync calls instead of the
 * kernel), and records how many loops it made. A 5th argument registers cleanup() before
 * the first GPU call instead (it then runs after the drain helper stopped, as a vendor
 * runtime's teardown does). A 6th argument skips the cuMemAlloc_v2: no exit hold, so the
 * exit runs the drain helper's stop handler at once, even at a closed gate. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "krex_cuda_types.h"
#include "victim.h"

extern CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n);
extern CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s);
static int g_free;
static const char *g_dir, *g_name;
static unsigned g_us;

#define put(suffix, text) victim_put(g_dir, g_name, suffix, text)
#define has(suffix) victim_has(g_dir, g_name, suffix)

static void cleanup(void) {
    char b[128];
    snprintf(b, sizeof b, "{\"pid\": %d, \"t\": %llu}", (int)getpid(), now_ns());
    put("exiting", b);
    unsigned long n = 0;
    while (!has("stop")) {
        if (g_free) { /* a teardown's stream-ordered frees (LIFE calls), 100 at a time */
            for (int i = 0; i < 100; i++) cuMemFreeAsync(0, NULL);
            cudaDeviceSynchronize();
        } else {
            launch(g_us);
            cudaDeviceSynchronize();
        }
        n++;
    }
    snprintf(b, sizeof b, "{\"pid\": %d, \"launches\": %lu}", (int)getpid(), n);
    put("json", b);
}

int main(int argc, char **argv) {
    if (argc < 4) return 2;
    g_dir = argv[1], g_name = argv[2], g_us = (unsigned)atoi(argv[3]);
    g_free = argc > 4;
    /* "early": registered before the first GPU call, as a vendor runtime's own exit handler
     * is (it runs after the drain helper's stop handler, i.e. with the helper gone). */
    int early = argc > 5;
    if (early) atexit(cleanup);
    launch(10);
    cudaDeviceSynchronize();
    if (!early) atexit(cleanup);
    CUdeviceptr p;
    if (argc <= 6 && cuMemAlloc_v2(&p, 1 << 20) != 0) return 3;
    char b[64];
    snprintf(b, sizeof b, "{\"pid\": %d}", (int)getpid());
    put("ready", b);
    while (!has("go")) usleep(10000);
    exit(0);
}
