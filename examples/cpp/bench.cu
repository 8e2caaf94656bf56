// A CUDA C++ benchmark that marks its timed loop with the KREX region macros.
// Build (shared cudart, so KREX can gate it):
//   nvcc -O2 -cudart shared -I"$(krex include-dir)" bench.cu -o bench
// Run:  krex run -- ./bench        (on the simulated GPU: see examples/cpp/README.md)
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>

#include "krex.h"

__global__ void saxpy(int n, float a, const float *x, float *y) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : (1 << 24);
    int iters = argc > 2 ? atoi(argv[2]) : 100;
    float *x, *y;
    cudaMalloc(&x, n * sizeof(float));
    cudaMalloc(&y, n * sizeof(float));
    cudaMemset(x, 0, n * sizeof(float));
    cudaMemset(y, 0, n * sizeof(float));
    dim3 block(256), grid((n + 255) / 256);
    saxpy<<<grid, block>>>(n, 2.0f, x, y);  // warm-up outside the region
    cudaDeviceSynchronize();

    cudaEvent_t start, stop;
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
    float ms = 0;
    {
        krex::Region region;  // exclusive GPU from here to the end of the scope
        cudaEventRecord(start, 0);
        for (int i = 0; i < iters; i++) saxpy<<<grid, block>>>(n, 2.0f, x, y);
        cudaEventRecord(stop, 0);
        cudaEventSynchronize(stop);
    }
    cudaEventElapsedTime(&ms, start, stop);
    printf("{\"kernel\":\"saxpy\",\"n\":%d,\"iters\":%d,\"mean_us\":%.3f}\n", n, iters, 1000.0 * ms / iters);
    cudaFree(x);
    cudaFree(y);
    return 0;
}
