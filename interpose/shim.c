/* libkrex_interpose.so: the data plane, loaded with LD_PRELOAD.
 *
 * Every intercepted entry point comes from the api_*.def tables. For each entry
 * there are KREX_NSLOT wrappers; wrapper 0 is exported under the real name
 * (the PLT path), wrappers 1..3 are handed out by dlsym / GetProcAddress when
 * those return a *different* real pointer for the same name (a _ptsz variant,
 * another library copy). Each wrapper is bound to exactly one real pointer.
 *
 * Outside KREX (no KREX_SHM/KREX_SLOT) every wrapper is a pass-through: no
 * threads, no output, dlsym returns real pointers.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <elf.h>
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "krex_core.h"
#include "krex_tables.h"

#define KREX_NSLOT 4
#define KREX_EXPORT __attribute__((visibility("default")))
/* dlsym and what it calls run before our constructor, and before a sanitizer
 * runtime has set itself up: it resolves its interceptors through dlsym, which is
 * ours. So under `make sanitize` that path is left uninstrumented. */
#define KREX_NO_SANITIZE __attribute__((no_sanitize("thread", "address")))
#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)

enum { MODE_OFF = 0, MODE_ON = 1 };

/* Everything the fast path reads, set once by krex_register(). `gate` is
 * published last with a release store and read with an acquire load, so a thread
 * that sees it also sees the other fields (this matters on aarch64, e.g. GH200). */
static struct {
    uint32_t *gate;     /* NULL until this process registered */
    uint32_t *inflight;
    uint64_t *submits;
    uint32_t owner_byte;
} g_fast;

#define RELAXED __ATOMIC_RELAXED
#define ACQUIRE __ATOMIC_ACQUIRE
#define RELEASE __ATOMIC_RELEASE

static int g_mode = MODE_OFF;             /* atomic: registration may switch it off */
static int g_log;
static char g_shm_name[128];
static int g_slot = -1;
static int g_gpu = -1;
static struct krex_shm *g_shm;            /* atomic pointer: published once attached */
static long long g_slot_gen = -1;         /* KREX_SLOT_GEN: the slot's generation when our command claimed it */
static int g_attach_err;                  /* why we could not attach the segment we were told to use */
static struct krex_proc *g_proc;
static uint32_t g_failed_gate;            /* gate word we already failed open on */
static uint64_t g_local_submits[KREX_NGATED];
static uint32_t g_pending_flags;
/* Held only for short, local work (attach, record, helper start): never across a
 * connect, a krexd reply or a grant, so fork (prepare handler) never waits long. */
static pthread_mutex_t g_reg_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_helper_started;
static char g_sock_path[108];
static char g_daemon_cmd[1024];
static int g_need_selfreg;                /* set once at load: no KREX_SLOT, register with krexd */
static int g_selfreg;                     /* atomic: 0 not yet, 1 in progress, 2 done, 3 failed */
static int g_reg_conn = -1;               /* self-registration: krexd keeps our slot while it is open */
static int g_spawned;                     /* atomic: this process already started krexd once */
static __thread int t_region_depth;
static __thread int t_region_fd = -1;     /* the connection that began this thread's region */
extern char **environ;
static __thread int t_depth __attribute__((tls_model("initial-exec")));

static void *krex_real[KREX_N_IDS][KREX_NSLOT];

static void klog(const char *fmt, ...) {
    if (!g_log) return;
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    int n = snprintf(buf, sizeof buf, "[krex %d] ", (int)getpid());
    n += vsnprintf(buf + n, sizeof buf - (size_t)n, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof buf - 2) n = (int)sizeof buf - 2;
    buf[n++] = '\n';
    ssize_t w = write(2, buf, (size_t)n);
    (void)w;
}

KREX_NO_SANITIZE static int mode_on(void) { return __atomic_load_n(&g_mode, RELAXED) == MODE_ON; }

static void set_flag(uint32_t f) {
    struct krex_proc *p = __atomic_load_n(&g_proc, ACQUIRE);
    if (p) __atomic_or_fetch(&p->flags, f, RELAXED);
    else __atomic_or_fetch(&g_pending_flags, f, RELAXED);
}

/* ------------------------------------------------------------------ gate */

static int krex_register(void);
static int krex_wait_gate(uint32_t word);

/* Fast path: a TLS depth check, one seq_cst increment, one seq_cst load. */
static inline int krex_enter(int cls) {
    if (UNLIKELY(t_depth++ != 0)) return 0; /* nested (a library calling itself) */
    uint32_t *gate = __atomic_load_n(&g_fast.gate, ACQUIRE);
    if (UNLIKELY(gate == NULL)) {
        if (!mode_on() || !krex_register()) return 0;
        gate = __atomic_load_n(&g_fast.gate, ACQUIRE);
    }
    uint32_t *inflight = g_fast.inflight;
    for (;;) {
        __atomic_fetch_add(inflight, 1, __ATOMIC_SEQ_CST);
        uint32_t w = __atomic_load_n(gate, __ATOMIC_SEQ_CST);
        if (LIKELY(w == KREX_GATE_OPEN || (w & 0xff) == g_fast.owner_byte)) break;
        __atomic_fetch_sub(inflight, 1, __ATOMIC_SEQ_CST);
        if (krex_wait_gate(w)) { /* holder is gone: fail open */
            __atomic_fetch_add(inflight, 1, __ATOMIC_SEQ_CST);
            break;
        }
    }
    __atomic_fetch_add(&g_fast.submits[cls], 1, __ATOMIC_RELAXED);
    return 1;
}

/* Slow path of a leave: someone else closed the gate while this call ran, so krexd may
 * be waiting for our in-flight count to reach 0. Wake it instead of letting it poll. */
__attribute__((noinline, cold)) static void krex_left_closed(void) { krex_wake_controller(g_shm, g_gpu); }

/* The decrement, then the gate load (both seq_cst): krexd closes the gate, then waits on
 * its wake word and scans the counters, so either its scan sees the decrement or we see
 * the gate closed and wake it (krex_abi.h). With the gate open: one extra load, no syscall. */
__attribute__((always_inline)) static inline void krex_leave(int counted) {
    if (counted) {
        __atomic_fetch_sub(g_fast.inflight, 1, __ATOMIC_SEQ_CST);
        uint32_t w = __atomic_load_n(g_fast.gate, __ATOMIC_SEQ_CST);
        if (UNLIKELY(w != KREX_GATE_OPEN && (w & 0xff) != g_fast.owner_byte)) krex_left_closed();
    }
    t_depth--;
}

/* Is the holder of gate word `w` gone? Its side fields count only once published for
 * this very word (krex_gate_holder: ownership is one CAS on the word, the fields come
 * after it); a word whose holder never published them within the heartbeat timeout of
 * our first look (a closer that crashed right after its CAS, or a word nobody wrote)
 * counts as gone too. */
static int holder_gone(int gpu, uint32_t w, uint64_t now, uint64_t since) {
    uint32_t holder = 0;
    int64_t pid = 0;
    uint64_t dl = 0;
    if (!krex_gate_holder(g_shm, gpu, w, &holder, &pid, &dl)) return now - since > KREX_HEARTBEAT_TIMEOUT_NS;
    (void)pid;
    switch (holder) {
    case KREX_HOLDER_PAUSE:
        return dl != 0 && now > dl;
    case KREX_HOLDER_REGION: {
        uint64_t hb = __atomic_load_n(&g_shm->hdr.heartbeat_ns, __ATOMIC_SEQ_CST);
        uint64_t to = g_shm->hdr.heartbeat_timeout_ns ? g_shm->hdr.heartbeat_timeout_ns
                                                      : KREX_HEARTBEAT_TIMEOUT_NS;
        return now > hb && now - hb > to;
    }
    default:
        return now - since > KREX_HEARTBEAT_TIMEOUT_NS;
    }
}

