// nvtx_ranges: a C++ harness that brackets simulated-GPU work with NVTX v3 ranges of
// every kind (push/pop, start/end, ASCII, wide, registered strings, a domain of its own,
// nvtx3::scoped_range, nesting, threads, a range ended on another thread). It knows
// nothing of KREX; under `krex run` with KREX_NVTX_REGION=PATTERN the ranges whose name
// matches become regions (interpose/nvtx_inject.c).
//
// Output: one JSON line per range, {"name": ..., "ns": ..., "tid": ...}: a CLOCK_MONOTONIC
// time inside the range (between its start and its work), which a test compares with the
// regions' grant and end times. Compiled by the test harness (tests/helpers) with the
// NVTX v3 headers of the CUDA toolkit.
#include <nvtx3/nvtx3.hpp>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <thread>
#include <unistd.h>
#include <sys/syscall.h>

extern "C" {
#include "krex_cuda_types.h"
typedef struct CUevent_st *cudaEvent_t;
cudaError_t cudaSetDevice(int device);
cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim, void **args, size_t sharedMem,
                             cudaStream_t stream);
cudaError_t cudaDeviceSynchronize(void);
}

// The layouts libkrex_nvtx.so declares for itself (interpose/nvtx_inject.c), checked
// against the real headers.
static_assert(offsetof(nvtxEventAttributes_t, messageType) == 32, "nvtxEventAttributes_v2 layout");
static_assert(offsetof(nvtxEventAttributes_t, message) == 40, "nvtxEventAttributes_v2 layout");
static_assert(NVTX_CBID_CORE_RangeStartEx == 4 && NVTX_CBID_CORE_RangePop == 11, "core callback ids");
static_assert(NVTX_CBID_CORE2_DomainRangeStartEx == 2 && NVTX_CBID_CORE2_DomainCreateW == 13, "core2 ids");
static_assert(NVTX_ETID_CALLBACKS == 1 && NVTX_ETID_VERSIONINFO == 3, "export table ids");
static_assert(NVTX_CB_MODULE_CORE == 1 && NVTX_CB_MODULE_CORE2 == 5, "module ids");

static void kernel() {}

static void work(unsigned us = 300) {
    dim3 grid = {us, 1, 1}, block = {1, 1, 1};
    if (cudaLaunchKernel((const void *)kernel, grid, block, nullptr, 0, nullptr) || cudaDeviceSynchronize()) {
        std::fprintf(stderr, "nvtx_ranges: a CUDA call failed\n");
        std::exit(1);
    }
}

static void mark(const char *name) {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    std::printf("{\"name\":\"%s\",\"ns\":%lld,\"tid\":%ld}\n", name,
                (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec, (long)syscall(SYS_gettid));
    std::fflush(stdout);
}

static nvtxEventAttributes_t ascii(const char *name) {
    nvtxEventAttributes_t a;
    std::memset(&a, 0, sizeof a);
    a.version = NVTX_VERSION;
    a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    a.messageType = NVTX_MESSAGE_TYPE_ASCII;
    a.message.ascii = name;
    return a;
}

struct test_domain {
    static constexpr char const *name{"krex-test"};
};

int main() {
    if (cudaSetDevice(0)) return 1;
    work(10);  // the context, outside any range

    nvtxRangePushA("k-push"); mark("k-push"); work(); nvtxRangePop();
    nvtxRangePushA("other-push"); mark("other-push"); work(); nvtxRangePop();

    nvtxRangePushA("k-outer"); nvtxRangePushA("k-inner"); mark("k-inner"); work(); nvtxRangePop(); nvtxRangePop();
    nvtxRangePushA("other-outer"); nvtxRangePushA("k-in-other"); mark("k-in-other"); work(); nvtxRangePop();
    nvtxRangePop();

    nvtxEventAttributes_t ex = ascii("k-ex");
    nvtxRangePushEx(&ex); mark("k-ex"); work(); nvtxRangePop();
    nvtxRangePushW(L"k-wide-\u00e9"); mark("k-wide"); work(); nvtxRangePop();

    nvtxDomainHandle_t d = nvtxDomainCreateA("krex-test");
    nvtxStringHandle_t reg = nvtxDomainRegisterStringA(d, "k-reg");
    nvtxEventAttributes_t ra = ascii("");
    ra.messageType = NVTX_MESSAGE_TYPE_REGISTERED;
    ra.message.registered = reg;
    nvtxDomainRangePushEx(d, &ra);
    nvtxRangePushA("other-global-while-domain"); nvtxRangePop();  // another domain's stack
    mark("k-reg"); work(); nvtxDomainRangePop(d);

    { nvtx3::scoped_range r{"k-cpp"}; mark("k-cpp"); work(); }
    { nvtx3::scoped_range_in<test_domain> r{"k-cpp-domain"}; mark("k-cpp-domain"); work(); }

    nvtxRangeId_t id = nvtxRangeStartA("k-start"); mark("k-start"); work(); nvtxRangeEnd(id);
    id = nvtxRangeStartA("k-cross"); mark("k-cross"); work();
    std::thread([id] { nvtxRangeEnd(id); }).join();  // ended on another thread
    nvtxRangePushA("k-after-cross"); mark("k-after-cross"); work(); nvtxRangePop();

    std::thread t1([] { nvtxRangePushA("k-thread"); mark("k-thread"); work(); nvtxRangePop(); });
    std::thread t2([] { nvtxRangePushA("k-thread"); mark("k-thread"); work(); nvtxRangePop(); });
    t1.join();
    t2.join();

    nvtxRangePushA("k-host"); id = nvtxRangeStartA("k-start-nested"); mark("k-start-nested"); work();
    nvtxRangeEnd(id); nvtxRangePop();
    id = nvtxRangeStartA("k-handed");  // handed over at its start: a push on its thread nests in it
    nvtxRangePushA("k-push-in-handed"); mark("k-push-in-handed"); work(); nvtxRangePop();
    nvtxRangeEnd(id);
    nvtxRangeId_t other = nvtxRangeStartA("other-start"); mark("other-start"); work(); nvtxRangeEnd(other);
    std::printf("{\"done\":true}\n");
    return 0;
}
