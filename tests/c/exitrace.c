/* Victim: a thread's async copy is counted by the shim (krex_enter bumps
 * `submits`) before the driver call, which spends host time (KREX_SIM_MOVE_BYTES=1: the
 * bytes move on the host first, as a real pageable H2D copy stages them) before the work is
 * queued. The main thread calls exit() meanwhile: stop_helper reads `before` (including the
 * copy), drains (the copy is not queued yet), stores exit_drained = 1 + before. The copy is
 * then queued, after the last drain, and the record still says "drained".
 *
 *   exitrace DIR NAME BYTES [nolife]
 * Writes DIR/NAME.ready ({"pid"}), waits for DIR/NAME.go, starts the copy on thread T,
 * sleeps 3 ms, exit(0). An atexit handler registered before any GPU call (runs after
 * stop_helper) writes DIR/NAME.exiting and keeps the process alive until DIR/NAME.stop.
 * T writes DIR/NAME.copy ({"t_call","t_ret"}) after the copy returned, then sleeps. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "krex_cuda_types.h"
#include "victim.h"

extern CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n);
extern CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s);
static const char *g_dir, *g_name;
static size_t g_bytes;
static volatile int g_go;
static CUdeviceptr g_dst;
static void *g_src;

#define put(suffix, text) victim_put(g_dir, g_name, suffix, text)
#define has(suffix) victim_has(g_dir, g_name, suffix)
static void linger(void) {
    char b[128];
    snprintf(b, sizeof b, "{\"pid\": %d, \"t\": %llu}", (int)getpid(), now_ns());
    put("exiting", b);
    while (!has("stop")) usleep(10000);
}
static void *copier(void *arg) {
    (void)arg;
    while (!g_go) usleep(100);
    unsigned long long t0 = now_ns();
    int rc = (int)cuMemcpyHtoDAsync_v2(g_dst, g_src, g_bytes, NULL);
    unsigned long long t1 = now_ns();
    char b[160];
    snprintf(b, sizeof b, "{\"rc\": %d, \"t_call\": %llu, \"t_ret\": %llu}", rc, t0, t1);
    put("copy", b);
    for (;;) pause();
    return NULL;
}
int main(int argc, char **argv) {
    if (argc < 4) return 2;
    g_dir = argv[1], g_name = argv[2], g_bytes = (size_t)atoll(argv[3]);
    int nolife = argc > 4;
    atexit(linger); /* before any GPU call: runs after the shim's stop_helper */
    launch(10);
    cudaDeviceSynchronize(); /* the drain helper runs: stop_helper is registered */
    g_src = malloc(g_bytes);
    memset(g_src, 1, g_bytes);
    if (nolife) g_dst = (CUdeviceptr)(uintptr_t)malloc(g_bytes); /* sim "device" memory is host memory */
    else if (cuMemAlloc_v2(&g_dst, g_bytes) != 0) return 3;
    pthread_t t;
    pthread_create(&t, NULL, copier, NULL);
    char b[64];
    snprintf(b, sizeof b, "{\"pid\": %d}", (int)getpid());
    put("ready", b);
    while (!has("go")) usleep(10000);
    g_go = 1;
    usleep(3000); /* T is inside the copy now: counted, its bytes moving on the host */
    exit(0);
}