/* Slow path: wait until the gate word changes. Returns 1 to fail open. */
static int krex_wait_gate(uint32_t w) {
    if (w == __atomic_load_n(&g_failed_gate, __ATOMIC_RELAXED)) return 1;
    struct krex_gpu *g = &g_shm->gpus[g_gpu];
    uint64_t t0 = krex_now_ns();
    if (g_proc) __atomic_fetch_add(&g_proc->blocked, 1, __ATOMIC_RELAXED);
    int failed = 0;
    for (;;) {
        krex_futex_wait(g_fast.gate, w, KREX_GATE_RECHECK_NS);
        if (__atomic_load_n(g_fast.gate, __ATOMIC_SEQ_CST) != w) break;
        uint64_t now = krex_now_ns();
        if (holder_gone(g_gpu, w, now, t0)) {
            __atomic_store_n(&g_failed_gate, w, __ATOMIC_RELAXED);
            __atomic_fetch_add(&g->fail_opens, 1, __ATOMIC_RELAXED);
            if (g_proc) __atomic_fetch_add(&g_proc->fail_opens, 1, __ATOMIC_RELAXED);
            set_flag(KREX_PF_FAILED_OPEN);
            klog("gate 0x%x on gpu %d: holder gone, failing open", w, g_gpu);
            failed = 1;
            break;
        }
    }
    if (g_proc) __atomic_fetch_add(&g_proc->blocked_ns, krex_now_ns() - t0, __ATOMIC_RELAXED);
    return failed;
}

/* ------------------------------------------------------------ real symbols */

typedef void *(*dlsym_fn)(void *, const char *);
static dlsym_fn g_real_dlsym; /* atomic */
/* Our own dlsym, by a hidden name: a reference to "dlsym" could bind to libc's. */
extern void *krex_self_dlsym(void *, const char *) __attribute__((visibility("hidden")));

/* glibc's dlsym by version: 2.34 moved it into libc; before that its base version
 * is the architecture's first glibc (2.2.5 x86_64, 2.17 aarch64, 2.0 i386, 2.3
 * ppc64, 2.4 arm, 2.27 riscv64, 2.36 loongarch64). dlvsym itself is not ours. */
KREX_NO_SANITIZE static void *libc_by_version(const char *name) {
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.0",
                                           "GLIBC_2.3",  "GLIBC_2.4",   "GLIBC_2.27", "GLIBC_2.36",
                                           "GLIBC_2.1",  "GLIBC_2.29",  "GLIBC_2.35", NULL};
    for (int i = 0; versions[i]; i++) {
        void *p = dlvsym(RTLD_NEXT, name, versions[i]);
        if (p && p != (void *)krex_self_dlsym) return p;
    }
    return NULL;
}

KREX_NO_SANITIZE static void *dlsym_by_version(void) { return libc_by_version("dlsym"); }

/* glibc's own dlopen/dlclose for the RTLD_NEXT search below: a sanitizer runtime
 * intercepts them and may call our dlsym before its interceptors work. */
typedef void *(*dlopen_fn)(const char *, int);
typedef int (*dlclose_fn)(void *);
static dlopen_fn g_real_dlopen;
static dlclose_fn g_real_dlclose;

KREX_NO_SANITIZE static void real_dl_init(void) {
    if (__atomic_load_n(&g_real_dlclose, __ATOMIC_ACQUIRE)) return;
    dlopen_fn o = (dlopen_fn)libc_by_version("dlopen");
    dlclose_fn c = (dlclose_fn)libc_by_version("dlclose");
    __atomic_store_n(&g_real_dlopen, o ? o : dlopen, __ATOMIC_RELEASE);
    __atomic_store_n(&g_real_dlclose, c ? c : dlclose, __ATOMIC_RELEASE);
}

/* The fallback when no version above matches (a new architecture, another base):
 * read the default-versioned "dlsym" straight from libc's (or libdl's) dynamic
 * symbol table, through its GNU or SysV hash table. */
struct elf_find {
    const char *name;
    void *addr;
};

KREX_NO_SANITIZE static uint32_t elf_gnu_hash(const char *s) {
    uint32_t h = 5381;
    for (; *s; s++) h = h * 33 + (unsigned char)*s;
    return h;
}

