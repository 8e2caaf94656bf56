/* libkrex_interpose.so: the data plane, loaded with LD_PRELOAD.
 *
 * The parts: shim_fastpath.h (the inline gate every gated wrapper runs),
 * hooks.c (the wrappers, generated from the api_*.def tables), resolve.c (real
 * symbols, dlsym), drain.c (the drain helper), ctx_gate.c (one context creation at a
 * time into the driver), client.c (talking to krexd), and
 * this file: process state, the gate's slow path, registration, load and fork.
 *
 * Outside KREX (no KREX_SHM/KREX_SLOT) every wrapper is a pass-through: no
 * threads, no output, dlsym returns real pointers.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "shim_fastpath.h"

struct krex_fast g_fast;
__thread int t_depth __attribute__((tls_model("initial-exec")));

void krex_left_closed(void) { krex_wake_controller(g_shm, g_gpu); }

int g_mode = MODE_OFF;
uint64_t g_chunk_bytes = UINT64_MAX; /* outside KREX nothing is split */
int g_log;
char g_shm_name[128];
int g_slot = -1;
int g_gpu = -1;
struct krex_shm *g_shm;
static long long g_slot_gen = -1;         /* KREX_SLOT_GEN: the slot's generation when our command claimed it */
static uint64_t g_stamp_gen;              /* our command's slot generation, for free stamps (registration) */
int g_attach_err;
struct krex_proc *g_proc;
static uint32_t g_failed_gate;            /* gate word we already failed open on */
static uint64_t g_local_submits[KREX_NGATED];
uint32_t g_pending_flags;
pthread_mutex_t g_reg_lock = PTHREAD_MUTEX_INITIALIZER;

void klog(const char *fmt, ...) {
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

/* ------------------------------------------------------------ gate slow path */

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
    case KREX_HOLDER_REGION:
        return krex_heartbeat_stale(g_shm, now, 1);
    default:
        return now - since > KREX_HEARTBEAT_TIMEOUT_NS;
    }
}

/* Slow path: wait until the gate word changes. Returns 1 to fail open. */
int krex_wait_gate(uint32_t w) {
    if (w == __atomic_load_n(&g_failed_gate, __ATOMIC_RELAXED)) return 1;
    struct krex_gpu *g = &g_shm->gpus[g_gpu];
    uint64_t t0 = krex_now_ns();
    if (g_proc) __atomic_fetch_add(&g_proc->blocked, 1, __ATOMIC_RELAXED);
    int failed = 0;
    int ctx_parked = krex_ctx_gate_park(); /* never park holding the context-creation token */
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
    /* The gate opened with another command's region queued behind the one that ended: its
     * gate closes next, and what we submitted now its entry would drain first. */
    if (!failed) krex_hold_pending(KREX_PEND_QUEUED, krex_now_ns());
    if (!failed) krex_pace_gate_opened();
    if (g_proc) __atomic_fetch_add(&g_proc->blocked_ns, krex_now_ns() - t0, __ATOMIC_RELAXED);
    krex_ctx_gate_unpark(ctx_parked);
    return failed;
}

/* ------------------------------------------------- a region about to begin */

/* Other commands' regions about to begin on our GPU (krex_abi.h, KREX_PENDING_HOLD_MS):
 * KREX_PEND_QUEUED while one is queued, KREX_PEND_SOON while one was announced; 0 when
 * krexd's heartbeat is stale (nobody would clear the words). Slow paths only. */
int krex_pending(void) {
    struct krex_shm *shm = __atomic_load_n(&g_shm, ACQUIRE);
    if (!shm || g_gpu < 0 || g_gpu >= KREX_MAX_GPUS) return 0;
    uint64_t mine = g_slot >= 0 && g_slot < KREX_MAX_SLOTS ? 1ull << g_slot : 0;
    struct krex_gpu *g = &shm->gpus[g_gpu];
    int r = 0;
    if (__atomic_load_n(&g->pending_slots, RELAXED) & ~mine) r |= KREX_PEND_QUEUED;
    if (__atomic_load_n(&g->soon_slots, RELAXED) & ~mine) r |= KREX_PEND_SOON;
    if (r && krex_heartbeat_stale(shm, krex_now_ns(), 1)) return 0;
    return r;
}

