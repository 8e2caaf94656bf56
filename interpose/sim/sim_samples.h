/* Names used by the `sample` and `cost_ns` columns of the api_*.def tables.
 *
 * cost_ns conventions of the simulated GPU:
 *   kernels  gridDim.x microseconds (1 us per block along x)
 *   copies   1 ns per byte, memsets likewise, batches: the sum of sizes
 *   graphs   the exec handle's value, in microseconds
 *   anything described only by an opaque struct: SIM_FIXED_NS
 * A sample is an argument list that launches a sim_us-microsecond kernel or a
 * sim_bytes-byte copy through that entry point. */
#ifndef KREX_SIM_SAMPLES_H
#define KREX_SIM_SAMPLES_H
#include <stdint.h>
#include "../krex_cuda_types.h"

#define SIM_US_NS(us) ((uint64_t)(us) * 1000ull)
#define SIM_FIXED_NS 10000ull
#define SIM_NULL_STREAM ((const void *)0)
/* LIFE calls (contexts, modules, device memory) occupy the simulated GPU this long: on an
 * H200 a sibling loading modules made a GEMM 42% slower (docs/results/lifecycle-calls/). */
#define SIM_LIFE_NS 500000ull

static inline const void *sim_cfg_stream_cu(const CUlaunchConfig *c) { return c ? (const void *)c->hStream : 0; }
static inline const void *sim_cfg_stream_rt(const cudaLaunchConfig_t *c) { return c ? (const void *)c->stream : 0; }
static inline const void *sim_cfg_stream_hip(const hipLaunchConfig_t *c) { return c ? (const void *)c->stream : 0; }
static inline const void *sim_cfg_stream_hipdrv(const HIP_LAUNCH_CONFIG *c) { return c ? (const void *)c->hStream : 0; }
#define SIM_CFG_STREAM(c)                                                   \
    _Generic((c), const CUlaunchConfig *: sim_cfg_stream_cu,                \
             const cudaLaunchConfig_t *: sim_cfg_stream_rt,                 \
             const hipLaunchConfig_t *: sim_cfg_stream_hip,                 \
             const HIP_LAUNCH_CONFIG *: sim_cfg_stream_hipdrv)(c)

static inline uint64_t sim_sum(const size_t *sizes, size_t n) {
    uint64_t s = 0;
    for (size_t i = 0; sizes && i < n; i++) s += sizes[i];
    return s;
}

#ifdef SIM_SAMPLES_DEFINE
/* The objects samples point at; tests set sim_us / sim_bytes then call sim_samples_init(). */
static unsigned int sim_us = 100;
static size_t sim_bytes = 100000;
static char sim_hbuf_store[4096];
static uint64_t sim_out_store[8]; /* where a LIFE sample's out-parameter lands */
static size_t sim_sizes[4];
static void *sim_ptrs[4];
static CUlaunchConfig sim_cfg_CUlaunchConfig;
static cudaLaunchConfig_t sim_cfg_cudaLaunchConfig_t;
static hipLaunchConfig_t sim_cfg_hipLaunchConfig_t;
static HIP_LAUNCH_CONFIG sim_cfg_HIP_LAUNCH_CONFIG;
static CUDA_LAUNCH_PARAMS sim_multi_CUDA_LAUNCH_PARAMS;
static hipLaunchParams sim_multi_hipLaunchParams;
static hipFunctionLaunchParams sim_multi_hipFunctionLaunchParams;
static void *sim_stream = (void *)0x5000;

static void sim_samples_init(void) {
    dim3 grid = {sim_us, 1, 1}, block = {1, 1, 1};
    sim_sizes[0] = sim_bytes;
    sim_ptrs[0] = sim_hbuf_store;
    sim_cfg_CUlaunchConfig = (CUlaunchConfig){sim_us, 1, 1, 1, 1, 1, 0, (CUstream)sim_stream, 0, 0};
    sim_cfg_cudaLaunchConfig_t = (cudaLaunchConfig_t){grid, block, 0, (cudaStream_t)sim_stream, 0, 0};
    sim_cfg_hipLaunchConfig_t = (hipLaunchConfig_t){grid, block, 0, (hipStream_t)sim_stream, 0, 0};
    sim_cfg_HIP_LAUNCH_CONFIG = (HIP_LAUNCH_CONFIG){sim_us, 1, 1, 1, 1, 1, 0, (hipStream_t)sim_stream, 0, 0};
    sim_multi_CUDA_LAUNCH_PARAMS = (CUDA_LAUNCH_PARAMS){0, sim_us, 1, 1, 1, 1, 1, 0, (CUstream)sim_stream, 0};
    sim_multi_hipLaunchParams = (hipLaunchParams){0, grid, block, 0, 0, (hipStream_t)sim_stream};
    sim_multi_hipFunctionLaunchParams = (hipFunctionLaunchParams){0, sim_us, 1, 1, 1, 1, 1, 0, (hipStream_t)sim_stream, 0};
}

#define SIM_US sim_us
#define SIM_BYTES sim_bytes
#define SIM_GRID ((dim3){sim_us, 1, 1})
#define SIM_BLOCK ((dim3){1, 1, 1})
#define SIM_STREAM sim_stream
#define SIM_HBUF ((void *)sim_hbuf_store)
#define SIM_OUT(T) ((T *)(void *)sim_out_store)
#define SIM_DPTR ((CUdeviceptr)(uintptr_t)sim_hbuf_store)
#define SIM_DPTR32 ((CUdeviceptr_v1)0x1000)
#define SIM_FUNC ((void *)0x1234)
#define SIM_CUFUNC ((void *)0x1234)
#define SIM_GRAPH ((void *)(uintptr_t)sim_us)
#define SIM_CFG(T) (&sim_cfg_##T)
#define SIM_MULTI(T) (&sim_multi_##T)
#define SIM_RT_LOC ((struct cudaMemLocation){1, 0})
#define SIM_CU_LOC ((CUmemLocation){1, 0})
#define SIM_PITCHED ((struct cudaPitchedPtr){sim_hbuf_store, 64, 64, 1})
#define SIM_EXTENT ((struct cudaExtent){64, 1, 1})
#define SIM_HIP_PITCHED ((hipPitchedPtr){sim_hbuf_store, 64, 64, 1})
#define SIM_HIP_EXTENT ((hipExtent){64, 1, 1})
#define SIM_HIP_LOC ((hipMemLocation){1, 0})
#endif

#endif
