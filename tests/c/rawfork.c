/* rawfork: one cuMemAlloc_v2 (arms the exit hold), then a child made by
 * syscall(SYS_fork) (no pthread_atfork handlers, as glibc's _Fork or a raw clone)
 * that calls exit(0). Prints the parent's pid and the child's status, then sleeps
 * until stdin closes. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "krex_cuda_types.h"
#include "victim.h"

extern CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n);

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    CUdeviceptr p;
    if (cuMemAlloc_v2(&p, 4096) != 0) return 3;
    pid_t c = (pid_t)syscall(SYS_fork);
    if (c == 0) exit(0);
    int st = 0;
    waitpid(c, &st, 0);
    printf("{\"pid\": %d, \"child\": %d, \"status\": %d}\n", (int)getpid(), (int)c, st);
    sleep(argc > 1 ? atoi(argv[1]) : 30);
    return 0;
}
