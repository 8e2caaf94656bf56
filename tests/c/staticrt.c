/* A process whose executable carries a CUDA runtime the hooks cannot see: it defines
 * __cudaRegisterFatBinary, as one that links cudart statically does, and launches through
 * a path no symbol hook covers (the simulated driver's own lookup). One counted kernel of
 * 5 us; after a line on stdin, one hidden kernel of argv[1] us; then it waits for EOF. */
#include <stdint.h>
#include <stdlib.h>

#include "victim.h"

void __cudaRegisterFatBinary(void) {}

extern int simgpu_cu_gpa(const char *symbol, void **pfn, uint64_t flags); /* the sim's libcuda */
typedef int (*cu_launch)(const void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                         unsigned bz, unsigned shmem, void *stream, void **params, void **extra);

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    unsigned us = argc > 1 ? (unsigned)strtoul(argv[1], NULL, 10) : 600000;
    printf("{\"act\": \"counted\", \"rc\": %d, \"pid\": %d}\n", launch(5), (int)getpid());
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return 1;
    void *pfn = NULL;
    int rc = simgpu_cu_gpa("cuLaunchKernel", &pfn, 0);
    if (rc == 0) rc = ((cu_launch)pfn)((const void *)0x1234, us, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    printf("{\"act\": \"hidden\", \"rc\": %d, \"t\": %llu}\n", rc, now_ns());
    while (fgets(line, sizeof line, stdin)) {
    }
    return 0;
}
