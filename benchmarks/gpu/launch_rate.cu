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
    if (!strcmp(mode, "enq")) {
        // Host-side enqueue cost only: short bursts that never fill the launch queue.
        double best = 1e30, sum = 0;
        int bursts = n / 256;
        for (int b = 0; b < bursts; b++) {
            auto s0 = std::chrono::steady_clock::now();
            for (int i = 0; i < 256; i++) empty_kernel<<<1, 1>>>();
            auto s1 = std::chrono::steady_clock::now();
            cudaDeviceSynchronize();
            double ns = std::chrono::duration<double, std::nano>(s1 - s0).count() / 256;
            sum += ns;
            if (ns < best) best = ns;
        }
        printf("{\"mode\":\"enq\",\"n\":%d,\"ns_per_launch\":%.1f,\"min_ns\":%.1f,\"err\":0}\n", n, sum / bursts, best);
        return 0;
    }
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
