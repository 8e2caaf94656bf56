/* krex.h: mark timing regions in C and C++ benchmarks.
 *
 *   KREX_REGION_BEGIN();  ... timed loop, final synchronize ...  KREX_REGION_END();
 *   { krex::Region r; ... }            // C++: ends at scope exit
 *
 * Under `krex run` the shim provides krex_region_begin/krex_region_end and the
 * region becomes exclusive. Without the shim the macros do nothing and return 0.
 * They find the shim at run time (dlsym), so nothing extra is linked. */
#ifndef KREX_H
#define KREX_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef int (*krex_region_fn_)(void);

static inline int krex_call_(const char *name) {
    krex_region_fn_ f = (krex_region_fn_)dlsym(RTLD_DEFAULT, name);
    return f ? f() : 0;
}

/* KREX_REGION_BEGIN(): 0 when granted (or KREX is absent), negative errno when refused
 * or when the process is meant to be under KREX but is not attached to it.
 * KREX_REGION_END(): 0 only when the region was exclusive from BEGIN to END;
 * -ETIMEDOUT (-110) when krexd cut it at --max-region before END (the rest of the
 * timing was NOT protected); 1 when it ended but was flagged (contaminated: see
 * `krex journal`); other negative values when krexd did not answer.
 * Treat any non-zero END as "do not trust this timing". */
#define KREX_REGION_BEGIN() krex_call_("krex_region_begin")
#define KREX_REGION_END() krex_call_("krex_region_end")

#ifdef __cplusplus
}

namespace krex {
class Region {
  public:
    Region() { KREX_REGION_BEGIN(); }
    ~Region() { KREX_REGION_END(); }
    Region(const Region &) = delete;
    Region &operator=(const Region &) = delete;
};
}  // namespace krex
#endif

#endif
