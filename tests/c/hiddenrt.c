/* A statically linked CUDA runtime, as the simulated GPU can show one (KREX_TEST_NO_CUDART:
 * no libcudart in DT_NEEDED, and __cudaRegisterFatBinary defined here): every launch goes
 * through a path no symbol hook covers (the simulated driver's own lookup, as a static
 * runtime uses the driver's export table), so the shim never counts, gates or drains it.
 *
 *   hiddenrt SECONDS US DEPTH
 *
 * Prints {"pid", "mode"} first, then queues DEPTH kernels of US simulated microseconds,
 * waits for them, over and over for SECONDS seconds (escape.c's loop). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

void __cudaRegisterFatBinary(void) {}

extern int simgpu_cu_gpa(const char *symbol, void **pfn, uint64_t flags); /* the sim's libcuda */
extern void simgpu_sync_all(const char *who);                              /* the device model */
typedef int (*cu_launch)(const void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                         unsigned bz, unsigned shmem, void *stream, void **params, void **extra);

static unsigned long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ull + (unsigned long long)ts.tv_nsec;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 4) {
        fprintf(stderr, "usage: %s SECONDS US DEPTH\n", argv[0]);
        return 2;
    }
    double seconds = atof(argv[1]);
    unsigned us = (unsigned)strtoul(argv[2], NULL, 10), depth = (unsigned)strtoul(argv[3], NULL, 10);
    printf("{\"pid\": %d, \"mode\": \"hidden\"}\n", (int)getpid());
    void *pfn = NULL;
    if (simgpu_cu_gpa("cuLaunchKernel", &pfn, 0) != 0 || !pfn) {
        fprintf(stderr, "hiddenrt: no cuLaunchKernel\n");
        return 3;
    }
    unsigned long long end = now_ns() + (unsigned long long)(seconds * 1e9);
    unsigned long n = 0;
    while (now_ns() < end) {
        for (unsigned i = 0; i < depth; i++) ((cu_launch)pfn)((const void *)0x1234, us, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        simgpu_sync_all("hiddenrt");
        n += depth;
    }
    printf("{\"launches\": %lu}\n", n);
    return 0;
}
