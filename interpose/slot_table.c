/* The slot table and the process records of the segment (part of the core: krex_core.c
 * maps the segment and gates it, this hands out and takes back its slots and records):
 * claim and release a slot, register a process under it, reap dead processes' records.
 * None of it is on the submission fast path. */
#include "krex_core.h"

#include <string.h>

#define SEQ __ATOMIC_SEQ_CST

/* Pids of the live processes registered under `slot` (all of them counted, at most
 * `max` written): one C scan instead of 1024 record reads from Python on region entry. */
int krex_slot_procs(struct krex_shm *shm, int slot, int64_t *pids, int max) {
    int n = 0;
    for (int i = 0; i < KREX_MAX_PROCS; i++) {
        struct krex_proc *p = &shm->procs[i];
        int64_t pid = __atomic_load_n(&p->pid, SEQ);
        if (pid == 0 || p->slot != slot || !krex_pid_alive(pid, p->start_ticks)) continue;
        if (pids && n < max) pids[n] = pid;
        n++;
    }
    return n;
}

/* Live processes still registered under `slot`. */
int krex_slot_live_procs(struct krex_shm *shm, int slot) {
    int n = 0;
    for (int i = 0; i < KREX_MAX_PROCS; i++) {
        struct krex_proc *p = &shm->procs[i];
        int64_t pid = __atomic_load_n(&p->pid, SEQ);
        if (pid != 0 && p->slot == slot && krex_pid_alive(pid, p->start_ticks)) n++;
    }
    for (int i = 0; i < 4; i++) /* and those registered without a record */
        n += krex_unrecorded_alive(__atomic_load_n(&shm->slots[slot].unrecorded_pids[i], SEQ));
    return n;
}

/* A slot just taken (FREE -> ACTIVE by a CAS): set it up for its command, bumping its
 * generation so stale handles notice. */
static void slot_init(struct krex_slot *sl, int gpu, int64_t owner_pid) {
    sl->gpu = gpu;
    sl->owner_pid = owner_pid;
    sl->inflight = 0;
    sl->unrecorded = 0;
    memset(sl->unrecorded_pids, 0, sizeof sl->unrecorded_pids);
    __atomic_store_n(&sl->warm, 0, SEQ);
    __atomic_add_fetch(&sl->generation, 1, SEQ);
}

/* A slot number is never handed out while a process registered under it lives: that
 * process's shim would pass the new owner's gate as if it were the new owner. */
int krex_slot_claim(struct krex_shm *shm, int gpu, int64_t owner_pid) {
    for (int s = 0; s < KREX_MAX_SLOTS; s++) {
        struct krex_slot *sl = &shm->slots[s];
        if (__atomic_load_n(&sl->state, SEQ) != KREX_SLOT_FREE || krex_slot_live_procs(shm, s) > 0) continue;
        uint32_t expect = KREX_SLOT_FREE;
        if (__atomic_compare_exchange_n(&sl->state, &expect, KREX_SLOT_ACTIVE, 0, SEQ, SEQ)) {
            slot_init(sl, gpu, owner_pid);
            return s;
        }
    }
    return -1;
}

/* Claim slot `s` itself (krexd's recovery: a slot number whose group still holds processes of
 * a command from before it restarted on a fresh segment). 1 if it was free and is now ours. */
int krex_slot_claim_n(struct krex_shm *shm, int s, int gpu, int64_t owner_pid) {
    if (s < 0 || s >= KREX_MAX_SLOTS) return 0;
    uint32_t expect = KREX_SLOT_FREE;
    if (!__atomic_compare_exchange_n(&shm->slots[s].state, &expect, KREX_SLOT_ACTIVE, 0, SEQ, SEQ)) return 0;
    slot_init(&shm->slots[s], gpu, owner_pid);
    return 1;
}

static int proc_free(struct krex_proc *p, int64_t pid);
static int take_dead(struct krex_shm *shm, struct krex_proc *p, int64_t pid, struct krex_ended *seen);
static struct krex_ended ended_of(const struct krex_proc *p, int64_t pid);
static void stamp_unreported(struct krex_shm *shm, const struct krex_ended *e);

