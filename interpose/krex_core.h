/* The C core shared by the shim (libkrex_interpose.so) and the cffi module
 * (krex._native): segment attach, gate operations, process records, time
 * (krex_core.c; slots and process records: slot_table.c; the SIGBUS guard: seg_guard.c;
 * the context-creation token: ctx_token.c).
 * The block between the CDEF markers is fed to cffi verbatim. */
#ifndef KREX_CORE_H
#define KREX_CORE_H
#include "krex_abi.h"

/* CDEF-BEGIN */
uint64_t krex_now_ns(void);
struct krex_shm *krex_shm_open(const char *name, int create, int n_gpus, int *err);
void krex_shm_close(struct krex_shm *shm);
int krex_shm_unlink(const char *name);
uint64_t krex_shm_size(void);

/* Integrity: the header's fixed fields carry a check, each process record one too. */
uint64_t krex_hdr_check(struct krex_shm *shm);
uint32_t krex_shm_verify(struct krex_shm *shm, uint32_t n_gpus);
void krex_hdr_restore(struct krex_shm *shm, const struct krex_header *want);
/* SIGBUS faults on a truncated segment this process resolved (seg_guard.c). */
uint64_t krex_seg_restores(void);
/* krex_env.h's rule for what a guardian takes from krexd: the data variables (space
 * separated), KREX_DAEMON_CMD's fixed head and module, and the characters its Python
 * path and arguments may hold. */
const char *krex_daemon_env_names(void);
const char *krex_daemon_cmd_head(void);
const char *krex_daemon_cmd_module(void);
const char *krex_daemon_cmd_safe_path(void);
const char *krex_shell_safe(void);
uint32_t krex_proc_check(struct krex_proc *p);
int krex_proc_audit(struct krex_shm *shm, uint32_t n_gpus, int *bad, int max_bad);
int krex_proc_why(struct krex_shm *shm, struct krex_proc *p, uint32_t n_gpus);

/* Controller side of the gate protocol. */
uint32_t krex_gate_acquire(struct krex_shm *shm, int gpu, uint32_t expect, int owner_slot, uint32_t holder,
                           int64_t holder_pid, uint64_t lease_deadline_ns, uint32_t *cur);
int krex_gate_release(struct krex_shm *shm, int gpu, uint32_t word);
int krex_gate_holder(struct krex_shm *shm, int gpu, uint32_t word, uint32_t *holder, int64_t *holder_pid,
                     uint64_t *lease_deadline_ns);
void krex_gate_open(struct krex_shm *shm, int gpu);
int krex_gate_inflight(struct krex_shm *shm, int gpu, int owner_slot, int64_t *pids, int max_pids);
uint32_t krex_drain_request(struct krex_shm *shm, int gpu);
int krex_drain_pending(struct krex_shm *shm, int gpu, int owner_slot, uint32_t seq,
                       int64_t *pids, int max_pids);
int krex_drain_partial(struct krex_shm *shm, int gpu, int owner_slot, uint32_t seq,
                       int64_t *pids, int max_pids);
void krex_heartbeat(struct krex_shm *shm);
/* Has krexd stopped beating: its last beat older at `now` than the segment's timeout
 * (hdr.heartbeat_timeout_ns, else KREX_HEARTBEAT_TIMEOUT_NS)? `never`: the answer for a
 * segment never beaten. The one staleness test of the C side (shim gate waits, client). */
int krex_heartbeat_stale(struct krex_shm *shm, uint64_t now, int never);

/* The controller's waits for in-flight calls to leave (step 3) and for drain acks
 * (step 4): they sleep on the GPU's `wake` futex word and re-scan after each wake, or
 * after recheck_ns without one (liveness of stragglers), until done or timeout_ns.
 * Return what is still outstanding (0 = done); pids get the stragglers. A signal ends
 * the wait early (st->interrupted), so a Python caller can run its handlers. */