KREX_NO_SANITIZE static int elf_find_cb(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct elf_find *f = data;
    const char *n = info->dlpi_name;
    if (!n || (!strstr(n, "/libc.so") && !strstr(n, "/libdl.so") && strncmp(n, "libc.so", 7) != 0)) return 0;
    const ElfW(Dyn) *dyn = NULL;
    for (int i = 0; i < info->dlpi_phnum; i++)
        if (info->dlpi_phdr[i].p_type == PT_DYNAMIC)
            dyn = (const ElfW(Dyn) *)(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
    if (!dyn) return 0;
    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    const uint32_t *gnu = NULL, *sysv = NULL;
    const ElfW(Half) *versym = NULL;
    for (; dyn->d_tag != DT_NULL; dyn++) {
        /* Most ports relocate these to addresses; a few (RISC-V, MIPS) keep offsets. */
        ElfW(Addr) v = dyn->d_un.d_ptr;
        if (v < info->dlpi_addr) v += info->dlpi_addr;
        switch (dyn->d_tag) {
        case DT_SYMTAB: symtab = (const ElfW(Sym) *)v; break;
        case DT_STRTAB: strtab = (const char *)v; break;
        case DT_GNU_HASH: gnu = (const uint32_t *)v; break;
        case DT_HASH: sysv = (const uint32_t *)v; break;
        case DT_VERSYM: versym = (const ElfW(Half) *)v; break;
        default: break;
        }
    }
    if (!symtab || !strtab) return 0;
#define ELF_MATCH(i)                                                                             \
    (symtab[i].st_shndx != SHN_UNDEF && strcmp(strtab + symtab[i].st_name, f->name) == 0 &&     \
     (!versym || !(versym[i] & 0x8000)))
    if (gnu) {
        uint32_t nb = gnu[0], off = gnu[1], bloom = gnu[2];
        const uint32_t *buckets = (const uint32_t *)((const ElfW(Addr) *)&gnu[4] + bloom);
        const uint32_t *chain = buckets + nb;
        uint32_t h = elf_gnu_hash(f->name);
        for (uint32_t i = nb ? buckets[h % nb] : 0; i >= off && i != 0; i++) {
            uint32_t h2 = chain[i - off];
            if ((h | 1) == (h2 | 1) && ELF_MATCH(i)) {
                f->addr = (void *)(info->dlpi_addr + symtab[i].st_value);
                return 1;
            }
            if (h2 & 1) break;
        }
    } else if (sysv) {
        for (uint32_t i = 0; i < sysv[1]; i++)
            if (ELF_MATCH(i)) {
                f->addr = (void *)(info->dlpi_addr + symtab[i].st_value);
                return 1;
            }
    }
#undef ELF_MATCH
    return 0;
}

KREX_NO_SANITIZE static void *dlsym_from_elf(void) {
    struct elf_find f = {"dlsym", NULL};
    dl_iterate_phdr(elf_find_cb, &f);
    return f.addr != (void *)krex_self_dlsym ? f.addr : NULL;
}

KREX_NO_SANITIZE static dlsym_fn find_real_dlsym(void) {
    void *p = dlsym_by_version();
    if (!p) p = dlsym_from_elf();
    return (dlsym_fn)p;
}

KREX_NO_SANITIZE static void *real_dlsym(void *h, const char *name) {
    dlsym_fn fn = __atomic_load_n(&g_real_dlsym, ACQUIRE);
    if (UNLIKELY(!fn)) {
        fn = find_real_dlsym();
        if (!fn) return NULL;
        __atomic_store_n(&g_real_dlsym, fn, RELEASE);
    }
    return fn(h, name);
}

/* For tests: the real dlsym as each method finds it (0 by version, 1 from the ELF). */
KREX_EXPORT void *krex_shim_dlsym_probe(int method) { return method ? dlsym_from_elf() : dlsym_by_version(); }

static const char *const krex_sonames[KREX_N_APIS][4] = {
    {"libcudart.so.13", "libcudart.so.12", "libcudart.so", NULL},
    {"libcuda.so.1", "libcuda.so", NULL, NULL},
    {"libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6", NULL},
};

/* Find `name` in an already-loaded vendor library; never loads one. */
static void *vendor_sym(int api, const char *name) {
    for (int i = 0; krex_sonames[api][i]; i++) {
        void *h = dlopen(krex_sonames[api][i], RTLD_LAZY | RTLD_NOLOAD);
        if (!h) continue;
        void *p = real_dlsym(h, name);
        dlclose(h);
        if (p) return p;
    }
    return NULL;
}

static int is_own_wrapper(void *p);

/* Resolve slot 0 (the exported wrapper's target) by name. */
static void *krex_resolve(int id, int k) {
    if (k != 0) return NULL; /* other slots are only ever bound, never resolved */
    const struct krex_entry *e = &krex_entries[id];
    void *p = real_dlsym(RTLD_NEXT, e->name);
    if (!p || is_own_wrapper(p)) p = vendor_sym(e->api, e->name);
    if (!p || is_own_wrapper(p)) {
        set_flag(KREX_PF_NO_REAL);
        klog("no real %s found", e->name);
        return NULL;
    }
    void *expect = NULL;
    if (!__atomic_compare_exchange_n(&krex_real[id][0], &expect, p, 0, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE))
        return expect;
    return p;
}

/* ---------------------------------------------------------------- wrappers */

#define KREX_GET_FN(name, k)                                                           \
    krex_fn_##name fn = (krex_fn_##name)__atomic_load_n(&krex_real[KREX_ID_##name][k], \
                                                         __ATOMIC_ACQUIRE);            \
    if (UNLIKELY(!fn)) fn = (krex_fn_##name)krex_resolve(KREX_ID_##name, k);           \
    if (UNLIKELY(!fn)) return KREX_NOTFOUND;

#define KREX_GATED(fname, name, k, cls, params, args) \
    KREX_RET fname params {                           \
        KREX_GET_FN(name, k)                          \
        int krex_counted = krex_enter(cls);           \
        KREX_RET krex_rc = fn args;                   \
        krex_leave(krex_counted);                     \
        return krex_rc;                               \
    }
#define KREX_BODY_KERNEL(f, n, k, p, a) KREX_GATED(f, n, k, KREX_CLS_KERNEL, p, a)
#define KREX_BODY_COPY(f, n, k, p, a) KREX_GATED(f, n, k, KREX_CLS_COPY, p, a)
#define KREX_BODY_MEMSET(f, n, k, p, a) KREX_GATED(f, n, k, KREX_CLS_MEMSET, p, a)
#define KREX_BODY_GRAPH(f, n, k, p, a) KREX_GATED(f, n, k, KREX_CLS_GRAPH, p, a)
#define KREX_BODY_PREFETCH(f, n, k, p, a) KREX_GATED(f, n, k, KREX_CLS_PREFETCH, p, a)

static void *krex_redirect(int lookup_id, const char *symbol, void *realp, uint64_t flags);
static void krex_ctx_add(void *ctx);
static void krex_ctx_del(void *ctx);

/* Lookups are not gated: call the real one, then swap in our wrapper. */
#define KREX_BODY_LOOKUP(fname, name, k, params, args)                          \
    KREX_RET fname params {                                                     \
        KREX_GET_FN(name, k)                                                    \
        KREX_RET krex_rc = fn args;                                             \
        if (krex_rc == 0 && pfn && *pfn)                                        \
            *pfn = krex_redirect(KREX_ID_##name, symbol, *pfn, (uint64_t)flags); \
        return krex_rc;                                                         \
    }
/* Contexts are tracked so the drain helper can synchronise non-primary ones. */
#define KREX_BODY_CTXNEW(fname, name, k, params, args)                \
    KREX_RET fname params {                                           \
        KREX_GET_FN(name, k)                                          \
        KREX_RET krex_rc = fn args;                                   \
        if (krex_rc == 0 && pctx) krex_ctx_add((void *)*pctx);        \
        return krex_rc;                                               \
    }
#define KREX_BODY_CTXDEL(fname, name, k, params, args) \
    KREX_RET fname params {                            \
        KREX_GET_FN(name, k)                           \
        krex_ctx_del((void *)ctx);                     \
        return fn args;                                \
    }

/* Graph captures are tracked per stream so the drain helper never synchronises a
 * context while one of this process's streams is capturing (that would invalidate
 * it). A stream leaves the table at its end of capture, failed or not, unless the
 * vendor says it is still capturing (e.g. an end from the wrong thread): a failed
 * end must not leave every later drain partial. */
#define KREX_MAX_CAPTURES 64
static void *g_cap_streams[KREX_MAX_CAPTURES];
static uint32_t g_captures;         /* streams in the table, plus captures that did not fit */
static uint32_t g_capture_overflow;

static uint32_t g_cap_waiting; /* the drain helper sleeps on g_captures (a futex word) */

static void captures_publish(void) {
    struct krex_proc *p = __atomic_load_n(&g_proc, ACQUIRE);
    if (p) __atomic_store_n(&p->captures, __atomic_load_n(&g_captures, __ATOMIC_SEQ_CST), RELAXED);
    /* After the seq_cst change of g_captures: the helper sets g_cap_waiting, then reads
     * g_captures, so it either sees the change or is woken here. */
    if (__atomic_load_n(&g_cap_waiting, __ATOMIC_SEQ_CST)) krex_futex_wake(&g_captures);
}

static void krex_capture_begin(void *stream) {
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

static void *vendor_sym(int api, const char *name);

/* 1 if the vendor reports `stream` still capturing; 0 if not or it cannot say. */
static int capture_still_active(int api, void *stream) {
    static const char *const names[KREX_N_APIS] = {"cudaStreamIsCapturing", "cuStreamIsCapturing",
                                                   "hipStreamIsCapturing"};
    typedef int (*fn_is_capturing)(void *, int *);
    fn_is_capturing f = (fn_is_capturing)vendor_sym(api, names[api]);
    int status = 0;
    return f && f(stream, &status) == 0 && status == 1; /* 1: active in all three APIs */
}

static void krex_capture_end(int api, void *stream) {
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

#define KREX_FIRST_(a, ...) a
#define KREX_FIRST(args) KREX_FIRST_ args /* every capture row's first argument is the stream */
#define KREX_BODY_CAPBEGIN(fname, name, k, params, args)               \
    KREX_RET fname params {                                            \
        KREX_GET_FN(name, k)                                           \
        KREX_RET krex_rc = fn args;                                    \
        if (krex_rc == 0) krex_capture_begin((void *)KREX_FIRST(args)); \
        return krex_rc;                                                \
    }
#define KREX_BODY_CAPEND(fname, name, k, params, args)                                      \
    KREX_RET fname params {                                                                 \
        KREX_GET_FN(name, k)                                                                \
        KREX_RET krex_rc = fn args;                                                         \
        krex_capture_end(krex_entries[KREX_ID_##name].api, (void *)KREX_FIRST(args));      \
        return krex_rc;                                                                     \
    }

#define X(name, lookup, variant, cls, params, args, stream, cost, sample) \
    typedef KREX_RET(*krex_fn_##name) params;                             \
    KREX_EXPORT KREX_BODY_##cls(name, name, 0, params, args)              \
    static KREX_BODY_##cls(krex_w1_##name, name, 1, params, args)         \
    static KREX_BODY_##cls(krex_w2_##name, name, 2, params, args)         \
    static KREX_BODY_##cls(krex_w3_##name, name, 3, params, args)

#define KREX_RET cudaError_t
#define KREX_NOTFOUND cudaErrorInitializationError
#include "api_cudart.def"
#undef KREX_RET
#undef KREX_NOTFOUND
#define KREX_RET CUresult
#define KREX_NOTFOUND CUDA_ERROR_NOT_FOUND
#include "api_driver.def"
#undef KREX_RET
#undef KREX_NOTFOUND
#define KREX_RET hipError_t
#define KREX_NOTFOUND hipErrorNotInitialized
#include "api_hip.def"
#undef KREX_RET
#undef KREX_NOTFOUND
#undef X

static void *const krex_wrappers[KREX_N_IDS][KREX_NSLOT] = {
#define X(name, ...) \
    [KREX_ID_##name] = {(void *)name, (void *)krex_w1_##name, (void *)krex_w2_##name, (void *)krex_w3_##name},
#include "api_cudart.def"
#include "api_driver.def"
#include "api_hip.def"
#undef X
};

static int is_own_wrapper(void *p) {
    /* Slow path only (dlsym / lookups): a linear scan is fine. */
    for (int i = 0; i < KREX_N_IDS; i++)
        for (int k = 0; k < KREX_NSLOT; k++)
            if (krex_wrappers[i][k] == p) return 1;
    return 0;
}

/* Bind `realp` to a wrapper of entry `id`: reuse the slot that already holds it
 * or claim an empty one. If all slots hold other pointers the call escapes the
 * gate; that is flagged, never silent. */
static void *krex_bind(int id, void *realp) {
    if (is_own_wrapper(realp)) return realp;
    for (int k = 0; k < KREX_NSLOT; k++) {
        void *cur = __atomic_load_n(&krex_real[id][k], __ATOMIC_ACQUIRE);
        if (cur == NULL && k == 0) cur = krex_resolve(id, 0);
        if (cur == realp) return krex_wrappers[id][k];
        if (cur == NULL) {
            void *expect = NULL;
            if (__atomic_compare_exchange_n(&krex_real[id][k], &expect, realp, 0, __ATOMIC_ACQ_REL,
                                            __ATOMIC_ACQUIRE) ||
                expect == realp)
                return krex_wrappers[id][k];
        }
    }
    set_flag(KREX_PF_LOOKUP_FALLBACK);
    klog("all %d wrapper slots of %s are taken; passing a real pointer", KREX_NSLOT,
         krex_entries[id].name);
    return realp;
}

/* Name -> entry id, by binary search over a sorted index built at load time. */
static int g_sorted[KREX_N_IDS];
static int g_nsorted;

static int cmp_ids(const void *a, const void *b) {
    return strcmp(krex_entries[*(const int *)a].name, krex_entries[*(const int *)b].name);
}

KREX_NO_SANITIZE static int krex_find(const char *name) {
    int lo = 0, hi = g_nsorted - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        int c = strcmp(name, krex_entries[g_sorted[mid]].name);
        if (c == 0) return g_sorted[mid];
        if (c < 0) hi = mid - 1;
        else lo = mid + 1;
    }
    return -1;
}

static int version_of(const char *name) {
    const char *v = strstr(name, "_v");
    return v ? atoi(v + 2) : 1;
}

/* GetProcAddress redirection. The lookup returns the real pointer for the
 * variant it chose (default or per-thread stream, ABI version); find the table
 * entry with that exact pointer, or else the best match by flags and version. */
static void *krex_redirect(int lookup_id, const char *symbol, void *realp, uint64_t flags) {
    if (!mode_on() || !symbol || is_own_wrapper(realp)) return realp;
    int api = krex_entries[lookup_id].api == KREX_API_HIP ? KREX_API_HIP : KREX_API_DRIVER;
    int best = -1;
    int want_pt = (flags & 2) != 0; /* *_PER_THREAD_DEFAULT_STREAM is 2 in all three APIs */
    for (int i = 0; i < KREX_N_IDS; i++) {
        const struct krex_entry *e = &krex_entries[i];
        if (!e->name || e->api != api || strcmp(e->lookup, symbol) != 0) continue;
        void *r = __atomic_load_n(&krex_real[i][0], __ATOMIC_ACQUIRE);
        if (!r) r = krex_resolve(i, 0);
        if (r == realp) return krex_bind(i, realp);
        if (e->variant == KREX_VAR_V1 || (e->variant == KREX_VAR_PT) != want_pt) continue;
        if (best < 0 || version_of(e->name) > version_of(krex_entries[best].name)) best = i;
    }
    if (best < 0) return realp; /* not something we gate */
    set_flag(KREX_PF_LOOKUP_FALLBACK);
    return krex_bind(best, realp);
}

KREX_EXPORT int krex_shim_active(void);

/* RTLD_NEXT relative to `caller`: real dlsym would take the caller to be us. */
KREX_NO_SANITIZE static void *dlsym_next(struct link_map *caller, const char *name) {
    Dl_info info;
    struct link_map *self = NULL;
    dladdr1((void *)krex_shim_active, &info, (void **)&self, RTLD_DL_LINKMAP);
    int self_after = 0;
    for (struct link_map *l = caller->l_next; l && self; l = l->l_next)
        if (l == self) self_after = 1;
    real_dl_init();
    dlopen_fn o = __atomic_load_n(&g_real_dlopen, __ATOMIC_ACQUIRE);
    dlclose_fn c = __atomic_load_n(&g_real_dlclose, __ATOMIC_ACQUIRE);
    void *p = NULL;
    /* The objects after the caller (and before us, when the caller precedes us), one
     * by one. dlopen(RTLD_NOLOAD) is never aimed at us: that would run our
     * constructor early when the caller is a preloaded library still initialising
     * (a sanitizer runtime resolves its interceptors like that). */
    for (struct link_map *l = caller->l_next; l && l != self && !p; l = l->l_next) {
        if (!l->l_name || !l->l_name[0]) continue;
        void *h = o(l->l_name, RTLD_LAZY | RTLD_NOLOAD);
        if (!h) continue;
        p = real_dlsym(h, name);
        c(h);
    }
    if (p || !self_after) return p;
    /* Then us (what we export), then everything after us: plain RTLD_NEXT from here. */
    int id = krex_find(name);
    if (id >= 0) return krex_wrappers[id][0];
    return real_dlsym(RTLD_NEXT, name);
}

KREX_EXPORT KREX_NO_SANITIZE void *dlsym(void *handle, const char *name) {
    void *p;
    if (handle == RTLD_NEXT) {
        Dl_info info;
        struct link_map *lm = NULL;
        p = NULL;
        if (dladdr1(__builtin_return_address(0), &info, (void **)&lm, RTLD_DL_LINKMAP) && lm)
            p = dlsym_next(lm, name);
    } else {
        p = real_dlsym(handle, name);
    }
    if (!p || !mode_on()) return p;
    int id = krex_find(name);
    return id < 0 ? p : krex_bind(id, p);
}
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpragmas"
#pragma GCC diagnostic ignored "-Wmissing-attributes" /* glibc's nonnull/leaf on dlsym: irrelevant here */
void *krex_self_dlsym(void *, const char *) __attribute__((alias("dlsym")));
#pragma GCC diagnostic pop

/* ------------------------------------------------------------ drain helper */

#define KREX_MAX_CTX 32
static void *g_ctxs[KREX_MAX_CTX];

static void krex_ctx_add(void *ctx) {
    for (int i = 0; i < KREX_MAX_CTX; i++) {
        void *expect = NULL;
        if (__atomic_compare_exchange_n(&g_ctxs[i], &expect, ctx, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            return;
    }
}

static void krex_ctx_del(void *ctx) {
    for (int i = 0; i < KREX_MAX_CTX; i++) {
        void *expect = ctx;
        __atomic_compare_exchange_n(&g_ctxs[i], &expect, NULL, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    }
}

typedef CUresult (*fn_i_p)(void *);
typedef CUresult (*fn_dev_state)(CUdevice, unsigned int *, int *);
typedef CUresult (*fn_retain)(CUcontext *, CUdevice);
typedef CUresult (*fn_release)(CUdevice);
typedef CUresult (*fn_void)(void);
typedef CUresult (*fn_setdev)(int);

/* The vendor functions a drain calls, looked up by the helper thread only. A lookup of a
 * library that is not loaded (HIP on a CUDA node) searches the whole library path: ~180
 * syscalls and ~0.2 ms of CPU per drain per process. So they are looked up again only
 * when the set of loaded objects changed (glibc's dlpi_adds/dlpi_subs counters). */
static struct {
    fn_i_p cu_count, cu_push, cu_pop;
    fn_dev_state cu_state;
    fn_retain cu_retain;
    fn_release cu_release;
    fn_void cu_sync;
    fn_i_p hip_count;
    fn_dev_state hip_state;
    fn_setdev hip_setdev;
    fn_void hip_sync;
    unsigned long long adds, subs;
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

static void drain_fns(void) {
    unsigned long long v[3] = {0, 0, 0};
    dl_iterate_phdr(loaded_gen, v);
    if (g_dfn.valid && v[2] && v[0] == g_dfn.adds && v[1] == g_dfn.subs) return;
    g_dfn.cu_count = (fn_i_p)vendor_sym(KREX_API_DRIVER, "cuDeviceGetCount");
    g_dfn.cu_state = (fn_dev_state)vendor_sym(KREX_API_DRIVER, "cuDevicePrimaryCtxGetState");
    g_dfn.cu_retain = (fn_retain)vendor_sym(KREX_API_DRIVER, "cuDevicePrimaryCtxRetain");
    g_dfn.cu_release = (fn_release)vendor_sym(KREX_API_DRIVER, "cuDevicePrimaryCtxRelease_v2");
    g_dfn.cu_push = (fn_i_p)vendor_sym(KREX_API_DRIVER, "cuCtxPushCurrent_v2");
    g_dfn.cu_pop = (fn_i_p)vendor_sym(KREX_API_DRIVER, "cuCtxPopCurrent_v2");
    g_dfn.cu_sync = (fn_void)vendor_sym(KREX_API_DRIVER, "cuCtxSynchronize");
    g_dfn.hip_count = (fn_i_p)vendor_sym(KREX_API_HIP, "hipGetDeviceCount");
    g_dfn.hip_state = (fn_dev_state)vendor_sym(KREX_API_HIP, "hipDevicePrimaryCtxGetState");
    g_dfn.hip_setdev = (fn_setdev)vendor_sym(KREX_API_HIP, "hipSetDevice");
    g_dfn.hip_sync = (fn_void)vendor_sym(KREX_API_HIP, "hipDeviceSynchronize");
    g_dfn.adds = v[0];
    g_dfn.subs = v[1];
    g_dfn.valid = v[2] != 0; /* counters unknown (an old libc): look up every time, as before */
}

/* Synchronise the CUDA contexts this process already has; never create one. */
static void drain_cuda(void) {
    fn_i_p count = g_dfn.cu_count, push = g_dfn.cu_push, pop = g_dfn.cu_pop;
    fn_dev_state state = g_dfn.cu_state;
    fn_retain retain = g_dfn.cu_retain;
    fn_release release = g_dfn.cu_release;
    fn_void sync = g_dfn.cu_sync;
    if (!count || !state || !retain || !release || !push || !pop || !sync) return;
    int n = 0;
    if (count(&n) != CUDA_SUCCESS) return;
    for (int d = 0; d < n; d++) {
        unsigned int fl = 0;
        int active = 0;
        if (state(d, &fl, &active) != CUDA_SUCCESS || !active) continue;
        CUcontext ctx = NULL;
        if (retain(&ctx, d) != CUDA_SUCCESS) continue;
        if (push(ctx) == CUDA_SUCCESS) {
            sync();
            CUcontext old;
            pop(&old);
        }
        release(d);
    }
    for (int i = 0; i < KREX_MAX_CTX; i++) {
        void *ctx = __atomic_load_n(&g_ctxs[i], __ATOMIC_ACQUIRE);
        if (!ctx || push(ctx) != CUDA_SUCCESS) continue;
        sync();
        CUcontext old;
        pop(&old);
    }
}

static void drain_hip(void) {
    fn_i_p count = g_dfn.hip_count;
    fn_dev_state state = g_dfn.hip_state;
    fn_setdev setdev = g_dfn.hip_setdev;
    fn_void sync = g_dfn.hip_sync;
    if (!count || !state || !setdev || !sync) return;
    int n = 0;
    if (count(&n) != hipSuccess) return;
    for (int d = 0; d < n; d++) {
        unsigned int fl = 0;
        int active = 0;
        if (state(d, &fl, &active) != hipSuccess || !active) continue;
        if (setdev(d) == hipSuccess) sync();
    }
}

static uint32_t g_helper_stop;  /* atomic: set at exit */
static uint32_t g_helper_busy;  /* atomic: inside a drain */
static pthread_t g_helper_thread;
static pid_t g_helper_pid;      /* the process that started it (a fork child has none) */

static void *krex_helper(void *arg) {
    (void)arg;
    prctl(PR_SET_NAME, "krex-drain", 0, 0, 0);
    /* Relaxed capture mode on this thread: a context synchronise here must not
     * invalidate a graph another thread is capturing (DESIGN.md consequence 7). */
    typedef CUresult (*fn_xmode)(CUstreamCaptureMode *);
    fn_xmode xmode = (fn_xmode)vendor_sym(KREX_API_DRIVER, "cuThreadExchangeStreamCaptureMode");
    if (xmode) {
        CUstreamCaptureMode m = CU_STREAM_CAPTURE_MODE_RELAXED;
        xmode(&m);
    }
    struct krex_gpu *g = &g_shm->gpus[g_gpu];
    struct krex_proc *p = g_proc;
    uint32_t seen = __atomic_load_n(&p->drain_ack, __ATOMIC_SEQ_CST);
    for (;;) {
        __atomic_store_n(&g_helper_busy, 0, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&g_helper_stop, __ATOMIC_SEQ_CST)) break;
        uint32_t cur = __atomic_load_n(&g->drain_seq, __ATOMIC_SEQ_CST);
        if (cur == seen) {
            krex_futex_wait(&g->drain_seq, cur, KREX_HELPER_RECHECK_NS);
            continue;
        }
        /* Busy before the stop check: exit either sees busy, or we see stop. */
        __atomic_store_n(&g_helper_busy, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&g_helper_stop, __ATOMIC_SEQ_CST)) break;
        /* A context synchronise would invalidate a capture in progress: give
         * the capture a moment to end, else ack as partial so the controller
         * marks the grant contaminated instead of silently clean. */
        uint64_t t0 = krex_now_ns();
        __atomic_store_n(&g_cap_waiting, 1, __ATOMIC_SEQ_CST);
        for (uint32_t c; (c = __atomic_load_n(&g_captures, __ATOMIC_SEQ_CST)) > 0;) {
            uint64_t spent = krex_now_ns() - t0;
            if (spent >= KREX_CAPTURE_WAIT_NS) break;
            krex_futex_wait(&g_captures, c, KREX_CAPTURE_WAIT_NS - spent); /* woken by the capture's end */
        }
        __atomic_store_n(&g_cap_waiting, 0, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&g_captures, __ATOMIC_SEQ_CST) > 0) {
            __atomic_store_n(&p->drain_partial, cur, __ATOMIC_SEQ_CST);
            __atomic_or_fetch(&p->flags, KREX_PF_DRAIN_PARTIAL, __ATOMIC_RELAXED);
        } else {
            drain_fns();
            drain_cuda();
            drain_hip();
        }
        __atomic_fetch_add(&p->drains, 1, __ATOMIC_RELAXED);
        __atomic_store_n(&p->drain_ack, cur, __ATOMIC_SEQ_CST);
        krex_wake_controller(g_shm, g_gpu); /* krexd sleeps until the last ack */
        seen = cur;
    }
    __atomic_store_n(&g_helper_busy, 0, __ATOMIC_SEQ_CST);
    return NULL;
}

/* At exit: no drain may start while the vendor libraries tear down, and one in
 * progress is waited for (bounded). Registered with atexit when the helper
 * starts, i.e. after the vendor runtime registered its own exit handlers, so it
 * runs before them. */
static void stop_helper(void) {
    if (!__atomic_load_n(&g_helper_started, ACQUIRE) || g_helper_pid != getpid()) return;
    __atomic_store_n(&g_helper_stop, 1, __ATOMIC_SEQ_CST);
    struct krex_shm *shm = __atomic_load_n(&g_shm, ACQUIRE);
    if (shm && g_gpu >= 0) krex_futex_wake(&shm->gpus[g_gpu].drain_seq); /* others just re-check */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += KREX_HEARTBEAT_TIMEOUT_NS / 1000000000;
    if (pthread_timedjoin_np(g_helper_thread, NULL, &ts) != 0)
        klog("drain helper still busy at exit; leaving it");
    else
        klog("drain helper stopped at exit");
}

static void start_helper(void) {
    sigset_t all, old;
    sigfillset(&all);
    /* The helper inherits a full mask, so process signals go to app threads. */
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setstacksize(&a, 256 * 1024);
    __atomic_store_n(&g_helper_stop, 0, __ATOMIC_SEQ_CST);
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

/* ------------------------------------------------------------ krexd client */

/* One JSON line each way over the daemon's Unix socket. The daemon learns who
 * we are from SO_PEERCRED; the message carries only what it cannot know.
 *
 * Nothing here can kill or hang the application: sends use MSG_NOSIGNAL (a
 * vanished krexd is EPIPE, never SIGPIPE), connecting and sending time out after
 * KREX_CONNECT_TIMEOUT_MS, and a wait for a reply re-checks krexd's heartbeat
 * every KREX_CLIENT_POLL_NS and gives up once it is older than the timeout. No
 * lock is held across any of it: each region has a connection of its own. */

/* Start krexd (KREX_DAEMON_CMD) in its own session, with /dev/null for stdin,
 * stdout and stderr and none of our other descriptors: an inherited pipe would
 * keep whoever reads our output waiting until krexd exits. */
static void spawn_daemon(void) {
    posix_spawn_file_actions_t fa;
    posix_spawnattr_t at;
    posix_spawn_file_actions_init(&fa);
    posix_spawnattr_init(&at);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 34))
    posix_spawn_file_actions_addclosefrom_np(&fa, 3);
#else
    DIR *d = opendir("/proc/self/fd");
    if (d) {
        for (struct dirent *e; (e = readdir(d));) {
            int fd = atoi(e->d_name);
            if (fd > 2 && fd != dirfd(d)) posix_spawn_file_actions_addclose(&fa, fd);
        }
        closedir(d);
    }
#endif
    sigset_t none, all;
    sigemptyset(&none);
    sigfillset(&all);
    posix_spawnattr_setsigmask(&at, &none);  /* not the application's blocked signals */
    posix_spawnattr_setsigdefault(&at, &all); /* nor its ignored ones (SIGTERM must stop krexd) */
    posix_spawnattr_setflags(&at, POSIX_SPAWN_SETSID | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    char *argv[] = {"/bin/sh", "-c", g_daemon_cmd, NULL};
    pid_t pid;
    int rc = posix_spawn(&pid, "/bin/sh", &fa, &at, argv, environ);
    posix_spawnattr_destroy(&at);
    posix_spawn_file_actions_destroy(&fa);
    klog("starting krexd: %s (%s)", g_daemon_cmd, rc ? strerror(rc) : "ok");
}

/* One connect attempt, bounded by KREX_CONNECT_TIMEOUT_MS (a full backlog). */
static int conn_try(void) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -errno;
    struct timeval tv = {KREX_CONNECT_TIMEOUT_MS / 1000, (KREX_CONNECT_TIMEOUT_MS % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_un a;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    memcpy(a.sun_path, g_sock_path, strlen(g_sock_path) + 1); /* length checked at init */
    if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0) return fd;
    int e = errno;
    close(fd);
    return -e;
}

/* A new connection to krexd, starting it (once per process) if nobody listens. */
static int conn_open(void) {
    if (!g_sock_path[0]) return -ENOENT;
    uint64_t deadline = krex_now_ns() + (uint64_t)KREX_DAEMON_START_WAIT_MS * 1000000ull;
    for (;;) {
        int fd = conn_try();
        if (fd >= 0) return fd;
        if ((fd != -ENOENT && fd != -ECONNREFUSED) || !g_daemon_cmd[0]) return fd;
        int expect = 0;
        if (__atomic_compare_exchange_n(&g_spawned, &expect, 1, 0, __ATOMIC_ACQ_REL, ACQUIRE)) spawn_daemon();
        if (krex_now_ns() > deadline) return fd;
        usleep(50000);
    }
}

static int send_all(int fd, const char *buf, size_t len) {
    while (len > 0) {
        ssize_t w = send(fd, buf, len, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            return errno == EAGAIN ? -ETIMEDOUT : -errno;
        }
        buf += w;
        len -= (size_t)w;
    }
    return 0;
}

static struct krex_shm *attach_shm(void);

/* Is krexd dead or hung: its heartbeat older than the timeout? 0 when unknown. */
static int daemon_stale(void) {
    struct krex_shm *shm = attach_shm();
    if (!shm) return 0;
    uint64_t hb = __atomic_load_n(&shm->hdr.heartbeat_ns, __ATOMIC_SEQ_CST);
    uint64_t to = __atomic_load_n(&shm->hdr.heartbeat_timeout_ns, RELAXED);
    uint64_t now = krex_now_ns();
    return hb && now > hb && now - hb > (to ? to : KREX_HEARTBEAT_TIMEOUT_NS);
}

/* Read one reply line into buf (event lines skipped). As long as krexd beats this
 * waits (a region may queue behind others); -ETIMEDOUT once it stops beating,
 * -EPIPE when it closed the connection. */
static int recv_line(int fd, char *buf, size_t n) {
    size_t got = 0;
    for (;;) {
        struct pollfd pf = {fd, POLLIN, 0};
        int r = poll(&pf, 1, (int)(KREX_CLIENT_POLL_NS / 1000000));
        if (r < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (r == 0) {
            if (daemon_stale()) return -ETIMEDOUT;
            continue;
        }
        ssize_t k = recv(fd, buf + got, 1, 0);
        if (k == 0) return -EPIPE;
        if (k < 0) {
            if (errno == EINTR || errno == EAGAIN) continue;
            return -errno;
        }
        if (buf[got] == '\n') {
            buf[got] = 0;
            if (strstr(buf, "\"event\"")) {
                got = 0;
                continue;
            }
            return 0;
        }
        if (got + 2 < n) got++; /* an over-long line is truncated, never overflows */
    }
}

static int conn_call(int fd, const char *req, char *rep, size_t n) {
    int rc = send_all(fd, req, strlen(req));
    return rc ? rc : recv_line(fd, rep, n);
}

static int json_int(const char *buf, const char *key, int *out) {
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = strstr(buf, pat);
    if (!p) return -1;
    return sscanf(p + strlen(pat), "%d", out) == 1 ? 0 : -1;
}

static int first_visible_gpu(void) {
    return g_gpu >= 0 ? g_gpu : 0;
}

/* Opt-in processes (krex env, no KREX_SLOT) ask krexd for a slot once; the
 * connection stays open for the process's life (krexd frees the slot when it
 * closes). One thread registers; the others wait for it, holding no lock. */
static int krex_self_register(void) {
    if (!g_need_selfreg) return 0;
    int expect = 0;
    if (!__atomic_compare_exchange_n(&g_selfreg, &expect, 1, 0, __ATOMIC_ACQ_REL, ACQUIRE)) {
        while (__atomic_load_n(&g_selfreg, ACQUIRE) == 1) usleep(1000);
        return __atomic_load_n(&g_selfreg, ACQUIRE) == 2 ? 0 : -1;
    }
    char req[128], rep[4096];
    int ok = -1, fd = conn_open();
    if (fd >= 0) {
        snprintf(req, sizeof req, "{\"op\":\"register\",\"gpu\":%d}\n", first_visible_gpu());
        int slot = -1, gpu = -1;
        if (conn_call(fd, req, rep, sizeof rep) == 0 && strstr(rep, "\"ok\":true") &&
            json_int(rep, "slot", &slot) == 0 && json_int(rep, "gpu", &gpu) == 0) {
            g_slot = slot;
            g_gpu = gpu;
            g_reg_conn = fd;
            ok = 0;
        } else {
            close(fd);
        }
    }
    __atomic_store_n(&g_selfreg, ok == 0 ? 2 : 3, RELEASE);
    return ok;
}

/* Regions are lost (krexd gone, hung or stopping) without harming the caller:
 * the marker returns an error and the process record says so. */
static void region_lost(const char *what, int rc) {
    set_flag(KREX_PF_DAEMON_LOST);
    klog("region %s: lost krexd (%s); the region is not exclusive", what, strerror(-rc));
}

/* The C/C++ region markers (krex.h) resolve these at run time. 0 = granted or
 * not under KREX; negative = refused or lost (errno value). A nested begin on the
 * same thread is a no-op. */
KREX_EXPORT int krex_region_begin(void) {
    /* Meant to be under KREX but not attached (segment gone or damaged): say so, never
     * pretend a region happened. */
    if (mode_on() && !__atomic_load_n(&g_fast.gate, ACQUIRE)) krex_register();
    if (__atomic_load_n(&g_attach_err, RELAXED)) return -__atomic_load_n(&g_attach_err, RELAXED);
    if (!mode_on() || !g_sock_path[0]) return 0;
    if (t_region_depth++ > 0) return 0;
    /* Register first: krexd frees a slot made on a region's own connection with it. */
    if (krex_self_register() != 0) {
        t_region_depth = 0;
        region_lost("begin", -ECONNREFUSED);
        return -ECONNREFUSED;
    }
    char req[160], rep[16384];
    snprintf(req, sizeof req, "{\"op\":\"begin\",\"tid\":%ld,\"gpu\":%d}\n", (long)syscall(SYS_gettid),
             first_visible_gpu());
    int fd = conn_open();
    int rc = fd < 0 ? fd : conn_call(fd, req, rep, sizeof rep);
    if (rc != 0 || !strstr(rep, "\"ok\":true")) {
        if (fd >= 0) close(fd);
        t_region_depth = 0;
        if (rc != 0) {
            region_lost("begin", rc);
            return rc;
        }
        klog("region refused: %s", rep);
        return -EIO;
    }
    t_region_fd = fd;
    return 0;
}

/* 0 = the region was exclusive from BEGIN to END. -ETIMEDOUT = krexd cut it at
 * --max-region before END (what ran after the cut was not protected). 1 = it ended
 * but krexd flagged it (contaminated; `krex journal` says why). Other negative
 * values: krexd was lost or did not answer. */
KREX_EXPORT int krex_region_end(void) {
    if (__atomic_load_n(&g_attach_err, RELAXED)) return -__atomic_load_n(&g_attach_err, RELAXED);
    if (!mode_on() || !g_sock_path[0]) return 0;
    if (t_region_depth <= 0) return -EINVAL;
    if (--t_region_depth > 0) return 0;
    int fd = t_region_fd;
    t_region_fd = -1;
    if (fd < 0) return -EIO;
    char rep[16384];
    int rc = conn_call(fd, "{\"op\":\"end\"}\n", rep, sizeof rep);
    close(fd);
    if (rc != 0) {
        region_lost("end", rc);
        return rc;
    }
    if (!strstr(rep, "\"ok\":true")) return -EIO;
    /* krexd puts the verdict first ("clean", "cut"), before the long record. */
    if (strstr(rep, "\"cut\":true")) return -ETIMEDOUT;
    if (!strstr(rep, "\"clean\":true")) return 1;
    return 0;
}

/* ------------------------------------------------------------ registration */

/* The segment, attached once (for the fast path, and for clients to read krexd's
 * heartbeat). Short: held lock, no krexd round trip. */
static struct krex_shm *attach_shm(void) {
    struct krex_shm *shm = __atomic_load_n(&g_shm, ACQUIRE);
    if (shm || !g_shm_name[0]) return shm;
    pthread_mutex_lock(&g_reg_lock);
    shm = g_shm;
    if (!shm) {
        int err = 0;
        shm = krex_shm_open(g_shm_name, 0, 0, &err);
        if (shm) {
            __atomic_store_n(&g_shm, shm, RELEASE);
        } else {
            __atomic_store_n(&g_attach_err, err ? err : EIO, RELAXED);
            klog("cannot attach %s (%s)", g_shm_name, strerror(err));
        }
    }
    pthread_mutex_unlock(&g_reg_lock);
    return shm;
}

static int krex_register(void) {
    /* Self-registration first (it may have to start krexd, which creates the
     * segment), with no lock held: it may wait for krexd. */
    if (krex_self_register() != 0) {
        klog("self-registration with krexd failed; passing through");
        __atomic_store_n(&g_mode, MODE_OFF, RELAXED);
        return 0;
    }
    if (!attach_shm()) {
        klog("cannot attach %s; passing through", g_shm_name);
        __atomic_store_n(&g_mode, MODE_OFF, RELAXED);
        return 0;
    }
    pthread_mutex_lock(&g_reg_lock);
    if (g_fast.gate || !mode_on()) goto out;
    if (g_slot < 0 || g_slot >= KREX_MAX_SLOTS) {
        __atomic_store_n(&g_mode, MODE_OFF, RELAXED);
        goto out;
    }
    if (g_gpu < 0) g_gpu = g_shm->slots[g_slot].gpu;
    if (g_gpu < 0 || g_gpu >= KREX_MAX_GPUS) g_gpu = 0;
    /* A process that outlived its command while the slot went to another command: it
     * must never pass that command's gate. It registers as a sibling of everyone. */
    int stale = g_slot_gen >= 0 &&
                (__atomic_load_n(&g_shm->slots[g_slot].state, __ATOMIC_SEQ_CST) != KREX_SLOT_ACTIVE ||
                 (long long)__atomic_load_n(&g_shm->slots[g_slot].generation, __ATOMIC_SEQ_CST) != g_slot_gen);
    int idx = krex_proc_register(g_shm, stale ? KREX_PROC_STALE : g_slot, g_gpu, (int64_t)getpid());
    if (idx >= 0) {
        struct krex_proc *p = &g_shm->procs[idx];
        __atomic_or_fetch(&p->flags, __atomic_load_n(&g_pending_flags, RELAXED), RELAXED);
        __atomic_store_n(&p->captures, __atomic_load_n(&g_captures, __ATOMIC_SEQ_CST), RELAXED);
        __atomic_store_n(&g_proc, p, RELEASE);
        g_fast.inflight = &p->inflight;
        g_fast.submits = p->submits;
        __atomic_store_n(&p->has_ctx, 1, __ATOMIC_SEQ_CST);
    } else {
        /* No record left: still gated, through the slot's shared counter. */
        g_fast.inflight = &g_shm->slots[g_slot].inflight;
        g_fast.submits = g_local_submits;
    }
    /* 0 never matches a closed gate's owner byte (slot+1 or 255). */
    g_fast.owner_byte = stale ? 0 : (uint32_t)g_slot + 1;
    if (stale) {
        set_flag(KREX_PF_STALE_SLOT);
        klog("slot %d was handed to another command (generation %lld, ours %lld): registering as a sibling",
             g_slot, (long long)g_shm->slots[g_slot].generation, g_slot_gen);
    }
    __atomic_store_n(&g_fast.gate, &g_shm->gpus[g_gpu].gate, RELEASE);
    if (g_proc && !g_helper_started) start_helper();
    klog("registered: slot %d gpu %d record %d", g_slot, g_gpu, idx);
out:
    pthread_mutex_unlock(&g_reg_lock);
    return __atomic_load_n(&g_fast.gate, ACQUIRE) != NULL;
}

/* fork: the prepare handler takes the registration lock, so the child never
 * inherits it held by a thread that does not exist there; parent and child
 * release it. The lock is only ever held briefly (see g_reg_lock). */
static void atfork_prepare(void) { pthread_mutex_lock(&g_reg_lock); }

static void atfork_parent(void) { pthread_mutex_unlock(&g_reg_lock); }

static void atfork_child(void) {
    pthread_mutex_unlock(&g_reg_lock);
    /* The child is a new process: re-register (own record, own helper) lazily.
     * The parent's connections stay the parent's. */
    __atomic_store_n(&g_fast.gate, NULL, RELAXED);
    __atomic_store_n(&g_proc, NULL, RELAXED);
    __atomic_store_n(&g_helper_started, 0, RELAXED);
    g_failed_gate = 0;
    for (int i = 0; i < KREX_MAX_CAPTURES; i++) g_cap_streams[i] = NULL;
    g_captures = g_capture_overflow = 0;
    g_cap_waiting = 0;
    if (g_reg_conn >= 0) close(g_reg_conn);
    g_reg_conn = -1;
    if (g_need_selfreg) g_selfreg = 0;
    if (t_region_fd >= 0) close(t_region_fd);
    t_region_fd = -1;
    t_region_depth = 0;
    g_spawned = 0;
    for (int i = 0; i < KREX_MAX_CTX; i++) g_ctxs[i] = NULL;
}

static int parse_int(const char *s, int *out) {
    if (!s || !*s) return 0;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < 0 || v > 1 << 20) return 0;
    *out = (int)v;
    return 1;
}

__attribute__((constructor)) static void krex_init(void) {
    for (int i = 0; i < KREX_N_IDS; i++)
        if (krex_entries[i].name) g_sorted[g_nsorted++] = i;
    qsort(g_sorted, (size_t)g_nsorted, sizeof(int), cmp_ids);
    const char *lg = getenv("KREX_LOG");
    g_log = lg && *lg && strcmp(lg, "0") != 0;
    const char *name = getenv("KREX_SHM");
    const char *slot = getenv("KREX_SLOT");
    if (!name || !*name || strlen(name) >= sizeof g_shm_name) return;
    const char *sock = getenv("KREX_SOCKET");
    if (sock && strlen(sock) < sizeof g_sock_path) strcpy(g_sock_path, sock);
    const char *dcmd = getenv("KREX_DAEMON_CMD");
    if (dcmd && strlen(dcmd) < sizeof g_daemon_cmd) strcpy(g_daemon_cmd, dcmd);
    if (slot && *slot && !parse_int(slot, &g_slot)) {
        klog("KREX_SLOT=%s is not a slot number; passing through", slot);
        return;
    }
    if (!slot || !*slot) {
        g_slot = -1;
        if (!g_sock_path[0]) {
            klog("KREX_SHM set without KREX_SLOT or KREX_SOCKET; passing through");
            return;
        }
        g_need_selfreg = 1;
    }
    const char *gen = getenv("KREX_SLOT_GEN");
    if (gen && *gen) {
        char *end;
        errno = 0;
        long long v = strtoll(gen, &end, 10);
        g_slot_gen = errno || *end || v < 0 ? -1 : v;
    }
    if (!parse_int(getenv("KREX_GPU"), &g_gpu)) {
        /* An opt-in process names its GPU through CUDA_VISIBLE_DEVICES. */
        const char *vis = getenv("CUDA_VISIBLE_DEVICES");
        if (!vis || !parse_int(vis, &g_gpu)) g_gpu = -1;
    }
    strcpy(g_shm_name, name);
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
    __atomic_store_n(&g_mode, MODE_ON, RELAXED);
}

/* Exposed for tests and `krex doctor`: is this process under KREX? */
KREX_EXPORT int krex_shim_active(void) { return mode_on(); }
KREX_EXPORT int krex_shim_registered(void) { return __atomic_load_n(&g_fast.gate, ACQUIRE) != NULL; }
KREX_EXPORT int krex_shim_helper_running(void) { return __atomic_load_n(&g_helper_started, ACQUIRE); }
/* For tests: graph captures this process is in (per stream). */
KREX_EXPORT int krex_shim_captures(void) { return (int)__atomic_load_n(&g_captures, __ATOMIC_SEQ_CST); }
