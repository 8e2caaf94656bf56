/* KREX ABI: the ONE definition of the segment layout, its constants, the
 * shim <-> controller protocol, and the wire protocol between clients and krexd.
 *
 * Both C (shim, cffi module) and Python (cffi cdef of this very file) read it.
 * Rules that keep it cffi-parsable: only "#define NAME <integer>" lines besides
 * the include guard, includes and the KREX_OPS table (krex_build.py expands its
 * rows into KREX_OP_* constants for cffi), no attributes, explicit padding.
 * tests/unit/test_abi.py asserts that sizes and offsets agree in C and Python.
 *
 * Protocol (Dekker pairing, both sides seq_cst):
 *   shim:       inflight++ ; g = gate ; if closed and not owner: inflight--, futex-wait(gate, g), retry
 *   controller: gate = closed(epoch, owner) ; wait until every non-owner inflight == 0
 * so any submission is either counted before the close or sees the gate closed.
 *
 * Waking the controller (the same pairing, once more):
 *   shim:       inflight-- ; g = gate ; if closed and not owner: wake++, futex-wake(wake) if waiters
 *   helper:     drain_ack = seq ; wake++, futex-wake(wake) if waiters
 *   (a look round: look_ack = look_seq as read before the look ; the same wake)
 *   controller: waiters++ ; w = wake ; scan counters/acks ; if not done: futex-wait(wake, w, recheck)
 * so the controller either sees the change in its scan or the wake word has moved.
 */
#ifndef KREX_ABI_H
#define KREX_ABI_H
#include <stdint.h>

#define KREX_MAGIC 1480938059
#define KREX_ABI_VERSION 11
#define KREX_MAX_GPUS 16
#define KREX_MAX_SLOTS 64
#define KREX_MAX_PROCS 1024

/* Gate word (a futex): 0 = open. Closed = (epoch24 << 8) | owner byte, where the
 * owner byte is slot+1, or KREX_OWNER_NONE for an operator pause. Never 0 when closed.
 * Its layout, for C and Python alike: the owner byte is word & KREX_GATE_OWNER_MASK
 * (0xFF), the epoch word >> KREX_GATE_EPOCH_SHIFT, of which the word keeps the bits of
 * KREX_GATE_EPOCH_MASK (0xFFFFFF). Decimal: cffi reads plain numbers. */
#define KREX_GATE_OPEN 0
#define KREX_OWNER_NONE 255
#define KREX_GATE_OWNER_MASK 255
#define KREX_GATE_EPOCH_SHIFT 8
#define KREX_GATE_EPOCH_MASK 16777215

/* Who holds a closed gate, and therefore what a waiting shim checks before failing open. */
#define KREX_HOLDER_NONE 0
#define KREX_HOLDER_REGION 1
#define KREX_HOLDER_PAUSE 2

#define KREX_SLOT_FREE 0
#define KREX_SLOT_ACTIVE 1

/* krex_proc.slot of a process whose slot was handed to another command after it
 * (its KREX_SLOT_GEN is older than the slot's generation): it owns no gate, and every
 * region counts it as a sibling. */
#define KREX_PROC_STALE -2

/* API classes: which counter a call bumps. Only the first KREX_NGATED are gated. LIFE
 * calls (contexts, modules, device memory) run no kernel but still work the GPU (an H200
 * measured a 42% slower GEMM while siblings loaded modules, docs/results/lifecycle-calls/):
 * they park at a closed gate like a submission, and are counted in `life_inflight`, not
 * `inflight`, because krexd freezes a process inside one rather than waiting it out (a
 * context takes 100+ ms to make, a PTX module seconds to JIT). */
#define KREX_CLS_KERNEL 0
#define KREX_CLS_COPY 1
#define KREX_CLS_MEMSET 2
#define KREX_CLS_GRAPH 3
#define KREX_CLS_PREFETCH 4
#define KREX_CLS_LIFE 5
#define KREX_NGATED 6
#define KREX_CLS_LOOKUP 6
#define KREX_CLS_CTX 7

/* Per-process flags (krex_proc.flags): things a doctor should hear about. */
#define KREX_PF_NO_REAL 1
#define KREX_PF_SLOTS_FULL 2
#define KREX_PF_FAILED_OPEN 4
#define KREX_PF_HELPER_FAILED 8
#define KREX_PF_DRAIN_TIMEOUT 16
#define KREX_PF_LOOKUP_FALLBACK 32
#define KREX_PF_DRAIN_PARTIAL 64
/* A C region (krex.h) lost krexd (dead, hung or stopped): it ran unprotected. */
#define KREX_PF_DAEMON_LOST 512
#define KREX_PF_STALE_SLOT 128
/* Pacing (pace.c) waited KREX_PACE_GIVEUP_MS for its queued work: off in this process. */
#define KREX_PF_PACE_OFF 1024
/* It may queue GPU work through a path the hooks do not count: a CUDA runtime linked into
 * the executable or exported by a loaded library other than libcudart. Never quiet. */