struct krex_wait_stats {
    uint64_t scans;     /* counter / ack scans */
    uint64_t wakeups;   /* futex waits that ended by a wake (or a moved word) */
    uint64_t timeouts;  /* futex waits that ended by recheck_ns: a re-check without a wake */
    uint64_t waited_ns;
    uint64_t interrupted; /* 1: a signal ended the wait early (the caller runs its handlers, then waits on) */
};
int krex_wait_inflight(struct krex_shm *shm, int gpu, int owner_slot, uint64_t timeout_ns, uint64_t recheck_ns,
                       int64_t *pids, int max_pids, struct krex_wait_stats *st);
/* Returns once fewer than `below` helpers still owe their ack (1: all acked), so krexd can
 * freeze each sibling as soon as it has drained, while the others still drain. */
int krex_wait_drain(struct krex_shm *shm, int gpu, int owner_slot, uint32_t seq, int below, uint64_t timeout_ns,
                    uint64_t recheck_ns, int64_t *pids, int max_pids, struct krex_wait_stats *st);
/* A region's end: a look-only request to every helper of `gpu` (they look at what their
 * process loaded, then ack in look_ack), and the wait for the acks of the processes in
 * want[0..n) (the siblings krexd did not freeze), as krex_wait_drain waits. */
uint32_t krex_look_request(struct krex_shm *shm, int gpu);
int krex_look_pending(struct krex_shm *shm, int gpu, const int64_t *want, int n, uint32_t seq, int64_t *pids,
                      int max_pids);
int krex_wait_look(struct krex_shm *shm, int gpu, const int64_t *want, int n, uint32_t seq, uint64_t timeout_ns,
                   uint64_t recheck_ns, int64_t *pids, int max_pids, struct krex_wait_stats *st);
/* Waker side: a sibling's call left while the gate was closed, or a helper acked. */
void krex_wake_controller(struct krex_shm *shm, int gpu);

/* Slots and process records. */
int krex_slot_claim(struct krex_shm *shm, int gpu, int64_t owner_pid);
int krex_slot_claim_n(struct krex_shm *shm, int s, int gpu, int64_t owner_pid);
int krex_slot_live_procs(struct krex_shm *shm, int slot);
int krex_slot_procs(struct krex_shm *shm, int slot, int64_t *pids, int max);
/* A live GPU-using process of another command: its identity across a region (sibling-context). */
struct krex_proc_id {
    int64_t pid;
    uint64_t start_ticks;
    uint32_t helper_tid;
    uint32_t pad0;
};
int krex_sibling_procs(struct krex_shm *shm, int gpu, int owner_slot, struct krex_proc_id *out, int max);
/* Those of them flagged KREX_PF_UNSEEN or KREX_PF_FOREIGN_NS (helper_tid 0), with those flags. */
int krex_bypass_procs(struct krex_shm *shm, int gpu, int owner_slot, struct krex_proc_id *out, uint32_t *flags,
                      int max);
int krex_life_busy(struct krex_shm *shm, int gpu, int owner_slot, int64_t *pids, int32_t *slots, uint32_t *tids,
                   int max);
int krex_recent_frees(struct krex_shm *shm, int gpu, int owner_slot, uint64_t owner_gen, uint64_t since_ns,
                      int32_t *slots, uint64_t *ago_ns, int max);
void krex_note_free(struct krex_shm *shm, int gpu, int slot, uint64_t gen, uint64_t settle_ns);
uint64_t krex_settle_until(struct krex_shm *shm, int gpu, int owner_slot, uint64_t owner_gen, uint64_t since_ns,
                           uint64_t *latest);
