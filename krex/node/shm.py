"""A typed wrapper over the shared-memory segment (layout: interpose/krex_abi.h).

`Segment` creates, attaches, snapshots and unlinks the segment and offers the
gate operations the control plane is built from. Every constant comes from the
cffi module, which read them from the ABI header."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeGuard

from krex.errors import Busy, KrexError, NotFound, PermissionDenied, Timeout, UsageError, error_kind
from krex.native import ffi, lib

CLASS_NAMES = ("kernel", "copy", "memset", "graph", "prefetch", "life")
HOLDER_NAMES = {
    lib.KREX_HOLDER_NONE: "none",
    lib.KREX_HOLDER_REGION: "region",
    lib.KREX_HOLDER_PAUSE: "pause",
}
PROC_FLAG_NAMES = {
    lib.KREX_PF_NO_REAL: "no-real-symbol",
    lib.KREX_PF_SLOTS_FULL: "slots-full",
    lib.KREX_PF_FAILED_OPEN: "failed-open",
    lib.KREX_PF_HELPER_FAILED: "helper-failed",
    lib.KREX_PF_DRAIN_TIMEOUT: "drain-timeout",
    lib.KREX_PF_LOOKUP_FALLBACK: "lookup-fallback",
    lib.KREX_PF_DRAIN_PARTIAL: "drain-partial",
    lib.KREX_PF_DAEMON_LOST: "daemon-lost",
    lib.KREX_PF_STALE_SLOT: "stale-slot",
    lib.KREX_PF_PACE_OFF: "pace-off",
    lib.KREX_PF_UNSEEN: "unseen-runtime",
    lib.KREX_PF_CHUNK_SETTING: "chunk-setting",
    lib.KREX_PF_FOREIGN_NS: "foreign-namespace",
}
# KREX_PF_IN_EXIT is a state, not a problem: a process inside its exit handlers (ProcInfo.exiting).
# KREX_PF_OTHER_PID_NS too: outside krexd's pid namespace (its regions say so as drain-unknown).
PROC_STATE_BITS = {lib.KREX_PF_IN_EXIT: "exiting", lib.KREX_PF_OTHER_PID_NS: "other-pid-namespace"}


def pid_namespace() -> int:
    """This process's pid namespace (the inode of /proc/self/ns/pid); 0 unknown."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def default_name() -> str:
    """The segment name: $KREX_SHM, else one per user."""
    name = os.environ.get("KREX_SHM") or f"/krex-{os.getuid()}"
    if not name.startswith("/") or "/" in name[1:] or len(name) > 120:
        raise UsageError(
            f"KREX_SHM={name!r} is not a valid shared-memory name",
            "use a name like /krex-mine: one leading slash, no other slashes, at most 120 characters",
        )
    return name


def now_ns() -> int:
    return int(lib.krex_now_ns())


def gate_owner(word: int) -> int:
    """The owner byte of a closed gate word: slot+1, or KREX_OWNER_NONE for a pause
    (the word's layout is krex_abi.h's)."""
    return int(word & lib.KREX_GATE_OWNER_MASK)


# krexd beats in the segment every KREX_HEARTBEAT_INTERVAL_NS; a beat older than this
# means it is stopped or hung (C: krex_heartbeat_stale in krex_core.c).
HEARTBEAT_TIMEOUT_S = lib.KREX_HEARTBEAT_TIMEOUT_NS / 1e9


def heartbeat_stale(age_s: float | None) -> TypeGuard[float]:
    """Is a heartbeat this old (Segment.heartbeat_age; None: never beaten) past the timeout?"""
    return age_s is not None and age_s > HEARTBEAT_TIMEOUT_S


@dataclass
class GateInfo:
    gpu: int
    closed: bool
    word: int
    holder: str
    owner_slot: int
    epoch: int
    lease_left_s: float | None
    holder_pid: int
    closes: int
    fail_opens: int


@dataclass
class SlotInfo:
    slot: int
    gpu: int
    owner_pid: int
    owner_alive: bool
    generation: int
    warm: bool = False  # started pre-warmed, waiting for the GPU (krexd's `prewarm`)