#define KREX_PF_UNSEEN 2048
/* KREX_COPY_CHUNK_BYTES was not a byte count, or below KREX_COPY_CHUNK_MIN_BYTES: not taken
 * as given (krex_chunk_bytes). */
#define KREX_PF_CHUNK_SETTING 4096

/* A GPU driver or runtime library is loaded in a link-map namespace other than the base
 * one (dlmopen): calls made there pass no hook, and its contexts are not the ones the
 * drain helper synchronises. krexd does not count the process as held by the gate. */
#define KREX_PF_FOREIGN_NS 8192
/* Inside its exit handler (the shim's, atexit): its drain helper was stopped on purpose,
 * its last drain runs or ran, and its calls still pass the gate. */
#define KREX_PF_IN_EXIT 16384
/* Registered outside krexd's pid namespace (a container): its record's pid means another
 * process, or none, to krexd, which may free the record while it lives. A freed record of
 * such a process tells no end: neither a kill nor when it ended (its exit stamps the
 * fixed settle time itself). */
#define KREX_PF_OTHER_PID_NS 32768

/* krex_proc_trust(): whether a process's record proves that the gate holds it. HELD: a
 * sealed record of this process, under the asked slot and generation, its drain helper
 * alive, no GPU library in a foreign namespace. NONE: no record (no gated call yet).
 * FILLING: being written or freed right now. DAMAGED: it fails its check. OTHER_SLOT:
 * under another command's slot. STALE: under an earlier generation of the slot.
 * NO_HELPER: its drain helper has not started (or cannot be named). EXECD: its helper is
 * gone while it lives (it exec'd). FOREIGN_NS: KREX_PF_FOREIGN_NS. UNSEEN: KREX_PF_UNSEEN. */
#define KREX_TRUST_HELD 0
#define KREX_TRUST_NONE 1
#define KREX_TRUST_FILLING 2
#define KREX_TRUST_DAMAGED 3
#define KREX_TRUST_OTHER_SLOT 4
#define KREX_TRUST_STALE 5
#define KREX_TRUST_NO_HELPER 6
#define KREX_TRUST_EXECD 7
#define KREX_TRUST_FOREIGN_NS 8
/* KREX_PF_UNSEEN: its record holds its hooked calls, but it may launch through a CUDA runtime
 * the hooks cannot see (a library exporting its own): frozen, as a static runtime in its
 * executable is, and drained by its helper. */
#define KREX_TRUST_UNSEEN 9

/* Header flags (krex_header.flags). */
#define KREX_HF_PROCS_FULL 1
/* Someone shrank the segment file and a process that then touched it gave the file its
 * size back (seg_guard.c's SIGBUS guard): krexd reports it as an incident. */
#define KREX_HF_RESTORED 2

/* krex_shm_verify(): what is wrong with a segment's header (a bit mask). */
#define KREX_BAD_MAGIC 1
#define KREX_BAD_ABI 2
#define KREX_BAD_GPUS 4
#define KREX_BAD_SIZE 8
#define KREX_BAD_CHECK 16

/* Copies and memsets larger than this (bytes) are issued by the shim as a sequence of
 * calls of at most this size, each passing the gate on its own (the `chunk` column of
 * the api_*.def tables), so a region waits for one chunk of a sibling's copy, not for
 * all of it. 64 MiB is 1-3 ms at the 25-50 GB/s of a PCIe 5 / H200 host copy, while a
 * gated call costs ~5 ns: the split adds nothing measurable to a large copy. A process
 * may override it once, at load, with KREX_COPY_CHUNK_BYTES (0: never split). */
#define KREX_COPY_CHUNK_BYTES 67108864
/* The smallest chunk an override may ask for: smaller ones are taken as this (at 4 KiB a
 * 300 MB copy became 73,000 calls and ran 15x slower; at 1 MiB, 300 calls of 20-40 us). */
#define KREX_COPY_CHUNK_MIN_BYTES 1048576
/* krex_chunk_bytes(): how it took a KREX_COPY_CHUNK_BYTES value: as given; CLAMPED, below
 * KREX_COPY_CHUNK_MIN_BYTES (that minimum); BAD, not a byte count (a sign, a unit, garbage:
 * the default). */
#define KREX_CHUNK_OK 0
#define KREX_CHUNK_CLAMPED 1
#define KREX_CHUNK_BAD 2

/* Bounded queues (pace.c). A region's entry waits for the work siblings had queued when
 * the gate closed (the drain): on the H200 up to 0.52 s. So while other commands share its
 * GPU, a thread checks every KREX_PACE_EVERY counted submissions how old the oldest of its
 * process's unfinished work is (an event recorded then), and waits while it is older than
 * the GPU's `queue_cap_us`: queued work then drains in about that long. krexd publishes the
 * cap (its `queue_cap_ms`, default KREX_QUEUE_CAP_MS; 0: no pacing). A wait that lasts
 * KREX_PACE_GIVEUP_MS (queued work that waits for the host, e.g. a stream wait on a flag
 * this thread sets later) turns pacing off in that process for good. */