#define PEND_POLL_NS 500000ull /* neither a gate's close nor krexd's clearing of the words wakes a futex */

/* Wait while krex_pending() says one of `what` and the gate is open, at most
 * KREX_PENDING_HOLD_MS after `t0` (a stale word slows, never stops). Counted in the
 * process record (`held`, `held_ns`) when it waited. */
void krex_hold_pending(int what, uint64_t t0) {
    uint32_t *gate = __atomic_load_n(&g_fast.gate, ACQUIRE);
    if (!gate) return;
    const uint64_t most = (uint64_t)KREX_PENDING_HOLD_MS * 1000000ull;
    uint64_t now = krex_now_ns(), start = now;
    while ((krex_pending() & what) && __atomic_load_n(gate, __ATOMIC_SEQ_CST) == KREX_GATE_OPEN && now - t0 < most) {
        uint64_t left = most - (now - t0);
        krex_futex_wait(gate, KREX_GATE_OPEN, left < PEND_POLL_NS ? left : PEND_POLL_NS);
        now = krex_now_ns();
    }
    struct krex_proc *p = __atomic_load_n(&g_proc, ACQUIRE);
    if (p && now > start + PEND_POLL_NS / 2) {
        __atomic_fetch_add(&p->held, 1, RELAXED);
        __atomic_fetch_add(&p->held_ns, now - start, RELAXED);
    }
}

/* Before a LIFE call: a context, module or memory call begun while another command's region
 * is about to begin may still run when its gate closes, and the gate cannot stop it midway
 * (krexd freezes its process, and the drain waits behind the driver lock it holds). So it
 * waits, as at a closed gate, until that gate has closed (then it parks there), the region
 * was dropped, or KREX_PENDING_HOLD_MS passed. A nested call is covered by the outer one. */
void krex_life_defer(void) {
    if (t_depth != 0 || !__atomic_load_n(&g_fast.gate, ACQUIRE) || !krex_pending()) return;
    krex_hold_pending(KREX_PEND_QUEUED | KREX_PEND_SOON, krex_now_ns());
}

/* ------------------------------------------------------------ the exit hold */

/* A process's contexts are torn down at exit, by the vendor runtime's exit handlers or by
 * the kernel after the last one, through no call a gate can stop: a sibling left running
 * by `--freeze gpu` would do that during a region. So once it has made a LIFE call, an
 * exit handler enters the gate as a LIFE call and keeps the count: the exit waits at a
 * closed gate, and while it runs, krexd sees a LIFE call in flight and freezes the process
 * before a region starts; it also stamps the slot's last free (the teardown frees all).
 * Registered after that first LIFE call, i.e. after the vendor runtime registered its own
 * handlers (inside the call), so it runs before them. */
static int g_life_gen = -1; /* the fork generation that made a LIFE call */
static pid_t g_life_pid;     /* ... and its pid: a vfork child shares our memory, not our pid */

/* The record says its exit began (exit(), a return from main, _exit): krexd, freeing the
 * record once the process is gone, tells this end from a kill (a signal, a crash: under MPS
 * its server may fail the other clients). Only the process's own record. */
static void note_exit(void) {
    struct krex_proc *p = __atomic_load_n(&g_proc, ACQUIRE);
    if (p && __atomic_load_n(&p->pid, RELAXED) == (int64_t)getpid() && !__atomic_load_n(&p->exit_ns, RELAXED))
        __atomic_store_n(&p->exit_ns, krex_now_ns(), __ATOMIC_SEQ_CST);
}

