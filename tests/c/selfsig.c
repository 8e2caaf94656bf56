/* A signal that arrives while the shim registers the process, for tests/integration/test_shim_faults.py.
 *
 *   selfsig MODE ARM        MODE: enter (the first GPU call registers) or begin
 *                           (KREX_REGION_BEGIN registers); ARM: connect or shm
 *
 * The SIGUSR1 handler launches a kernel. The program defines its own connect() and
 * shm_open() (exported: built with -rdynamic, see KREX_TEST_RDYNAMIC), which raise
 * SIGUSR1 once from inside the shim's registration: the self-registration round trip to
 * krexd (connect) or the segment attach under the registration lock (shm). Prints
 * {"registered"} and {"done"} lines; "handler_depth" is the shim's depth of gated calls
 * when the handler ran (0: its launch was gated, not taken for a nested call). */
/* KREX_TEST_RDYNAMIC */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "include/krex.h"
#include "krex_cuda_types.h"
#include "victim.h"


static volatile int g_armed, g_fired, g_handled;
static int g_arm_shm;

static volatile int g_handler_depth = -1;

static void on_usr1(int sig) {
    (void)sig;
    int (*depth)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "krex_shim_depth");
    g_handler_depth = depth ? depth() : -2; /* 0: the launch below is gated, not nested */
    launch(1000);
    g_handled++;
}

static void fire(int shm) {
    if (g_armed && shm == g_arm_shm && !g_fired) {
        g_fired = 1;
        raise(SIGUSR1);
    }
}

int connect(int fd, const struct sockaddr *a, socklen_t l) {
    int (*real)(int, const struct sockaddr *, socklen_t) =
        (int (*)(int, const struct sockaddr *, socklen_t))dlsym(RTLD_NEXT, "connect");
    fire(0);
    return real(fd, a, l);
}

int shm_open(const char *name, int flags, mode_t mode) {
    int (*real)(const char *, int, mode_t) = (int (*)(const char *, int, mode_t))dlsym(RTLD_NEXT, "shm_open");
    const char *seg = getenv("KREX_SHM"); /* KREX's segment only, not the simulated device's */
    if (seg && !strcmp(name, seg)) fire(1);
    return real(name, flags, mode);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: selfsig enter|begin connect|shm\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_usr1;
    sa.sa_flags = SA_RESTART;
    sigaction(SIGUSR1, &sa, NULL);
    g_arm_shm = strcmp(argv[2], "shm") == 0;
    g_armed = 1;
    long rc = 0;
    if (strcmp(argv[1], "begin") == 0) {
        rc = KREX_REGION_BEGIN();
        KREX_REGION_END();
    } else {
        launch(1);
    }
    printf("{\"registered\":%ld,\"fired\":%d}\n", rc, g_fired);
    cudaDeviceSynchronize();
    printf("{\"done\":1,\"handled\":%d,\"handler_depth\":%d}\n", g_handled, g_handler_depth);
    return 0;
}