#define KREX_PACE_EVERY 8
#define KREX_QUEUE_CAP_MS 15
#define KREX_PACE_GIVEUP_MS 2000
/* The drain budget (pace.c, krexd's `drain_budget_ms`; 0: the per-process cap above). On a
 * GPU shared by n submitting processes, time-sliced or run in order, a process's queued work
 * runs at about 1/n of the GPU, so the time its oldest unfinished work has waited, and the
 * wall time per submission it measures, both already count everyone's queue: bounding them
 * by the budget keeps each process's own queue near budget/n, its share, and the whole GPU's
 * near the budget. Where even one check interval of a process's work is more than its share
 * (a kernel longer than budget/n), it waits for that work before it returns to submit more:
 * at most one interval of its work in flight, never none. */
#define KREX_DRAIN_BUDGET_MS 4
/* Long work takes turns (pace.c, krexd's `pace_tokens`; 0: off). The floor above still
 * leaves one interval per process in flight, so with kernels longer than the budget a drain
 * waited for one of each sibling's: its entry grew with the number of commands (15 x up to
 * 11 ms at C=16 on the H200). A process on the floor therefore submits its next interval only
 * while it holds one of the GPU's `pace_tokens` turns (krex_gpu.turns): at most that many
 * long intervals are queued on the GPU at a time, however many commands share it, and two
 * keep it busy while a third waits its turn. A turn is a word (holder pid << 40 | lease end
 * in us of CLOCK_MONOTONIC, mod 2^40), leased for the interval its holder submits next (its
 * own GPU time: the wall time it measured for one, over the turns in use; a quarter of
 * KREX_TURN_LEASE_US more, at least KREX_TURN_LEASE_US, at most KREX_TURN_LEASE_MAX_US) and
 * renewed so while the holder waits for its own work. A holder doing host work before it
 * launches keeps its turn for up to that interval (the turn idles at most as long as its
 * kernel then runs, so two turns keep the GPU busy; longer host work lets it lapse, and the
 * holder may then launch without one); a holder that dies, is frozen or stops submitting
 * holds the others back at most that interval (a word whose lease ends further off than
 * KREX_TURN_LEASE_MAX_US is no holder's). Only long work takes turns
 * (not a floor taken because a region is near), and a command whose own region is announced
 * or queued takes none. A process waits at most
 * KREX_TURN_WAIT_MS for one, then goes on without (slower to drain once, never stuck). */
#define KREX_PACE_TOKENS 2
#define KREX_TURNS_MAX 4
#define KREX_TURN_LEASE_US 2000
#define KREX_TURN_WAIT_MS 1000
#define KREX_TURN_LEASE_MAX_US 50000
/* A region about to begin on a GPU (krex_gpu.pending_slots, soon_slots): siblings' queues
 * shrink before its gate closes. While another command's region is queued (BEGIN sent, gate
 * not yet its), a sibling's pacing check and its LIFE calls (contexts, modules, device
 * memory) wait until that gate closes, and a call parked at the gate that opens with such a
 * region still queued keeps waiting for it; while another command said a region comes soon
 * (an automatic region's target entered, krex.region.soon()), a sibling's pacing check
 * waits until its own queued work has finished and its LIFE calls wait as above. Each wait
 * lasts at most KREX_PENDING_HOLD_MS per call (a stale word slows, never stops), and a
 * hint lapses KREX_SOON_MS after it was given unless the region's BEGIN comes first. */
#define KREX_PENDING_HOLD_MS 50
#define KREX_SOON_MS 200
/* One context creation at a time into the driver (ctx_token.c, shim's ctx_gate.c). The
 * driver makes contexts one at a time node-wide, behind its resource-manager lock (an H100
 * measured 0.35 s for one alone, a median 5.7 s with 32 at once), and a region's drain waits
 * behind that lock for every creation queued in it: 465 ms with 5 queued. So a call that
 * makes a context (the CTXNEW rows and the primary-context retains of the api_*.def tables)
 * first takes the node's token (krex_header.ctx_token), not yet counted in flight at the
 * gate (a drain does not wait for it, a freezer may stop it), and gives it back once the
 * vendor call has returned: a drain then waits for at most the one creation inside the
 * driver. It never parks at a closed gate holding it (it gives it back first, takes it again
 * after), and a command whose own region holds the gate takes none. The word is holder pid
 * << 40 | lease end (us of CLOCK_MONOTONIC, mod 2^40); pid 0 when the holder is not in
 * krexd's pid namespace. A token whose holder died is taken over at once; one whose lease
 * ended (a holder stopped, frozen, or exec'd while holding it) is free: KREX_CTX_TOKEN_LEASE_MS
 * is several times the longest single creation measured (0.7 s on a loaded H200, 0.35 s on
 * an H100), so a live holder keeps it through its call, and a stuck one holds the others back
 * at most that long. Waiters poll with backoff up to KREX_CTX_TOKEN_POLL_MAX_US (a creation
 * is hundreds of ms: a poll costs nothing next to it). KREX_CTX_TOKEN=0 in a process's
 * environment turns it off there (for A/B measurements). */