static void exit_hold(void) {
    /* Only in the process that armed it: a child made without fork handlers (a raw
     * clone, glibc's _Fork) keeps our generation, and must not hold our record. */
    if (g_life_gen != g_fork_gen || g_life_pid != getpid() || t_depth != 0 ||
        !__atomic_load_n(&g_fast.gate, ACQUIRE))
        return;
    krex_life_defer();
    int tok = krex_enter(KREX_CLS_LIFE); /* parks while another command's region runs */
    if (g_fast.life_inflight == g_fast.inflight) {
        /* No record: the count went to the slot's shared counter, which krexd waits for;
         * held for good it would stall every region while the command lives. */
        krex_leave(tok, KREX_CLS_LIFE);
        krex_note_free(g_shm, g_gpu, g_slot, g_stamp_gen, KREX_FREE_SETTLE_NS);
        return;
    }
    note_exit();
    /* The count stays held (krexd freezes a process inside a LIFE call before a region),
     * but not the depth: the GPU calls this exit still makes (vendor teardown, exit
     * handlers registered before ours) must stay gated, not pass as nested. */
    t_depth--;
    /* Its teardown frees all its memory once the process is gone: krexd waits for that
     * from when it finds it gone, sized by what it held (the record's exit_ns, above). The
     * stamp here marks the time only, for the frees a grant must not miss. Outside krexd's
     * pid namespace krexd cannot find it gone (KREX_PF_OTHER_PID_NS): the fixed time. */
    struct krex_proc *p = __atomic_load_n(&g_proc, ACQUIRE);
    int unseen = p && (__atomic_load_n(&p->flags, RELAXED) & KREX_PF_OTHER_PID_NS);
    krex_note_free(g_shm, g_gpu, g_slot, g_stamp_gen, unseen ? KREX_FREE_SETTLE_NS : 0);
}

typedef int (*fn_addr_range)(uint64_t *, size_t *, uint64_t);
typedef int (*fn_xmode_t)(CUstreamCaptureMode *);

/* How long the GPU may clear the memory a free of device pointer `ptr` hands back: its
 * allocation's size (the driver's cuMemGetAddressRange_v2, the real one, in relaxed capture
 * mode so another thread's capture is not invalidated) at KREX_SETTLE_NS_PER_GB, at least
 * KREX_SETTLE_MIN_NS; KREX_FREE_SETTLE_NS when the driver cannot tell (no such call, not an
 * allocation's base, a capture under way in this process). The scrub runs on the driver's
 * own copy-engine channel after the call returns (docs/design/control-plane.md), so no sync of ours
 * orders it: only its size bounds it. */
static uint64_t free_settle_ns(uintptr_t ptr) {
    static fn_addr_range range;
    static fn_xmode_t xmode;
    static int looked;
    if (!__atomic_load_n(&looked, ACQUIRE)) {
        range = (fn_addr_range)vendor_sym(KREX_API_DRIVER, "cuMemGetAddressRange_v2");
        xmode = (fn_xmode_t)vendor_sym(KREX_API_DRIVER, "cuThreadExchangeStreamCaptureMode");
        __atomic_store_n(&looked, 1, RELEASE);
    }
    if (!range || __atomic_load_n(&g_captures, RELAXED) != 0) return KREX_FREE_SETTLE_NS;
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    if (xmode) xmode(&mode);
    uint64_t base = 0;
    size_t size = 0;
    int rc = range(&base, &size, (uint64_t)ptr);
    if (xmode) xmode(&mode);
    if (rc != 0 || base != (uint64_t)ptr || size == 0) return KREX_FREE_SETTLE_NS;
    uint64_t ns = (uint64_t)((double)size * KREX_SETTLE_NS_PER_GB / (1024.0 * 1024.0 * 1024.0));
    return ns < KREX_SETTLE_MIN_NS ? KREX_SETTLE_MIN_NS : ns;
}

uint64_t krex_life_free(int id, uintptr_t arg0, int end, uint64_t settle_ns) {
    if (!krex_frees[id] || (krex_frees[id] != 1 && arg0 == 0) || !__atomic_load_n(&g_fast.gate, ACQUIRE)) return 0;
    if (!end) settle_ns = krex_frees[id] == 3 ? free_settle_ns(arg0) : KREX_FREE_SETTLE_NS;
    krex_note_free(g_shm, g_gpu, g_slot, g_stamp_gen, settle_ns); /* seq_cst: a later grant's read sees it */
    /* Counted from the first stamp to after the second: krexd, freezing us in between (right
     * after the driver freed), knows a free ended with no stamp of its end yet. */
    struct krex_proc *p = __atomic_load_n(&g_proc, ACQUIRE);
    if (p) __atomic_add_fetch(&p->free_inflight, end ? (uint32_t)-1 : 1u, __ATOMIC_SEQ_CST);
    return settle_ns;
}