@dataclass
class ProcInfo:
    pid: int
    slot: int
    gpu: int
    alive: bool
    has_ctx: bool
    inflight: int
    life_inflight: int
    drain_ack: int
    submits: dict[str, int]
    blocked: int
    blocked_ms: float
    fail_opens: int
    drains: int
    flags: list[str] = field(default_factory=list)
    paced: int = 0  # times a thread waited for its own queued work (pace.c)
    paced_ms: float = 0.0
    held: int = 0  # times a call waited for another command's region about to begin (shim.c)
    held_ms: float = 0.0
    quiet: bool = False  # nothing queued since its last full drain: a drain skips it
    exiting: bool = False  # its exit handlers stopped the shim's helper (KREX_PF_IN_EXIT)

    def plus(self, o: ProcInfo) -> ProcInfo:
        """The counters of both (pid 0): the freed records of one command, as one."""
        return ProcInfo(
            0, self.slot, self.gpu, False, self.has_ctx or o.has_ctx, 0, 0, 0,
            {k: v + o.submits.get(k, 0) for k, v in self.submits.items()},
            self.blocked + o.blocked, self.blocked_ms + o.blocked_ms, self.fail_opens + o.fail_opens,
            self.drains + o.drains, [], self.paced + o.paced, self.paced_ms + o.paced_ms,
            self.held + o.held, self.held_ms + o.held_ms,
        )


def proc_info(r: Any, alive: bool, quiet: bool = False) -> ProcInfo:
    """A process record (struct krex_proc) as read now."""
    return ProcInfo(
        pid=int(r.pid),
        slot=int(r.slot),
        gpu=int(r.gpu),
        alive=alive,
        has_ctx=bool(r.has_ctx),
        inflight=int(r.inflight),
        life_inflight=int(r.life_inflight),
        drain_ack=int(r.drain_ack),
        submits={n: int(r.submits[k]) for k, n in enumerate(CLASS_NAMES)},
        blocked=int(r.blocked),
        blocked_ms=int(r.blocked_ns) / 1e6,
        fail_opens=int(r.fail_opens),
        drains=int(r.drains),
        flags=[n for bit, n in PROC_FLAG_NAMES.items() if r.flags & bit],
        paced=int(r.paced),
        paced_ms=int(r.paced_ns) / 1e6,
        held=int(r.held),
        held_ms=int(r.held_ns) / 1e6,
        quiet=quiet,
        exiting=bool(r.flags & lib.KREX_PF_IN_EXIT),
    )


@dataclass
class Snapshot:
    name: str
    n_gpus: int
    daemon_pid: int
    heartbeat_age_s: float | None
    proc_overflows: int
    gates: list[GateInfo]
    slots: list[SlotInfo]
    procs: list[ProcInfo]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StepResult:
    """Outcome of one controller step (wait for in-flight, drain)."""

    ok: bool
    seconds: float
    count: int
    stragglers: list[int]
    partial: list[int] = field(default_factory=list)  # acked without a full sync (graph capture)
    stats: dict[str, int] = field(default_factory=dict)  # the C wait loop's scans, wakeups, timeouts
    acks: dict[int, float] = field(default_factory=dict)  # drain: pid -> seconds until it acked


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def _recheck_ns(recheck: float | None) -> int:
    return int(lib.KREX_WAIT_RECHECK_NS) if recheck is None else _ns(recheck)


_SLICE_S = lib.KREX_WAIT_SLICE_NS / 1e9
DRAIN_TIMEOUT_S = lib.KREX_DRAIN_TIMEOUT_MS / 1e3  # krexd's default for the in-flight and drain waits


def _wait(
    call: Callable[[int, Any], int], timeout: float, below: int = 1
) -> tuple[int, float, dict[str, int]]:
    """Run a C wait loop (`call(timeout_ns, stats)`) until fewer than `below` remain or the
    timeout, in slices: between them (and when a signal interrupts the C call) Python runs
    pending signal handlers, so Ctrl-C on `krex pause` raises even when it landed just
    before a C wait began."""
    t0 = time.monotonic()
    st = ffi.new("struct krex_wait_stats *")
    total = {"scans": 0, "wakeups": 0, "timeouts": 0}
    while True:
        left = timeout - (time.monotonic() - t0)
        n = int(call(_ns(min(left, _SLICE_S)), st))
        for k in total:
            total[k] += int(getattr(st, k))
        if n < below or time.monotonic() - t0 >= timeout:
            return n, time.monotonic() - t0, total


