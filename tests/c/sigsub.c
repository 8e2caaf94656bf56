/* A sibling whose signal handler submits GPU work, for tests/integration/test_freeze_policy.py.
 *
 *   sigsub SECONDS HANDLER_US
 *
 * The main thread launches a 1-us simulated kernel every 2 ms, so inside another
 * command's region it sits parked at the closed gate; each SIGUSR1 runs a handler ON
 * that thread which launches a HANDLER_US kernel. A handler's call is not nested in a
 * call of its thread (the thread is parked, not inside one): the gate must hold it too.
 * Prints {"pid"} first, then {"handler_ns"} (CLOCK_MONOTONIC) for each handler run. */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "krex_cuda_types.h"
#include "victim.h"


static unsigned g_handler_us;

static void on_usr1(int sig) {
    (void)sig;
    unsigned long long t = now_ns();
    launch(g_handler_us);
    char buf[64];
    int n = snprintf(buf, sizeof buf, "{\"handler_ns\":%llu}\n", t);
    if (write(1, buf, (size_t)n) < 0) _exit(3);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: sigsub SECONDS HANDLER_US\n");
        return 2;
    }
    double seconds = atof(argv[1]);
    g_handler_us = (unsigned)atoi(argv[2]);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_usr1;
    /* NODEFER: a signal during a handler parked at the gate runs a handler of its own,
     * so handlers run all through a region, not once per region. */
    sa.sa_flags = SA_RESTART | SA_NODEFER;
    sigaction(SIGUSR1, &sa, NULL);
    launch(1); /* registers */
    printf("{\"pid\":%d}\n", (int)getpid());
    fflush(stdout);
    unsigned long long end = now_ns() + (unsigned long long)(seconds * 1e9);
    while (now_ns() < end) {
        launch(1);
        usleep(2000);
    }
    return 0;
}
