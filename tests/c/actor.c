/* A scripted victim for the integration tests: runs the actions given on the
 * command line, in order, and prints one JSON line per action.
 *
 *   actor ACTION...
 *
 *   k:US       launch a US-microsecond simulated kernel with cudaLaunchKernel
 *              (asynchronous: it returns at once, the kernel ends US later)
 *   kn:N:US    N such launches back to back (one line, at the end)
 *   copy:N     a synchronous N-byte cudaMemcpy: inside a gated call for N ns
 *   malloc     cudaMalloc of 64 bytes (a LIFE call; creates a context in the simulator)
 *   malloc:N   cudaMalloc of N bytes (the simulator maps them without reserving memory)
 *   free       cudaFree of the last malloc's pointer
 *   freeasync  cudaFreeAsync of the last malloc's pointer on the NULL stream
 *   sync       cudaDeviceSynchronize
 *   fork       fork(); the child runs the remaining actions too, as "child"
 *   sigwait    wait for SIGUSR1 (blocked from the start, so none is lost)
 *   line       read one line from stdin; exit quietly at EOF
 *   sleep:MS   sleep MS milliseconds
 *   reap       parent: wait for every child; child: nothing
 *   threads    only report (every line carries the thread count)
 *   begin      KREX_REGION_BEGIN() (krex.h); rc is its return value
 *   end        KREX_REGION_END()
 *   capbegin:S cudaStreamBeginCapture on stream handle S (a number)
 *   capend:S   cudaStreamEndCapture on stream handle S
 *   rc:N       make the simulated GPU return N from every call from now on
 *   ctx        cuDevicePrimaryCtxRetain of device 0 (the driver's call that makes a context)
 *   ctxnew     cuCtxCreate_v2 on device 0
 *   green      cuGreenCtxCreate on device 0, then cuGreenCtxStreamCreate: a stream of it
 *   green:N    N such green contexts, the stream on the last one
 *   gk:US      a US-microsecond kernel with cuLaunchKernel on that green context's stream
 *   greendel   cuGreenCtxDestroy of that green context
 *   greendel1  cuGreenCtxDestroy of the first green context made (green:N's first)
 *   greenconv  cuCtxFromGreenCtx of the green context of gk (the application's own conversion)
 *   greenbad   cuGreenCtxDestroy of a handle no green context has (it fails)
 *
 * Every line: {"act","role","pid","tid","rc","t0","t1","threads","helper"}, where
 * t0/t1 are CLOCK_MONOTONIC ns around the action and helper is the shim's
 * krex_shim_helper_running() (-1 when no shim is loaded). */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "include/krex.h"
#include "krex_cuda_types.h"

extern cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim, void **args,
                                    size_t sharedMem, cudaStream_t stream);
extern cudaError_t cudaMalloc(void **p, size_t n);
extern cudaError_t cudaFree(void *p);
extern cudaError_t cudaFreeAsync(void *p, cudaStream_t s);
extern cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind);
extern cudaError_t cudaDeviceSynchronize(void);
extern cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode);
extern cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t *pGraph);
extern CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
extern CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev);
extern CUresult cuGreenCtxCreate(CUgreenCtx *phCtx, CUdevResourceDesc desc, CUdevice dev, unsigned int flags);
extern CUresult cuGreenCtxDestroy(CUgreenCtx hCtx);
extern CUresult cuCtxFromGreenCtx(CUcontext *pContext, CUgreenCtx hCtx);
extern CUresult cuGreenCtxStreamCreate(CUstream *phStream, CUgreenCtx greenCtx, unsigned int flags, int priority);
extern CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                               unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                               unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra);

static const char *role = "parent";
static void *last_alloc; /* malloc's, for free */
static CUgreenCtx green;   /* green's, for gk and greendel */
static CUgreenCtx green_first; /* the first one green made, for greendel1 */
static CUstream green_stream;

static unsigned long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ull + (unsigned long long)ts.tv_nsec;
}

static int count_threads(void) {
    int n = 0;
    DIR *d = opendir("/proc/self/task");
    if (!d) return -1;
    for (struct dirent *de; (de = readdir(d));) n += de->d_name[0] != '.';
    closedir(d);
    return n;
}

static int helper_running(void) {
    int (*f)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "krex_shim_helper_running");
    return f ? f() : -1;
}

static void report(const char *act, long rc, unsigned long long t0, unsigned long long t1) {
    printf("{\"act\":\"%s\",\"role\":\"%s\",\"pid\":%d,\"tid\":%d,\"rc\":%ld,\"t0\":%llu,\"t1\":%llu,"
           "\"threads\":%d,\"helper\":%d}\n",
           act, role, (int)getpid(), (int)syscall(SYS_gettid), rc, t0, t1, count_threads(),
           helper_running());
    fflush(stdout);
}