def _oserror(err: int, name: str) -> KrexError:
    kind = error_kind(err)  # the kind is krex.errors'; the words are about the segment
    if kind is NotFound:
        return NotFound(
            f"no KREX shared memory {name}: nothing has run under KREX on this machine yet",
            "start a command with `krex run -- CMD` (or `krex daemon start`)",
        )
    if kind is PermissionDenied and err == errno.EPERM:  # krex_shm_open's word for "not ours"
        try:
            st = os.stat("/dev/shm" + name, follow_symlinks=False)
            what = f"belongs to uid {st.st_uid} with mode {st.st_mode & 0o777:04o}"
        except OSError:
            what = "is not trustworthy"
        return PermissionDenied(
            f"shared memory {name} {what}: it is not a KREX segment of yours (someone may have "
            "planted it), refusing to use it",
            f"remove it (its owner or root: rm /dev/shm{name}), or set KREX_SHM to another name",
        )
    if kind is PermissionDenied:
        return PermissionDenied(
            f"permission denied opening shared memory {name}",
            "run as the user who started KREX, or point KREX_SHM at a segment of your own",
        )
    if err == errno.EPROTO:
        return KrexError(
            f"shared memory {name} is not a KREX segment of ABI {lib.KREX_ABI_VERSION}",
            f"remove it (`krex daemon stop`, or rm /dev/shm{name}) and start again",
        )
    return kind(f"cannot open shared memory {name}: {os.strerror(err)}", "check /dev/shm")


@dataclass(frozen=True)
class Ended:
    """A process with GPU state that ended, as its freed record said (krex_ended)."""

    pid: int
    gpu: int
    slot: int  # KREX_PROC_STALE: it had outlived its command
    slot_gen: int  # the low 32 bits of its command's slot generation
    exit_ns: int  # krex_now_ns as its exit began; 0: it ended without its exit handler (killed)
    # Outside krexd's pid namespace (KREX_PF_OTHER_PID_NS): krexd may have freed its record
    # while it lived, so this tells neither a kill nor when it ended.
    unseen: bool = False
    record: ProcInfo | None = None  # its record as freed: its counters for its command's report