/* A process of this slot found no free record: list it where a dead one's entry or a
 * free one is left (krexd flags regions while a listed pid lives), else count it for
 * good (krexd then flags every region of the slot's GPU until the slot is claimed again). */
void krex_slot_note_unrecorded(struct krex_slot *sl, int64_t pid) {
    /* An entry is the pid (low 32 bits) and its start time (high 32 bits, truncated),
     * so an unrelated process that reuses the pid does not keep it listed. */
    int64_t entry = (int64_t)(((uint64_t)(uint32_t)krex_pid_start_ticks(pid) << 32) | (uint32_t)pid);
    for (int i = 0; i < 4; i++) {
        int64_t cur = __atomic_load_n(&sl->unrecorded_pids[i], SEQ);
        if (krex_unrecorded_alive(cur)) continue;
        if (__atomic_compare_exchange_n(&sl->unrecorded_pids[i], &cur, entry, 0, SEQ, SEQ)) return;
    }
    __atomic_add_fetch(&sl->unrecorded, 1, SEQ);
}

int krex_unrecorded_alive(int64_t entry) {
    int64_t pid = (int64_t)(uint32_t)entry;
    if (pid == 0 || !krex_pid_alive(pid, 0)) return 0;
    return (uint32_t)krex_pid_start_ticks(pid) == (uint32_t)((uint64_t)entry >> 32);
}

void krex_slot_release(struct krex_shm *shm, int slot) {
    if (slot < 0 || slot >= KREX_MAX_SLOTS) return;
    struct krex_slot *sl = &shm->slots[slot];
    /* Forget the slot's dead processes; live stragglers keep their record. */
    for (int i = 0; i < KREX_MAX_PROCS; i++) {
        struct krex_proc *p = &shm->procs[i];
        int64_t pid = __atomic_load_n(&p->pid, SEQ);
        if (pid != 0 && p->slot == slot && !krex_pid_alive(pid, p->start_ticks)) take_dead(shm, p, pid, NULL);
    }
    sl->owner_pid = 0;
    sl->gpu = -1;
    sl->inflight = 0;
    __atomic_store_n(&sl->state, KREX_SLOT_FREE, SEQ);
    krex_slot_set_warm(shm, slot, 0); /* its waiters wake, and register as stale */
}

void krex_slot_set_warm(struct krex_shm *shm, int slot, int warm) {
    if (slot < 0 || slot >= KREX_MAX_SLOTS) return;
    __atomic_store_n(&shm->slots[slot].warm, warm ? 1u : 0u, SEQ);
    if (!warm) krex_futex_wake(&shm->slots[slot].warm);
}

static void proc_init(struct krex_shm *shm, struct krex_proc *p, int slot, int gpu, int64_t pid) {
    struct krex_proc fresh;
    memset(&fresh, 0, sizeof fresh);
    p->slot = slot;
    p->gpu = gpu;
    p->start_ticks = krex_pid_start_ticks(pid);
    p->has_ctx = 0;
    p->inflight = 0;
    p->life_inflight = 0;
    p->free_inflight = 0;
    p->drained_at = 0;
    p->exit_drained = 0;
    /* Owes every look from the GPU's current request on until its helper's start-up look:
     * one behind the request sequence, as look_owed compares (a 0 would owe none once the
     * sequence is 2^31 past it). */
    p->look_ack = gpu >= 0 && gpu < KREX_MAX_GPUS ? __atomic_load_n(&shm->gpus[gpu].drain_seq, SEQ) - 1 : 0;
    p->exit_looked = 0;
    p->ordered_life = 0;
    p->flags = 0;
    p->drain_ack = __atomic_load_n(&p->drain_ack, SEQ);
    memcpy(p->submits, fresh.submits, sizeof p->submits);
    p->blocked = p->blocked_ns = p->fail_opens = p->drains = 0;
    p->paced = p->paced_ns = p->held = p->held_ns = 0;
    p->drain_partial = 0;
    p->captures = 0;
    p->helper_tid = 0;
    p->slot_gen = 0; /* the registering shim stores its command's generation next */
    p->exit_ns = 0;
    __atomic_store_n(&p->check, krex_proc_check(p), SEQ); /* last: the record is whole now */
}

