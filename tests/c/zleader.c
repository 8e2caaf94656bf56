/* Victim: the main thread leaves with pthread_exit (the
 * leader is then a zombie, /proc/PID/stat says 'Z'), another thread goes on using the GPU.
 *
 *   zleader DIR NAME US
 * Writes DIR/NAME.ready, main thread exits. Thread B waits for DIR/NAME.go, launches one
 * US-us kernel (async), writes DIR/NAME.launched, then waits for DIR/NAME.stop and exits. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "krex_cuda_types.h"
#include "victim.h"

static const char *g_dir, *g_name;
static unsigned g_us;
#define put(suffix, text) victim_put(g_dir, g_name, suffix, text)
#define has(suffix) victim_has(g_dir, g_name, suffix)
static void *worker(void *arg) {
    (void)arg;
    while (!has("go")) usleep(1000);
    unsigned long long t0 = now_ns();
    int rc = launch(g_us);
    char b[128];
    snprintf(b, sizeof b, "{\"pid\": %d, \"rc\": %d, \"t\": %llu}", (int)getpid(), rc, t0);
    put("launched", b);
    while (!has("stop")) usleep(10000);
    cudaDeviceSynchronize();
    exit(0);
}
int main(int argc, char **argv) {
    if (argc < 4) return 2;
    g_dir = argv[1], g_name = argv[2], g_us = (unsigned)atoi(argv[3]);
    launch(10);
    cudaDeviceSynchronize(); /* registered, drain helper running */
    pthread_t t;
    pthread_create(&t, NULL, worker, NULL);
    char b[64];
    snprintf(b, sizeof b, "{\"pid\": %d}", (int)getpid());
    put("ready", b);
    pthread_exit(NULL);
}
