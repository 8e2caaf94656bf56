// Launch rate of an empty kernel: measures what the shim's gate adds per launch.
// Build: nvcc -O2 -cudart shared -arch=sm_90 launch_rate.cu -o launch_rate -lcuda
#include <cuda.h>
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

__global__ void empty_kernel() {}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 100000;
    const char *mode = argc > 2 ? argv[2] : "rt";
    CUfunction f = nullptr;
    if (!strcmp(mode, "drv")) {
        cudaFree(0);
        cudaFunction_t rf;
        cudaGetFuncBySymbol(&rf, (const void *)empty_kernel);
        f = (CUfunction)rf;
    }
    for (int i = 0; i < 1000; i++) empty_kernel<<<1, 1>>>();
    cudaDeviceSynchronize();
    auto t0 = std::chrono::steady_clock::now();
    if (f) {
        for (int i = 0; i < n; i++) cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, 0, nullptr, nullptr);
    } else {
        for (int i = 0; i < n; i++) empty_kernel<<<1, 1>>>();
    }
    cudaError_t e = cudaDeviceSynchronize();
    auto t1 = std::chrono::steady_clock::now();
    double ns = std::chrono::duration<double, std::nano>(t1 - t0).count() / n;
    printf("{\"mode\":\"%s\",\"n\":%d,\"ns_per_launch\":%.1f,\"err\":%d}\n", mode, n, ns, (int)e);
    return e != cudaSuccess;
}
