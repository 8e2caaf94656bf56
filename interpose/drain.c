/* The drain helper: one thread per registered process that synchronises the
 * process's own GPU contexts when krexd asks (drain_seq) and acks (drain_ack),
 * so a region starts with no sibling work left on the device. Also the context
 * and graph-capture tracking the hooks feed it. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <string.h>
#include <sys/mman.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <time.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "shim_fastpath.h"

/* Graph captures are tracked per stream so the drain helper never synchronises a
 * context while one of this process's streams is capturing (that would invalidate
 * it). A stream leaves the table at its end of capture, failed or not, unless the
 * vendor says it is still capturing (e.g. an end from the wrong thread): a failed
 * end must not leave every later drain partial. */
#define KREX_MAX_CAPTURES 64
static void *g_cap_streams[KREX_MAX_CAPTURES];
uint32_t g_captures;                 /* streams in the table, plus captures that did not fit */
static uint32_t g_capture_overflow;
static uint32_t g_cap_waiting; /* the drain helper sleeps on g_captures (a futex word) */

static void captures_publish(void) {
    struct krex_proc *p = __atomic_load_n(&g_proc, ACQUIRE);
    if (p) __atomic_store_n(&p->captures, __atomic_load_n(&g_captures, __ATOMIC_SEQ_CST), RELAXED);
    /* After the seq_cst change of g_captures: the helper sets g_cap_waiting, then reads
     * g_captures, so it either sees the change or is woken here. */
    if (__atomic_load_n(&g_cap_waiting, __ATOMIC_SEQ_CST)) krex_futex_wake(&g_captures);
}

void krex_capture_begin(void *stream) {
    for (int i = 0; i < KREX_MAX_CAPTURES; i++) {
        void *expect = NULL;
        if (__atomic_compare_exchange_n(&g_cap_streams[i], &expect, stream, 0, __ATOMIC_ACQ_REL, ACQUIRE)) {
            __atomic_add_fetch(&g_captures, 1, __ATOMIC_SEQ_CST);
            captures_publish();
            return;
        }
    }
    __atomic_add_fetch(&g_capture_overflow, 1, RELAXED);
    __atomic_add_fetch(&g_captures, 1, __ATOMIC_SEQ_CST);
    captures_publish();
}

/* 1 if the vendor reports `stream` still capturing; 0 if not or it cannot say. */
static int capture_still_active(int api, void *stream) {
    static const char *const names[KREX_N_APIS] = {"cudaStreamIsCapturing", "cuStreamIsCapturing",
                                                   "hipStreamIsCapturing"};
    typedef int (*fn_is_capturing)(void *, int *);
    fn_is_capturing f = (fn_is_capturing)vendor_sym(api, names[api]);
    int status = 0;
    return f && f(stream, &status) == 0 && status == 1; /* 1: active in all three APIs */
}

void krex_capture_end(int api, void *stream) {
    if (capture_still_active(api, stream)) return;
    for (int i = 0; i < KREX_MAX_CAPTURES; i++) {
        void *expect = stream;
        if (stream && __atomic_compare_exchange_n(&g_cap_streams[i], &expect, NULL, 0, __ATOMIC_ACQ_REL, ACQUIRE)) {
            __atomic_sub_fetch(&g_captures, 1, __ATOMIC_SEQ_CST);
            captures_publish();
            return;
        }
    }
    /* Not in the table: one of the captures that did not fit ends. */
    uint32_t o = __atomic_load_n(&g_capture_overflow, RELAXED);
    while (o > 0 && !__atomic_compare_exchange_n(&g_capture_overflow, &o, o - 1, 0, RELAXED, RELAXED)) {
    }
    if (o > 0) {
        __atomic_sub_fetch(&g_captures, 1, __ATOMIC_SEQ_CST);
        captures_publish();
    }
}

/* The contexts a drain synchronises besides the primary ones: those cuCtxCreate made, and
 * the CUcontext of each green context (a primary sync need not wait for a green context's
 * work: cuda.h promises it only from CUDA 13 on). A context that fits in no table is counted
 * in g_ctx_overflow instead, for good: while it is non-zero, the process's drains ack as
 * partial and never raise drained_at (krexd marks the region contaminated), rather than read
 * as drained with work on a context nobody synchronised. Never counted down: a destroy call
 * cannot tell which context it ends (one that fails, of a handle never counted, would make a
 * live untracked context's work read as drained); a process past the tables stays flagged. */
#define KREX_MAX_CTX 32
static void *g_ctxs[KREX_MAX_CTX];
static uint32_t g_ctx_overflow;

/* Idempotent: a context already held is not added again (two threads adding the same one at
 * once may both take a slot; krex_ctx_del clears every slot that holds it). */