/* A stream-ordered LIFE call counts twice (as it starts and as it ends), so a last exit
 * drain that either overlaps sees the count move. One made after that drain (a teardown's
 * async frees) queued work that drain did not cover: drain again here, since no helper is
 * left to answer krexd (it would wait its whole drain timeout, or miss the work). */
void krex_life_ordered(int id, int end) {
    if (!krex_ordered[id]) return;
    struct krex_proc *p = __atomic_load_n(&g_proc, ACQUIRE);
    if (!p) return;
    __atomic_add_fetch(&p->ordered_life, end ? KREX_ORDERED_END : 1, __ATOMIC_SEQ_CST);
    if (end) krex_exit_redrain(); /* (returns at once while the drain helper runs) */
}

/* A LIFE call passed the gate: name its thread in the record (krexd renices it while a
 * region's drain waits behind it, the driver lock it holds; a context creation took
 * 100-700 ms on a loaded H200). Not on the submission path. */
uint32_t krex_life_thread(void) {
    struct krex_proc *p = __atomic_load_n(&g_proc, ACQUIRE);
    if (!p || !krex_in_krexds_pid_ns()) return 0;
    uint32_t tid = (uint32_t)syscall(SYS_gettid);
    __atomic_store_n(&p->life_tid, tid, __ATOMIC_RELAXED);
    return tid;
}

/* The call ended: clear the record's thread if it is still this one (another thread that
 * began a LIFE call since named itself). Never a thread that has left its call. */