int main(int argc, char **argv) {
    sigset_t usr1;
    sigemptyset(&usr1);
    sigaddset(&usr1, SIGUSR1);
    sigprocmask(SIG_BLOCK, &usr1, NULL);
    setvbuf(stdout, NULL, _IOLBF, 0);
    report("start", 0, now_ns(), now_ns());
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        unsigned long long t0 = now_ns();
        long rc = 0;
        if (!strncmp(a, "k:", 2)) {
            dim3 grid = {(unsigned)strtoul(a + 2, NULL, 10), 1, 1}, block = {1, 1, 1};
            rc = cudaLaunchKernel((const void *)0x1234, grid, block, NULL, 0, NULL);
            report("k", rc, t0, now_ns());
        } else if (!strncmp(a, "kn:", 3)) {
            char *us = NULL;
            unsigned long n = strtoul(a + 3, &us, 10);
            dim3 grid = {(unsigned)strtoul(us && *us == ':' ? us + 1 : "0", NULL, 10), 1, 1}, block = {1, 1, 1};
            for (unsigned long j = 0; j < n && rc == 0; j++)
                rc = cudaLaunchKernel((const void *)0x1234, grid, block, NULL, 0, NULL);
            report("kn", rc, t0, now_ns());
        } else if (!strncmp(a, "copy:", 5)) {
            static char buf[16]; /* the simulator moves no bytes: any pointers do */
            rc = cudaMemcpy(buf, buf + 8, (size_t)strtoull(a + 5, NULL, 10), cudaMemcpyHostToHost);
            report("copy", rc, t0, now_ns());
        } else if (!strcmp(a, "malloc") || !strncmp(a, "malloc:", 7)) {
            rc = cudaMalloc(&last_alloc, a[6] == ':' ? (size_t)strtoull(a + 7, NULL, 10) : 64);
            report("malloc", rc, t0, now_ns());
        } else if (!strcmp(a, "free")) {
            rc = cudaFree(last_alloc);
            report(a, rc, t0, now_ns());
        } else if (!strcmp(a, "freeasync")) {
            rc = cudaFreeAsync(last_alloc, NULL);
            report(a, rc, t0, now_ns());
        } else if (!strcmp(a, "sync")) {
            rc = cudaDeviceSynchronize();
            report(a, rc, t0, now_ns());
        } else if (!strcmp(a, "fork")) {
            fflush(stdout);
            pid_t p = fork();
            if (p == 0) role = "child";
            report(a, p, t0, now_ns());
        } else if (!strcmp(a, "sigwait")) {
            int sig = 0;
            rc = sigwait(&usr1, &sig);
            report(a, rc, t0, now_ns());
        } else if (!strcmp(a, "line")) {
            char buf[256];
            if (!fgets(buf, sizeof buf, stdin)) return 0;
            report(a, 0, t0, now_ns());
        } else if (!strncmp(a, "sleep:", 6)) {
            usleep((useconds_t)atoi(a + 6) * 1000);
            report("sleep", 0, t0, now_ns());
        } else if (!strcmp(a, "reap")) {
            int status = 0, bad = 0;
            while (wait(&status) > 0) bad += !WIFEXITED(status) || WEXITSTATUS(status) != 0;
            report(a, bad, t0, now_ns());
        } else if (!strcmp(a, "threads")) {
            report(a, 0, t0, now_ns());
        } else if (!strcmp(a, "begin")) {
            rc = KREX_REGION_BEGIN();
            report(a, rc, t0, now_ns());
        } else if (!strcmp(a, "end")) {
            rc = KREX_REGION_END();
            report(a, rc, t0, now_ns());
        } else if (!strncmp(a, "capbegin:", 9)) {
            rc = cudaStreamBeginCapture((cudaStream_t)strtoul(a + 9, NULL, 0), 0);
            report("capbegin", rc, t0, now_ns());
        } else if (!strncmp(a, "capend:", 7)) {
            cudaGraph_t g = NULL;
            rc = cudaStreamEndCapture((cudaStream_t)strtoul(a + 7, NULL, 0), &g);
            report("capend", rc, t0, now_ns());
        } else if (!strcmp(a, "ctx")) {
            CUcontext c = NULL;
            rc = cuDevicePrimaryCtxRetain(&c, 0);
            report(a, rc, t0, now_ns());
        } else if (!strcmp(a, "ctxnew")) {
            CUcontext c = NULL;
            rc = cuCtxCreate_v2(&c, 0, 0);
            report(a, rc, t0, now_ns());
        } else if (!strcmp(a, "green") || !strncmp(a, "green:", 6)) {
            long n = a[5] == ':' ? atol(a + 6) : 1;
            for (long j = 0; j < n && rc == 0; j++)
                if ((rc = cuGreenCtxCreate(&green, NULL, 0, 1 /* CU_GREEN_CTX_DEFAULT_STREAM */)) == 0 && j == 0)
                    green_first = green;
            if (rc == 0) rc = cuGreenCtxStreamCreate(&green_stream, green, 1 /* CU_STREAM_NON_BLOCKING */, 0);
            report("green", rc, t0, now_ns());
        } else if (!strncmp(a, "gk:", 3)) {
            rc = cuLaunchKernel((CUfunction)(void *)0x1234, (unsigned)strtoul(a + 3, NULL, 10), 1, 1, 1, 1, 1, 0,
                                green_stream, NULL, NULL);
            report("gk", rc, t0, now_ns());
        } else if (!strcmp(a, "greendel")) {
            rc = cuGreenCtxDestroy(green);
            report(a, rc, t0, now_ns());
        } else if (!strcmp(a, "greendel1")) {
            rc = cuGreenCtxDestroy(green_first);
            report(a, rc, t0, now_ns());
        } else if (!strcmp(a, "greenconv")) {
            CUcontext c = NULL;
            rc = cuCtxFromGreenCtx(&c, green);
            report(a, rc, t0, now_ns());
        } else if (!strcmp(a, "greenbad")) {
            static char never_made;
            rc = cuGreenCtxDestroy((CUgreenCtx)(void *)&never_made);
            report(a, rc, t0, now_ns());
        } else if (!strncmp(a, "rc:", 3)) {
            void (*set)(int) = (void (*)(int))dlsym(RTLD_DEFAULT, "simgpu_set_return");
            if (set) set(atoi(a + 3));
            report("rc", set ? 0 : -1, t0, now_ns());
        } else {
            fprintf(stderr, "actor: unknown action %s\n", a);
            return 2;
        }
    }
    report("exit", 0, now_ns(), now_ns());
    return 0;
}
