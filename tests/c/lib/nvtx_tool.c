/* A stand-in for another NVTX tool (Nsight's injection library): it takes some of the
 * range slots, counts the calls it gets, hands out handles and range ids of its own,
 * and writes the counts as JSON to $NVTX_TOOL_OUT at exit. It leaves the other slots
 * (PushEx, PushW, StartEx, StartW) to NVTX, so a tool chained in front of it must
 * never call those. Built by tests/integration/test_nvtx_regions.py as a shared object. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef void (*fn_t)(void);
typedef const void *(*get_t)(uint32_t);
struct callbacks {
    size_t size;
    int (*table)(int module, fn_t ***out, unsigned *size);
};

static int pushes, pops, starts, ends, dpushes, dpops, regs, domains, depth;
static uint64_t next_id = 1000;

static int push_a(const char *m) { (void)m; pushes++; return 100 + depth++; }
static int pop(void) { pops++; return 100 + --depth; }
static uint64_t start_a(const char *m) { (void)m; starts++; return next_id++; }
static void end(uint64_t id) { (void)id; ends++; }
static int d_push(void *d, const void *a) { (void)d; (void)a; dpushes++; return 0; }
static int d_pop(void *d) { (void)d; dpops++; return 0; }
static void *reg_a(void *d, const char *s) { (void)d; (void)s; return (void *)(uintptr_t)(0x5000 + ++regs); }
static void *create_a(const char *s) { (void)s; return (void *)(uintptr_t)(0x9000 + ++domains); }

__attribute__((destructor)) static void report(void) {
    const char *out = getenv("NVTX_TOOL_OUT");
    FILE *f = out ? fopen(out, "w") : NULL;
    if (!f) return;
    fprintf(f, "{\"pushes\":%d,\"pops\":%d,\"starts\":%d,\"ends\":%d,\"dpushes\":%d,\"dpops\":%d,"
               "\"regs\":%d,\"domains\":%d}\n", pushes, pops, starts, ends, dpushes, dpops, regs, domains);
    fclose(f);
}

__attribute__((visibility("default"))) int InitializeInjectionNvtx2(get_t get) {
    const struct callbacks *cb = get(1);
    fn_t **core, **core2;
    unsigned n1, n2;
    if (!cb || !cb->table(1, &core, &n1) || !cb->table(5, &core2, &n2)) return 0;
    *core[9] = (fn_t)push_a;   /* RangePushA */
    *core[11] = (fn_t)pop;     /* RangePop */
    *core[5] = (fn_t)start_a;  /* RangeStartA */
    *core[7] = (fn_t)end;      /* RangeEnd */
    *core2[4] = (fn_t)d_push;  /* DomainRangePushEx */
    *core2[5] = (fn_t)d_pop;   /* DomainRangePop */
    *core2[10] = (fn_t)reg_a;  /* DomainRegisterStringA */
    *core2[12] = (fn_t)create_a; /* DomainCreateA */
    return 1;
}