#define KREX_CTX_TOKEN_LEASE_MS 2000
#define KREX_CTX_TOKEN_POLL_MAX_US 2000

/* Timing constants: the ONE home of each. The shim (C) and krexd and its clients
 * (Python, through cffi) both read them from here; nothing restates a value.
 * krexd beats every KREX_HEARTBEAT_INTERVAL_NS. A beat older than
 * KREX_HEARTBEAT_TIMEOUT_NS means krexd is dead or hung: shims fail open, guardians
 * thaw their commands, clients stop waiting for a reply. */
#define KREX_HEARTBEAT_INTERVAL_NS 100000000
#define KREX_HEARTBEAT_TIMEOUT_NS 2000000000
/* A shim waiting at a closed gate re-checks the gate's holder this often. */
#define KREX_GATE_RECHECK_NS 20000000
/* The drain helper waits this long for a graph capture to end before acking partial. */
#define KREX_CAPTURE_WAIT_NS 100000000
/* Clients (shim and Python) waiting for a reply re-check krexd's heartbeat this often. */
#define KREX_CLIENT_POLL_NS 200000000
/* Clients give up connecting to (or sending to) krexd after this many ms. */
#define KREX_CONNECT_TIMEOUT_MS 5000
/* Clients give up waiting for a reply krexd gives at once (started, release, status) after
 * this many ms (admission and regions wait as long as krexd beats). */
#define KREX_REPLY_TIMEOUT_MS 30000
/* The guardian (`krex run`) checks krexd's heartbeat this often. */
#define KREX_GUARDIAN_POLL_NS 100000000
/* krexd, waiting on a GPU's `wake` word for in-flight calls to leave or drain helpers to
 * ack, re-checks without a wake this often: a straggler that died (SIGKILL mid-call, no
 * wake ever comes) is noticed by the liveness check of the next scan. */
#define KREX_WAIT_RECHECK_NS 10000000
/* A Python caller of those waits gets control back at least this often, so a signal that
 * landed just before the C wait began still runs its handler (Ctrl-C on `krex pause`). */
#define KREX_WAIT_SLICE_NS 200000000
/* The drain helper re-checks its GPU's drain_seq (and whether to stop) this often. */
#define KREX_HELPER_RECHECK_NS 1000000000
/* krex_proc.ordered_life's count of ends (its high half). */
#define KREX_ORDERED_END 4294967296
/* An exit waits out the region that holds the gate, then at most this long for regions
 * that follow it at once (drain.c, wait_out_region). */
#define KREX_EXIT_WAIT_NS 250000000
/* A look round (krex_look_request) at a region's end: krexd waits at most this long for the
 * helpers of the siblings it did not freeze to look at what their process loaded (a CUDA
 * runtime the hooks cannot see, a GPU library in another namespace) and ack. One that does
 * not ack in time (stopped, starved, its helper blocked) flags the
 * region. 250 ms: a helper woken late on a loaded CPU (tens of ms seen) is no reason to flag. */
#define KREX_LOOK_TIMEOUT_MS 250
/* Registration and fork() wait at most this long for a just-started drain helper to
 * finish starting. */
#define KREX_HELPER_SETTLE_NS 500000000
/* A client that starts krexd on demand waits this long for it to answer. */
#define KREX_DAEMON_START_WAIT_MS 15000
/* krexd's defaults, overridden by its settings (krex/node/config.py). The shim needs
 * none of them; they are here so that every timing constant has one home. */
/* The driver clears freed GPU memory on the GPU after the freeing call has returned (an
 * H200 kernel ran 13% slower while siblings freed 4 GB at a time, its regions gated and
 * clean: docs/results/lifecycle-calls/), and the exit of a process with GPU state frees all
 * of it. Nothing says when that clearing ends, so a region granted within this long of a
 * sibling's free or exit is flagged `recent-free`. Not measured: 4 GB cleared at the
 * ~3 TB/s that slowdown implies takes ~1.3 ms; 100 ms covers ~300 GB. */
#define KREX_FREE_SETTLE_NS 100000000
/* After a sibling process ended during a region's entry, krexd waits this long per GB it
 * held (NVML's last figure for it), at least KREX_SETTLE_MIN_NS, instead of
 * KREX_FREE_SETTLE_NS: the H200 cleared freed memory at 2.5 ms/GB, and an exit left at most
 * 5 ms of it after the reap for 16 GB, 115 ms for 64 GB (docs/results/free-settle/). A
 * process NVML never reported keeps KREX_FREE_SETTLE_NS. The same rate sizes a free whose
 * bytes the shim can ask the driver for (cudaFree, cuMemFree, hipFree of an allocation's
 * base: its address range), from the end of the call; every other freeing call keeps
 * KREX_FREE_SETTLE_NS. */
