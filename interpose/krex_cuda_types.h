/* Minimal, ABI-compatible declarations of the CUDA and HIP types that appear in
 * the api_*.def tables. The shim and the simulated GPU only pass these through
 * (or read the few fields named below), so opaque handles are enough and no
 * vendor header is needed at build time. tests/unit/test_tables.py compiles the
 * tables against the real CUDA 13 headers to prove every prototype matches.
 * Struct layouts that matter (by-value args, fields the simulator reads) copy
 * the vendor definitions exactly. */
#ifndef KREX_CUDA_TYPES_H
#define KREX_CUDA_TYPES_H
#include <stddef.h>
#include <stdint.h>

/* ---- CUDA driver ---- */
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned int CUdeviceptr_v1;
typedef uint64_t cuuint64_t;
typedef struct CUctx_st *CUcontext;
typedef struct CUgreenCtx_st *CUgreenCtx;
typedef struct CUdevResourceDesc_st *CUdevResourceDesc;
typedef struct CUstream_st *CUstream;
typedef struct CUfunc_st *CUfunction;
typedef struct CUarray_st *CUarray;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUlaunchAttribute_st CUlaunchAttribute;
typedef struct CUDA_MEMCPY2D_st CUDA_MEMCPY2D;
typedef struct CUDA_MEMCPY2D_v1_st CUDA_MEMCPY2D_v1;
typedef struct CUDA_MEMCPY3D_st CUDA_MEMCPY3D;
typedef struct CUDA_MEMCPY3D_v1_st CUDA_MEMCPY3D_v1;
typedef struct CUDA_MEMCPY3D_PEER_st CUDA_MEMCPY3D_PEER;
typedef struct CUDA_MEMCPY3D_BATCH_OP_st CUDA_MEMCPY3D_BATCH_OP;
typedef struct CUmemcpyAttributes_st CUmemcpyAttributes;
typedef struct CUctxCreateParams_st CUctxCreateParams;
typedef struct CUexecAffinityParam_st CUexecAffinityParam;
typedef int CUdriverProcAddressQueryResult;
typedef int CUstreamCaptureMode;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct CUgraphEdgeData_st CUgraphEdgeData;
typedef struct CUmemLocation_st { int type; int id; } CUmemLocation;
typedef struct CUmod_st *CUmodule;
typedef struct CUlib_st *CUlibrary;
typedef int CUjit_option;                 /* enum CUjit_option_enum */
typedef int CUlibraryOption;              /* enum CUlibraryOption_enum */
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUmemAllocationProp_st CUmemAllocationProp;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef struct CUlaunchConfig_st {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;
typedef struct CUDA_LAUNCH_PARAMS_st {
    CUfunction function;
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    void **kernelParams;
} CUDA_LAUNCH_PARAMS;
#define CUDA_SUCCESS 0
#define CUDA_ERROR_NOT_FOUND 500
#define CUDA_ERROR_NOT_SUPPORTED 801
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_CONTEXT_IS_DESTROYED 709
#define KREX_ERR_CAPTURE_INVALIDATED 901 /* same value in CUDA driver, runtime and HIP */
#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 2
#define CU_STREAM_CAPTURE_MODE_RELAXED 2

/* ---- CUDA runtime ---- */
typedef int cudaError_t;
typedef struct CUstream_st *cudaStream_t;
typedef struct CUgraphExec_st *cudaGraphExec_t;
typedef struct cudaArray *cudaArray_t;
typedef const struct cudaArray *cudaArray_const_t;
typedef struct CUkern_st *cudaKernel_t;
typedef struct dim3 { unsigned int x, y, z; } dim3;
enum cudaMemcpyKind { cudaMemcpyHostToHost = 0, cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2, cudaMemcpyDeviceToDevice = 3, cudaMemcpyDefault = 4 };
enum cudaDriverEntryPointQueryResult { cudaDriverEntryPointSuccess = 0 };
enum cudaStreamCaptureMode { cudaStreamCaptureModeGlobal = 0, cudaStreamCaptureModeThreadLocal = 1,
    cudaStreamCaptureModeRelaxed = 2 };
typedef struct CUgraph_st *cudaGraph_t;
typedef struct CUmemPoolHandle_st *cudaMemPool_t;
typedef struct CUgraphNode_st *cudaGraphNode_t;
typedef struct cudaGraphEdgeData_st cudaGraphEdgeData;
struct cudaPitchedPtr { void *ptr; size_t pitch; size_t xsize; size_t ysize; };
struct cudaExtent { size_t width; size_t height; size_t depth; };
struct cudaMemLocation { int type; int id; };
struct cudaMemcpy3DParms;
struct cudaMemcpy3DPeerParms;
struct cudaMemcpyAttributes;
struct cudaMemcpy3DBatchOp;
typedef struct cudaLaunchAttribute_st cudaLaunchAttribute;
typedef struct cudaLaunchConfig_st {
    dim3 gridDim;
    dim3 blockDim;
    size_t dynamicSmemBytes;
    cudaStream_t stream;
    cudaLaunchAttribute *attrs;
    unsigned int numAttrs;
} cudaLaunchConfig_t;
#define cudaSuccess 0
#define cudaErrorInitializationError 3
#define cudaEnablePerThreadDefaultStream 2

/* ---- HIP ---- */
typedef int hipError_t;
typedef struct ihipStream_t *hipStream_t;
typedef struct ihipEvent_t *hipEvent_t;
typedef struct ihipModuleSymbol_t *hipFunction_t;
typedef struct hipGraphExec *hipGraphExec_t;
typedef struct hipArray *hipArray_t;
typedef const struct hipArray *hipArray_const_t;
typedef void *hipDeviceptr_t;
typedef struct ihipModule_t *hipModule_t;
typedef struct ihipCtx_t *hipCtx_t;
typedef int hipDevice_t;
typedef int hipJitOption;                 /* enum hipJitOption */
typedef enum hipMemcpyKind { hipMemcpyHostToHost = 0, hipMemcpyHostToDevice = 1,
    hipMemcpyDeviceToHost = 2, hipMemcpyDeviceToDevice = 3, hipMemcpyDefault = 4 } hipMemcpyKind;
typedef int hipDriverProcAddressQueryResult;
typedef int hipDriverEntryPointQueryResult;
typedef int hipStreamCaptureMode;
typedef struct ihipGraph *hipGraph_t;
typedef struct hipGraphNode *hipGraphNode_t;
typedef struct hipGraphEdgeData hipGraphEdgeData;
typedef struct hipPitchedPtr { void *ptr; size_t pitch; size_t xsize; size_t ysize; } hipPitchedPtr;
typedef struct hipExtent { size_t width; size_t height; size_t depth; } hipExtent;
typedef struct hipMemLocation { int type; int id; } hipMemLocation; /* type: enum hipMemLocationType */
struct hipMemcpy3DParms;
struct hipMemcpy3DBatchOp;
typedef struct hipMemcpy3DPeerParms hipMemcpy3DPeerParms;
typedef struct hipMemcpyAttributes hipMemcpyAttributes;
typedef struct hip_Memcpy2D hip_Memcpy2D;
typedef struct HIP_MEMCPY3D HIP_MEMCPY3D;
typedef struct hipLaunchAttribute_st hipLaunchAttribute;
typedef struct hipLaunchConfig_st {
    dim3 gridDim;
    dim3 blockDim;
    size_t dynamicSmemBytes;
    hipStream_t stream;
    hipLaunchAttribute *attrs;
    unsigned int numAttrs;
} hipLaunchConfig_t;
typedef struct HIP_LAUNCH_CONFIG_st {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    hipStream_t hStream;
    hipLaunchAttribute *attrs;
    unsigned int numAttrs;
} HIP_LAUNCH_CONFIG;
typedef struct hipLaunchParams_t {
    void *func;
    dim3 gridDim;
    dim3 blockDim;
    void **args;
    size_t sharedMem;
    hipStream_t stream;
} hipLaunchParams;
typedef struct hipFunctionLaunchParams_t {
    hipFunction_t function;
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    hipStream_t hStream;
    void **kernelParams;
} hipFunctionLaunchParams;
#define hipSuccess 0
#define hipErrorNotInitialized 3
#define HIP_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 2

#endif
