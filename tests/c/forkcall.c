/* Forks that leave a gated call behind, for tests/integration/test_shim_faults.py.
 *
 *   forkcall in-call    a SIGALRM handler fork()s while the thread is inside a gated
 *                       200 ms cudaMemcpy; the child returns into that call, leaves it,
 *                       launches a kernel and exits 0
 *   forkcall ljmp       a SIGALRM handler siglongjmp()s out of a gated cudaMemcpy (the
 *                       call is never left); the process then forks a child that
 *                       launches a kernel
 *   forkcall ljmp-loop  the same siglongjmp, then no fork: it prints {"loop"} and
 *                       launches a 20 ms kernel every 30 ms for 10 s (its calls now pass
 *                       as nested, ungated: only freezing can stop them)
 *   forkcall in-call-reg  as in-call, but the child launches a kernel (and so
 *                       registers) inside the handler, before it returns into the copy;
 *                       it stays 3 s after its line so its record can be read
 *   forkcall exec-in-call PROG ARGS...  the handler exec()s PROG inside the gated copy
 *   forkcall exec-after PROG ARGS...    exec()s PROG after a kernel, outside any call
 *                       (both print {"exec"} first)
 *
 * The child prints {"child","rc","depth","registered"}: the shim's depth of gated calls
 * after its launch (0), and whether its shim registered it (1: its calls are gated, not
 * taken for nested calls of a call its parent entered). The parent prints
 * {"child_status"} (the raw wait status). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include "krex_cuda_types.h"
#include "victim.h"

extern cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind);

static sigjmp_buf g_jump;
static volatile pid_t g_child = -1;
static int g_mode_ljmp, g_mode_reg;
static char **g_exec; /* exec-in-call: what the handler runs */

static int shim_int(const char *name) {
    int (*f)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, name);
    return f ? f() : -1;
}

static void on_alrm(int sig) {
    (void)sig;
    if (g_exec) execv(g_exec[0], g_exec);
    if (g_mode_ljmp) siglongjmp(g_jump, 1);
    g_child = fork();
    if (g_child == 0 && g_mode_reg) launch(100); /* registers, still inside the copy */
}

static void child_work(void) {
    int rc = launch(100);
    cudaDeviceSynchronize();
    printf("{\"child\":%d,\"rc\":%d,\"depth\":%d,\"registered\":%d}\n", (int)getpid(), rc,
           shim_int("krex_shim_depth"), shim_int("krex_shim_registered"));
    fflush(stdout);
    if (g_mode_reg) sleep(3);
    _exit(0);
}

int main(int argc, char **argv) {
    int execs = argc > 2 && !strncmp(argv[1], "exec-", 5);
    if (argc < 2 || (argc != 2 && !execs) || (strncmp(argv[1], "in-call", 7) && strncmp(argv[1], "ljmp", 4) && !execs)) {
        fprintf(stderr, "usage: forkcall in-call|in-call-reg|ljmp|ljmp-loop | exec-in-call|exec-after PROG ARGS...\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    g_mode_ljmp = !strncmp(argv[1], "ljmp", 4);
    g_mode_reg = !strcmp(argv[1], "in-call-reg");
    launch(1); /* registers */
    cudaDeviceSynchronize();
    if (execs) {
        printf("{\"exec\":%d}\n", (int)getpid());
        if (!strcmp(argv[1], "exec-after")) execv(argv[2], argv + 2);
        g_exec = argv + 2;
    }
    signal(SIGALRM, on_alrm);
    static char buf[16]; /* the simulator moves no bytes: 1 ns per byte of a copy */
    struct itimerval it = {{0, 0}, {0, 20000}};
    if (!sigsetjmp(g_jump, 1)) {
        setitimer(ITIMER_REAL, &it, NULL);
        cudaMemcpy(buf, buf + 8, 200000000, cudaMemcpyHostToHost);
    }
    if (g_child == 0) child_work(); /* in-call: the child left the copy it was forked in */
    if (!strcmp(argv[1], "ljmp-loop")) {
        printf("{\"loop\":%d}\n", (int)getpid());
        for (int i = 0; i < 333; i++) {
            launch(20000);
            usleep(30000);
        }
        return 0;
    }
    if (g_mode_ljmp) {
        g_child = fork();
        if (g_child == 0) child_work();
    }
    int st = 0;
    waitpid(g_child, &st, 0);
    printf("{\"child_status\":%d}\n", st);
    return 0;
}