#define KREX_SETTLE_NS_PER_GB 3000000
#define KREX_SETTLE_MIN_NS 5000000
/* A guardian that gets a stop signal (SIGINT, SIGTERM, ...) while its command still waits
 * pre-warmed (nothing of it on the GPU yet) SIGKILLs it this long after, if it still waits:
 * a Python command blocked in the shim's wait cannot run its own handler. */
#define KREX_WARM_KILL_NS 1000000000
/* A region still open after this long is ended by force (max_region, --max-region). */
#define KREX_MAX_REGION_MS 60000
/* A daemon started on demand exits after this long without work (idle_exit). */
#define KREX_ON_DEMAND_IDLE_EXIT_MS 120000
/* Region entry waits this long for in-flight work and drain acks (drain_timeout). */
#define KREX_DRAIN_TIMEOUT_MS 5000
/* Region entry waits this long for a group to report frozen (freeze_timeout). */
#define KREX_FREEZE_TIMEOUT_MS 2000
/* `krex pause`: how long the pause holds (--for) by default and at most, and how long
 * it waits for in-flight work and drain acks (--timeout) by default and at most. */
#define KREX_PAUSE_LEASE_MS 600000
#define KREX_PAUSE_LEASE_MAX_MS 604800000
#define KREX_PAUSE_TIMEOUT_MS 10000
#define KREX_PAUSE_TIMEOUT_MAX_MS 86400000

/* ------------------------------------------------------------------ the wire
 * Clients (krex run's guardian, krex.region, the shim) and krexd talk over one Unix
 * stream socket. Every message, either way, is one frame, in host byte order:
 *     struct krex_msg_hdr | the op's body (body_len bytes) | a JSON object (json_len bytes)
 * The body is the op's fixed struct (krex_req_* / krex_rep_* below, named per op in
 * KREX_OPS; every error reply's is struct krex_rep_error) followed by its text tail. It
 * carries everything a C client (guardian.c, client.c) sends or reads, so C neither
 * writes nor parses JSON: C senders set json_len to 0, and C readers drop a reply's JSON
 * unread. The JSON object carries the rest, for Python clients only: optional fields,
 * rich replies (status, a region record, a release's regions). A field is in the body or
 * in the JSON, never both. A reply repeats its request's op; KREX_OP_EVENT frames
 * (admission queued) may come before it. Identity never comes from a frame: krexd reads
 * it from SO_PEERCRED (invariant I6).
 *
 * Text tails. A body struct's uint32_t fields named NAME_str and NAME_strs are not values:
 * each is the byte count of one text of the tail, which follows the struct inside the body
 * in the order of those fields (body_len = sizeof the struct + their sum). A text is a run
 * of UTF-8 strings, each ended by a NUL (none inside): NAME_str one string (0 bytes: none,
 * absent from the dict form), NAME_strs a list of them (0 bytes: empty). A map goes as a
 * list, each key followed by its value's strings (the struct says how many). A field
 * has_NAME says whether the integer NAME is set (the dict form: null or absent when not).
 * Python's dict form (krex/protocol.py) names each by NAME alone.
 *
 * A frame krexd cannot use (unknown op, a body of the wrong size or a tail that does not
 * add up, a text that is not NUL-ended UTF-8, JSON that is not an object, a field of the
 * wrong type) gets an error reply and the connection goes on; a bad magic, a truncated
 * frame or one longer than KREX_WIRE_MAX gets an error reply and ends the connection (the
 * stream cannot be resynchronised). */
/* "KRX2" as its first four bytes on a little-endian host (KRX1 frames carried JSON where
 * these carry text tails). */
#define KREX_WIRE_MAGIC 844649035
#define KREX_WIRE_MAX 1048576
/* krex_msg_hdr.status of a reply. */
#define KREX_ST_OK 0
#define KREX_ST_ERROR 1

/* The operations: name, code, request body, reply body (none: JSON only).
 * NONE is the op of a reply to a frame krexd could not read (or sent before any). */
#define KREX_OPS(X)                                           \
    X(NONE, 0, none, none)                                    \
    X(HELLO, 1, none, none)                                   \
    X(ADMIT, 2, krex_req_admit, krex_rep_admit)               \
    X(STARTED, 3, krex_req_started, none)                     \
    X(RELEASE, 4, krex_req_release, krex_rep_release)         \
    X(ADOPT, 5, none, none)                                   \
    X(REGISTER, 6, krex_req_register, krex_rep_register)      \
    X(BEGIN, 7, krex_req_begin, krex_rep_begin)               \
    X(END, 8, none, krex_rep_end)                             \
    X(STATUS, 9, none, none)                                  \
    X(SHUTDOWN, 10, none, none)                               \
    X(EVENT, 11, none, krex_rep_event)                        \
    X(SOON, 12, none, none)
/* C: enum krex_op { KREX_OP_NONE = 0, KREX_OP_HELLO = 1, ... }. cffi gets the same
 * names as constants, from krex_build.py's reading of the rows above. */