/* Free a record of a dead process. Its check is cleared first, so the next claimer's
 * record reads as "being filled in" until it seals it (never as damaged). */
static int proc_free(struct krex_proc *p, int64_t pid) {
    uint32_t c = __atomic_exchange_n(&p->check, 0, SEQ);
    if (__atomic_compare_exchange_n(&p->pid, &pid, 0, 0, SEQ, SEQ)) return 1;
    krex_proc_check_restore(p, c);
    return 0;
}

/* Undo the check cleared by a claim or a free that then lost the pid race. Put it back
 * only where it still seals what the record holds: if another claimer won the record,
 * it seals the record itself, and the old check stored over its own (it may have
 * sealed already) would make its record read as damaged for good. */
void krex_proc_check_restore(struct krex_proc *p, uint32_t c) {
    uint32_t zero = 0;
    if (c != 0 && c == krex_proc_check(p)) __atomic_compare_exchange_n(&p->check, &zero, c, 0, SEQ, SEQ);
}

/* Returns the record index for `pid`, claiming a free or dead one. An exec'd
 * process keeps the pid and so finds its old record again. */
int krex_proc_register(struct krex_shm *shm, int slot, int gpu, int64_t pid) {
    for (int i = 0; i < KREX_MAX_PROCS; i++) {
        struct krex_proc *p = &shm->procs[i];
        if (__atomic_load_n(&p->pid, SEQ) == pid) {
            uint64_t st = krex_pid_start_ticks(pid);
            if (!p->start_ticks || p->start_ticks == st) {
                /* The same process registering again is a new image (exec: it registers
                 * once per image): nothing of the old image's calls, contexts or helper
                 * is left, so its record starts afresh (an exec from inside a gated
                 * call would otherwise leave an in-flight count of 1 for good). */
                __atomic_store_n(&p->check, 0, SEQ);
                proc_init(shm, p, slot, gpu, pid);
                return i;
            }
        }
    }
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < KREX_MAX_PROCS; i++) {
            struct krex_proc *p = &shm->procs[i];
            int64_t cur = __atomic_load_n(&p->pid, SEQ);
            if (pass == 0 && cur != 0) continue;
            /* Pass 1 takes a dead process's record, or a free one: the reaper may have
             * freed records behind pass 0's scan. */
            if (pass == 1 && cur != 0 && krex_pid_alive(cur, p->start_ticks)) continue;
            /* Claim first, then fill: the pid CAS is the ownership token. The check is
             * cleared before, so the half-filled record never reads as damaged. */
            struct krex_ended was = ended_of(p, cur);
            uint32_t c = __atomic_exchange_n(&p->check, 0, SEQ);
            if (__atomic_compare_exchange_n(&p->pid, &cur, pid, 0, SEQ, SEQ)) {
                if (cur != 0) stamp_unreported(shm, &was); /* a dead one's record: krexd never saw it end */
                proc_init(shm, p, slot, gpu, pid);
                return i;
            }
            krex_proc_check_restore(p, c);
        }
    }
    __atomic_or_fetch(&shm->hdr.flags, KREX_HF_PROCS_FULL, SEQ);
    __atomic_add_fetch(&shm->hdr.proc_overflows, 1, SEQ);
    return -1;
}

/* Free records of dead processes. Returns how many were freed. Each had GPU state, whose
 * scrubbing krexd cannot size from here: its slot gets the fixed settle time. */
int krex_proc_reap(struct krex_shm *shm) {
    return krex_proc_reap_ended(shm, NULL, 0);
}

