/* Private to libkrex_interpose.so: what its parts (shim.c, hooks.c, resolve.c,
 * drain.c, pace.c, ctx_gate.c, client.c) share. Everything declared here is hidden: nothing leaks
 * into the application's symbol namespace, and hidden data is reached
 * PC-relative, so splitting the shim into files costs the fast path nothing. */
#ifndef KREX_SHIM_H
#define KREX_SHIM_H
#include <pthread.h>
#include <stdint.h>

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

#define RELAXED __ATOMIC_RELAXED
#define ACQUIRE __ATOMIC_ACQUIRE
#define RELEASE __ATOMIC_RELEASE

enum { MODE_OFF = 0, MODE_ON = 1 };

#pragma GCC visibility push(hidden)

/* shim.c: process state, set once at load or by registration. */
extern int g_mode;                    /* atomic: registration may switch it off */
extern int g_log;
extern char g_shm_name[128];
extern int g_slot;
extern int g_gpu;
extern struct krex_shm *g_shm;        /* atomic pointer: published once attached */
extern struct krex_proc *g_proc;
extern int g_attach_err;              /* why we could not attach the segment we were told to use */
extern uint32_t g_pending_flags;
extern uint64_t g_chunk_bytes;        /* split copies/memsets above this; set once at load */
/* Held only for short, local work (attach, record, helper start): never across a
 * connect, a krexd reply or a grant, so fork (prepare handler) never waits long. */
extern pthread_mutex_t g_reg_lock;
void klog(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
int krex_register(void);
int krex_wait_gate(uint32_t word);
struct krex_shm *attach_shm(void);
void krex_life_ordered(int id, int end);     /* LIFE call `id` starts/ended: a stream-ordered one counts */
void krex_exit_redrain(void);                /* drain.c: after such a call past the last exit drain */
uint32_t krex_life_thread(void);             /* a LIFE call passed the gate: record its thread */
void krex_life_thread_end(uint32_t tid);     /* ... and ended: unrecord it (if still the one) */
void krex_life_done(void);                   /* a LIFE call succeeded: arm the exit hold */
/* LIFE call `id` (first argument arg0): a free? stamp it (end 0: before the driver call, which
 * returns the settle time it stamped; end 1: after it, with that time). */
uint64_t krex_life_free(int id, uintptr_t arg0, int end, uint64_t settle_ns);
/* Another command's region is about to begin on our GPU (shim.c): */
#define KREX_PEND_QUEUED 1 /* ... its BEGIN is queued */
#define KREX_PEND_SOON 2   /* ... it was announced */
int krex_pending(void);
void krex_hold_pending(int what, uint64_t t0); /* wait while one of `what` and the gate is open (bounded) */
void krex_life_defer(void);                    /* before a LIFE call: that wait, for both */

KREX_NO_SANITIZE static inline int mode_on(void) { return __atomic_load_n(&g_mode, RELAXED) == MODE_ON; }

static inline void set_flag(uint32_t f) {
    struct krex_proc *p = __atomic_load_n(&g_proc, ACQUIRE);
    if (p) __atomic_or_fetch(&p->flags, f, RELAXED);
    else __atomic_or_fetch(&g_pending_flags, f, RELAXED);
}

/* resolve.c: the real entry points behind our wrappers, and dlsym. */
extern void *krex_real[KREX_N_IDS][KREX_NSLOT];
extern uint32_t krex_real_gen;
void *vendor_sym(int api, const char *name);
/* dl_iterate_phdr under the shim's loader-walk lock, which fork's prepare handler takes too:
 * a child forked while another thread walked the list could inherit the loader's own lock held
 * (the ASan build's fork stress test hung so in dl_iterate_phdr). Recursive: a signal handler's
 * GPU call may resolve a symbol on a thread inside a walk. */
struct dl_phdr_info;
int krex_dl_iterate(int (*cb)(struct dl_phdr_info *, size_t, void *), void *data);
int krex_object_defines(const struct dl_phdr_info *info, const char *name);
void krex_note_unseen_runtime(void); /* flag KREX_PF_UNSEEN if a loaded object brings a CUDA runtime */
void krex_dl_fork_prepare(void);
void krex_dl_fork_parent(void);
void krex_dl_fork_child(void);
void *krex_next_sym(const char *name);
void *krex_resolve(int id, int k);

/* hooks.c: the wrappers generated from the api_*.def tables. */
extern unsigned char krex_frees[]; /* by entry id: 3 a Free of a device allocation the driver can size,
                                    * 2 another *Free* (NULL: none), 1 another freeing LIFE call */
extern unsigned char krex_ordered[]; /* by entry id: 1 a stream-ordered LIFE call */
extern void *const krex_wrappers[KREX_N_IDS][KREX_NSLOT];
void krex_hooks_init(void);
int is_own_wrapper(void *p);
void *krex_bind(int id, void *realp);
KREX_NO_SANITIZE int krex_find(const char *name);

/* drain.c: context and capture tracking, and the drain helper thread. */
int krex_ns_has_gpu(void *h); /* the link-map namespace of handle h holds a GPU library */
extern int g_helper_started;          /* atomic */
extern uint32_t g_captures;           /* streams capturing, plus captures that did not fit */
void krex_ctx_add(void *ctx);
int krex_ctx_del(void *ctx);
void krex_green_add(void *green);             /* a green context made: track its CUcontext */
void krex_green_note(void *green, void *ctx); /* ... the CUcontext it converts to, known */
void *krex_green_del(void *green);            /* ... about to be destroyed */
void krex_green_restore(void *green, void *ctx); /* ... whose destruction failed */
void krex_capture_begin(void *stream);
void krex_capture_end(int api, void *stream);
void start_helper(void);
int krex_in_krexds_pid_ns(void);
void krex_wait_helper_named(void);
void krex_wait_helper_settled(void);
void krex_drain_after_fork(void);

/* pace.c: bounded queues (every KREX_PACE_EVERY counted submissions of a thread). */
extern __thread unsigned t_pace __attribute__((tls_model("initial-exec")));
void krex_pace(int id, const void *stream) __attribute__((cold));
void krex_pace_after_fork(void);
void krex_pace_gate_opened(void); /* a call parked at a closed gate goes on: take a turn first */

/* ctx_gate.c: the node's context-creation token around a call that makes a context. */
extern unsigned char krex_ctx_makes[]; /* by entry id: 1 a call that makes a context (CTXNEW, GREENNEW, a primary retain) */
extern __thread int t_life_counted __attribute__((tls_model("initial-exec"))); /* this thread's counted LIFE call */
void krex_ctx_init(void);            /* at load: the tables' creating calls, KREX_CTX_TOKEN */
int krex_ctx_begin(void);            /* before such a call's gate entry: 1 if it owns the token's turn */
void krex_ctx_end(int began);        /* after its vendor call: give the token back */
int krex_ctx_gate_park(void);        /* krex_wait_gate: give the token back before parking ... */
void krex_ctx_gate_unpark(int parked); /* ... and take it again after */
void krex_ctx_after_fork(void);

/* client.c: krexd connections (self-registration, C/C++ regions). */
extern char g_sock_path[108];
extern char g_daemon_cmd[1024];
extern int g_need_selfreg;            /* set once at load: no KREX_SLOT, register with krexd */
int krex_self_register(void);
void krex_client_after_fork(void);

#pragma GCC visibility pop

KREX_EXPORT int krex_shim_active(void);

#endif