#define KREX_OP_ENUM_(name, code, req, rep) KREX_OP_##name = code,
enum krex_op { KREX_OPS(KREX_OP_ENUM_) };

struct krex_msg_hdr {
    uint32_t magic;                 /* KREX_WIRE_MAGIC */
    uint16_t op;                    /* KREX_OP_* */
    uint16_t status;                /* replies: KREX_ST_*; 0 in requests */
    uint32_t body_len;              /* bytes of the op's body that follow (0, or its struct and tail) */
    uint32_t json_len;              /* bytes of the JSON object after the body (0: none; always 0 from C) */
};

/* Every error reply (status KREX_ST_ERROR), whatever its op: what went wrong, how to fix
 * it, and the kind (a class of krex/errors.py: what a client raises). */
struct krex_rep_error {
    uint32_t error_str;
    uint32_t fix_str;
    uint32_t kind_str;
    uint32_t pad0;
};

/* event: something krexd says before the reply (admission queued: `event` "queued"). */
struct krex_rep_event {
    int32_t slots_busy;             /* commands holding slots when it queued */
    uint32_t event_str;             /* what happened: "queued" */
    uint32_t note_str;              /* what to tell the user (optin.queue_note) */
    uint32_t pad0;
};

/* admit: `krex run`'s guardian asks for a slot (krexd keeps it while the connection is open). */
struct krex_req_admit {
    int32_t gpu;                    /* the GPU asked for, when has_gpu (else krexd picks one) */
    _Bool has_gpu;
    uint8_t pad0[3];
    uint32_t guardian_str;          /* "native": krexd checks what this guardian cannot */
    uint32_t device_str;            /* --device: auto, gpu, sim (none: auto) */
    uint32_t freeze_str;            /* --freeze (none: the daemon's policy) */
    uint32_t tenant_str;            /* --tenant (none: the user's name) */
    uint32_t auto_value_str;        /* KREX_AUTO_REGION, for the release's notes and report */
    uint32_t pad1;
};
/* The admission: the slot, what to give the command and what to print. */
struct krex_rep_admit {
    int32_t slot;
    int32_t gpu;
    double admission_wait_s;        /* how long it queued */
    _Bool auto_value;               /* krexd took the request's auto_value */
    uint8_t pad0[3];
    uint32_t device_str;            /* the daemon's device kind: gpu, amd, sim */
    uint32_t shm_str;               /* its segment's name */
    uint32_t group_str;             /* the slot's group: a cgroup directory or the signal freezer's file */
    uint32_t freezer_str;           /* cgroup2, cgroup1, signal */
    uint32_t env_set_strs;          /* a map: NAME, value */
    uint32_t env_prepend_strs;      /* a map: NAME, value, separators (optin.prepend) */
    uint32_t shared_cpus_strs;      /* the CPUs the command may use, decimal (empty: any) */
    uint32_t notes_strs;            /* what to print before it runs */
    uint32_t pad1;
};

/* started: the command's pid, for krexd to hold (join: krexd moves it into the slot's group). */
struct krex_req_started {
    int32_t pid;
    _Bool join;
    uint8_t pad0[3];
};

/* release: the command ended; krexd frees the slot. With `report`, krexd makes the whole
 * --report (what only the guardian saw comes here: the exit status, krexd's stall) and the
 * guardian writes it as it is. The stall is bounded: the first time krexd stopped beating
 * while the command ran, and its first beat after that; later stalls are not reported. */
struct krex_req_release {
    _Bool report;                   /* --report: send report_json */
    _Bool has_stalled_ts;           /* krexd stopped beating while the command ran */
    _Bool has_stall_age_s;          /* with has_stalled_ts */
    _Bool has_resumed_ts;           /* and beat again after that */
    int32_t exit_status;            /* the command's, as `krex run` exits with it */
    double stalled_ts;              /* CLOCK_REALTIME, s: when the guardian saw the stall */
    double stall_age_s;             /* the heartbeat's age then */
    double resumed_ts;              /* CLOCK_REALTIME, s: when it saw a beat again */
    uint32_t leftovers_str;         /* what to do with processes it left: "kill" (none) or "keep" */
    uint32_t auto_dir_str;          /* the KREX_AUTO_STATUS_DIR its processes wrote into */
    uint32_t extra_str;             /* the caller's members for the report: a JSON object's text
                                     * from Python (krex.proc.launcher), passed on unread */
    _Bool has_exit_pid;             /* how the command ended is known (not when another reaped */
    _Bool has_exit_signal;          /* it): both set, or neither */
    uint8_t pad1[2];
    int32_t exit_pid;               /* the process it started */
    int32_t exit_signal;            /* the signal that killed it, 0: none (under MPS a fault) */
    uint32_t exit_command_str;      /* its command line, ASCII, at most 199 bytes */
    uint32_t pad0;
};
struct krex_rep_release {
    uint32_t notes_strs;            /* what to print after it ran */
    uint32_t report_json_str;       /* the whole --report (JSON text made by krexd), written as is */
};

