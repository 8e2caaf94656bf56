/* Split copies and memsets, generated from the tables' chunk column: every row
 * with a COPY or SET spec is called through its exported wrapper (the PLT path)
 * with buffers of several chunks, and the bytes it leaves are checked.
 *
 *   chunks run BYTES [NAME]     call every chunked entry (or NAME) with BYTES-long
 *                               buffers: {"name","rc","ok","t0","t1"} per call
 *   chunks capture BYTES        cudaMemcpyAsync of BYTES on a stream, during a graph
 *                               capture of that stream, then after its end
 *
 * Run with KREX_SIM_MOVE_BYTES=1 (the simulator then moves bytes: its "device"
 * memory is host memory) and KREX_COPY_CHUNK_BYTES set; the test counts the
 * simulated GPU's ops per call in its trace. */
#define _GNU_SOURCE
#define SIM_SAMPLES_DEFINE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "krex_tables.h"
#include "sim/sim_samples.h"

static void *g_fp;
static uintptr_t g_dst, g_src;
static uint64_t g_n;
static uint32_t g_val;

static unsigned long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ull + (unsigned long long)ts.tv_nsec;
}

/* Replace the spec's fields in the sample arguments by the test's buffers. */
#define CK_SET_COPY(cnt, esz, val, dst, src) \
    cnt = (__typeof__(cnt))g_n;              \
    dst = (__typeof__(dst))g_dst;            \
    src = (__typeof__(src))g_src;
#define CK_SET_SET(cnt, esz, val, dst) \
    cnt = (__typeof__(cnt))g_n;        \
    dst = (__typeof__(dst))g_dst;      \
    val = (__typeof__(val))g_val;
#define CK_KIND_NONE() 0
#define CK_KIND_COPY(cnt, esz, val, ...) 1
#define CK_KIND_SET(cnt, esz, val, ...) 2
#define CK_ESZ_NONE() 0
#define CK_ESZ_COPY(cnt, esz, ...) esz
#define CK_ESZ_SET(cnt, esz, ...) esz
#define CK_INFO(kind, spec) {CK_KIND_##kind spec, CK_ESZ_##kind spec}

/* Only rows with a chunk spec get a caller (the others' samples need not fit). */
#define CK_DEF(kind, spec, name, params, args, sample) CK_DEF_##kind(spec, name, params, args, sample)
#define CK_DEF_NONE(spec, name, params, args, sample)
#define CK_DEF_COPY(spec, name, params, args, sample) CK_DEF_WITH(CK_SET_COPY, spec, name, params, args, sample)
#define CK_DEF_SET(spec, name, params, args, sample) CK_DEF_WITH(CK_SET_SET, spec, name, params, args, sample)
/* A caller that records the row's chunk parameters (`set`), then calls the hook. */
#define CK_DEF_WITH(set, spec, name, params, args, sample) \
    extern int name params;                                \
    static int with_##name params {                        \
        set spec                                           \
        return ((int(*) params)g_fp) args;                 \
    }                                                      \
    static int call_##name(void) { return with_##name sample; }
#define CK_PTR(kind, spec, p) CK_PTR_##kind(p)
#define CK_PTR_NONE(p) NULL
#define CK_PTR_COPY(p) p
#define CK_PTR_SET(p) p

