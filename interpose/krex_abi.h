/* KREX shared-memory ABI: the ONE definition of the segment layout, its
 * constants and the shim <-> controller protocol.
 *
 * Both C (shim, cffi module) and Python (cffi cdef of this very file) read it.
 * Rules that keep it cffi-parsable: only "#define NAME <integer>" lines besides
 * the include guard and includes, no attributes, explicit padding.
 * tests/unit/test_abi.py asserts that sizes and offsets agree in C and Python.
 *
 * Protocol (Dekker pairing, both sides seq_cst):
 *   shim:       inflight++ ; g = gate ; if closed and not owner: inflight--, futex-wait(gate, g), retry
 *   controller: gate = closed(epoch, owner) ; wait until every non-owner inflight == 0
 * so any submission is either counted before the close or sees the gate closed.
 */
#ifndef KREX_ABI_H
#define KREX_ABI_H
#include <stdint.h>

#define KREX_MAGIC 1480938059
#define KREX_ABI_VERSION 1
#define KREX_MAX_GPUS 16
#define KREX_MAX_SLOTS 64
#define KREX_MAX_PROCS 1024

/* Gate word (a futex): 0 = open. Closed = (epoch24 << 8) | owner byte, where the
 * owner byte is slot+1, or KREX_OWNER_NONE for an operator pause. Never 0 when closed. */
#define KREX_GATE_OPEN 0
#define KREX_OWNER_NONE 255

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

/* API classes: which counter a submission bumps. Only the first KREX_NGATED are gated. */
#define KREX_CLS_KERNEL 0
#define KREX_CLS_COPY 1
#define KREX_CLS_MEMSET 2
#define KREX_CLS_GRAPH 3
#define KREX_CLS_PREFETCH 4
#define KREX_NGATED 5
#define KREX_CLS_LOOKUP 5
#define KREX_CLS_CTX 6

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

/* Header flags (krex_header.flags). */
#define KREX_HF_PROCS_FULL 1

/* krex_shm_verify(): what is wrong with a segment's header (a bit mask). */
#define KREX_BAD_MAGIC 1
#define KREX_BAD_ABI 2
#define KREX_BAD_GPUS 4
#define KREX_BAD_SIZE 8
#define KREX_BAD_CHECK 16

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
/* The guardian (`krex run`) checks krexd's heartbeat this often. */
#define KREX_GUARDIAN_POLL_NS 100000000
/* The drain helper re-checks its GPU's drain_seq (and whether to stop) this often. */
#define KREX_HELPER_RECHECK_NS 1000000000
/* A client that starts krexd on demand waits this long for it to answer. */
#define KREX_DAEMON_START_WAIT_MS 15000
/* krexd's defaults, overridden by its settings (krex/node/config.py). The shim needs
 * none of them; they are here so that every timing constant has one home. */
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
    uint64_t reserved[6];
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
    uint64_t reserved[7];
};

struct krex_slot {
    uint32_t state;                 /* KREX_SLOT_* */
    int32_t gpu;
    int64_t owner_pid;              /* the guardian (krex run) that claimed it */
    uint64_t generation;            /* bumped on each claim, so stale handles notice */
    uint32_t inflight;              /* used only by processes that found no krex_proc record */
    uint32_t pad0;
    uint64_t reserved[4];
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
    uint64_t submits[5];            /* per gated class; KREX_NGATED entries */
    uint64_t blocked;               /* times a call waited at a closed gate */
    uint64_t blocked_ns;
    uint64_t fail_opens;
    uint64_t drains;
    uint32_t drain_partial;         /* last drain_seq acked WITHOUT a full sync (graph capture running) */
    uint32_t captures;              /* graph captures in progress in this process */
    uint32_t check;                 /* krex_proc_check() of pid, slot, gpu, start_ticks */
    uint32_t pad1;
};

struct krex_shm {
    struct krex_header hdr;
    struct krex_gpu gpus[16];       /* KREX_MAX_GPUS */
    struct krex_slot slots[64];     /* KREX_MAX_SLOTS */
    struct krex_proc procs[1024];   /* KREX_MAX_PROCS */
};

#endif