/* register: an opt-in process asks for a slot (krexd keeps it while the connection is open). */
struct krex_req_register {
    int32_t gpu;                    /* the GPU it means to use */
    uint32_t pad0;
};
struct krex_rep_register {
    int32_t slot;
    int32_t gpu;
};

/* begin: a region on the calling thread; the reply is the grant (its details in the JSON). */
struct krex_req_begin {
    int64_t tid;                    /* the measuring thread (0: the process's main thread) */
    int32_t gpu;
    uint32_t label_str;             /* krex_region_begin's label (none: unlabelled) */
};
struct krex_rep_begin {
    int32_t slot;
    int32_t gpu;
};

/* end: the verdict up front; the JSON holds the end reason, flags and the region record. */
struct krex_rep_end {
    _Bool clean;                    /* exclusive from BEGIN to END, nothing flagged */
    _Bool cut;                      /* krexd ended it at --max-region before END */
    uint8_t pad0[6];
};

struct krex_header {
    uint32_t magic;
    uint32_t abi_version;
    uint32_t n_gpus;
    uint32_t flags;
    uint64_t size;
    int64_t daemon_pid;
    uint64_t heartbeat_ns;          /* CLOCK_MONOTONIC of the controller's last beat */
    uint64_t heartbeat_timeout_ns;  /* a region older than this without a beat is dead */
    uint64_t created_ns;
    uint64_t proc_overflows;        /* processes that found no free record */
    uint64_t instance;              /* random at creation: which segment this is (its generation) */
    uint64_t check;                 /* krex_hdr_check() of the fields that never change */
    uint64_t pidns;                 /* krexd's pid namespace (inode of /proc/self/ns/pid); 0 unknown */
    uint64_t ctx_token;             /* 0 free, else holder pid << 40 | lease end (us, mod 2^40): the
                                     * node's one context creation in the driver (KREX_CTX_TOKEN_LEASE_MS) */
    uint64_t reserved[4];
};

struct krex_gpu {
    uint32_t gate;                  /* futex word, see above */
    uint32_t drain_seq;             /* futex word: bumped to ask every helper to drain */
    uint32_t holder;                /* KREX_HOLDER_* */
    int32_t owner_slot;             /* -1 when none */
    uint64_t epoch;                 /* bumped on every close and open */
    uint64_t closed_ns;
    uint64_t lease_deadline_ns;     /* pause: when it lapses (0 = never) */
    int64_t holder_pid;             /* process that closed the gate */
    uint64_t regions;               /* closes so far */
    uint64_t fail_opens;            /* shims that gave up waiting on this gate */
    uint64_t pub_epoch;             /* epoch whose holder fields above are published */
    uint32_t wake;                  /* futex word: bumped when a sibling leaves a gated call while
                                     * the gate is closed, and when a drain helper acks */
    uint32_t waiters;               /* controller threads sleeping on `wake` (wakers skip the
                                     * syscall while 0) */
    uint64_t slot_free_ns[64];      /* per slot (KREX_MAX_SLOTS): CLOCK_MONOTONIC of its processes'
                                     * latest GPU memory free or exit (KREX_FREE_SETTLE_NS); kept
                                     * when the slot's records and the slot itself are freed */
    uint64_t slot_free_gen[64];     /* the slot generation (its command) that made each stamp: a
                                     * command that gets the number next still waits for it */
    uint32_t queue_cap_us;          /* pace.c: set by krexd while 2 or more commands share this GPU
                                     * (0: no pacing) */
    uint32_t drain_full;            /* set by krexd before a drain request: 1 = every sibling with
                                     * a context drains, quiet or not (policy `all`); 0 = one quiet
                                     * since its last full drain owes none (krex_proc_quiet) */
    uint32_t budget_us;             /* pace.c: the GPU's drain budget, set by krexd while 2 or more
                                     * commands share this GPU (0: queue_cap_us per process) */
    uint32_t pace_tokens;           /* pace.c: turns in use (KREX_PACE_TOKENS; 0: long work does not
                                     * take turns), set by krexd with budget_us */
    uint64_t pending_slots;         /* bit s: slot s asked for a region that does not hold the gate
                                     * yet (krexd; KREX_PENDING_HOLD_MS) */
    uint64_t soon_slots;            /* bit s: slot s said a region comes soon (krexd, KREX_SOON_MS) */
    uint64_t slot_free_until_ns[64]; /* per slot: until when the GPU may still clear memory its
                                     * processes freed (the stamp plus the time its size takes at
                                     * KREX_SETTLE_NS_PER_GB, or KREX_FREE_SETTLE_NS when unsized);
                                     * an atomic max, made with slot_free_ns */
    uint64_t turns[4];              /* KREX_TURNS_MAX turns for long work: 0 free, else
                                     * pid << 40 | lease end (us, mod 2^40) (pace.c) */
    uint32_t turn_waiters;          /* processes waiting for a turn (pace.c; a waiter that died
                                     * leaves it high: releasers then only yield once more) */
    uint32_t look_seq;              /* the drain_seq of the latest look-only request (krex_look_request):
                                     * helpers woken for it look at what their process loaded and ack
                                     * it in look_ack, with no drain */
};