/* Free records of dead processes; the first `max` of them go to `out` (krexd sizes the wait
 * for their memory's scrubbing from when it found them gone, and tells a kill from an exit),
 * the others stamp their slot with the fixed settle time. Returns how many were freed. */
int krex_proc_reap_ended(struct krex_shm *shm, struct krex_ended *out, int max) {
    int n = 0;
    for (int i = 0; i < KREX_MAX_PROCS; i++) {
        struct krex_proc *p = &shm->procs[i];
        int64_t pid = __atomic_load_n(&p->pid, SEQ);
        if (pid != 0 && !krex_pid_alive(pid, p->start_ticks) && take_dead(shm, p, pid, n < max ? &out[n] : NULL))
            n++;
    }
    return n;
}

/* A new image of process `pid` (exec keeps the pid and the start time) found the record of
 * its old one: that image ended by the exec, its exit handlers skipped as by _exit, which is
 * no kill. Its exit_ns says so, unless set already (a new image that registers starts its
 * record afresh). Returns 1 if such a record was found. */
int krex_proc_note_exec(struct krex_shm *shm, int64_t pid, uint64_t now_ns) {
    uint64_t st = 0;
    for (int i = 0; i < KREX_MAX_PROCS; i++) {
        struct krex_proc *p = &shm->procs[i];
        if (__atomic_load_n(&p->pid, SEQ) != pid) continue;
        if (!st) st = krex_pid_start_ticks(pid);
        if (p->start_ticks && st && p->start_ticks != st) continue; /* a dead one's, pid reused */
        uint64_t zero = 0;
        __atomic_compare_exchange_n(&p->exit_ns, &zero, now_ns, 0, SEQ, SEQ);
        return 1;
    }
    return 0;
}

/* What a dead process's record says of it: read before its record is freed or claimed
 * (winning the pid CAS afterwards proves no one changed it meanwhile). */
static struct krex_ended ended_of(const struct krex_proc *p, int64_t pid) {
    struct krex_ended e;
    memset(&e, 0, sizeof e);
    e.pid = pid;
    e.slot = p->slot;
    e.gpu = p->gpu;
    e.slot_gen = p->slot_gen;
    e.flags = __atomic_load_n(&p->flags, SEQ);
    e.exit_ns = __atomic_load_n(&p->exit_ns, SEQ);
    e.rec = *p; /* a dead process writes no more: its counters are final */
    return e;
}

/* A record of a process with GPU state freed where krexd does not hear of it: the driver
 * may still scrub its memory (the teardown frees all of it), so its slot gets the fixed
 * settle time from now, under its command's generation (rebuilt from the slot's current
 * one and the low 32 bits the record keeps). One that outlived its command stamps slot 0
 * under a generation no command has: any region waits for it. */
static void stamp_unreported(struct krex_shm *shm, const struct krex_ended *e) {
    if (e->gpu < 0 || e->gpu >= KREX_MAX_GPUS) return;
    int slot = e->slot;
    uint64_t gen = UINT64_MAX;
    if (slot >= 0 && slot < KREX_MAX_SLOTS) {
        uint64_t cur = __atomic_load_n(&shm->slots[slot].generation, SEQ);
        gen = (cur & ~0xffffffffull) | e->slot_gen;
        if (gen > cur && gen >= (1ull << 32)) gen -= 1ull << 32;
    } else {
        slot = 0;
    }
    krex_note_free(shm, e->gpu, slot, gen, KREX_FREE_SETTLE_NS);
}

/* Free the record of dead process `pid`; what it said goes to *seen, or, with no `seen`,
 * becomes a stamp of its slot (stamp_unreported). 0 if another freer or claimer won. */
static int take_dead(struct krex_shm *shm, struct krex_proc *p, int64_t pid, struct krex_ended *seen) {
    struct krex_ended e = ended_of(p, pid);
    if (!proc_free(p, pid)) return 0;
    if (seen) *seen = e;
    else stamp_unreported(shm, &e);
    return 1;
}