class Segment:
    """One mapping of the segment. Not thread-safe for writers; the daemon
    serialises gate changes per GPU."""

    def __init__(self, ptr: Any, name: str) -> None:
        self._p = ptr
        self.name = name
        self.fixed_gpus: int | None = None  # krexd's own count: never trust a header it must check
        # Where the records of dead processes go as krexd frees them (its exit ledger,
        # krex/node/exits.py); None: each stamps its slot with the fixed settle time.
        self.on_ended: Callable[[list[Ended]], None] | None = None
        # Held from freeing records to their report: a look that finds nothing left to free
        # then finds in on_ended's ledger what another thread was freeing meanwhile.
        self._reap_lock = threading.Lock()
        # What the records freed by reap_records counted, per slot, under the low 32 bits of
        # its generation: a command's report counts its processes that ended before it did.
        self._freed: dict[int, tuple[int, ProcInfo]] = {}

    # ---------------------------------------------------------------- life
    @classmethod
    def attach(cls, name: str | None = None) -> Segment:
        return cls._open(name or default_name(), 0, 0)

    @classmethod
    def create(cls, name: str | None = None, n_gpus: int = 1, exclusive: bool = False) -> Segment:
        if not 1 <= n_gpus <= lib.KREX_MAX_GPUS:
            raise UsageError(f"{n_gpus} GPUs is out of range", f"KREX supports 1..{lib.KREX_MAX_GPUS} GPUs")
        return cls._open(name or default_name(), 2 if exclusive else 1, n_gpus)

    @classmethod
    def _open(cls, name: str, create: int, n_gpus: int) -> Segment:
        err = ffi.new("int *")
        p = lib.krex_shm_open(name.encode(), create, n_gpus, err)
        if p == ffi.NULL:
            raise _oserror(err[0], name)
        return cls(p, name)

    @staticmethod
    def unlink(name: str | None = None) -> bool:
        return bool(lib.krex_shm_unlink((name or default_name()).encode()) == 0)

    def close(self) -> None:
        if self._p is not None:
            lib.krex_shm_close(self._p)
            self._p = None

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def raw(self) -> Any:
        if self._p is None:
            raise KrexError("segment is closed")
        return self._p

    @property
    def n_gpus(self) -> int:
        if self.fixed_gpus is not None:
            return self.fixed_gpus
        return max(1, min(int(self.raw.hdr.n_gpus), int(lib.KREX_MAX_GPUS)))

    def check_gpu(self, gpu: int) -> None:
        if not 0 <= gpu < self.n_gpus:
            raise NotFound(
                f"unknown GPU {gpu}: this node has {self.n_gpus} GPU(s) (0..{self.n_gpus - 1})",
                "pick a GPU index from `krex status`",
            )

    # ------------------------------------------------------------- snapshot
    def snapshot(self) -> Snapshot:
        p = self.raw
        now = now_ns()
        gates = []
        for g in range(self.n_gpus):
            gp = p.gpus[g]
            word = int(gp.gate)
            lease = int(gp.lease_deadline_ns)
            gates.append(
                GateInfo(
                    gpu=g,
                    closed=word != lib.KREX_GATE_OPEN,
                    word=word,
                    holder=HOLDER_NAMES.get(int(gp.holder), "?"),
                    owner_slot=int(gp.owner_slot),
                    epoch=int(gp.epoch),
                    lease_left_s=(lease - now) / 1e9 if lease and word else None,
                    holder_pid=int(gp.holder_pid),
                    closes=int(gp.regions),
                    fail_opens=int(gp.fail_opens),
                )
            )
        slots = []
        for s in range(lib.KREX_MAX_SLOTS):
            sp = p.slots[s]
            if sp.state == lib.KREX_SLOT_ACTIVE:
                owner = int(sp.owner_pid)
                slots.append(
                    SlotInfo(
                        s,
                        int(sp.gpu),
                        owner,
                        bool(lib.krex_pid_alive(owner, 0)),
                        int(sp.generation),
                        bool(sp.warm),
                    )
                )
        procs = []
        for i in range(lib.KREX_MAX_PROCS):
            r = p.procs[i]
            if r.pid == 0:
                continue
            procs.append(
                proc_info(r, bool(lib.krex_pid_alive(r.pid, r.start_ticks)),
                          bool(lib.krex_proc_quiet(ffi.addressof(p.procs, i))))
            )
        return Snapshot(
            name=self.name,
            n_gpus=self.n_gpus,
            daemon_pid=int(p.hdr.daemon_pid),
            heartbeat_age_s=self.heartbeat_age(),
            proc_overflows=int(p.hdr.proc_overflows),
            gates=gates,
            slots=slots,
            procs=procs,
        )

    # ------------------------------------------------------------ the gate
    def gate_word(self, gpu: int) -> int:
        return int(self.raw.gpus[gpu].gate)

    def close_gate(
        self,
        gpu: int,
        owner_slot: int | None = None,
        *,
        holder: int | None = None,
        holder_pid: int = 0,
        lease_s: float | None = None,
        expect: int = 0,
    ) -> int:
        """Take the gate: with an owner for a region, without one for a pause. One
        compare-and-swap from `expect` (the open gate, or a word the caller may take
        over); raises Busy when someone else holds it. Returns the new gate word."""
        self.check_gpu(gpu)
        if holder is None:
            holder = lib.KREX_HOLDER_REGION if owner_slot is not None else lib.KREX_HOLDER_PAUSE
        deadline = now_ns() + int(lease_s * 1e9) if lease_s else 0
        cur = ffi.new("uint32_t *")
        owner = -1 if owner_slot is None else owner_slot
        word = int(lib.krex_gate_acquire(self.raw, gpu, expect, owner, holder, holder_pid, deadline, cur))
        if word == 0:
            raise Busy(
                f"GPU {gpu}'s gate is held by {self.describe_holder(gpu, int(cur[0]))}",
                "wait for it to be released",
            )
        return word

    def describe_holder(self, gpu: int, word: int) -> str:
        if word == lib.KREX_GATE_OPEN:
            return "nobody"
        owner = gate_owner(word)
        return "an operator pause" if owner == lib.KREX_OWNER_NONE else f"a region of slot {owner - 1}"

    def holder(self, gpu: int, word: int) -> tuple[int, int, int] | None:
        """(holder kind, holder pid, lease deadline ns) published for `word`, or None."""
        h, pid, dl = ffi.new("uint32_t *"), ffi.new("int64_t *"), ffi.new("uint64_t *")
        if not lib.krex_gate_holder(self.raw, gpu, word, h, pid, dl):
            return None
        return int(h[0]), int(pid[0]), int(dl[0])

    def open_gate(self, gpu: int, word: int | None = None) -> bool:
        """Open the gate if it still holds `word` (one compare-and-swap); without a
        word, force it open whoever holds it (recovery and teardown only)."""
        self.check_gpu(gpu)
        if word is None:
            lib.krex_gate_open(self.raw, gpu)
            return True
        return bool(lib.krex_gate_release(self.raw, gpu, word))

    def inflight(self, gpu: int, owner_slot: int | None = None) -> tuple[int, list[int]]:
        pids = ffi.new("int64_t[64]")
        n = lib.krex_gate_inflight(self.raw, gpu, -1 if owner_slot is None else owner_slot, pids, 64)
        return int(n), sorted({int(pids[i]) for i in range(64) if pids[i]})

    def _c_wait(
        self, wait: Any, gpu: int, owner: int, extra: tuple[int, ...], timeout: float, recheck: float | None,
        max_pids: int, below: int = 1,
    ) -> tuple[int, float, dict[str, int], Any]:
        """One of the C waits of protocol steps 3 and 4 (krex_wait_inflight, krex_wait_drain:
        ``wait(shm, gpu, owner, *extra, timeout_ns, recheck_ns, pids, max_pids, stats)``) run
        by _wait until fewer than `below` are outstanding: (what is outstanding, seconds,
        wait stats, the pids buffer)."""
        pids = ffi.new(f"int64_t[{max_pids}]")
        every = _recheck_ns(recheck)
        n, secs, stats = _wait(
            lambda left, st: wait(self.raw, gpu, owner, *extra, left, every, pids, max_pids, st),
            timeout,
            below,
        )
        return n, secs, stats, pids

    def wait_inflight(
        self,
        gpu: int,
        owner_slot: int | None = None,
        timeout: float = DRAIN_TIMEOUT_S,
        recheck: float | None = None,
    ) -> StepResult:
        """Wait until no non-owner thread is inside a gated call (protocol step 3). Sleeps
        on the GPU's wake word, which a sibling bumps as it leaves a gated call while the
        gate is closed; re-checks every `recheck` seconds without a wake (a straggler that
        died never wakes anyone). The C wait releases the GIL."""
        owner = -1 if owner_slot is None else owner_slot
        n, secs, stats, pids = self._c_wait(lib.krex_wait_inflight, gpu, owner, (), timeout, recheck, 64)
        stragglers = sorted({int(pids[i]) for i in range(64) if pids[i]}) if n else []
        return StepResult(n == 0, secs, n, stragglers, stats=stats)

    def drain(
        self,
        gpu: int,
        owner_slot: int | None = None,
        timeout: float = DRAIN_TIMEOUT_S,
        recheck: float | None = None,
        on_progress: Callable[[set[int]], None] | None = None,
        on_slow: Callable[[set[int]], None] | None = None,
        slow_after: float = 0.025,
        full: bool = False,
    ) -> StepResult:
        """Ask every sibling helper to synchronise its contexts and wait for the
        acks (protocol step 4). `count` is how many processes had to drain. Each helper
        wakes the waiter after its ack (see wait_inflight for `recheck`). `on_progress`
        gets the pids still owing an ack, first right after the request and then each time
        fewer remain, so krexd freezes a drained sibling while the others still drain.
        `on_slow` gets the pids still owing one once, `slow_after` seconds in (a record of
        what a slow drain waited for). `acks` says when each acked. `full`: every sibling
        with a context drains, even one quiet since its last full drain (krex_proc_quiet)."""
        t0 = time.monotonic()
        owner = -1 if owner_slot is None else owner_slot
        self.raw.gpus[gpu].drain_full = 1 if full else 0  # before the request: its helpers read it
        # Count who must drain BEFORE asking: a quick helper could ack in between.
        nxt = (int(self.raw.gpus[gpu].drain_seq) + 1) & 0xFFFFFFFF
        initial = int(lib.krex_drain_pending(self.raw, gpu, owner, nxt, ffi.NULL, 0))
        seq = int(lib.krex_drain_request(self.raw, gpu))
        pids = ffi.new("int64_t[256]")
        stats = {"scans": 1, "wakeups": 0, "timeouts": 0}
        n = int(lib.krex_drain_pending(self.raw, gpu, owner, seq, pids, 256))
        acks: dict[int, float] = {}
        owing: set[int] | None = None
        slow_due = on_slow is not None
        while True:
            now_owing = {int(pids[i]) for i in range(min(n, 256))}
            if owing is not None and n <= 256:
                t = time.monotonic() - t0
                acks.update((p, t) for p in owing - now_owing)
            owing = now_owing if n <= 256 else owing
            if on_progress is not None and n <= 256:  # a capped list would not say who is done
                on_progress(now_owing)
            spent = time.monotonic() - t0
            left = timeout - spent
            if n == 0 or left <= 0:
                break
            if slow_due and spent >= slow_after and on_slow is not None:
                slow_due = False
                on_slow(now_owing)
            below = n if (on_progress is not None or slow_due) else 1
            wait = min(left, slow_after - spent) if slow_due else left
            n, _, st, pids = self._c_wait(
                lib.krex_wait_drain, gpu, owner, (seq, below), max(wait, 0.0), recheck, 256, below
            )
            for k in stats:
                stats[k] += st[k]
        if n == 0:
            np_ = int(lib.krex_drain_partial(self.raw, gpu, owner, seq, pids, 256))
            partial = sorted(int(pids[i]) for i in range(min(np_, 256)))
            return StepResult(True, time.monotonic() - t0, initial, [], partial, stats=stats, acks=acks)
        stragglers = sorted(int(pids[i]) for i in range(min(n, 256)))
        return StepResult(False, time.monotonic() - t0, initial, stragglers, stats=stats, acks=acks)

    def heartbeat(self) -> None:
        lib.krex_heartbeat(self.raw)

    def heartbeat_age(self, daemon_pid: int | None = None) -> float | None:
        """Seconds since krexd's last beat; None before its first one, or when ``daemon_pid``
        is given and the segment is another daemon's."""
        if daemon_pid is not None and int(self.raw.hdr.daemon_pid) != daemon_pid:
            return None
        hb = int(self.raw.hdr.heartbeat_ns)
        return (now_ns() - hb) / 1e9 if hb else None

    def set_daemon(self, pid: int, heartbeat_timeout_s: float | None = None) -> None:
        self.raw.hdr.daemon_pid = pid
        # Shims compare theirs: a pid or tid from another pid namespace means another
        # process in krexd's /proc (the drain helper's tid is published only if they match).
        self.raw.hdr.pidns = pid_namespace()
        if heartbeat_timeout_s:
            self.raw.hdr.heartbeat_timeout_ns = int(heartbeat_timeout_s * 1e9)
        self.heartbeat()

    # -------------------------------------------------------- slots, procs
    def claim_slot(self, gpu: int, owner_pid: int | None = None, reap: bool = True) -> int:
        """Claim a free slot. `reap=True` first frees slots of dead guardians; the
        daemon passes False because it also keeps slots whose processes outlived
        their guardian (they must stay siblings until they are gone)."""
        self.check_gpu(gpu)
        if reap:
            self.reap()
        s = int(lib.krex_slot_claim(self.raw, gpu, owner_pid or os.getpid()))
        if s < 0:
            raise Timeout(f"all {lib.KREX_MAX_SLOTS} slots are taken", "wait for commands to finish")
        return s

    def release_slot(self, slot: int) -> None:
        self.reap_records()  # first: what the release frees of its dead processes is not reported
        lib.krex_slot_release(self.raw, slot)
        with self._reap_lock:
            self._freed.pop(slot, None)

    def slot_procs(self, slot: int) -> list[ProcInfo]:
        """The process records of the command holding `slot`: the live ones, then one that
        sums those krexd freed as their processes ended (gate counters for its report)."""
        gen = int(self.raw.slots[slot].generation) & 0xFFFFFFFF if 0 <= slot < lib.KREX_MAX_SLOTS else -1
        with self._reap_lock:
            procs = [p for p in self.snapshot().procs if p.slot == slot]
            freed = self._freed.get(slot)
        return procs + [freed[1]] if freed is not None and freed[0] == gen else procs

    def reap_records(self) -> int:
        """Free the records of dead processes; what each said of its end goes to on_ended."""
        sink = self.on_ended
        if sink is None:
            return int(lib.krex_proc_reap(self.raw))
        n = lib.KREX_MAX_PROCS
        buf = ffi.new("struct krex_ended[]", n)
        with self._reap_lock:
            got = min(int(lib.krex_proc_reap_ended(self.raw, buf, n)), n)
            if got:
                ended = [
                    Ended(int(e.pid), int(e.gpu), int(e.slot), int(e.slot_gen), int(e.exit_ns),
                          bool(e.flags & lib.KREX_PF_OTHER_PID_NS), proc_info(e.rec, False))
                    for e in (buf[i] for i in range(got))
                ]
                for e in ended:
                    self._tally(e)
                sink(ended)
        return int(got)

    def _tally(self, e: Ended) -> None:
        """Count a freed record toward its command (under _reap_lock)."""
        if e.record is None or not 0 <= e.slot < lib.KREX_MAX_SLOTS:
            return  # one that outlived its command counts toward none
        had = self._freed.get(e.slot)
        if had is not None and had[0] == e.slot_gen:
            self._freed[e.slot] = (e.slot_gen, had[1].plus(e.record))
        else:  # the slot's first, or the earlier ones were of a command gone since
            self._freed[e.slot] = (e.slot_gen, e.record)

    def reap(self) -> int:
        """Free process records and slots whose owners are dead."""
        n = self.reap_records()
        for s in range(lib.KREX_MAX_SLOTS):
            sp = self.raw.slots[s]
            if sp.state == lib.KREX_SLOT_ACTIVE and not lib.krex_pid_alive(sp.owner_pid, 0):
                lib.krex_slot_release(self.raw, s)
                n += 1
        return n

    def slot_submits(self, slot: int) -> int:
        """Gated submissions of the command holding one slot, its ended processes' included
        (LIFE calls are no submissions: they say nothing of how launch-bound a region is).
        Read at a region's ends: the records as they are, no liveness check."""
        gen = int(self.raw.slots[slot].generation) & 0xFFFFFFFF
        with self._reap_lock:
            n = 0
            for i in range(lib.KREX_MAX_PROCS):
                r = self.raw.procs[i]
                if r.pid and r.slot == slot:
                    n += sum(int(r.submits[k]) for k in range(lib.KREX_CLS_LIFE))
            freed = self._freed.get(slot)
        if freed is not None and freed[0] == gen:
            n += sum(freed[1].submits[k] for k in CLASS_NAMES[: lib.KREX_CLS_LIFE])
        return n

    def life_busy(self, gpu: int, owner_slot: int) -> dict[int, tuple[int, int]]:
        """Live sibling processes inside a LIFE call (context, module, device memory), or
        exiting after one: {pid: (slot, thread)}: KREX_PROC_STALE for a slot handed on; the
        thread that last began a LIFE call there, 0 if unknown (krex_proc.life_tid)."""
        pids, slots, tids = ffi.new("int64_t[64]"), ffi.new("int32_t[64]"), ffi.new("uint32_t[64]")
        n = min(int(lib.krex_life_busy(self.raw, gpu, owner_slot, pids, slots, tids, 64)), 64)
        return {int(pids[i]): (int(slots[i]), int(tids[i])) for i in range(n)}

    def ctx_token_holder(self) -> int:
        """The pid holding the node's context-creation token (krex_abi.h,
        KREX_CTX_TOKEN_LEASE_MS); 0: a holder outside krexd's pid namespace; -1: free."""
        return int(lib.krex_ctx_token_holder(self.raw, lib.krex_now_ns()))

    def ctx_token_drop(self, pids: Iterable[int]) -> int:
        """Free the token if one of `pids` (processes krexd froze) holds it: a frozen process
        never holds it. Returns the pid it was taken from (0: none)."""
        holder = self.ctx_token_holder()
        if holder <= 0 or holder not in set(pids):
            return 0
        return holder if lib.krex_ctx_token_drop(self.raw, holder) else 0

    def exiting(self, gpu: int, owner_slot: int) -> set[int]:
        """Sibling processes inside the kernel's exit, past any freezer (krex_sibling_exiting)."""
        pids = ffi.new("int64_t[64]")
        n = min(int(lib.krex_sibling_exiting(self.raw, gpu, owner_slot, pids, 64)), 64)
        return {int(pids[i]) for i in range(n)}

    def frees_inflight(self, gpu: int, owner_slot: int) -> int:
        """Live sibling processes between the two stamps of a free (krex_proc.free_inflight)."""
        return int(lib.krex_frees_inflight(self.raw, gpu, owner_slot))

    def life_only(self, pids: Iterable[int]) -> set[int]:
        """Those of `pids` whose records show nothing that could be queued on the GPU but
        the context, module or memory call they are inside (krex_proc_life_only). The live
        process's record: not one an earlier process with the pid left (krex_drain_excuse)."""
        want = set(pids)
        out = set()
        for i in range(lib.KREX_MAX_PROCS):
            r = self.raw.procs[i]
            pid = int(r.pid)
            if (
                pid in want
                and lib.krex_pid_alive(pid, r.start_ticks)
                and lib.krex_proc_life_only(ffi.addressof(self.raw.procs, i))
            ):
                out.add(pid)
        return out

    def drain_owing(self, gpu: int, owner_slot: int, seq: int) -> set[int]:
        """Sibling pids that still owe drain `seq` an ack (at most 256)."""
        pids = ffi.new("int64_t[256]")
        n = int(lib.krex_drain_pending(self.raw, gpu, owner_slot, seq & 0xFFFFFFFF, pids, 256))
        return {int(pids[i]) for i in range(min(n, 256))}

    def drain_excuse(self, gpu: int, pid: int, seq: int) -> bool:
        """Take a frozen process's ack of drain `seq` as given: it owed it only for the LIFE
        call it is inside (krex_drain_excuse)."""
        return bool(lib.krex_drain_excuse(self.raw, gpu, pid, seq & 0xFFFFFFFF))

    def look_request(self, gpu: int) -> int:
        """Ask every drain helper of `gpu` to look at what its process loaded and ack, with
        no drain (krex_look_request). Its sequence, for wait_look."""
        return int(lib.krex_look_request(self.raw, gpu))

    def wait_look(self, gpu: int, pids: Iterable[int], seq: int, timeout: float) -> StepResult:
        """Wait until every process of `pids` with a record on `gpu` acked look `seq`, at most
        `timeout` s (a C futex wait on the GPU's wake word, as the drain's)."""
        want = sorted(set(pids))
        if not want:
            return StepResult(True, 0.0, 0, [])
        arr = ffi.new("int64_t[]", want)
        out = ffi.new("int64_t[256]")
        every = _recheck_ns(None)
        n, secs, stats = _wait(
            lambda left, st: lib.krex_wait_look(
                self.raw, gpu, arr, len(want), seq & 0xFFFFFFFF, left, every, out, 256, st
            ),
            timeout,
        )
        late = sorted(int(out[i]) for i in range(min(n, 256))) if n else []
        return StepResult(n == 0, secs, n, late, stats=stats)

    def bypass_procs(self, gpu: int, owner_slot: int) -> dict[tuple[int, int], int]:
        """(pid, start time) -> flags of other commands' records on `gpu` flagged with a way past
        the hooks (KREX_PF_UNSEEN, KREX_PF_FOREIGN_NS): one C pass (krex_bypass_procs)."""
        n = lib.KREX_MAX_PROCS
        ids, fl = ffi.new("struct krex_proc_id[]", n), ffi.new("uint32_t[]", n)
        got = min(int(lib.krex_bypass_procs(self.raw, gpu, owner_slot, ids, fl, n)), n)
        return {(int(ids[i].pid), int(ids[i].start_ticks)): int(fl[i]) for i in range(got)}

    def proc_brief(self, pid: int) -> dict[str, int] | None:
        """A process record's in-flight counts and drain-helper thread, for a slow entry's
        record (one pass over the records: use only when something is already slow)."""
        for i in range(lib.KREX_MAX_PROCS):
            r = self.raw.procs[i]
            if int(r.pid) == pid:
                return {
                    "inflight": int(r.inflight),
                    "life_inflight": int(r.life_inflight),
                    "helper_tid": int(r.helper_tid),
                    "quiet": int(lib.krex_proc_quiet(ffi.addressof(self.raw.procs, i))),
                }
        return None

    def slot_pids(self, slot: int, alive_only: bool = True) -> list[int]:
        if alive_only:  # the common case, on krexd's region entry path: one C scan
            buf = ffi.new("int64_t[]", lib.KREX_MAX_PROCS)
            n = int(lib.krex_slot_procs(self.raw, slot, buf, lib.KREX_MAX_PROCS))
            return [int(buf[i]) for i in range(min(n, lib.KREX_MAX_PROCS))]
        out = []
        for i in range(lib.KREX_MAX_PROCS):
            r = self.raw.procs[i]
            if r.pid and r.slot == slot and (not alive_only or lib.krex_pid_alive(r.pid, r.start_ticks)):
                out.append(int(r.pid))
        return out


def raise_stragglers(step: str, gpu: int, res: StepResult, timeout: float) -> None:
    raise Timeout(
        f"{step} on GPU {gpu} timed out after {timeout:g}s; stragglers: "
        + ", ".join(str(p) for p in res.stragglers),
        "raise --timeout, or find out why those processes are stuck in a GPU call",
        res.stragglers,
    )