void krex_ctx_add(void *ctx) {
    if (!ctx) return;
    for (int i = 0; i < KREX_MAX_CTX; i++)
        if (__atomic_load_n(&g_ctxs[i], __ATOMIC_ACQUIRE) == ctx) return;
    for (int i = 0; i < KREX_MAX_CTX; i++) {
        void *expect = NULL;
        if (__atomic_compare_exchange_n(&g_ctxs[i], &expect, ctx, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            return;
    }
    __atomic_add_fetch(&g_ctx_overflow, 1, __ATOMIC_SEQ_CST);
}

/* Before its destruction (the helper must not synchronise a context being destroyed).
 * Returns whether it was held: a destroy that fails puts it back (krex_ctx_add). */
int krex_ctx_del(void *ctx) {
    if (!ctx) return 0;
    int found = 0;
    for (int i = 0; i < KREX_MAX_CTX; i++) {
        void *expect = ctx;
        found |= __atomic_compare_exchange_n(&g_ctxs[i], &expect, NULL, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    }
    return found;
}

/* Green context -> the CUcontext it converts to, so that its destruction takes that context
 * out of g_ctxs. A slot is claimed by its green handle, then given its context. */
#define KREX_MAX_GREEN 32
static struct {
    void *green;
    void *ctx;
} g_greens[KREX_MAX_GREEN];

static int green_slot(void *green) {
    for (int i = 0; i < KREX_MAX_GREEN; i++)
        if (__atomic_load_n(&g_greens[i].green, __ATOMIC_ACQUIRE) == green) return i;
    return -1;
}

/* 1 if `green` is held now (it was, or it took a free slot), 0 if no slot was free. */
static int green_put(void *green, void *ctx) {
    if (green_slot(green) >= 0) return 1;
    for (int i = 0; i < KREX_MAX_GREEN; i++) {
        void *expect = NULL;
        if (__atomic_compare_exchange_n(&g_greens[i].green, &expect, green, 0, __ATOMIC_ACQ_REL, ACQUIRE)) {
            __atomic_store_n(&g_greens[i].ctx, ctx, RELEASE);
            krex_ctx_add(ctx);
            return 1;
        }
    }
    return 0;
}

/* After a green context was made: its CUcontext from the real cuCtxFromGreenCtx (resolved once,
 * as a hook's own function is). One it cannot convert, or no slot holds, is one no drain
 * synchronises: counted (g_ctx_overflow) until its destruction. */
void krex_green_add(void *green) {
    typedef CUresult (*fn_from_green)(CUcontext *, CUgreenCtx);
    fn_from_green from = (fn_from_green)__atomic_load_n(&krex_real[KREX_ID_cuCtxFromGreenCtx][0], ACQUIRE);
    if (!from) from = (fn_from_green)krex_resolve(KREX_ID_cuCtxFromGreenCtx, 0);
    CUcontext ctx = NULL;
    if (green && from && from(&ctx, (CUgreenCtx)green) == CUDA_SUCCESS && ctx && green_put(green, ctx)) return;
    __atomic_add_fetch(&g_ctx_overflow, 1, __ATOMIC_SEQ_CST);
}

/* The application converted a green context: held if it was not (its creation's conversion
 * failed), never counted here (its creation was). */
void krex_green_note(void *green, void *ctx) { (void)green_put(green, ctx); }

/* Before its destruction, as krex_ctx_del. Returns the CUcontext it untracked (NULL: none),
 * for krex_green_restore when the destroy fails. */
void *krex_green_del(void *green) {
    int i = green ? green_slot(green) : -1;
    if (i < 0) return NULL;
    void *ctx = __atomic_exchange_n(&g_greens[i].ctx, NULL, __ATOMIC_ACQ_REL);
    if (ctx) krex_ctx_del(ctx);
    __atomic_store_n(&g_greens[i].green, NULL, RELEASE);
    return ctx;
}

/* A destroy that failed: the green context lives on, tracked again (or counted). */
void krex_green_restore(void *green, void *ctx) {
    if (ctx && !green_put(green, ctx)) __atomic_add_fetch(&g_ctx_overflow, 1, __ATOMIC_SEQ_CST);
}

typedef CUresult (*fn_i_p)(void *);
typedef CUresult (*fn_dev_state)(CUdevice, unsigned int *, int *);
typedef CUresult (*fn_retain)(CUcontext *, CUdevice);
typedef CUresult (*fn_release)(CUdevice);
typedef CUresult (*fn_void)(void);
typedef CUresult (*fn_setdev)(int);

/* The vendor functions a drain calls, looked up by the helper thread only. A lookup walks
 * every loaded object (vendor_sym: never a library path search), so they are looked up
 * again only when the set of loaded objects changed (glibc's dlpi_adds/dlpi_subs
 * counters), or a hook resolved a real function since (vendor_sym may find a library
 * through it). */
static struct {
    fn_i_p cu_count, cu_push, cu_pop;
    fn_dev_state cu_state;
    fn_retain cu_retain;
    fn_release cu_release;
    fn_void cu_sync;
    fn_i_p cu_sync_ctx; /* cuCtxSynchronize_v2 (CUDA 12.8+): a context synced without being made current */
    fn_i_p hip_count;
    fn_dev_state hip_state;
    fn_setdev hip_setdev;
    fn_void hip_sync;
    unsigned long long adds, subs;
    uint32_t real_gen; /* krex_real_gen then: a hook resolved since may name a library (vendor_sym) */
    int valid;
} g_dfn;

static int loaded_gen(struct dl_phdr_info *info, size_t size, void *data) {
    unsigned long long *v = data;
    if (size >= offsetof(struct dl_phdr_info, dlpi_subs) + sizeof info->dlpi_subs) {
        v[0] = info->dlpi_adds;
        v[1] = info->dlpi_subs;
        v[2] = 1;
    }
    return 1; /* the counters are the same in every entry: the first one is enough */
}

/* A CUDA runtime the hooks cannot see: linked into the executable (its symbol table, as
 * krex.device.elfcheck reads it), or exported by a loaded object other than libcudart.
 * Its launches bypass every symbol hook, so the process is never taken as quiet. */
static int exe_defines(const char *sym) {
    int fd = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    struct stat st;
    int found = 0;
    if (fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof(Elf64_Ehdr)) {
        const unsigned char *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m != MAP_FAILED) {
            size_t len = (size_t)st.st_size;
            const Elf64_Ehdr *eh = (const Elf64_Ehdr *)m;
            if (!memcmp(eh->e_ident, ELFMAG, SELFMAG) && eh->e_ident[EI_CLASS] == ELFCLASS64 &&
                eh->e_shoff && eh->e_shoff + (uint64_t)eh->e_shnum * sizeof(Elf64_Shdr) <= len) {
                const Elf64_Shdr *sh = (const Elf64_Shdr *)(m + eh->e_shoff);
                for (int i = 0; i < eh->e_shnum && !found; i++) {
                    if ((sh[i].sh_type != SHT_SYMTAB && sh[i].sh_type != SHT_DYNSYM) || sh[i].sh_link >= eh->e_shnum)
                        continue;
                    const Elf64_Shdr *str = &sh[sh[i].sh_link];
                    if (sh[i].sh_offset + sh[i].sh_size > len || str->sh_offset + str->sh_size > len) continue;
                    const Elf64_Sym *sy = (const Elf64_Sym *)(m + sh[i].sh_offset);
                    size_t n = sh[i].sh_size / sizeof(Elf64_Sym), slen = strlen(sym);
                    for (size_t j = 0; j < n && !found; j++) {
                        if (sy[j].st_shndx == SHN_UNDEF || !sy[j].st_name ||
                            sy[j].st_name + slen + 1 > str->sh_size)
                            continue;
                        found = !memcmp(m + str->sh_offset + sy[j].st_name, sym, slen + 1);
                    }
                }
            }
            munmap((void *)m, len);
        }
    }
    close(fd);
    return found;
}

/* Every loaded object, not only the global scope that dlsym(RTLD_DEFAULT) searches (a
 * library loaded RTLD_LOCAL, or after libcudart, hides its runtime from dlsym), read from
 * memory: dl_iterate_phdr takes only the loader's short list lock, so a look never waits
 * for a dlopen in progress (a cuBLAS or cuDNN load runs its constructors for hundreds of ms
 * under the loader's big lock). An object of a dlopen in progress is listed once mapped,
 * before its constructors run, so one that brings a runtime is seen before it can launch. */
static int defines_runtime(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    (void)data;
    const char *b = info->dlpi_name ? strrchr(info->dlpi_name, '/') : NULL;
    b = b ? b + 1 : info->dlpi_name;
    if (b && !strncmp(b, "libcudart.so", 12)) return 0; /* the file's name, not a folder's */
    return krex_object_defines(info, "__cudaRegisterFatBinary");
}

static void note_unseen_runtime(void) {
    if (krex_dl_iterate(defines_runtime, NULL)) set_flag(KREX_PF_UNSEEN);
}

void krex_note_unseen_runtime(void) { note_unseen_runtime(); }

/* A GPU driver or runtime library, by its file name (the real ones and the simulated
 * ones share these names). */
static int is_gpu_lib(const char *path) {
    if (!path) return 0;
    const char *b = strrchr(path, '/');
    b = b ? b + 1 : path;
    return !strncmp(b, "libcuda.so", 10) || !strncmp(b, "libcudart.so", 12) || !strncmp(b, "libamdhip64.so", 14);
}

/* Whether the link-map namespace of handle `h` holds a GPU driver or runtime library. */
int krex_ns_has_gpu(void *h) {
    struct link_map *lm = NULL;
    if (dlinfo(h, RTLD_DI_LINKMAP, &lm) != 0 || !lm) return 0;
    while (lm->l_prev) lm = lm->l_prev;
    for (; lm; lm = lm->l_next)
        if (is_gpu_lib(lm->l_name)) return 1;
    return 0;
}

/* The loader's debugger interface lists every namespace (dl_iterate_phdr only the
 * caller's): r_version 2 (glibc 2.35 on) chains one r_debug per namespace, the base one
 * first. Declared here so that an older glibc's headers build it too. */
struct krex_r_debug_ns {
    struct r_debug base;
    struct krex_r_debug_ns *r_next;
};

/* A GPU library in a namespace other than the base one (a dlmopen that did not pass our
 * hook): flag the process (KREX_PF_FOREIGN_NS). */
static void note_foreign_ns(void) {
    struct krex_r_debug_ns *d = (struct krex_r_debug_ns *)&_r_debug;
    if (d->base.r_version < 2) return;
    for (d = d->r_next; d; d = d->base.r_version >= 2 ? d->r_next : NULL)
        for (struct link_map *lm = d->base.r_map; lm; lm = lm->l_next)
            if (is_gpu_lib(lm->l_name)) {
                set_flag(KREX_PF_FOREIGN_NS);
                return;
            }
}

/* Between drains, every KREX_HELPER_RECHECK_NS: a library loaded since (dlopen) that
 * exports a CUDA runtime makes the process unseen before its next drain can skip it, and
 * a GPU library loaded into another namespace marks it as one the gate does not hold. */
static unsigned long long g_loaded_seen[2]; /* the loader's counters check_loaded last saw */

static void check_loaded(void) {
    unsigned long long *seen = g_loaded_seen;
    unsigned long long v[3] = {0, 0, 0};
    krex_dl_iterate(loaded_gen, v);
    if (v[2] && v[0] == seen[0] && v[1] == seen[1]) return;
    seen[0] = v[0];
    seen[1] = v[1];
    note_unseen_runtime();
    note_foreign_ns();
}

/* A look that acks krexd's look rounds: the request read first, so every library loaded
 * before any request up to it is looked at, one still being loaded included (listed before
 * its constructors run, which may launch through the runtime it brings). It takes no lock a
 * dlopen holds (note_unseen_runtime); krexd waits for the ack at most KREX_LOOK_TIMEOUT_MS
 * and flags the region past that. */
static void look(struct krex_gpu *g, struct krex_proc *p) {
    uint32_t ls = __atomic_load_n(&g->look_seq, __ATOMIC_SEQ_CST);
    check_loaded();
    if (__atomic_exchange_n(&p->look_ack, ls, __ATOMIC_SEQ_CST) != ls) krex_wake_controller(g_shm, g_gpu);
}

static void drain_fns(void) {
    unsigned long long v[3] = {0, 0, 0};
    krex_dl_iterate(loaded_gen, v);
    uint32_t gen = __atomic_load_n(&krex_real_gen, __ATOMIC_ACQUIRE);
    if (g_dfn.valid && v[2] && v[0] == g_dfn.adds && v[1] == g_dfn.subs && gen == g_dfn.real_gen) return;
    g_dfn.cu_count = (fn_i_p)vendor_sym(KREX_API_DRIVER, "cuDeviceGetCount");
    g_dfn.cu_state = (fn_dev_state)vendor_sym(KREX_API_DRIVER, "cuDevicePrimaryCtxGetState");
    g_dfn.cu_retain = (fn_retain)vendor_sym(KREX_API_DRIVER, "cuDevicePrimaryCtxRetain");
    g_dfn.cu_release = (fn_release)vendor_sym(KREX_API_DRIVER, "cuDevicePrimaryCtxRelease_v2");
    g_dfn.cu_push = (fn_i_p)vendor_sym(KREX_API_DRIVER, "cuCtxPushCurrent_v2");
    g_dfn.cu_pop = (fn_i_p)vendor_sym(KREX_API_DRIVER, "cuCtxPopCurrent_v2");
    g_dfn.cu_sync = (fn_void)vendor_sym(KREX_API_DRIVER, "cuCtxSynchronize");
    g_dfn.cu_sync_ctx = (fn_i_p)vendor_sym(KREX_API_DRIVER, "cuCtxSynchronize_v2");
    g_dfn.hip_count = (fn_i_p)vendor_sym(KREX_API_HIP, "hipGetDeviceCount");
    g_dfn.hip_state = (fn_dev_state)vendor_sym(KREX_API_HIP, "hipDevicePrimaryCtxGetState");
    g_dfn.hip_setdev = (fn_setdev)vendor_sym(KREX_API_HIP, "hipSetDevice");
    g_dfn.hip_sync = (fn_void)vendor_sym(KREX_API_HIP, "hipDeviceSynchronize");
    note_unseen_runtime(); /* (the loaded objects changed) */
    g_dfn.adds = v[0];
    g_dfn.subs = v[1];
    g_dfn.real_gen = gen;
    g_dfn.valid = v[2] != 0; /* counters unknown (an old libc): look up every time, as before */
}

/* Synchronise the CUDA contexts this process already has; never create one. Returns 1 if
 * every one was synchronised (or CUDA is not loaded), 0 if any step failed, -1 if a tracked
 * context that lives could not be made current to synchronise it (a green context current
 * on an application thread, on a driver without cuCtxSynchronize_v2): its work may still
 * be queued, so the drain is partial, never whole. A destroyed one has nothing queued. */
static int drain_cuda(void) {
    fn_i_p count = g_dfn.cu_count, push = g_dfn.cu_push, pop = g_dfn.cu_pop;
    fn_dev_state state = g_dfn.cu_state;
    fn_retain retain = g_dfn.cu_retain;
    fn_release release = g_dfn.cu_release;
    fn_void sync = g_dfn.cu_sync;
    if (!count && !state && !retain && !release && !push && !pop && !sync) return 1; /* no CUDA here */
    if (!count || !state || !retain || !release || !push || !pop || !sync) return 0;
    int n = 0, ok = 1;
    if (count(&n) != CUDA_SUCCESS) return 0;
    for (int d = 0; d < n; d++) {
        unsigned int fl = 0;
        int active = 0;
        if (state(d, &fl, &active) != CUDA_SUCCESS) ok = 0;
        if (!active) continue;
        CUcontext ctx = NULL;
        if (retain(&ctx, d) != CUDA_SUCCESS) {
            ok = 0;
            continue;
        }
        if (push(ctx) == CUDA_SUCCESS) {
            if (sync() != CUDA_SUCCESS) ok = 0;
            CUcontext old;
            pop(&old);
        } else {
            ok = 0;
        }
        release(d);
    }
    if (__atomic_load_n(&g_ctx_overflow, __ATOMIC_SEQ_CST)) ok = 0; /* a context no table holds */
    int unsynced = 0;
    for (int i = 0; i < KREX_MAX_CTX; i++) {
        void *ctx = __atomic_load_n(&g_ctxs[i], __ATOMIC_ACQUIRE);
        if (!ctx) continue;
        /* By handle where the driver can: a green context is current to one thread at a
         * time (cuda.h, cuCtxFromGreenCtx), so pushing it here could fail while an
         * application thread has it current. A driver without it says NOT_SUPPORTED. */
        CUresult r = g_dfn.cu_sync_ctx ? (CUresult)g_dfn.cu_sync_ctx(ctx) : CUDA_ERROR_NOT_SUPPORTED;
        if (r != CUDA_ERROR_NOT_SUPPORTED) {
            if (r != CUDA_SUCCESS) ok = 0;
            continue;
        }
        CUresult pr = push(ctx);
        if (pr != CUDA_SUCCESS) {
            /* Destroyed meanwhile: a stamp less, never a wrong one. Else: work left behind. */
            int gone = pr == CUDA_ERROR_INVALID_CONTEXT || pr == CUDA_ERROR_CONTEXT_IS_DESTROYED;
            unsynced |= !gone;
            ok = 0;
            continue;
        }
        if (sync() != CUDA_SUCCESS) ok = 0;
        CUcontext old;
        pop(&old);
    }
    return unsynced ? -1 : ok;
}

static int drain_hip(void) {
    fn_i_p count = g_dfn.hip_count;
    fn_dev_state state = g_dfn.hip_state;
    fn_setdev setdev = g_dfn.hip_setdev;
    fn_void sync = g_dfn.hip_sync;
    if (!count && !state && !setdev && !sync) return 1; /* no HIP here */
    if (!count || !state || !setdev || !sync) return 0;
    int n = 0, ok = 1;
    if (count(&n) != hipSuccess) return 0;
    for (int d = 0; d < n; d++) {
        unsigned int fl = 0;
        int active = 0;
        if (state(d, &fl, &active) != hipSuccess) ok = 0;
        if (!active) continue;
        if (setdev(d) != hipSuccess || sync() != hipSuccess) ok = 0;
    }
    return ok;
}


/* Synchronise every context of the process. drained_at is raised only when nothing was in
 * flight as it began (the counts read first, then in flight found 0: every call counted by
 * then had queued its work), so that work is done once the syncs return. */
/* Returns 0 when a live context's work may be left queued (drain_cuda's -1): the drain is
 * partial. */
static int full_drain(struct krex_proc *p) {
    uint64_t before = krex_proc_submits(p), ord = __atomic_load_n(&p->ordered_life, __ATOMIC_SEQ_CST);
    int quiet = __atomic_load_n(&p->inflight, __ATOMIC_SEQ_CST) == 0 && (uint32_t)ord == (uint32_t)(ord >> 32);
    drain_fns();
    int cu = drain_cuda();
    int ok = cu > 0;
    ok &= drain_hip();
    if (quiet && ok) {
        uint64_t cur = __atomic_load_n(&p->drained_at, __ATOMIC_SEQ_CST);
        /* Raise only (the exit's last drain may run beside a helper still busy at exit). */
        while (cur < 1 + before &&
               !__atomic_compare_exchange_n(&p->drained_at, &cur, 1 + before, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
        }
    }
    return cu >= 0;
}

int g_helper_started;
static uint32_t g_helper_named;   /* atomic: its thread is named in the record (helper_tid) */
static uint32_t g_helper_settled; /* atomic: its start-up (thread set-up, dlsym) is over */
static uint32_t g_helper_stop;  /* atomic: set at exit */
static uint32_t g_helper_busy;  /* atomic: inside a drain */
static pthread_t g_helper_thread;
static pid_t g_helper_pid;      /* the process that started it (a fork child has none) */

/* Our pid and tid mean the same processes to krexd only in krexd's pid namespace (a
 * container or `unshare -p` gives other numbers): compare the namespaces' inodes, which
 * krexd publishes in the header. Unknown either side: not the same. */
int krex_in_krexds_pid_ns(void) {
    struct stat st;
    uint64_t theirs = __atomic_load_n(&g_shm->hdr.pidns, __ATOMIC_SEQ_CST);
    return theirs != 0 && stat("/proc/self/ns/pid", &st) == 0 && (uint64_t)st.st_ino == theirs;
}

static void *krex_helper(void *arg) {
    (void)arg;
    prctl(PR_SET_NAME, "krex-drain", 0, 0, 0);
    /* krexd tells an exec'd process (its helper gone, its pid alive) by this thread; only
     * where our tid means the same thread to krexd (else it stays 0: no such inference). */
    if (krex_in_krexds_pid_ns())
        __atomic_store_n(&g_proc->helper_tid, (uint32_t)syscall(SYS_gettid), __ATOMIC_SEQ_CST);
    /* Before any loader call: registration waits for this, and may hold the loader lock
     * (a first GPU call inside a library constructor, under dlopen). */
    __atomic_store_n(&g_helper_named, 1, __ATOMIC_SEQ_CST);
    krex_futex_wake(&g_helper_named);
    struct krex_gpu *g = &g_shm->gpus[g_gpu];
    struct krex_proc *p = g_proc;
    if (exe_defines("__cudaRegisterFatBinary")) set_flag(KREX_PF_UNSEEN);
    look(g, p);
    /* Only now does the record read as drained (krex_proc_quiet): nothing of it was queued
     * before its first gated call, but a runtime the hooks cannot see (in the executable, or
     * in a library whose constructor made that call, the loader's lock held meanwhile, so
     * that the look above waits for it) queues what no count shows. After the flag: a
     * reader that sees the stamp sees it. A raise only (0 to 1). */
    uint64_t never = 0;
    __atomic_compare_exchange_n(&g_proc->drained_at, &never, 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    /* Relaxed capture mode on this thread: a context synchronise here must not
     * invalidate a graph another thread is capturing (DESIGN.md consequence 7). */
    typedef CUresult (*fn_xmode)(CUstreamCaptureMode *);
    fn_xmode xmode = (fn_xmode)vendor_sym(KREX_API_DRIVER, "cuThreadExchangeStreamCaptureMode");
    if (xmode) {
        CUstreamCaptureMode m = CU_STREAM_CAPTURE_MODE_RELAXED;
        xmode(&m);
    }
    __atomic_store_n(&g_helper_settled, 1, __ATOMIC_SEQ_CST);
    krex_futex_wake(&g_helper_settled);
    uint32_t seen = __atomic_load_n(&p->drain_ack, __ATOMIC_SEQ_CST);
    for (;;) {
        __atomic_store_n(&g_helper_busy, 0, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&g_helper_stop, __ATOMIC_SEQ_CST)) break;
        uint32_t cur = __atomic_load_n(&g->drain_seq, __ATOMIC_SEQ_CST);
        if (cur == seen) {
            if (krex_futex_wait(&g->drain_seq, cur, KREX_HELPER_RECHECK_NS) == ETIMEDOUT) look(g, p);
            continue;
        }
        /* Busy before the stop check: exit either sees busy, or we see stop. */
        __atomic_store_n(&g_helper_busy, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&g_helper_stop, __ATOMIC_SEQ_CST)) break;
        /* Every request first looks at what was loaded since the last look (cheap while the
         * loader's counters have not moved): a library loaded just before it that brings its
         * own runtime makes the process not quiet here, and drained. A look-only request
         * (krexd's look round at a region's end) ends there: no drain, no drain ack. */
        look(g, p);
        if (__atomic_load_n(&g->look_seq, __ATOMIC_SEQ_CST) == cur) {
            seen = cur;
            continue;
        }
        /* A context synchronise would invalidate a capture in progress: give
         * the capture a moment to end, else ack as partial so the controller
         * marks the grant contaminated instead of silently clean. */
        uint64_t t0 = krex_now_ns();
        __atomic_store_n(&g_cap_waiting, 1, __ATOMIC_SEQ_CST);
        int quiet = !__atomic_load_n(&g->drain_full, __ATOMIC_SEQ_CST) && krex_proc_quiet(p);
        for (uint32_t c; !quiet && (c = __atomic_load_n(&g_captures, __ATOMIC_SEQ_CST)) > 0;) {
            uint64_t spent = krex_now_ns() - t0;
            if (spent >= KREX_CAPTURE_WAIT_NS) break;
            krex_futex_wait(&g_captures, c, KREX_CAPTURE_WAIT_NS - spent); /* woken by the capture's end */
        }
        __atomic_store_n(&g_cap_waiting, 0, __ATOMIC_SEQ_CST);
        if (quiet) {
            /* Nothing queued since the last full drain: ack without a driver call (which
             * would wait for a context, module or memory call another thread is inside). */
        } else if (__atomic_load_n(&g_captures, __ATOMIC_SEQ_CST) > 0) {
            __atomic_store_n(&p->drain_partial, cur, __ATOMIC_SEQ_CST);
            __atomic_or_fetch(&p->flags, KREX_PF_DRAIN_PARTIAL, __ATOMIC_RELAXED);
        } else {
            int whole = full_drain(p);
            /* Work of a context it could not name, or could not make current. */
            if (!whole || __atomic_load_n(&g_ctx_overflow, __ATOMIC_SEQ_CST)) {
                __atomic_store_n(&p->drain_partial, cur, __ATOMIC_SEQ_CST);
                __atomic_or_fetch(&p->flags, KREX_PF_DRAIN_PARTIAL, __ATOMIC_RELAXED);
            }
        }
        __atomic_fetch_add(&p->drains, 1, __ATOMIC_RELAXED);
        __atomic_store_n(&p->drain_ack, cur, __ATOMIC_SEQ_CST);
        krex_wake_controller(g_shm, g_gpu); /* krexd sleeps until the last ack */
        seen = cur;
    }
    __atomic_store_n(&g_helper_busy, 0, __ATOMIC_SEQ_CST);
    return NULL;
}

/* At exit, before the helper stops, while another command's region holds the gate: wait
 * for it to end, as the exit hold waits, so that neither the last drain (a context
 * reference count and a sync) nor the helper's end (krexd would read a new image) falls
 * inside it. The helper still answers drains meanwhile. Neither a pause nor a krexd that
 * stopped beating is waited for. Regions that follow at once (others' back-to-back regions,
 * the gate never seen open) are waited for only KREX_EXIT_WAIT_NS more: then the exit goes
 * on, and krexd flags the region it falls in (the helper's end reads as a new image) rather
 * than the exit starving (unbounded, back-to-back regions held one 8 s). The gate word is a futex,
 * woken at every opening, so a gap between two regions is seen when there is one. */
static void wait_out_region(struct krex_shm *shm) {
    uint32_t *gate = __atomic_load_n(&g_fast.gate, __ATOMIC_ACQUIRE);
    if (!shm || !gate || g_gpu < 0) return;
    uint32_t first = KREX_GATE_OPEN;
    uint64_t t_next = 0; /* when a region after the first one was seen */
    for (;;) {
        uint32_t w = __atomic_load_n(gate, __ATOMIC_SEQ_CST), holder = 0;
        if (w == KREX_GATE_OPEN || (w & KREX_GATE_OWNER_MASK) == g_fast.owner_byte) return;
        int64_t pid = 0;
        uint64_t deadline = 0, now = krex_now_ns();
        if (krex_gate_holder(shm, g_gpu, w, &holder, &pid, &deadline) && holder != KREX_HOLDER_REGION) return;
        if (krex_heartbeat_stale(shm, now, 1)) return;
        if (first == KREX_GATE_OPEN) first = w;
        else if (w != first && !t_next) t_next = now;
        uint64_t wait = KREX_GATE_RECHECK_NS; /* re-checks the heartbeat while it waits */
        if (t_next) {
            if (now - t_next >= KREX_EXIT_WAIT_NS) {
                klog("exit: other commands' regions follow one another; going on inside one (krexd flags it)");
                return;
            }
            if (KREX_EXIT_WAIT_NS - (now - t_next) < wait) wait = KREX_EXIT_WAIT_NS - (now - t_next);
        }
        krex_futex_wait(gate, w, wait);
    }
}

/* At exit: no drain may start while the vendor libraries tear down, and one in
 * progress is waited for (bounded). Registered with atexit when the helper
 * starts, i.e. after the vendor runtime registered its own exit handlers, so it
 * runs before them. Then one last drain here, while the libraries still stand, and
 * the record says so (drained_at): the teardown's own calls are LIFE calls, gated
 * (they park at a closed gate), so krexd owes this process no ack unless it submits
 * again (a stream-ordered LIFE call drains again itself). Without it, every region during
 * a sibling's teardown (100+ ms on a GPU) waited the whole drain timeout for an ack from a
 * helper that was gone. */
static void last_drain(struct krex_shm *shm, struct krex_proc *rec);
static uint32_t g_exit_drained; /* atomic: the exit's last drain ran */

static void stop_helper(void) {
    if (!__atomic_load_n(&g_helper_started, ACQUIRE) || g_helper_pid != getpid()) return;
    struct krex_shm *shm = __atomic_load_n(&g_shm, ACQUIRE);
    wait_out_region(shm);
    /* Unnamed first: a helper that is gone while the process lives must not read as an
     * exec (other threads may still submit while the process exits). */
    struct krex_proc *rec = __atomic_load_n(&g_proc, ACQUIRE);
    if (rec) {
        /* Flagged before: krexd reads a helper gone without the flag as one never started. */
        __atomic_or_fetch(&rec->flags, KREX_PF_IN_EXIT, __ATOMIC_SEQ_CST);
        __atomic_store_n(&rec->helper_tid, 0, __ATOMIC_SEQ_CST);
    }
    __atomic_store_n(&g_helper_stop, 1, __ATOMIC_SEQ_CST);
    if (shm && g_gpu >= 0) krex_futex_wake(&shm->gpus[g_gpu].drain_seq); /* others just re-check */
    /* The helper answers no look round from here on: this thread looks once more at what is
     * loaded (not through check_loaded, whose counters are the helper's), and krexd's look
     * rounds owe the record nothing after it (what an exit handler loads later is not seen). */
    if (rec) {
        note_unseen_runtime();
        note_foreign_ns();
        __atomic_store_n(&rec->exit_looked, 1, __ATOMIC_SEQ_CST);
        if (shm && g_gpu >= 0) krex_wake_controller(shm, g_gpu);
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += KREX_HEARTBEAT_TIMEOUT_NS / 1000000000;
    if (pthread_timedjoin_np(g_helper_thread, NULL, &ts) != 0) {
        klog("drain helper still busy at exit; leaving it");
        return;
    }
    klog("drain helper stopped at exit");
    last_drain(shm, rec);
}

/* The last drain of an exit, once its helper has stopped (and again after a stream-ordered
 * LIFE call made since: krex_exit_redrain). Also at a closed gate (a region that closed it
 * since wait_out_region, a pause): no ack can come from here on, and a region whose entry
 * began meanwhile otherwise waited the whole drain timeout for us, frozen inside our exit
 * (H200: 2 regions in 80). Only with nothing in flight: a submission is counted before the
 * driver queues it, so one counted but not yet queued would escape this drain. The count is
 * read first, then in-flight found 0 (stream-ordered LIFE calls too: as many ended as
 * started): any call counted by then has returned (its work is queued). */
static void last_drain(struct krex_shm *shm, struct krex_proc *rec) {
    if (!rec || __atomic_load_n(&g_captures, __ATOMIC_SEQ_CST) > 0) return; /* a sync would end a capture */
    uint64_t t0 = krex_now_ns();
    for (;;) {
        uint64_t ord = __atomic_load_n(&rec->ordered_life, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&rec->inflight, __ATOMIC_SEQ_CST) == 0 && (uint32_t)ord == (uint32_t)(ord >> 32)) break;
        if (krex_now_ns() - t0 >= KREX_HELPER_SETTLE_NS) return; /* krexd waits for an ack, and flags */
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
    /* Not gated: a sync and a reference count of a live context do no GPU work (the helper
     * does the same at every drain), and an exit must not wait out an operator's pause.
     * It raises drained_at if nothing was in flight as it began; another thread that
     * submitted since moves the count past it, and krexd then owes an ack nobody gives. */
    (void)full_drain(rec);
    __atomic_store_n(&g_exit_drained, 1, __ATOMIC_SEQ_CST);
    __atomic_store_n(&rec->exit_drained, 1, __ATOMIC_SEQ_CST);
    if (shm && g_gpu >= 0) krex_wake_controller(shm, g_gpu); /* a drain waiting on us re-checks */
}

void krex_exit_redrain(void) {
    /* Only after a last drain that ran (one that gave up waiting would wait again at each
     * async free of a teardown); the flag first: getpid is a syscall. */
    if (!__atomic_load_n(&g_exit_drained, __ATOMIC_SEQ_CST) || g_helper_pid != getpid()) return;
    last_drain(__atomic_load_n(&g_shm, ACQUIRE), __atomic_load_n(&g_proc, ACQUIRE));
}

void start_helper(void) {
    sigset_t all, old;
    sigfillset(&all);
    /* The helper inherits a full mask, so process signals go to app threads. */
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setstacksize(&a, 256 * 1024);
    __atomic_store_n(&g_helper_stop, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&g_helper_named, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&g_helper_settled, 0, __ATOMIC_SEQ_CST);
    if (pthread_create(&g_helper_thread, &a, krex_helper, NULL) == 0) {
        g_helper_pid = getpid();
        __atomic_store_n(&g_helper_started, 1, RELEASE);
        static int registered; /* atexit handlers survive fork: once per image is enough */
        if (!registered) {
            registered = 1;
            atexit(stop_helper);
        }
    } else {
        set_flag(KREX_PF_HELPER_FAILED);
    }
    pthread_attr_destroy(&a);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

/* Wait (bounded: a helper that never gets there costs one wait, never a hang) for a
 * just-started helper to reach `*flag`. Registration waits until it is named (its first
 * step, no lock needed), so a process that execs right after its first call has it
 * named. fork waits until its start-up is over: that start-up allocates and calls
 * dlsym, and a child forked meanwhile would inherit those locks held by a thread it
 * does not have, and hang on its first use (seen with ASan's allocator, whose gcc-12
 * runtime has no fork handler). */
static void wait_helper(uint32_t *flag) {
    if (!__atomic_load_n(&g_helper_started, ACQUIRE) || g_helper_pid != getpid()) return;
    uint64_t t0 = krex_now_ns();
    while (!__atomic_load_n(flag, __ATOMIC_SEQ_CST)) {
        uint64_t spent = krex_now_ns() - t0;
        if (spent >= KREX_HELPER_SETTLE_NS) break;
        krex_futex_wait(flag, 0, KREX_HELPER_SETTLE_NS - spent);
    }
}

void krex_wait_helper_named(void) { wait_helper(&g_helper_named); }
void krex_wait_helper_settled(void) { wait_helper(&g_helper_settled); }

/* fork: the child is a new process with no helper, no captures, no contexts yet. */
void krex_drain_after_fork(void) {
    __atomic_store_n(&g_helper_started, 0, RELAXED);
    __atomic_store_n(&g_exit_drained, 0, RELAXED);
    /* Its record (and flags) are new: look at what is loaded again, as at any start. */
    g_loaded_seen[0] = g_loaded_seen[1] = 0;
    for (int i = 0; i < KREX_MAX_CAPTURES; i++) g_cap_streams[i] = NULL;
    g_captures = g_capture_overflow = 0;
    g_cap_waiting = 0;
    for (int i = 0; i < KREX_MAX_CTX; i++) g_ctxs[i] = NULL;
    for (int i = 0; i < KREX_MAX_GREEN; i++) g_greens[i].green = g_greens[i].ctx = NULL;
    g_ctx_overflow = 0;
}
