/* Expands the api_*.def tables into entry ids and metadata. Included by the
 * shim, the simulated GPU and the generated tests, so every consumer sees the
 * same list. */
#ifndef KREX_TABLES_H
#define KREX_TABLES_H
#include "krex_abi.h"
#include "krex_cuda_types.h"

#define KREX_UNPAREN(...) __VA_ARGS__
#define KREX_STR(x) #x

/* Classes that only the C side knows about (not gated, not counted). */
#define KREX_CLS_CTXNEW 8
#define KREX_CLS_CTXDEL 9
#define KREX_CLS_CAPBEGIN 10
#define KREX_CLS_CAPEND 11
#define KREX_CLS_GREENNEW 12
#define KREX_CLS_GREENDEL 13
#define KREX_CLS_GREENCTX 14

enum krex_variant { KREX_VAR_DEF = 0, KREX_VAR_PT = 1, KREX_VAR_V1 = 2 };
enum krex_api { KREX_API_CUDART = 0, KREX_API_DRIVER = 1, KREX_API_HIP = 2, KREX_N_APIS = 3 };

enum krex_id {
#define X(name, ...) KREX_ID_##name,
#include "api_cudart.def"
    KREX_ID__END_CUDART,
#include "api_driver.def"
    KREX_ID__END_DRIVER,
#include "api_hip.def"
    KREX_ID__END_HIP,
#undef X
    KREX_N_IDS
};

struct krex_entry {
    const char *name;
    const char *lookup;
    unsigned char api;
    unsigned char variant;
    unsigned char cls;
};

/* Indexed by enum krex_id; the three end markers have name == NULL. */
static const struct krex_entry krex_entries[KREX_N_IDS] = {
#define X(name, lookup, variant, cls, ...) \
    [KREX_ID_##name] = {#name, #lookup, KREX_API_CUDART, KREX_VAR_##variant, KREX_CLS_##cls},
#include "api_cudart.def"
#undef X
#define X(name, lookup, variant, cls, ...) \
    [KREX_ID_##name] = {#name, #lookup, KREX_API_DRIVER, KREX_VAR_##variant, KREX_CLS_##cls},
#include "api_driver.def"
#undef X
#define X(name, lookup, variant, cls, ...) \
    [KREX_ID_##name] = {#name, #lookup, KREX_API_HIP, KREX_VAR_##variant, KREX_CLS_##cls},
#include "api_hip.def"
#undef X
};

/* FOR_EACH over up to 16 arguments (enough for the widest prototype, 14). */
#define KREX_NARGS_(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, _12, _13, _14, _15, _16, N, ...) N
#define KREX_NARGS(...) KREX_NARGS_(__VA_ARGS__, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1)
#define KREX_CAT_(a, b) a##b
#define KREX_CAT(a, b) KREX_CAT_(a, b)
#define KREX_FE_1(m, x) m(x)
#define KREX_FE_2(m, x, ...) m(x) KREX_FE_1(m, __VA_ARGS__)
#define KREX_FE_3(m, x, ...) m(x) KREX_FE_2(m, __VA_ARGS__)
#define KREX_FE_4(m, x, ...) m(x) KREX_FE_3(m, __VA_ARGS__)
#define KREX_FE_5(m, x, ...) m(x) KREX_FE_4(m, __VA_ARGS__)
#define KREX_FE_6(m, x, ...) m(x) KREX_FE_5(m, __VA_ARGS__)
#define KREX_FE_7(m, x, ...) m(x) KREX_FE_6(m, __VA_ARGS__)
#define KREX_FE_8(m, x, ...) m(x) KREX_FE_7(m, __VA_ARGS__)
#define KREX_FE_9(m, x, ...) m(x) KREX_FE_8(m, __VA_ARGS__)
#define KREX_FE_10(m, x, ...) m(x) KREX_FE_9(m, __VA_ARGS__)
#define KREX_FE_11(m, x, ...) m(x) KREX_FE_10(m, __VA_ARGS__)
#define KREX_FE_12(m, x, ...) m(x) KREX_FE_11(m, __VA_ARGS__)
#define KREX_FE_13(m, x, ...) m(x) KREX_FE_12(m, __VA_ARGS__)
#define KREX_FE_14(m, x, ...) m(x) KREX_FE_13(m, __VA_ARGS__)
#define KREX_FE_15(m, x, ...) m(x) KREX_FE_14(m, __VA_ARGS__)
#define KREX_FE_16(m, x, ...) m(x) KREX_FE_15(m, __VA_ARGS__)
#define KREX_FOR_EACH(m, ...) KREX_CAT(KREX_FE_, KREX_NARGS(__VA_ARGS__))(m, __VA_ARGS__)

/* The `chunk` column: KREX_CK_##chunk is `kind, (count, element size, value, pointers...)`.
 * kind NONE: never split; COPY: a 1-D copy, `count` bytes from src to dst; SET: a 1-D
 * memset of `count` elements. Chunks advance every pointer by the bytes done. */
#define KREX_CK_NONE NONE, ()
#define KREX_CK_COPY(count, dst, src) COPY, (count, 1, 0, dst, src)
#define KREX_CK_SET(count, esize, dst, value) SET, (count, esize, value, dst)
/* m(a..., the spec's fields): one more expansion, so `KREX_UNPAREN spec` splits. */
#define KREX_CALL(m, ...) m(__VA_ARGS__)

/* FNV-1a over the bytes of every argument: the simulator records it and the
 * tests recompute it, which proves arguments pass through the shim untouched. */
static inline uint64_t krex_fnv(uint64_t h, const void *p, unsigned long n) {
    const unsigned char *b = (const unsigned char *)p;
    for (unsigned long i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}
#define KREX_HASH1(a) krex_h = krex_fnv(krex_h, &(a), sizeof(a));
#define KREX_HASH_ARGS(...) \
    ({ uint64_t krex_h = 1469598103934665603ull; KREX_FOR_EACH(KREX_HASH1, __VA_ARGS__) krex_h; })

#endif