#define X(name, lookup, variant, cls, params, args, stream, cost, sample, chunk) \
    KREX_CALL(CK_DEF, KREX_CK_##chunk, name, params, args, sample)
#include "api_cudart.def"
#include "api_driver.def"
#include "api_hip.def"
#undef X

static int (*const callers[KREX_N_IDS])(void) = {
#define X(name, lookup, variant, cls, params, args, stream, cost, sample, chunk) \
    [KREX_ID_##name] = KREX_CALL(CK_PTR, KREX_CK_##chunk, call_##name),
#include "api_cudart.def"
#include "api_driver.def"
#include "api_hip.def"
#undef X
};
static void *const direct[KREX_N_IDS] = {
#define X(name, lookup, variant, cls, params, args, stream, cost, sample, chunk) \
    [KREX_ID_##name] = KREX_CALL(CK_PTR, KREX_CK_##chunk, (void *)name),
#include "api_cudart.def"
#include "api_driver.def"
#include "api_hip.def"
#undef X
};
static const struct { int kind, esz; } info[KREX_N_IDS] = {
#define X(name, lookup, variant, cls, params, args, stream, cost, sample, chunk) \
    [KREX_ID_##name] = KREX_CALL(CK_INFO, KREX_CK_##chunk),
#include "api_cudart.def"
#include "api_driver.def"
#include "api_hip.def"
#undef X
};

#define GUARD 64

static unsigned char pattern(size_t i, int id) { return (unsigned char)(i * 131u + (unsigned)id * 7u + 1u); }

/* One call of entry `id` over `bytes` bytes; 1 when it left exactly the right bytes. */
static int run_one(int id, size_t bytes, int *rc) {
    int esz = info[id].esz;
    size_t n = bytes / (size_t)esz;
    bytes = n * (size_t)esz;
    unsigned char *dst = malloc(bytes + GUARD), *src = malloc(bytes);
    if (!dst || !src) return 0;
    memset(dst, 0xEE, bytes + GUARD);
    for (size_t i = 0; i < bytes; i++) src[i] = pattern(i, id);
    static const uint32_t vals[5] = {0, 0xA5, 0xBEEF, 0, 0xDEADBEEF};
    g_fp = direct[id];
    g_dst = (uintptr_t)dst;
    g_src = (uintptr_t)src;
    g_n = n;
    g_val = vals[esz];
    *rc = callers[id]();
    int ok = 1;
    for (size_t i = bytes; i < bytes + GUARD; i++) ok &= dst[i] == 0xEE; /* nothing past the end */
    if (info[id].kind == 1) {
        ok &= memcmp(dst, src, bytes) == 0;
    } else {
        for (size_t i = 0; i < n && ok; i++) {
            uint32_t v = esz == 1 ? dst[i] : esz == 2 ? ((uint16_t *)dst)[i] : ((uint32_t *)dst)[i];
            ok &= v == g_val;
        }
    }
    /* On an error: how many leading bytes were done (whole chunks before the failing one). */
    if (*rc != 0) {
        size_t done = 0;
        while (done < bytes && (info[id].kind == 1 ? dst[done] == src[done] : dst[done] != 0xEE)) done++;
        printf("{\"done_bytes\":%zu}\n", done);
    }
    free(dst);
    free(src);
    return ok;
}

extern cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode);
extern cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t *pGraph);

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    sim_samples_init();
    if (argc < 3) {
        fprintf(stderr, "usage: %s run BYTES [NAME] | capture BYTES\n", argv[0]);
        return 2;
    }
    size_t bytes = strtoull(argv[2], NULL, 10);
    if (!strcmp(argv[1], "capture")) {
        int id = KREX_ID_cudaMemcpyAsync;
        cudaStream_t s = (cudaStream_t)sim_stream;
        for (int cap = 1; cap >= 0; cap--) {
            if (cap) cudaStreamBeginCapture(s, 0);
            int rc, ok;
            unsigned long long t0 = now_ns();
            ok = run_one(id, bytes, &rc);
            unsigned long long t1 = now_ns();
            if (cap) cudaStreamEndCapture(s, NULL);
            printf("{\"name\":\"cudaMemcpyAsync\",\"capturing\":%d,\"rc\":%d,\"ok\":%d,\"t0\":%llu,\"t1\":%llu}\n",
                   cap, rc, ok, t0, t1);
        }
        return 0;
    }
    const char *only = argc >= 4 ? argv[3] : NULL;
    for (int i = 0; i < KREX_N_IDS; i++) {
        if (!krex_entries[i].name || info[i].kind == 0 || krex_entries[i].variant == KREX_VAR_V1) continue;
        if (only && strcmp(only, krex_entries[i].name)) continue;
        int rc;
        unsigned long long t0 = now_ns();
        int ok = run_one(i, bytes, &rc);
        unsigned long long t1 = now_ns();
        printf("{\"name\":\"%s\",\"kind\":%d,\"esz\":%d,\"rc\":%d,\"ok\":%d,\"t0\":%llu,\"t1\":%llu}\n",
               krex_entries[i].name, info[i].kind, info[i].esz, rc, ok, t0, t1);
    }
    return 0;
}