int krex_frees_inflight(struct krex_shm *shm, int gpu, int owner_slot);
uint64_t krex_proc_submits(struct krex_proc *p);
int krex_proc_quiet(struct krex_proc *p);
int krex_proc_life_only(struct krex_proc *p);
int krex_drain_excuse(struct krex_shm *shm, int gpu, int64_t pid, uint32_t seq);
int krex_sibling_exiting(struct krex_shm *shm, int gpu, int owner_slot, int64_t *pids, int max);
void krex_slot_release(struct krex_shm *shm, int slot);
/* Pre-warmed starts: set or clear a slot's `warm` (clearing wakes its waiting processes). */
void krex_slot_set_warm(struct krex_shm *shm, int slot, int warm);
int krex_proc_register(struct krex_shm *shm, int slot, int gpu, int64_t pid);
int krex_proc_trust(struct krex_shm *shm, int64_t pid, uint64_t start_ticks, int slot, uint64_t generation);
void krex_proc_trust_n(struct krex_shm *shm, const int64_t *pids, const uint64_t *starts, int n, int slot,
                       uint64_t generation, int32_t *codes);
int krex_proc_reap(struct krex_shm *shm);
/* A record of a dead process freed by krex_proc_reap_ended: what krexd needs to wait for
 * the scrubbing of the GPU memory it held, and to tell an exit from a kill. */
struct krex_ended {
    int64_t pid;
    int32_t slot; /* KREX_PROC_STALE: it had outlived its command */
    int32_t gpu;
    uint32_t slot_gen;
    uint32_t flags;   /* krex_proc.flags: KREX_PF_OTHER_PID_NS, its end unseen */
    uint64_t exit_ns; /* krex_proc.exit_ns: 0 = it ended without its exit handler */
    struct krex_proc rec; /* the record as it was freed: its counters still count in its
                           * command's --report (krexd frees records as their processes end) */
};
int krex_proc_reap_ended(struct krex_shm *shm, struct krex_ended *out, int max);
int krex_proc_note_exec(struct krex_shm *shm, int64_t pid, uint64_t now_ns);
void krex_proc_check_restore(struct krex_proc *p, uint32_t c);
void krex_slot_note_unrecorded(struct krex_slot *sl, int64_t pid);
int krex_unrecorded_alive(int64_t entry);
int krex_pid_alive(int64_t pid, uint64_t start_ticks);
uint64_t krex_pid_start_ticks(int64_t pid);

/* Futex helpers, also used by tests. */
int krex_futex_wait(uint32_t *addr, uint32_t expected, uint64_t timeout_ns);
int krex_futex_wake(uint32_t *addr);
uint32_t krex_load32(uint32_t *addr);
/* KREX_COPY_CHUNK_BYTES as the shim takes it: *out the chunk size (UINT64_MAX: never split,
 * for "0"); KREX_CHUNK_OK, _CLAMPED (below the minimum: the minimum) or _BAD (not a decimal
 * byte count, e.g. "-1": the default). One rule for the shim and `krex run`'s warning. */
int krex_chunk_bytes(const char *text, uint64_t *out);
/* The node's context-creation token (ctx_token.c, krex_abi.h KREX_CTX_TOKEN_LEASE_MS). */
uint64_t krex_ctx_token_word(int64_t pid, uint64_t now_ns);
int krex_ctx_token_lapsed(uint64_t w, uint64_t now_ns);
int64_t krex_ctx_token_pid(uint64_t w);
int64_t krex_ctx_token_holder(struct krex_shm *shm, uint64_t now_ns);
uint64_t krex_ctx_token_try(struct krex_shm *shm, int64_t pid, uint64_t now_ns, int check_alive);
int krex_ctx_token_give(struct krex_shm *shm, uint64_t held);
int krex_ctx_token_drop(struct krex_shm *shm, int64_t pid);
/* CDEF-END */

/* The shim's attach at load maps the segment with system calls only (shim.c
 * attach_at_load); its first gated call hands that mapping and its descriptor here, to
 * the SIGBUS guard krex_shm_open gives every other mapping. Takes fd (closed on failure). */
void krex_shm_guard(struct krex_shm *shm, int fd, const char *name);
/* Drop the guard of a mapping about to be unmapped (closes its descriptor). */
void krex_shm_unguard(struct krex_shm *shm);

#endif
