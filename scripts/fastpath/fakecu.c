/* A stand-in libcuda.so.1 whose cuLaunchKernel returns at once: calling it
 * with and without the shim isolates what the gate's fast path costs. */
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
__attribute__((visibility("default"), noinline)) int cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy,
        unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shm, CUstream s, void **p, void **e) {
    __asm__ volatile("" ::: "memory");
    return (int)(gx == 0xdeadbeef);
}
/* A small copy: the chunked wrappers' fast path (one size compare more than a kernel's). */
__attribute__((visibility("default"), noinline)) int cuMemcpyHtoD_v2(unsigned long long dst, const void *src,
                                                                   unsigned long n) {
    __asm__ volatile("" ::: "memory");
    return (int)(n == 0xdeadbeef);
}
