/* Preloaded before the shim by tests/integration/test_shim_faults.py: a glibc whose
 * symbol versions the shim does not know (dlvsym finds no "dlsym" by any version
 * name), as on a new architecture. The shim must still find the real dlsym. */
#define _GNU_SOURCE
#include <stddef.h>

void *dlvsym(void *handle, const char *symbol, const char *version) {
    (void)handle;
    (void)symbol;
    (void)version;
    return NULL;
}
