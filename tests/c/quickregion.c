/* Victim: takes a region at once after its start (a C benchmark whose
 * first thing is a timed region), one 2 ms kernel inside. Prints {"pid","t_main","t_begin",
 * "begin","end"} as JSON lines on stdout. */
#define _GNU_SOURCE
#include <stdio.h>
#include <unistd.h>

#include "include/krex.h"
#include "krex_cuda_types.h"
#include "victim.h"

int main(void) {
    unsigned long long t_main = now_ns();
    int b = KREX_REGION_BEGIN();
    unsigned long long t_begin = now_ns();
    launch(2000);
    cudaDeviceSynchronize();
    int e = KREX_REGION_END();
    printf("{\"pid\": %d, \"t_main\": %llu, \"t_begin\": %llu, \"begin\": %d, \"end\": %d}\n", (int)getpid(), t_main,
           t_begin, b, e);
    return 0;
}
