/* Process-record claim storm for tests/integration/test_proc_records.py.
 *
 *   claims SHM_NAME FORKERS CHILDREN
 *
 * FORKERS processes each fork CHILDREN short-lived children one after another; every
 * child claims a process record (krex_proc_register, as a shim does at registration)
 * and exits at once, while a reaper frees the records of dead processes
 * (krex_proc_reap, as krexd does). Claimers collide on the same free record all the
 * time. At the end, with nobody filling a record in any more, prints
 * {"claims","failed","damaged"}: a lost race must never leave a record that reads as
 * damaged (krexd would raise a false trust alarm and flag every region). */
#define _GNU_SOURCE
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "krex_core.h"

uint64_t krex_now_ns(void); /* (declared here too: the test build links krex_core.c for it) */

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: claims SHM_NAME FORKERS CHILDREN\n");
        return 2;
    }
    int err = 0, forkers = atoi(argv[2]), children = atoi(argv[3]);
    struct krex_shm *shm = krex_shm_open(argv[1], 0, 0, &err);
    if (!shm) {
        fprintf(stderr, "claims: cannot attach %s: errno %d\n", argv[1], err);
        return 2;
    }
    /* The 1024 records run out within a round: from then on claims take over the records
     * of dead processes (the pass that races hardest), and the reaper, now and then,
     * frees dead ones under the claimers' feet. */
    pid_t reaper = fork();
    if (reaper == 0) {
        for (;;) {
            usleep(200000);
            krex_proc_reap(shm);
        }
    }
    int failed = 0;
    for (int f = 0; f < forkers; f++) {
        if (fork() != 0) continue;
        int bad = 0;
        for (int c = 0; c < children; c++) {
            pid_t k = fork();
            if (k == 0) _exit(krex_proc_register(shm, 0, 0, getpid()) < 0);
            int st = 0;
            waitpid(k, &st, 0);
            bad += !WIFEXITED(st) || WEXITSTATUS(st) != 0;
        }
        _exit(bad > 255 ? 255 : bad);
    }
    for (int f = 0; f < forkers; f++) {
        int st = 0;
        wait(&st);
        failed += WIFEXITED(st) ? WEXITSTATUS(st) : 1;
    }
    kill(reaper, SIGKILL);
    waitpid(reaper, NULL, 0);
    int damaged = krex_proc_audit(shm, 1, NULL, 0);
    printf("{\"claims\":%d,\"failed\":%d,\"damaged\":%d}\n", forkers * children, failed, damaged);
    return 0;
}
