/* Fills krexd's process-record table, for tests/integration/test_proc_records.py.
 *
 *   filler N GOFILE
 *
 * Launches a 1-us simulated kernel (registers), forks N children that each launch one
 * too (each takes a record of its own, until the table is full) and then sleep. Prints
 * {"filled":N} once all have; once GOFILE exists the parent takes a region, times a 1 ms kernel
 * (launch + synchronise), ends the region and prints {"begin","end","timed_ms"} (END's
 * value: 0 clean, 1 contaminated). Kills its children before it exits. */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "include/krex.h"
#include "krex_cuda_types.h"
#include "victim.h"


int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: filler N GOFILE\n");
        return 2;
    }
    int n = atoi(argv[1]);
    setvbuf(stdout, NULL, _IOLBF, 0);
    launch(1);
    cudaDeviceSynchronize();
    pid_t *kids = calloc((size_t)n, sizeof *kids);
    int ready[2];
    if (pipe(ready)) return 1;
    for (int i = 0; i < n; i++) {
        pid_t p = fork();
        if (p == 0) {
            launch(1);
            cudaDeviceSynchronize();
            if (write(ready[1], "r", 1) != 1) _exit(1); /* registered (or listed): say so */
            for (;;) pause();
        }
        kids[i] = p;
    }
    /* "filled" only once every child has registered: a test that counts on a full table
     * must not race the children's first call. */
    char c;
    for (int i = 0; i < n; i++)
        if (read(ready[0], &c, 1) != 1) return 1;
    printf("{\"filled\":%d}\n", n);
    while (access(argv[2], F_OK) != 0) usleep(20000);
    long b = KREX_REGION_BEGIN();
    unsigned long long t1 = now_ns();
    launch(1000);
    cudaDeviceSynchronize();
    unsigned long long t2 = now_ns();
    long e = KREX_REGION_END();
    printf("{\"begin\":%ld,\"end\":%ld,\"timed_ms\":%.3f}\n", b, e, (double)(t2 - t1) / 1e6);
    for (int i = 0; i < n; i++) kill(kids[i], SIGKILL);
    while (wait(NULL) > 0) {
    }
    return 0;
}
