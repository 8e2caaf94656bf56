/* KREX_NVTX_REGION: make NVTX load libkrex_nvtx.so (interpose/nvtx_inject.c) in every
 * process of a command, `krex run` and `krex env` alike: at load, before any NVTX call,
 * the shim points NVTX_INJECTION64_PATH at the library next to itself. An injection
 * that was configured already (Nsight Systems') moves to KREX_NVTX_NEXT, where the
 * library finds it and chains to it. Only under KREX (KREX_SHM set) and only when
 * KREX_NVTX_REGION is not empty: otherwise nothing changes. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "shim.h"

#define NVTX_LIB "libkrex_nvtx.so"

__attribute__((constructor)) static void krex_nvtx_env(void) {
    const char *pat = getenv("KREX_NVTX_REGION"), *shm = getenv("KREX_SHM");
    if (!pat || !*pat || !shm || !*shm) return;
    Dl_info info;
    if (!dladdr((void *)krex_nvtx_env, &info) || !info.dli_fname) return;
    char path[PATH_MAX];
    const char *slash = strrchr(info.dli_fname, '/');
    size_t dir = slash ? (size_t)(slash - info.dli_fname) + 1 : 0;
    if (dir + sizeof NVTX_LIB > sizeof path) return;
    memcpy(path, info.dli_fname, dir);
    memcpy(path + dir, NVTX_LIB, sizeof NVTX_LIB);
    if (access(path, R_OK) != 0) {
        klog("KREX_NVTX_REGION is set but %s is missing: NVTX ranges will not be regions", path);
        return;
    }
    const char *old = getenv("NVTX_INJECTION64_PATH");
    if (old && strcmp(old, path) == 0) return;
    if (old && *old) setenv("KREX_NVTX_NEXT", old, 1); /* chained to by the library */
    setenv("NVTX_INJECTION64_PATH", path, 1);
}