void krex_life_thread_end(uint32_t tid) {
    struct krex_proc *p = __atomic_load_n(&g_proc, ACQUIRE);
    uint32_t expect = tid;
    if (p && tid) __atomic_compare_exchange_n(&p->life_tid, &expect, 0, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
}

void krex_life_done(void) {
    if (!mode_on() || __atomic_load_n(&g_life_gen, RELAXED) == g_fork_gen) return;
    static int registered; /* atexit handlers survive fork: once per image */
    if (!__atomic_exchange_n(&registered, 1, __ATOMIC_ACQ_REL)) atexit(exit_hold);
    g_life_pid = getpid();
    __atomic_store_n(&g_life_gen, g_fork_gen, RELAXED);
}

/* os._exit and C's _exit/_Exit skip atexit, yet the kernel tears the contexts down all
 * the same: the same hold first (multiprocessing's children leave this way). Only in the
 * process that armed it: a vfork child (subprocess's failed exec) shares our memory and
 * this thread's depth, and must touch neither. */
typedef void (*exit_fn)(int);
static exit_fn g_real_exit[2]; /* libc's _exit, _Exit: looked up at load, never in a vfork child */
static __attribute__((noreturn)) void exit_via(int which, int status) {
    if (__atomic_load_n(&g_life_gen, RELAXED) == g_fork_gen && g_life_pid == getpid()) exit_hold();
    note_exit();
    if (g_real_exit[which]) g_real_exit[which](status);
    syscall(SYS_exit_group, status); /* what libc's _exit does */
    __builtin_unreachable();
}
KREX_EXPORT void _exit(int status) { exit_via(0, status); }
KREX_EXPORT void _Exit(int status) { exit_via(1, status); }

/* ------------------------------------------------------------ registration */

/* The segment, attached once (for the fast path, and for clients to read krexd's
 * heartbeat). Short: held lock, no krexd round trip. */
struct krex_shm *attach_shm(void) {
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

static int register_now(void);

/* The attach at load, from our constructor: system calls only, so that no function a
 * program interposes (shm_open, mmap, a sanitizer's) runs inside our constructor, before
 * its own. Attach only, and only a whole segment nobody else may open: anything unusual
 * (missing, "others" may open it, too small, its header not verified) is left to the
 * attach at the first gated call, with its full checks (krex_shm_open). */
static int g_load_fd = -1; /* attach_at_load's descriptor, until guard_load_mapping */

static struct krex_shm *attach_at_load(const char *name) {
    char path[sizeof g_shm_name + 16];
    const char *n = name[0] == '/' ? name + 1 : name;
    size_t len = strlen(n);
    if (!len || memchr(n, '/', len) || len + 10 > sizeof path) return NULL;
    memcpy(path, "/dev/shm/", 9);
    memcpy(path + 9, n, len + 1);
    /* Every argument as a long: syscall() reads whole registers, and an int's upper half is
     * not defined (an mmap offset of garbage maps past the end: SIGBUS). */
    long fd = syscall(SYS_openat, (long)AT_FDCWD, path, (long)(O_RDWR | O_CLOEXEC | O_NOFOLLOW), 0L);
    if (fd < 0) return NULL;
    struct stat st;
    long p = -1;
    if (syscall(SYS_fstat, fd, &st) == 0 && S_ISREG(st.st_mode) && !(st.st_mode & 0007) &&
        (uint64_t)st.st_size >= sizeof(struct krex_shm))
        p = syscall(SYS_mmap, 0L, (long)sizeof(struct krex_shm), (long)(PROT_READ | PROT_WRITE), (long)MAP_SHARED,
                    fd, 0L);
    if (p == -1 || krex_shm_verify((struct krex_shm *)p, 0) != 0) {
        if (p != -1) syscall(SYS_munmap, p, (long)sizeof(struct krex_shm));
        syscall(SYS_close, fd);
        return NULL;
    }
    /* Kept for the SIGBUS guard, installed at the first gated call (guard_load_mapping):
     * sigaction is one of the functions a sanitizer interposes. */
    __atomic_store_n(&g_load_fd, (int)fd, RELEASE);
    return (struct krex_shm *)p;
}

/* The attach at load's mapping gets krex_shm_open's SIGBUS guard (a segment truncated
 * by a group member: the access completes on the restored file instead of killing us).
 * Until then, between load and the first gated call, only the constructor's own reads
 * touched it. Once; the slow path. */
static void guard_load_mapping(void) {
    int fd = __atomic_exchange_n(&g_load_fd, -1, __ATOMIC_ACQ_REL);
    struct krex_shm *shm = __atomic_load_n(&g_shm, ACQUIRE);
    if (fd < 0) return;
    if (shm) krex_shm_guard(shm, fd, g_shm_name);
    else close(fd);
}

/* A pre-warmed command (krexd's `prewarm`) was started before a slot freed up, so its
 * imports and CPU set-up overlap the running commands; its first gated call waits here
 * until krexd gives it the slot. Inside the registration, signals blocked (a handler's GPU
 * call must not re-enter it): a stop signal is the guardian's to act on, and it SIGKILLs a
 * command still waiting (KREX_WARM_KILL_NS). Never waits on a krexd that stopped beating. */
static void warm_wait(void) {
    if (g_slot < 0 || g_slot >= KREX_MAX_SLOTS) return; /* no KREX_SLOT: krexd's register op waits */
    struct krex_shm *shm = attach_shm();
    if (!shm) return;
    struct krex_slot *sl = &shm->slots[g_slot];
    if (!__atomic_load_n(&sl->warm, __ATOMIC_SEQ_CST)) return;
    uint64_t t0 = krex_now_ns();
    klog("slot %d is pre-warmed: its first GPU call waits for a free slot", g_slot);
    while (__atomic_load_n(&sl->warm, __ATOMIC_SEQ_CST)) {
        /* Handed to another command: ours has ended; registration then makes us stale. */
        if (g_slot_gen >= 0 && (long long)__atomic_load_n(&sl->generation, __ATOMIC_SEQ_CST) != g_slot_gen) break;
        if (krex_heartbeat_stale(shm, krex_now_ns(), 0)) {
            klog("krexd stopped beating while slot %d waited pre-warmed: going on", g_slot);
            break;
        }
        krex_futex_wait(&sl->warm, 1, 200000000ull);
    }
    klog("slot %d waited %.1f ms for its turn", g_slot, (double)(krex_now_ns() - t0) / 1e6);
}

/* Registration runs with every signal blocked: a handler's GPU call on this thread would
 * otherwise pass as nested (ungated, while krexd does not know us yet), or re-enter the
 * registration it interrupted and wait for itself (g_reg_lock, the self-registration
 * wait). The slow path only: once per process. */
int krex_register(void) {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    /* Its own calls, if any, pass as nested. Lowered before the mask is restored: a
     * signal that came meanwhile is delivered then, and its handler's call is gated. */
    t_depth++;
    int r = register_now();
    t_depth--;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return r;
}

static int register_now(void) {
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
    guard_load_mapping();
    warm_wait(); /* before the gate is published: no thread of ours passes meanwhile */
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
    g_stamp_gen = g_slot_gen >= 0 ? (uint64_t)g_slot_gen
                                  : __atomic_load_n(&g_shm->slots[g_slot].generation, __ATOMIC_SEQ_CST);
    int idx = krex_proc_register(g_shm, stale ? KREX_PROC_STALE : g_slot, g_gpu, (int64_t)getpid());
    if (idx >= 0) {
        struct krex_proc *p = &g_shm->procs[idx];
        /* Outside krexd's pid namespace: first, before krexd may free the record. */
        int other_ns = !krex_in_krexds_pid_ns();
        __atomic_or_fetch(&p->flags, __atomic_load_n(&g_pending_flags, RELAXED) | (other_ns ? KREX_PF_OTHER_PID_NS : 0),
                          __ATOMIC_SEQ_CST);
        __atomic_store_n(&p->captures, __atomic_load_n(&g_captures, __ATOMIC_SEQ_CST), RELAXED);
        /* The command's generation: krexd holds a process to its slot's gate only while its
         * record names the slot's current one (krex_proc_trust). */
        __atomic_store_n(&p->slot_gen, (uint32_t)g_stamp_gen, __ATOMIC_SEQ_CST);
        __atomic_store_n(&g_proc, p, RELEASE);
        static int exit_noted; /* atexit handlers survive fork: once per image */
        if (!__atomic_exchange_n(&exit_noted, 1, __ATOMIC_ACQ_REL)) atexit(note_exit);
        g_fast.inflight = &p->inflight;
        g_fast.life_inflight = &p->life_inflight;
        g_fast.submits = p->submits;
        /* Nothing of it is queued yet (every gated call registers before it is counted), so
         * until it submits it reads as drained (krex_proc_quiet; krexd may also freeze it
         * inside its first context creation, krex_proc_life_only): from when its drain
         * helper has looked for a runtime the hooks cannot see (drain.c, krex_helper). */
        __atomic_store_n(&p->has_ctx, 1, __ATOMIC_SEQ_CST);
        /* It registers at its first gated call, so it has no GPU work yet: it owes no ack
         * to a drain requested before now. Without this, a process registering at a
         * closed gate while krexd drains owes that drain an ack, and krexd, having seen
         * its slot drained a moment before (krexd freezes each sibling as soon as it has
         * drained), may freeze it before its helper acks: the drain then waits for it to
         * its timeout. has_ctx is stored before drain_seq is read, and krexd bumps
         * drain_seq before it scans has_ctx (seq_cst both): a scan that misses has_ctx
         * finds an ack that is already current; one that sees it with the older sequence
         * waits for the helper's ack, as for any process registered before the request. */
        __atomic_store_n(&p->drain_ack, __atomic_load_n(&g_shm->gpus[g_gpu].drain_seq, __ATOMIC_SEQ_CST),
                         __ATOMIC_SEQ_CST);
        /* In another pid namespace our pid means another process to krexd: it cannot
         * tell whether we live, so it may skip our drain. Counted as a process it cannot
         * account for: its regions are flagged while our command lives. */
        if (other_ns) __atomic_add_fetch(&g_shm->slots[g_slot].unrecorded, 1, __ATOMIC_SEQ_CST);
    } else {
        /* No record left: still gated, through the slot's shared counter; but no drain
         * helper of ours is known to krexd, so it flags every region while we live. */
        krex_slot_note_unrecorded(&g_shm->slots[g_slot], (int64_t)getpid());
        g_fast.inflight = &g_shm->slots[g_slot].inflight;
        g_fast.life_inflight = g_fast.inflight; /* no record to freeze by: waited for instead */
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
    if (g_proc && !g_helper_started) {
        start_helper();
        /* Its thread named (bounded) before our first call returns: an exec right after
         * it then leaves a record krexd can tell is exec'd. */
        krex_wait_helper_named();
    }
    klog("registered: slot %d gpu %d record %d", g_slot, g_gpu, idx);
out:
    pthread_mutex_unlock(&g_reg_lock);
    return __atomic_load_n(&g_fast.gate, ACQUIRE) != NULL;
}

/* fork: the prepare handler takes the registration lock, so the child never
 * inherits it held by a thread that does not exist there; parent and child
 * release it. The lock is only ever held briefly (see g_reg_lock). */
static void atfork_prepare(void) {
    krex_wait_helper_settled();
    pthread_mutex_lock(&g_reg_lock);
    krex_dl_fork_prepare(); /* after the registration lock: registration may walk the loader */
}

static void atfork_parent(void) {
    krex_dl_fork_parent();
    pthread_mutex_unlock(&g_reg_lock);
}

int g_fork_gen;

static void atfork_child(void) {
    krex_dl_fork_child();
    pthread_mutex_unlock(&g_reg_lock);
    /* The child is a new process: re-register (own record, own helper) lazily.
     * The parent's connections stay the parent's. A fork inside a gated call (from a
     * signal handler) leaves that call in the child too: its token is of the old fork
     * generation, so its leave touches no count (the count is the parent's). The depth
     * is not inherited (a depth left behind by a siglongjmp out of a call would
     * otherwise make every later call of the child pass as nested, ungated). */
    g_fork_gen++;
    t_depth = 0;
    krex_pace_after_fork();
    krex_ctx_after_fork();
    __atomic_store_n(&g_fast.gate, NULL, RELAXED);
    __atomic_store_n(&g_proc, NULL, RELAXED);
    g_failed_gate = 0;
    krex_drain_after_fork();
    krex_client_after_fork();
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
    krex_hooks_init();
    krex_ctx_init();
    g_real_exit[0] = (exit_fn)krex_next_sym("_exit");
    g_real_exit[1] = (exit_fn)krex_next_sym("_Exit");
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
    g_chunk_bytes = KREX_COPY_CHUNK_BYTES;
    const char *ck = getenv("KREX_COPY_CHUNK_BYTES");
    if (ck && *ck) {
        uint64_t v;
        int how = krex_chunk_bytes(ck, &v);
        g_chunk_bytes = v;
        if (how != KREX_CHUNK_OK) set_flag(KREX_PF_CHUNK_SETTING); /* recorded at registration */
        if (how == KREX_CHUNK_BAD)
            klog("KREX_COPY_CHUNK_BYTES=%s is not a byte count; using %d", ck, KREX_COPY_CHUNK_BYTES);
        else if (how == KREX_CHUNK_CLAMPED)
            klog("KREX_COPY_CHUNK_BYTES=%s is below %d; using %d", ck, KREX_COPY_CHUNK_MIN_BYTES,
                 KREX_COPY_CHUNK_MIN_BYTES);
    }
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
    __atomic_store_n(&g_mode, MODE_ON, RELAXED);
    /* Attach now, with the credentials the process was started with: a process that drops
     * them later (setuid) still reaches the segment, and krexd sees the mapping in
     * /proc/PID/maps, its proof that this process's first gated call will register and
     * wait at the gate. One that cannot attach (another user) shows no mapping: krexd
     * freezes its command's slot. A self-registering process attaches once krexd has
     * given it a slot (krexd may have to be started first). */
    if (!g_need_selfreg) {
        struct krex_shm *shm = attach_at_load(g_shm_name), *none = NULL;
        if (shm && !__atomic_compare_exchange_n(&g_shm, &none, shm, 0, RELEASE, RELAXED)) {
            syscall(SYS_munmap, shm, (long)sizeof(struct krex_shm));
            int fd = __atomic_exchange_n(&g_load_fd, -1, __ATOMIC_ACQ_REL);
            if (fd >= 0) syscall(SYS_close, (long)fd);
        }
        /* An exec'd image: its old one's record tells krexd that image ended, not killed. */
        shm = __atomic_load_n(&g_shm, ACQUIRE);
        if (shm) krex_proc_note_exec(shm, (int64_t)getpid(), krex_now_ns());
    }
}

/* dlmopen: a GPU library loaded into a link-map namespace other than the base one is
 * called through that namespace's own symbols, which no hook of ours (preloaded into the
 * base namespace only) sees, and its contexts are not the ones the drain helper
 * synchronises. Such a process registers at once, flagged KREX_PF_FOREIGN_NS: krexd does
 * not count it as held by the gate. (The drain helper also looks for such libraries
 * between drains, for a dlmopen that did not come through here.) */
typedef void *(*dlmopen_fn)(Lmid_t, const char *, int);

KREX_EXPORT void *dlmopen(Lmid_t lmid, const char *file, int mode) {
    static dlmopen_fn real;
    dlmopen_fn r = __atomic_load_n(&real, ACQUIRE);
    if (!r) {
        r = (dlmopen_fn)krex_next_sym("dlmopen");
        __atomic_store_n(&real, r, RELEASE);
    }
    if (!r) return NULL;
    void *h = r(lmid, file, mode);
    if (h && lmid != LM_ID_BASE && mode_on() && krex_ns_has_gpu(h)) {
        set_flag(KREX_PF_FOREIGN_NS);
        if (!__atomic_load_n(&g_fast.gate, ACQUIRE)) krex_register(); /* takes the pending flag along */
        klog("a GPU library was loaded into another link-map namespace (dlmopen %s)", file ? file : "-");
    }
    return h;
}

/* dlclose: a library that brought its own CUDA runtime, launched through it and is
 * unloaded before the drain helper's next look would leave no trace for that look (it
 * reads the objects loaded now): look once more while it is still mapped. One scan of the
 * loaded objects per unload, which is rare. */
typedef int (*dlclose_fn)(void *);

KREX_EXPORT int dlclose(void *handle) {
    static dlclose_fn real;
    dlclose_fn r = __atomic_load_n(&real, ACQUIRE);
    if (!r) {
        r = (dlclose_fn)krex_next_sym("dlclose");
        __atomic_store_n(&real, r, RELEASE);
    }
    if (!r) return -1;
    if (mode_on() && __atomic_load_n(&g_fast.gate, ACQUIRE)) krex_note_unseen_runtime();
    return r(handle);
}

/* Exposed for tests and `krex doctor`: is this process under KREX? */
KREX_EXPORT int krex_shim_active(void) { return mode_on(); }
KREX_EXPORT int krex_shim_registered(void) { return __atomic_load_n(&g_fast.gate, ACQUIRE) != NULL; }
KREX_EXPORT int krex_shim_helper_running(void) { return __atomic_load_n(&g_helper_started, ACQUIRE); }
/* Our GPU's gate word when our own command closed it (a region of another of its processes
 * or threads), else 0. Then a region of ours would wait for it: krex.region(soft=True) runs
 * inside it instead, and the word (its epoch) tells that region from the next one. */
KREX_EXPORT uint32_t krex_shim_gate_word(void) {
    struct krex_shm *shm = mode_on() ? attach_shm() : NULL;
    if (!shm || g_slot < 0 || g_slot >= KREX_MAX_SLOTS) return 0;
    int gpu = g_gpu >= 0 ? g_gpu : shm->slots[g_slot].gpu;
    if (gpu < 0 || gpu >= KREX_MAX_GPUS) return 0;
    uint32_t w = __atomic_load_n(&shm->gpus[gpu].gate, __ATOMIC_SEQ_CST);
    return w != KREX_GATE_OPEN && (w & KREX_GATE_OWNER_MASK) == (uint32_t)g_slot + 1 ? w : 0;
}
/* For tests: this thread's depth of gated calls (0 outside every call: its next call is gated). */
KREX_EXPORT int krex_shim_depth(void) { return t_depth; }
/* For tests: graph captures this process is in (per stream). */
KREX_EXPORT int krex_shim_captures(void) { return (int)__atomic_load_n(&g_captures, __ATOMIC_SEQ_CST); }