struct krex_slot {
    uint32_t state;                 /* KREX_SLOT_* */
    int32_t gpu;
    int64_t owner_pid;              /* the guardian (krex run) that claimed it */
    uint64_t generation;            /* bumped on each claim, so stale handles notice */
    uint32_t inflight;              /* used only by processes that found no krex_proc record */
    uint32_t unrecorded;            /* such processes beyond the list below, and processes in
                                       another pid namespace (never decremented) */
    int64_t unrecorded_pids[4];     /* such processes (pid | start ticks << 32): flagged while alive */
    uint32_t warm;                  /* a futex: 1 while the command is pre-warmed (krexd's `prewarm`,
                                     * admitted before a slot freed up), and its processes' first
                                     * gated call waits; krexd clears it when a slot frees up */
    uint32_t reserved;
};

struct krex_proc {
    int64_t pid;                    /* 0 = free record */
    int32_t slot;
    uint32_t has_ctx;               /* 1 once the process submitted GPU work */
    uint32_t inflight;              /* threads inside a gated call right now */
    uint32_t drain_ack;             /* last drain_seq this process's helper finished */
    uint32_t flags;                 /* KREX_PF_* */
    int32_t gpu;
    uint64_t start_ticks;           /* /proc/pid/stat field 22: tells pid reuse apart */
    uint64_t submits[6];            /* per gated class; KREX_NGATED entries */
    uint64_t blocked;               /* times a call waited at a closed gate */
    uint64_t blocked_ns;
    uint64_t fail_opens;
    uint64_t drains;
    uint32_t drain_partial;         /* last drain_seq acked WITHOUT a full sync (graph capture running) */
    uint32_t captures;              /* graph captures in progress in this process */
    uint32_t check;                 /* krex_proc_check() of pid, slot, gpu, start_ticks */
    uint32_t helper_tid;            /* its drain helper's thread: gone while the pid lives = exec'd */
    uint32_t life_inflight;         /* threads inside a LIFE call right now (1 for good once it exits:
                                     * the context's teardown is the kernel's, past every call) */
    uint32_t free_inflight;         /* threads inside a free (a LIFE call that hands memory back),
                                     * from its first stamp to its second: one frozen right after
                                     * the driver call has freed memory with no second stamp yet */
    uint32_t exit_drained;          /* 1 once its exit's last drain ran (its drain helper gone): its
                                     * teardown's LIFE count does not keep it from being quiet, and
                                     * even a full drain owes it no ack while it stays quiet */
    uint64_t drained_at;            /* 1 + its GPU-work calls (krex_proc_submits) as it began its
                                     * last full drain (helper or exit), with none in flight then;
                                     * 0: none yet. While they stay that many, nothing of it can be
                                     * queued on the GPU: krexd owes it no drain (krex_proc_quiet) */
    uint64_t ordered_life;          /* stream-ordered LIFE calls (async allocations and frees):
                                     * +1 as each starts, +KREX_ORDERED_END as it ends (low and
                                     * high halves: starts and ends). They queue work on a
                                     * stream, so they count with the gated submissions */
    uint64_t paced;                 /* pace.c: times a thread waited for its queued work */
    uint64_t paced_ns;
    uint64_t held;                  /* times a call waited for another command's region about to
                                     * begin (shim.c, krex_hold_pending: pacing checks, LIFE calls,
                                     * a gate that opened with one queued) */
    uint64_t held_ns;
    uint32_t life_tid;              /* a thread inside a LIFE call, the last to begin one (0: none,
                                     * that one ended, or not in krexd's pid namespace): krexd lends
                                     * it priority while a region's drain waits for that call */
    uint32_t slot_gen;              /* low 32 bits of the slot generation it registered under
                                     * (its command's): krex_proc_trust compares it */
    uint32_t look_ack;              /* the latest look_seq its helper read before a look at what the
                                     * process loaded (the loader's counters, then each object's
                                     * dynamic symbols): every library loaded before that request
                                     * was looked at. Set at registration (one behind the GPU's
                                     * requests), its helper's start, every drain request, every
                                     * KREX_HELPER_RECHECK_NS */
    uint32_t exit_looked;           /* 1 once its exit handler, its helper stopped, looked at what it
                                     * loaded: krexd's look rounds owe it no ack from then on */
    uint64_t exit_ns;               /* krex_now_ns as its exit began (exit(), _exit(), a return from
                                     * main: the shim's exit handler); 0: not begun, or it ended
                                     * without one (a signal, a crash). krexd reads it as it frees
                                     * the record of the dead process (krex_proc_reap_ended) */
};

struct krex_shm {
    struct krex_header hdr;
    struct krex_gpu gpus[16];       /* KREX_MAX_GPUS */
    struct krex_slot slots[64];     /* KREX_MAX_SLOTS */
    struct krex_proc procs[1024];   /* KREX_MAX_PROCS */
};

#endif
