/* A sibling that tries to run GPU work the gate does not hold (the chaos test's
 * escaping sibling kinds, tests/helpers/chaos.py).
 *
 *   escape MODE SECONDS US DEPTH [ARG]
 *
 * Prints {"pid", "mode"} first (each image: a re-exec prints again).
 * Queues DEPTH kernels of US simulated microseconds back to back, then waits for them,
 * over and over for SECONDS seconds: a deep queue, so work it queued before a freeze
 * runs on after it. MODE:
 *   plain    through cudaLaunchKernel, with whatever environment it was started with
 *   setuid   setuid(ARG) and setgid(ARG) first (a root process dropping privileges),
 *            then as plain
 *   reexec   one kernel, then (after ARG ms, default 600: krexd has looked at it by
 *            then) exec itself again as plain without LD_PRELOAD: the same executable,
 *            pid and start time, no shim
 *   dlmopen  load the library ARG in a link-map namespace of its own (dlmopen with
 *            LM_ID_NEWLM, after 300 ms) and queue the kernels through its nsgpu_run,
 *            whose calls go to that namespace's own CUDA runtime. With a 7th argument
 *            "raw": one kernel through the base namespace first (it registers), then
 *            libc's own dlmopen, looked up past the shim's hook */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "victim.h"

static int hammer(double seconds, unsigned us, unsigned depth) {
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

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 5) {
        fprintf(stderr, "usage: %s plain|setuid|reexec|dlmopen SECONDS US DEPTH [ARG]\n", argv[0]);
        return 2;
    }
    const char *mode = argv[1];
    double seconds = atof(argv[2]);
    unsigned us = (unsigned)strtoul(argv[3], NULL, 10), depth = (unsigned)strtoul(argv[4], NULL, 10);
    const char *arg = argc > 5 ? argv[5] : NULL;
    printf("{\"pid\": %d, \"mode\": \"%s\"}\n", (int)getpid(), mode);
    if (!strcmp(mode, "plain")) return hammer(seconds, us, depth);
    if (!strcmp(mode, "setuid")) {
        unsigned id = arg ? (unsigned)strtoul(arg, NULL, 10) : 65534;
        if (setgid(id) != 0 || setuid(id) != 0) {
            perror("escape: setuid");
            return 3;
        }
        return hammer(seconds, us, depth);
    }
    if (!strcmp(mode, "reexec")) {
        launch(us);
        cudaDeviceSynchronize();
        usleep((arg ? (unsigned)atoi(arg) : 600) * 1000u);
        unsetenv("LD_PRELOAD");
        argv[1] = "plain";
        execv("/proc/self/exe", argv);
        perror("escape: execv");
        return 3;
    }
    if (!strcmp(mode, "dlmopen")) {
        void *(*open_ns)(Lmid_t, const char *, int) = dlmopen;
        if (argc > 6 && !strcmp(argv[6], "raw")) {
            launch(us);
            cudaDeviceSynchronize();
            void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
            open_ns = libc ? (void *(*)(Lmid_t, const char *, int))dlsym(libc, "dlmopen") : NULL;
            if (!open_ns) return 3;
        }
        usleep(300000);
        void *h = arg ? open_ns(LM_ID_NEWLM, arg, RTLD_NOW | RTLD_LOCAL) : NULL;
        int (*run)(double, unsigned, unsigned) = h ? (int (*)(double, unsigned, unsigned))dlsym(h, "nsgpu_run") : NULL;
        if (!run) {
            fprintf(stderr, "escape: dlmopen %s: %s\n", arg ? arg : "(none)", dlerror());
            return 3;
        }
        return run(seconds, us, depth);
    }
    fprintf(stderr, "escape: unknown mode %s\n", mode);
    return 2;
}
