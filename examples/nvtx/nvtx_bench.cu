// A CUDA C++ benchmark that brackets its timed loop with an NVTX v3 range and knows
// nothing of KREX. Under `krex run` with KREX_NVTX_REGION=timed the range is a region:
//   nvcc -O2 -cudart shared -I"$CUDA_HOME/include" nvtx_bench.cu -o nvtx_bench
//   KREX_NVTX_REGION=timed krex run --report r.json -- ./nvtx_bench
// (-cudart shared: KREX cannot gate a statically linked CUDA runtime.) Its other ranges
// ("setup", "check") do not match and pass through to whatever else listens (Nsight).
#include <cuda_runtime.h>
#include <nvtx3/nvtx3.hpp>
#include <cstdio>
#include <cstdlib>

__global__ void saxpy(int n, float a, const float *x, float *y) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : (1 << 24);
    int iters = argc > 2 ? atoi(argv[2]) : 200;
    float *x, *y;
    dim3 block(256), grid((n + 255) / 256);
    {
        nvtx3::scoped_range setup{"setup"};
        cudaMalloc(&x, n * sizeof(float));
        cudaMalloc(&y, n * sizeof(float));
        cudaMemset(x, 0, n * sizeof(float));
        cudaMemset(y, 0, n * sizeof(float));
        saxpy<<<grid, block>>>(n, 2.0f, x, y);  // warm-up
        cudaDeviceSynchronize();
    }
    cudaEvent_t start, stop;
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
    float ms = 0;
    {
        nvtx3::scoped_range timed{"timed"};  // the region under KREX_NVTX_REGION=timed
        cudaEventRecord(start, 0);
        for (int i = 0; i < iters; i++) saxpy<<<grid, block>>>(n, 2.0f, x, y);
        cudaEventRecord(stop, 0);
        cudaEventSynchronize(stop);
    }
    cudaEventElapsedTime(&ms, start, stop);
    {
        nvtx3::scoped_range check{"check"};
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) {
            fprintf(stderr, "nvtx_bench: %s\n", cudaGetErrorString(e));
            return 1;
        }
    }
    printf("{\"kernel\":\"saxpy\",\"n\":%d,\"iters\":%d,\"mean_us\":%.3f}\n", n, iters, 1000.0 * ms / iters);
    cudaFree(x);
    cudaFree(y);
    return 0;
}
