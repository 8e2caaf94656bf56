"""krexd: the per-node control plane.

Owns the segment, the slot cgroups, the CPU partition and the journal, and runs
the region protocol of DESIGN.md for each GPU in FIFO order. A request for an idle
GPU with nobody queued enters on its own connection's thread (no hand-off before the
grant); otherwise it queues for the GPU's worker thread. Either way the worker holds
the granted region and runs its end:

  queue -> block (close gate) -> catch stragglers (in-flight == 0) -> drain
        -> freeze siblings -> pin the measuring thread -> grant
  end   -> unpin -> thaw -> open gate -> journal

Clients send KREX frames over a Unix socket (interpose/krex_abi.h, read by
krex/protocol.py); each op has one handler in Daemon.handlers; who they are
comes from SO_PEERCRED, never from the message (I6). Every region ends: on
END, when its owner's connection closes or its pid dies, when --max-region runs
out, or when the daemon stops (I4)."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import fcntl
import grp
import json
import logging
import os
import pwd
import queue
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from krex import paths
from krex.device.gpus import GpuInfo, discover
from krex.errors import Busy, DaemonLost, KrexError, NotFound, PermissionDenied, UsageError
from krex.native import ffi, lib
from krex.node import (
    config,
    conns,
    coretime,
    cpus,
    freezepolicy,
    freezer,
    journal,
    mps,
    optin,
    procfs,
    regionqueue,
)
from krex.node import unheld as unheldwork
from krex.node.attest import Attestor
from krex.node.config import Config, config_from
from krex.node.pending import Pending
from krex.node.segguard import Expected, SegmentGuard, remove_world
from krex.node.shm import (
    HEARTBEAT_TIMEOUT_S,
    Segment,
    default_name,
    gate_owner,
    heartbeat_stale,
    pid_namespace,
)
from krex.protocol import MAX_FRAME, REQUESTS, ProtocolError, encode_reply, int_field

# One home for each timing constant: the ABI header (interpose/krex_abi.h).
HEARTBEAT_S = lib.KREX_HEARTBEAT_INTERVAL_NS / 1e9
# A slot's region records kept for its report (the `release` reply); its tally counts every
# region, and the report says how many it does not list.
RELEASE_MAX_RECORDS = 1000

log = logging.getLogger("krex.node.daemon")  # not __name__: it runs as __main__ under -m
# A request handler: (daemon, connection, peer pid from SO_PEERCRED, request, the connection's
# state) -> reply. HANDLERS is the ONE dispatch table, an op of KREX_OPS -> its handler, filled
# by @handles on the Daemon's methods; tests/unit/test_protocol.py checks it covers every request op.
Handler = Callable[["Daemon", socket.socket, int, dict[str, Any], dict[str, Any]], "dict[str, Any] | None"]
HANDLERS: dict[str, Handler] = {}


def handles(op: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        if op not in REQUESTS or op in HANDLERS:
            raise RuntimeError(f"handler for {op!r}: not a request op of KREX_OPS, or one already has one")
        HANDLERS[op] = fn
        return fn

    return register


def _error(e: KrexError) -> dict[str, Any]:
    kind = "UsageError" if isinstance(e, ProtocolError) else type(e).__name__
    return {"ok": False, "error": str(e), "fix": e.fix, "kind": kind}


def _group_id(name: str | None) -> int:
    if name is None:
        return os.getegid()
    try:
        return int(name) if name.isdigit() else grp.getgrnam(name).gr_gid
    except KeyError:
        raise NotFound(f"no group {name!r}", "give an existing group name or gid (see /etc/group)") from None


def _status_fields(pid: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key in ("Uid", "Gid", "Groups", "PPid"):
                    out[key] = [int(x) for x in val.split()]
                    if len(out) == 4:  # all four come early; the rest (~50 lines) is not needed
                        break
    except (OSError, ValueError):
        pass
    return out


def _peer_groups(pid: int, gid: int) -> set[int]:
    """The peer's primary and supplementary groups (SO_PEERCRED has only the primary)."""
    st = _status_fields(pid)
    return {gid, *st.get("Gid", []), *st.get("Groups", [])}


def _fit(records: list[dict[str, Any]], budget: int) -> int:
    """How many of `records`, from the first, fit in `budget` bytes of JSON."""
    total = 2
    for i, r in enumerate(records):
        total += len(json.dumps(r, default=str)) + 2
        if total > budget:
            return i
    return len(records)


def _roots(pids: Iterable[int]) -> dict[int, int]:
    """pid -> start time of those still alive (one gone already cannot be told from a reuse)."""
    out = {}
    for p in pids:
        start = int(lib.krex_pid_start_ticks(p))
        if start:
            out[p] = start
    return out


def _user_name(uid: int) -> str:
    """A command's default tenant: its user's name (the uid where it has none)."""
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid-{uid}"
    try:
        return regionqueue.check_tenant(name)
    except KrexError:
        return f"uid-{uid}"


def _is_root(s: Slot, pid: int) -> bool:
    """`pid` is one of the slot's root processes (the same process, not a reuse of its pid)."""
    start = s.root_pids.get(pid)
    return start is not None and lib.krex_pid_alive(pid, start) == 1


def _check_own_tree(child: int, peer: int, uid: int) -> None:
    """`child` must be the peer's own process or a descendant of it, with the peer's
    (real) user id; anything else could be someone else's process."""
    st = _status_fields(child)
    if not st:
        raise NotFound(f"no process {child}", "send the pid of your own command")
    if uid != 0 and st.get("Uid", [-1])[0] != uid:
        raise PermissionDenied(
            f"process {child} does not run as uid {uid}: only your own processes may join your slot",
            "send the pid of your own command",
        )
    p, ppid = child, st.get("PPid", [0])  # the child's parent from the read above
    for _ in range(256):
        if p == peer:
            return
        p = ppid[0] if ppid else 0
        if p <= 1:
            break
        ppid = _status_fields(p).get("PPid", [0])
    raise PermissionDenied(
        f"process {child} is not in the process tree of pid {peer}: only your own command may join your slot",
        "send the pid of the command you started",
    )


# How long a connection thread waits for another request to serve before it ends (seconds).
CONN_THREAD_IDLE_S = 30.0
# A reply or event a client does not read for this long ends its connection (seconds).
SEND_TIMEOUT_S = 30
_SNDTIMEO = struct.pack("ll", SEND_TIMEOUT_S, 0)  # struct timeval
# krexd starts a new watchdog at most this often (seconds).
WATCHDOG_RESTART_S = 2.0


@dataclass(eq=False)  # identity semantics: slots are dict keys and set members
class Slot:
    slot: int
    gpu: int
    # "run" (a krex run guardian), "auto" (a self-registered process) or "orphan" (processes
    # of a command from before krexd restarted on a fresh segment: see _adopt_orphans)
    kind: str
    guardian_pid: int
    group: freezer.Group
    # pid -> its start time (clock ticks): a root that died and whose pid was reused by
    # an unrelated process must not make that process a member of the slot.
    root_pids: dict[int, int] = field(default_factory=dict)
    guardian_connected: bool = True
    created: float = field(default_factory=time.time)
    freeze: str | None = None  # the command's own freeze policy (krex run --freeze), else the daemon's
    # Admitted pre-warmed (Config.prewarm): started before a slot freed up; its processes wait at
    # their first gated call (and its regions in _begin) until _promote gives it the GPU.
    warm: bool = False
    warm_s: float | None = None  # how long it waited pre-warmed, once given the GPU
    last_rate: float | None = None  # submissions per second of its last region (adaptive policy)
    generation: int = 0  # the segment's slot generation when this slot was claimed
    last_deep_scan: float = 0.0
    # Its regions' records, for the guardian's report (the `release` reply): krexd's own
    # record of the command, never read back from a journal that may have rotated. The
    # first RELEASE_MAX_RECORDS are kept; those past it are counted in `records_dropped`.
    records: list[dict[str, Any]] = field(default_factory=list)
    records_dropped: int = 0
    # optin.region_tally of all its regions (kept past `records`' limit): the release's notes
    # and the report's counts; optin.auto_labels of all its regions: the auto_region counts.
    tally: dict[str, Any] = field(default_factory=dict)
    auto_labels: dict[str, int] = field(default_factory=dict)
    # For the native guardian's report (`release` with "report": true): its admit's wait
    # and whether it runs on the simulated device.
    admission_wait_s: float = 0.0
    simulated: bool = False
    # The native guardian's KREX_AUTO_REGION (its admit): the release's notes and report.
    auto_value: str = ""
    # Whose share of the GPU's exclusive time its regions use (regionqueue): `krex run
    # --tenant`, else its user's name.
    tenant: str = ""
    # Where its group went (below the caller's cgroup, or a fallback and why): the admit's
    # notes, the report and, for a fallback, its regions' records.
    placement: freezer.Placement | None = None
    # Its processes' time on its GPU's region core, counted in other commands' regions
    # (coretime; opened at its first such region, closed with the slot).
    core_watch: list[coretime.CoreWatch] | None = None


@dataclass
class Region:
    slot: int
    gpu: int
    pid: int
    tid: int
    t_request: float
    label: str = ""  # who opened it, e.g. "auto:triton.testing:do_bench"
    tenant: str = ""  # its command's tenant: whose share of the GPU's exclusive time it uses
    word: int = 0  # the gate word while this region holds the gate
    thawing: bool = False  # set (under krexd's lock) once its end has listed whom to thaw
    granted: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    end_reason: str = ""
    grant: dict[str, Any] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)
    after_reply: Callable[[], None] | None = None  # run by the connection thread once the grant is sent


def _same_processes(known: dict[int, int]) -> set[int]:
    """The pids of `known` (pid -> start time) that are gone or still the same process:
    not one that reused the pid since."""
    out = set()
    for pid, start in known.items():
        now = int(lib.krex_pid_start_ticks(pid))
        if now == 0 or now == start:
            out.add(pid)
    return out


INSPECT_EVERY_S = 0.2  # the inspector thread's look at new processes (freezepolicy.Inspector)


class _FreezePlan:
    """Which siblings a region freezes, each started as soon as its processes have acked
    the drain (`progress` is shm.drain's callback). The siblings and the policy are read
    on the first call, right after the drain request; `final=True` after the drain adds
    the siblings that arrived meanwhile and starts every freeze not yet started."""

    def __init__(
        self, d: Daemon, gpu: int, owner_slot: int, frozen: list[Slot], stuck: Iterable[int] = ()
    ) -> None:
        self.d, self.gpu, self.owner_slot = d, gpu, owner_slot
        # Pids still inside a GPU call when the in-flight wait gave up: past the gate, so
        # the gate cannot hold them; their slots are frozen whatever the policy.
        self.stuck = set(stuck)
        self.frozen = frozen  # the region's list, filled as each freeze starts: thawed whatever happens
        self.planned = False
        self.owner: Slot | None = None
        self.policy = ""
        self.why: list[str] = []
        self.siblings: list[Slot] = []
        self.to_freeze: list[Slot] = []
        self.futs: dict[Slot, concurrent.futures.Future[float]] = {}
        self.early = 0  # freezes started while other siblings still drained
        self.life_unfrozen: list[int] = []  # inside a LIFE call, of no slot krexd can freeze
        self.boosted: list[tuple[int, int, int]] = []  # (pid, tid, old nice) lent priority by _plan
        self.lent: list[list[int]] = []  # [pid, tid] of each, for the region's record
        self.draining = True  # until unboost: a plan made after the drain lends nothing
        self.unheld: dict[int, tuple[int, str]] = {}  # sibling pids the gate does not hold: (slot, why)

    def _plan(self, siblings: list[Slot]) -> None:
        policy, chosen, why, unheld = self.d._freeze_choice(self.owner, siblings)
        self.unheld.update(unheld)
        chosen, why = list(chosen), list(why)
        # Read after the gate closed: a LIFE call (context, module, device memory) begun
        # since parks at the gate, so one read finds every one the gate cannot stop.
        life: dict[int, list[int]] = {}
        busy = self.d.seg.life_busy(self.gpu, self.owner_slot)
        for pid, (slot, _tid) in busy.items():
            life.setdefault(slot, []).append(pid)
        if self.draining:
            self._lend(busy, siblings)
        for s in siblings:
            if s in chosen:
                continue
            if self.stuck & set(self.d._group_pids(s)):
                chosen.append(s)
                why.append(f"slot {s.slot}: a process is still inside a GPU call, past the gate")
            elif s.slot in life:
                chosen.append(s)
                why.append(
                    f"slot {s.slot}: pids {sorted(life[s.slot])} inside a context, module or device "
                    "memory call (or exiting after one), which the gate cannot stop midway"
                )
        known = {s.slot for s in siblings} | {s.slot for s in self.siblings}
        self.life_unfrozen.extend(p for slot, ps in life.items() if slot not in known for p in ps)
        self.policy = self.policy or policy
        self.why.extend(why)
        self.siblings.extend(siblings)
        self.to_freeze.extend(chosen)

    def _lend(self, busy: dict[int, tuple[int, int]], siblings: list[Slot]) -> None:
        """Lend helper_nice to the thread inside each sibling's LIFE call until the drain is
        over (unboost): its drain waits for that call (the helper's sync needs the driver
        lock it holds). Only a process its slot's group holds (the record is the command's
        to write: not one it merely names), of krexd's own user (_boost)."""
        by_slot = {s.slot: s for s in siblings}
        for pid, (slot, tid) in busy.items():
            s = by_slot.get(slot)
            if not tid or s is None:
                continue
            try:
                held = set(s.group.pids()) | set(s.root_pids)
            except KrexError:
                continue
            if pid not in held:
                continue
            old_nice = self.d._boost(pid, tid)
            if old_nice is not None:
                self.boosted.append((pid, tid, old_nice))
                self.lent.append([pid, tid])

    def unboost(self) -> None:
        """The LIFE threads' own nice back (after the drain; again at the region's end)."""
        self.draining = False
        while self.boosted:
            pid, tid, old = self.boosted.pop()
            cpus.unboost(pid, tid, old)

    def progress(self, pending: set[int], final: bool = False) -> None:
        d = self.d
        with d.lock:
            now = [s for s in d.slots.values() if s.gpu == self.gpu and s.slot != self.owner_slot]
            if not self.planned:
                self.owner = d.slots.get(self.owner_slot)
        if not self.planned:
            self.planned = True
            self._plan(now)
        elif final:
            # By identity, not by number: a sibling that ended mid-drain may have left its
            # number to a newcomer, which must be planned (frozen) as well.
            known = set(self.siblings)
            self._plan([s for s in now if s not in known])
        for s in self.to_freeze:
            # Its registered pids read now, not at the plan: one that registered since
            # must have acked too.
            if s not in self.futs and (final or not (set(d.seg.slot_pids(s.slot)) & pending)):
                self.early += 0 if final else 1
                self.frozen.append(s)
                self.futs[s] = d.pool.submit(s.group.freeze, d.cfg.freeze_timeout_s)


def _wait_out(
    probe: Callable[[], set[int] | None], step_s: float, timeout_s: float, stop: threading.Event
) -> tuple[set[int], set[int]]:
    """Re-probe every `step_s`, at most `timeout_s`, until none of the first probe's pids is
    left; a probe that could not answer (None) changes nothing. (Those still left at the
    deadline, those it waited for.)"""
    left = probe() or set()
    waited = set(left)
    deadline = time.monotonic() + timeout_s
    while left and time.monotonic() < deadline and not stop.is_set():
        time.sleep(step_s)
        now = probe()
        if now is not None:
            left &= now
    return left, waited


class Daemon:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.stop = threading.Event()
        self.stop_reason = ""
        self._fail_opens: list[int] = []
        self.started_at = time.time()
        self.pid = os.getpid()
        self.info: GpuInfo = discover(cfg.device)
        self.mps = mps.Mps(cfg, self.info)  # checks only; its control daemons start in start()
        self.sock_path = paths.socket_path()
        self.journal_path = paths.journal_path()
        self.shm_name = cfg.shm_name or default_name()
        self.share_gid = _group_id(cfg.group)
        self._lock_fd: int | None = None
        self._journal_lock = threading.Lock()
        self.journal_error: str | None = None
        self.stalls: list[tuple[float, float]] = []  # (start, end) monotonic: heartbeat gaps past the timeout
        self._last_beat = time.monotonic()
        self._sock_ino: int | None = None
        self._take_lock()  # before any cgroup is touched: a second daemon must change nothing
        # Started on demand from inside a command? Never live in (and freeze with) its slot group.
        freezer.leave_slot_groups()
        self.freezer = freezer.detect(cfg.freezer, root_name=freezer.root_name_for(self.shm_name))
        self.partition = cpus.partition(cpus.discover(), self.info.count, self.info.numa or None)
        # Whether the time siblings' processes spend on a region core can be counted
        # (coretime: per slot cgroup v2, perf events); None if so, else why not.
        self.core_watch_off = coretime.available(
            self.freezer.root if self.freezer.name == "cgroup2" else None,
            next((c for sl in self.partition.slices for c in sl.reserved), 0),
        )
        self.lend_off_why: str | None = None
        if self.core_watch_off and cfg.lend_cores != "off" and not self.partition.degraded:
            # Lent, a region core could run a sibling's process that ends before any audit
            # sees it: never unflagged, so not lent where that time cannot be counted.
            self.lend_off_why = f"region cores are not lent: {self.core_watch_off}"
            cfg.lend_cores = "off"
        self.slots: dict[int, Slot] = {}
        # Each GPU's queued regions, in the order they get the GPU (fair between tenants by
        # default: krex/node/regionqueue.py).
        weights = regionqueue.parse_weights(cfg.tenant_weights)
        self.queues: dict[int, regionqueue.FifoQueue[Region] | regionqueue.FairQueue[Region]] = {
            g: regionqueue.make(cfg.region_queue, weights) for g in range(self.info.count)
        }
        self.current: dict[int, Region | None] = dict.fromkeys(range(self.info.count))
        # A region granted on its connection's thread, for the GPU's worker to hold and close.
        self.held: dict[int, tuple[Region, Generator[None, None, None]] | None] = dict.fromkeys(
            range(self.info.count)
        )
        self.regions_done = 0
        self.last_busy = time.monotonic()
        self.seg: Segment
        # Regions queued or announced, published so that siblings' queues shrink early.
        self.pending = Pending(lambda: self.seg, self.info.count, cfg.early_shrink)
        self._server: socket.socket | None = None
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="freeze")
        self.inspector = freezepolicy.Inspector()
        # (the segment's address, its freezepolicy.segment_id): read once per segment
        self._seg_id: tuple[int, tuple[int, int] | None] | None = None
        # (pid, start time, helper tid) reniced to helper_nice: the start time tells a reused
        # pid apart (its new helper is reniced too)
        self._boosted: set[tuple[int, int, int]] = set()
        self._boost_lock = threading.Lock()
        self._boost_ok = True  # False once a renice was refused (not root): not tried again
        self.attestor = Attestor.for_device(self.info.kind, self.info.physical)
        self._conns: queue.SimpleQueue[conns.Conn] = queue.SimpleQueue()
        self._idle_threads = 0  # connection threads waiting on _conns
        self._loop = conns.ConnLoop(self._role, self._hand_over, {0, os.geteuid()}, self.share_gid)
        self.fault: str | None = None  # why krexd stopped without being asked to
        self._idle_lock = threading.Lock()
        self._opt_in: dict[str, tuple[dict[str, str], dict[str, list[str]]]] = {}  # per kind
        # The deep leftover scan reads every process's environment: 16 releases at once
        # ran 16 scans (half of krexd's CPU per command on a 16-core node); now they share.
        tag = f"KREX_SHM={self.shm_name}".encode()
        self._tag_scan = procfs.FreshScan(lambda: procfs.environ_scan(tag, (b"KREX_SLOT", b"KREX_SLOT_GEN")))
        self._unremoved: dict[str, freezer.Group] = {}  # released slots' groups still busy

    # ------------------------------------------------------------------ setup
    def slots_per_gpu(self, gpu: int) -> int:
        if self.cfg.slots_per_gpu:
            return self.cfg.slots_per_gpu
        return cpus.default_slots_per_gpu(self.partition, gpu)

    def _take_lock(self) -> None:
        # Every directory we write into is checked, and every file opened without
        # following symlinks: a squatted /tmp/krex-<uid> must change nothing.
        paths.ensure_state_dir()
        lp = paths.lock_path()
        paths.ensure_dir(lp.parent, "KREX socket directory")
        paths.ensure_dir(self.journal_path.parent, "KREX journal directory")
        try:
            fd = paths.open_private(lp, os.O_RDWR | os.O_CREAT)
        except OSError as e:
            raise KrexError(
                f"cannot create {lp}: {e.strerror}", "set KREX_SOCKET (or KREX_STATE_DIR) to a writable place"
            ) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            pid = paths.read_lock_pid(lp)
            raise Busy(
                f"a KREX daemon is already running (pid {pid or '?'}, socket {self.sock_path})",
                "use it, or stop it first with `krex daemon stop`",
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(self.pid).encode())
        self._lock_fd = fd

    def _recover(self) -> dict[str, int]:
        """Leave nothing from a previous daemon frozen or closed (I4, I5)."""
        thawed = self.freezer.recover()
        reopened = 0
        now = int(lib.krex_now_ns())
        for g in range(self.info.count):
            w = self.seg.gate_word(g)
            h = self.seg.holder(g, w) if w != lib.KREX_GATE_OPEN else None
            live_pause = h is not None and h[0] == lib.KREX_HOLDER_PAUSE and (h[2] == 0 or h[2] > now)
            if w != lib.KREX_GATE_OPEN and not live_pause and self.seg.open_gate(g, w):
                reopened += 1
        reaped = int(lib.krex_proc_reap(self.seg.raw))  # records only: slots are judged below
        # A slot whose guardian or processes still live is adopted: its command is a
        # sibling like any other (frozen during regions) until its processes are gone.
        adopted = 0
        for n in range(lib.KREX_MAX_SLOTS):
            sp = self.seg.raw.slots[n]
            if sp.state != lib.KREX_SLOT_ACTIVE:
                continue
            gpu = int(sp.gpu) if 0 <= sp.gpu < self.info.count else 0
            group = self.freezer.group(f"slot-{n}")
            slot = Slot(
                n,
                gpu,
                "run",
                int(sp.owner_pid),
                group,
                _roots(self.seg.slot_pids(n)),
                guardian_connected=False,
                generation=int(sp.generation),
                warm=bool(sp.warm),  # still pre-warmed: it waits on, in slot order
            )
            if lib.krex_pid_alive(sp.owner_pid, 0) or self._group_pids(slot):
                self.slots[n] = slot
                self._publish_queue_caps()
                adopted += 1
            else:
                with contextlib.suppress(KrexError, OSError):
                    group.remove()
                self.seg.release_slot(n)
        # Groups of the previous daemon that still hold processes, with no slot adopted for
        # them: their command registered in a segment this one replaced (the name unlinked,
        # then krexd killed before it linked it again).
        for group in self.freezer.leftover_groups():
            name = group.name
            n = int(name[5:]) if name.startswith("slot-") and name[5:].isdigit() else -1
            if not 0 <= n < lib.KREX_MAX_SLOTS or n in self.slots:
                continue
            group = self.freezer.group(name)
            with contextlib.suppress(KrexError):
                if group.pids() and lib.krex_slot_claim_n(self.seg.raw, n, 0, 0):
                    self._adopt_orphans(n, 0, group)
                    adopted += 1
        # A daemon killed inside a region left its owner's measuring thread pinned to the
        # region core and, with lent cores, the other threads moved off it: undone here.
        for s in list(self.slots.values()):
            with contextlib.suppress(KrexError):
                sl = self.partition.slice_for(s.gpu)
                full = self.partition.command_cpus(s.gpu, self.cfg.lend_cores)
                cpus.unnarrow(self._group_pids(s), sl.reserved, full)
        with self.lock:
            self._promote()  # slots that freed up with the old daemon go to warm ones now
        return {"thawed": thawed, "reopened": reopened, "reaped": reaped, "adopted": adopted}

    def _adopt_orphans(self, n: int, gpu: int, group: freezer.Group) -> None:
        """Slot `n`'s group holds live processes no slot of this segment knows: a command from
        before krexd restarted on a fresh segment. Their shims registered in the old one, whose
        gate nobody closes, and they would pass a new owner of slot `n` as its own. So the
        number stays theirs (claimed here), and they are frozen in every region under every
        policy (_freeze_choice) until they are gone (the reaper then releases it)."""
        pids = group.pids()
        roots = {p: int(lib.krex_pid_start_ticks(p)) for p in pids}
        gen = int(self.seg.raw.slots[n].generation)
        s = Slot(n, gpu, "orphan", 0, group, roots, guardian_connected=False, generation=gen)
        with self.lock:
            self.slots[n] = s
        log.warning(
            "slot %d: %d process(es) of a command from before this krexd (pids %s) hold its group; "
            "kept as a sibling frozen in every region until they end",
            n,
            len(pids),
            pids[:8],
        )
        self._publish_queue_caps()

    def _open_segment(self) -> None:
        try:
            seg = Segment.create(self.shm_name, n_gpus=self.info.count)
        except PermissionDenied:
            raise  # someone else's segment: never adopt it, never remove it behind their back
        except KrexError:  # ours, but from another ABI or torn: start afresh
            Segment.unlink(self.shm_name)
            seg = Segment.create(self.shm_name, n_gpus=self.info.count)
        try:  # first: the branch below would remake a live daemon's segment
            refuse_a_shared_segment(seg, self.shm_name, self.sock_path.parent)
        except UsageError:
            seg.close()
            raise
        if seg.n_gpus != self.info.count:
            busy = [p for p in seg.snapshot().procs if p.alive]
            if busy:
                raise Busy(
                    f"segment {self.shm_name} was made for {seg.n_gpus} GPUs and is still in use",
                    "stop the commands using it, or set KREX_SHM to another name",
                )
            seg.close()
            Segment.unlink(self.shm_name)
            seg = Segment.create(self.shm_name, n_gpus=self.info.count)
        self.seg = seg

    def _listen(self) -> socket.socket:
        p = self.sock_path
        paths.ensure_dir(p.parent, "KREX socket directory")
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)  # no window in which anyone but us may connect
        try:
            s.bind(str(p))
            # 0660, group = the sharing group: the owner and its group may connect, nobody else.
            os.chown(p, -1, self.share_gid, follow_symlinks=False)
            os.chmod(p, 0o660)
            self._sock_ino = os.stat(p, follow_symlinks=False).st_ino
        except OSError as e:
            s.close()
            raise KrexError(
                f"cannot create socket {p}: {e.strerror}", "set KREX_SOCKET to a writable path"
            ) from e
        finally:
            os.umask(old)
        s.listen(128)
        return s

    def _share_files(self) -> None:
        """Give the sharing group what its members need: the segment (their shims
        count in it), the state directory (to reach the socket) and the journal
        (their reports read it). Nobody else gets anything."""
        if self.share_gid == os.getegid() and self.cfg.group is None:
            return
        targets = [Path("/dev/shm" + self.shm_name), paths.state_dir()]
        with contextlib.suppress(OSError, KrexError):
            os.close(paths.open_private(self.journal_path, os.O_WRONLY | os.O_CREAT))
            targets.append(self.journal_path)
        for t in targets:
            try:
                os.chown(t, -1, self.share_gid, follow_symlinks=False)
            except OSError as e:
                raise PermissionDenied(
                    f"cannot give {t} to group {self.share_gid}: {e.strerror}",
                    "run krexd as root, or share it with a group you are a member of",
                ) from e
        with contextlib.suppress(OSError):
            os.chmod(paths.state_dir(), 0o750)

    def start(self) -> dict[str, int]:
        if self.cfg.lend_cores == "all":
            # Commands now share krexd's core: keep region entry ahead of their CPU work.
            # Every thread started from here on inherits it (nice is per thread on Linux).
            try:
                os.setpriority(os.PRIO_PROCESS, 0, -5)
            except OSError as e:
                log.warning(
                    "cannot raise krexd's priority to nice -5 (%s): with lent cores, region entry "
                    "competes with the commands' CPU work; run krexd as root or with CAP_SYS_NICE",
                    e.strerror,
                )
        if not self.partition.degraded:
            # krexd's own threads (those started from here on inherit it) never run on a
            # region core: the measuring thread's alone.
            keep = set(os.sched_getaffinity(0)) - {c for sl in self.partition.slices for c in sl.reserved}
            if keep:
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(0, keep)
        conns.raise_fd_limit()
        self.mps.start(lambda g: self.current.get(g) is not None)  # asked for and unavailable: no start
        self._open_segment()
        self.seg.fixed_gpus = self.info.count
        self.seg.set_daemon(self.pid, HEARTBEAT_TIMEOUT_S)
        self._fail_opens = self._read_fail_opens()
        if any(self._fail_opens):
            # Counted by shims while no daemon (or a dead one) held their gate.
            log.warning(
                "fail-opens recorded in %s before this start: %s",
                self.shm_name,
                ", ".join(f"gpu {g}: {n}" for g, n in enumerate(self._fail_opens) if n),
            )
        self.guard = SegmentGuard(self.seg, self.info.count, self.pid, int(HEARTBEAT_TIMEOUT_S * 1e9))
        rec = self._recover()
        self._server = self._listen()
        self._share_files()
        self._watchdog_started = time.monotonic()
        self._start_watchdog()
        self._log_start(rec)
        for target in (self._heartbeat_loop, self._reaper_loop, self._inspector_loop):
            threading.Thread(target=target, daemon=True).start()
        for g in range(self.info.count):
            threading.Thread(target=self._gpu_loop, args=(g,), daemon=True, name=f"gpu{g}").start()
        return rec

    def _log_start(self, rec: dict[str, int]) -> None:
        c = self.cfg
        names = ", ".join(self.info.names) or "-"
        log.info(
            "krexd %s started: pid %d, socket %s, segment %s, %s x%d (%s), freezer %s",
            _version(),
            self.pid,
            self.sock_path,
            self.shm_name,
            self.info.kind,
            self.info.count,
            names,
            self.freezer.name,
        )
        settings = {
            "slots_per_gpu": c.slots_per_gpu or [self.slots_per_gpu(g) for g in range(self.info.count)],
            "prewarm": c.prewarm,
            "max_region_s": c.max_region_s,
            "idle_exit_s": c.idle_exit_s if c.idle_exit_s is not None else "never",
            "freezer": c.freezer or f"auto ({self.freezer.name})",
            "freeze_policy": c.freeze_policy,
            "freeze_timeout_s": c.freeze_timeout_s,
            "drain_timeout_s": c.drain_timeout_s,
            "lend_cores": c.lend_cores,
            "drain_budget_ms": c.drain_budget_ms,
            "queue_cap_ms": c.queue_cap_ms,
            "early_shrink": c.early_shrink,
            "log_level": c.log_level,
        }
        log.info(
            "config: %s",
            ", ".join(f"{k}={v} ({c.sources.get(k, 'default')})" for k, v in settings.items()),
        )
        part = self.partition
        log.info(
            "cpu partition: housekeeping %s; %s%s",
            part.housekeeping,
            "; ".join(f"gpu {sl.gpu}: shared {sl.shared}, region {sl.reserved}" for sl in part.slices),
            f"; DEGRADED: {part.reason}" if part.degraded else "",
        )
        if self.lend_off_why:
            log.warning("%s; set lend_cores = \"off\" to silence this", self.lend_off_why)
        elif self.core_watch_off:
            log.info("region cores: siblings' time on them is not counted (%s)", self.core_watch_off)
        log.info("recovery: %d group(s) thawed, %d gate(s) reopened, %d record(s) reaped, %d slot(s) adopted",
                 rec["thawed"], rec["reopened"], rec["reaped"], rec["adopted"])

    def _read_fail_opens(self) -> list[int]:
        return [int(self.seg.raw.gpus[g].fail_opens) for g in range(self.seg.n_gpus)]

    def _start_watchdog(self) -> None:
        """A process of our own that thaws our groups if we hang (krex/node/watchdog.py)."""
        import subprocess

        from krex.pystart import module_argv

        root = self.shm_name.strip("/").replace("/", "-") or "krex"
        args = [str(self.pid), self.shm_name, root, self.freezer.name]
        try:
            self._watchdog: subprocess.Popen[bytes] | None = subprocess.Popen(
                [*module_argv("krex.node.watchdog"), *args],
                stdin=subprocess.DEVNULL,
                close_fds=True,
                env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
                # Not in krexd's process group: a signal to the group (Ctrl-C on a daemon
                # run in a terminal, kill -9 -PGID) must not take the watchdog along.
                start_new_session=True,
            )
        except OSError as e:
            self._watchdog = None
            log.error("cannot start the watchdog: %s; guardians still thaw their own commands", e)

    def serve_forever(self) -> None:
        """Serve until asked to stop. Whatever else ends the loop is a fault: krexd then
        stops as for a stop request (regions end and are journaled, siblings thaw) and
        `run` exits non-zero, so a supervisor (systemd's Restart=on-failure) restarts it."""
        assert self._server is not None
        try:
            self._loop.run(self.stop, lambda: self._server, self._check_socket, self._relisten)
        except conns.LoopFailed as e:
            self.fault = f"krexd stopped serving: {e}"
            log.error("%s", self.fault)
        except BaseException as e:  # noqa: BLE001 - a bug: stop cleanly, and say so
            self.fault = f"krexd stopped serving: {type(e).__name__}: {e}"
            log.exception("%s", self.fault)
            if not isinstance(e, Exception):
                self.stop_reason = self.stop_reason or self.fault
        finally:
            if self.fault:
                self.stop_reason = self.fault
            self.shutdown()
            self._loop.close()

    def _relisten(self) -> None:
        """The listening socket failed: bind a new one (the lock says the path is ours)."""
        try:
            new = self._listen()
        except KrexError as e:
            log.error("cannot make a new listening socket: %s", e)
            return
        old, self._server = self._server, new
        if old is not None:
            with contextlib.suppress(OSError):
                old.close()

    def _hand_over(self, c: conns.Conn) -> None:
        """Serve a connection's request on an idle connection thread, else on a new one. A
        thread waits CONN_THREAD_IDLE_S for another request once it handed its connection
        back: starting a thread for each was 6% of krexd's time per command (16 at once,
        16 cores), on the thread that accepts."""
        with self._idle_lock:
            if self._idle_threads:
                self._idle_threads -= 1
                self._conns.put(c)
                return
        threading.Thread(target=self._conn_thread, args=(c,), daemon=True).start()

    def _conn_thread(self, c: conns.Conn) -> None:
        while True:
            self._serve(c)
            with self._idle_lock:
                self._idle_threads += 1
            try:
                c = self._conns.get(timeout=CONN_THREAD_IDLE_S)
            except queue.Empty:
                with self._idle_lock:
                    # A connection handed over just now (under this lock) is served; else
                    # this thread leaves, counted out under the same lock.
                    try:
                        c = self._conns.get_nowait()
                    except queue.Empty:
                        self._idle_threads -= 1
                        return

    def _check_socket(self) -> None:
        """Someone removed (or replaced) our socket: clients would find no daemon
        while we hold the lock. Bind a fresh one; we still own the path (the lock)."""
        try:
            ino: int | None = os.stat(self.sock_path, follow_symlinks=False).st_ino
        except OSError:
            ino = None
        if ino == self._sock_ino:
            return
        try:
            new = self._listen()
        except KrexError as e:
            log.error("socket %s vanished and cannot be re-created: %s", self.sock_path, e)
            self._sock_ino = ino  # do not retry every 0.2 s
            return
        assert self._server is not None
        self._server.close()
        self._server = new
        log.warning("socket %s was removed or replaced; re-created it", self.sock_path)

    def shutdown(self) -> None:
        self.stop.set()
        log.info("krexd stopping: %s", self.stop_reason or "stop requested")
        with self.lock:
            for r in self.current.values():
                if r is not None:
                    r.end_reason = r.end_reason or "daemon-stop"
                    r.ended.set()
            for q in self.queues.values():
                for r in q:
                    r.cancelled = True
                    r.granted.set()
            self.changed.notify_all()
        deadline = time.monotonic() + 5
        while any(self.current.values()) and time.monotonic() < deadline:
            time.sleep(0.01)
        for g in range(self.info.count):
            w = self.seg.gate_word(g)
            if w != lib.KREX_GATE_OPEN and gate_owner(w) != lib.KREX_OWNER_NONE:
                self.seg.open_gate(g, w)
        for s in list(self.slots.values()):
            with contextlib.suppress(KrexError):
                s.group.thaw()
                s.group.remove()  # thaws; never kills, keeps a group that still has processes
        with self.lock:  # after any segment check under way (it would put our pid back)
            self.seg.raw.hdr.daemon_pid = 0
        self.mps.stop()  # after every region ended: only the control daemons krexd started
        wd = getattr(self, "_watchdog", None)
        if wd is not None:
            wd.terminate()
            with contextlib.suppress(Exception):
                wd.wait(5)
        with contextlib.suppress(KrexError, OSError):
            self.freezer.remove_root()  # only when no slot group was kept (live processes)
        self.guard.close()
        if self.cfg.throwaway:  # nothing will use this world's shared memory again
            users = [p.pid for p in self.seg.snapshot().procs if p.alive and p.pid != self.pid]
            if users:  # their shims still read the gate there; a krexd started again adopts them
                log.info("throwaway world: kept segment %s: %d process(es) still use it (pids %s)",
                         self.shm_name, len(users), users[:8])
            else:
                gone = remove_world(self.shm_name, os.environ.get("KREX_SIM_SHM"))
                log.info("throwaway world: removed %s from /dev/shm", ", ".join(gone) or "nothing")
        if self._server:
            self._server.close()
        with contextlib.suppress(OSError):
            if os.stat(self.sock_path, follow_symlinks=False).st_ino == self._sock_ino:
                self.sock_path.unlink()
        log.info("krexd stopped (pid %d, %d region(s) served)", self.pid, self.regions_done)

    # ------------------------------------------------------------- background
    def _check_watchdog(self) -> None:
        """Start a new watchdog if ours died (self-registered processes have no guardian)."""
        wd = getattr(self, "_watchdog", None)
        if wd is None or wd.poll() is None or self.stop.is_set():
            return
        now = time.monotonic()
        if now - self._watchdog_started < WATCHDOG_RESTART_S:
            return  # one that dies at once (a broken install) is not restarted in a loop
        log.warning("the watchdog (pid %d) exited with %s: starting a new one", wd.pid, wd.returncode)
        self._watchdog_started = now
        self._start_watchdog()

    def _heartbeat_loop(self) -> None:
        last = time.monotonic()
        while not self.stop.is_set():
            self.seg.heartbeat()
            self._check_watchdog()
            try:
                self._guard_tick()
            except Exception as e:  # noqa: BLE001 - the watch must never stop the heartbeat
                log.error("segment check failed: %s: %s", type(e).__name__, e)
            self._check_fail_opens()  # n_gpus word loads; a snapshot only when one rose
            self.pending.expire()
            self._last_beat = last
            time.sleep(HEARTBEAT_S)
            now = time.monotonic()
            if now - last > HEARTBEAT_TIMEOUT_S:
                # We were stopped or starved past the timeout: shims failed open and
                # guardians thawed their commands meanwhile. Regions that spanned it say so.
                with self.lock:
                    self.stalls.append((last, now))
                    del self.stalls[:-100]
                log.warning("krexd did not beat for %.2f s (stopped or starved)", now - last)
            last = now

    def _stalled_during(self, t0: float, t1: float) -> float:
        """Seconds of [t0, t1] during which krexd did not beat (stopped or starved)."""
        with self.lock:
            spans = list(self.stalls)
        now = time.monotonic()
        if now - self._last_beat > HEARTBEAT_TIMEOUT_S:  # one the beat loop has not seen yet
            spans.append((self._last_beat, now))
        return sum(min(b, t1) - max(a, t0) for a, b in spans if a < t1 and b > t0)

    def _check_fail_opens(self) -> None:
        """Log shims that passed a closed gate because its holder looked dead (I5)."""
        now = self._read_fail_opens()
        for g, (old, new) in enumerate(zip(self._fail_opens, now, strict=False)):
            if new > old:
                pids = [p.pid for p in self.seg.snapshot().procs if p.gpu == g and p.fail_opens]
                log.warning(
                    "gpu %d: %d fail-open(s) (total %d): a shim passed a closed gate whose holder "
                    "was gone (a dead region holder or an expired pause lease); pids with fail-opens: %s",
                    g,
                    new - old,
                    new,
                    pids or "-",
                )
        self._fail_opens = now

    # ------------------------------------------------------------ the segment
    def _expected(self) -> Expected:
        """What the segment must hold, from krexd's own state (call with self.lock)."""
        exp = Expected()
        for g in range(self.info.count):
            r = self.current.get(g)
            exp.gates[g] = {r.word} if r is not None and r.word else set()
            exp.owner[g] = r.slot + 1 if r is not None else -1
        exp.slots = {n: (s.gpu, s.generation) for n, s in self.slots.items()}
        exp.warm = {n for n, s in self.slots.items() if s.warm}
        return exp

    def _guard_tick(self) -> list[str]:
        """Check the segment; on trouble repair it and record an incident. Returns the problems."""
        with self.lock:
            if self.stop.is_set():
                return []  # shutdown clears the header's daemon pid: not an incident
            exp = self._expected()
            problems = self.guard.check(exp)
            if not problems:
                return []
            inc = self.guard.repair(problems, exp, lambda: self._known_pids() - {self.pid})
        log.warning("segment incident: %s; %s", "; ".join(inc.problems), "; ".join(inc.actions))
        return problems

    def _check_not_lost(self) -> None:
        if self.guard.lost:
            raise KrexError(
                f"KREX cannot gate new work: {self.guard.lost}",
                "stop the commands using it, then `krex daemon stop` and start again "
                "(`krex doctor` says more)",
            )

    def _reaper_loop(self) -> None:
        while not self.stop.is_set():
            time.sleep(0.1)
            with self.lock:
                for r in self.current.values():
                    # A forked child can keep the owner's socket open: check the pid too.
                    if r is not None and not r.ended.is_set() and not lib.krex_pid_alive(r.pid, 0):
                        r.end_reason = "owner-died"
                        r.ended.set()
                for s in list(self.slots.values()):
                    dead = False
                    if s.kind == "auto":
                        dead = not lib.krex_pid_alive(s.guardian_pid, 0)
                    elif not s.guardian_connected:
                        dead = not self._group_pids(s, deep=self._deep_scan_due(s))
                    elif s.kind == "run" and not lib.krex_pid_alive(s.guardian_pid, 0):
                        # Gone while its connection stays open (a descriptor some other
                        # process still holds): as if the connection had closed.
                        s.guardian_connected = False
                        self.pool.submit(self._guardian_lost, s, f"pid {s.guardian_pid} is gone")
                    if dead:
                        self._release(s.slot, "owner-gone")
                self._remove_released()
                busy = bool(self.slots) or any(self.current.values())
                if busy:
                    self.last_busy = time.monotonic()
            if self.cfg.idle_exit_s is not None and time.monotonic() - self.last_busy > self.cfg.idle_exit_s:
                self.stop_reason = f"idle for {self.cfg.idle_exit_s:g} s"
                self.stop.set()

    def _unrecorded(self, gpu: int) -> dict[int, int]:
        """Slots of `gpu` with live processes that registered without a record (the table
        was full): gated through the slot's counter, but drained by nobody. The shim lists
        up to 4 per slot by pid (counted while alive); more, and processes in a pid
        namespace other than krexd's, are counted for good.
        A slot released meanwhile (its GPU no longer known) counts on every GPU."""
        out = {}
        for n in range(lib.KREX_MAX_SLOTS):
            sp = self.seg.raw.slots[n]
            active = int(sp.state) == lib.KREX_SLOT_ACTIVE
            if active and int(sp.gpu) != gpu:
                continue
            live = sum(lib.krex_unrecorded_alive(e) for e in sp.unrecorded_pids)
            count = live + (int(sp.unrecorded) if active else 0)
            if count:
                out[n] = count
        return out

    def _inspector_loop(self) -> None:
        """Inspect commands' processes for the `gpu` policy off the regions' path: those a
        region queued (it froze their slots meanwhile) at once, and every
        INSPECT_EVERY_S the new processes of every slot, so that most are known before a
        region asks."""
        while not self.stop.is_set():
            self.inspector.wanted.wait(INSPECT_EVERY_S)
            self.inspector.wanted.clear()
            try:
                self.inspector.inspect_pending()
                with self.lock:
                    slots = list(self.slots.values())
                for s in slots:
                    for pid in self._group_pids(s):
                        if self.stop.is_set():
                            return
                        if not self.inspector.seen(pid):
                            self.inspector.facts(pid)
            except Exception:  # noqa: BLE001 - an inspection that failed is retried by the next region
                log.exception("inspector")

    def _group_pids(self, s: Slot, deep: bool = False) -> list[int]:
        """Live processes of a slot's tree: its freezer group, its root pids, the processes
        registered under it in the segment and, with `deep`, every process whose
        environment names this slot and its generation (one that left the group or the
        ancestry still carries them)."""
        try:
            pids = set(s.group.pids())
        except KrexError:
            pids = set()
        pids |= {p for p, t in s.root_pids.items() if lib.krex_pid_alive(p, t)}
        pids |= set(self.seg.slot_pids(s.slot))
        if deep:
            pids |= self._env_tagged(s.slot, s.generation)
        pids.discard(self.pid)
        pids.discard(s.guardian_pid)  # the guardian lives outside the slot
        return sorted(p for p in pids if lib.krex_pid_alive(p, 0))

    def _env_tagged(self, slot: int, generation: int) -> set[int]:
        """Processes whose environment says they belong to slot `slot` of generation
        `generation` of our segment (what `krex run` gives its command): those that left
        the slot's group and its ancestry too. Every /proc/PID/environ is read, from a scan
        that began after this call (FreshScan), so concurrent releases share one scan."""
        want_slot, want_gen = str(slot).encode(), str(generation).encode()
        return {
            pid
            for pid, vals in self._tag_scan.get().items()
            if want_slot in vals[b"KREX_SLOT"] and want_gen in vals[b"KREX_SLOT_GEN"]
        }

    def _deep_scan_due(self, s: Slot) -> bool:
        now = time.monotonic()
        if now - s.last_deep_scan < 1.0:
            return False
        s.last_deep_scan = now
        return True

    def _leftovers(self, n: int, policy: str, slot: Slot | None = None) -> dict[str, Any]:
        """The command of slot `n` ended: what of its tree still lives is a leftover. Kill
        them (the default, as most runners do) or keep them as a sibling slot that lives on
        (frozen in other commands' regions) until they end. Either way the slot number is
        not handed out while one of them lives. `slot`: that command's Slot (nothing is done
        if the number went to another command meanwhile)."""
        with self.lock:
            s = self.slots.get(n)
        if s is None or (slot is not None and s is not slot):
            return {"leftovers": [], "action": "none"}
        found = self._group_pids(s, deep=True)
        info = [{"pid": p, "cmd": procfs.cmdline(p, 200) or "?"} for p in found]
        if not found:
            return {"leftovers": [], "action": "none"}
        if policy == "keep":
            return {"leftovers": info, "action": "kept"}
        deadline = time.monotonic() + 5.0
        while found and time.monotonic() < deadline:
            s.group.kill_all(found)
            time.sleep(0.02)
            found = self._group_pids(s, deep=True)
        return {"leftovers": info, "action": "kill-failed" if found else "killed", "alive": found}

    # ------------------------------------------------------------------ slots
    def _new_slot(self, gpu: int, kind: str, guardian_pid: int, warm: bool = False) -> Slot:
        # The slot table lives in the segment, which any process of the user can write:
        # check (and repair) it before claiming from it, as before every grant. Waiting for
        # the next heartbeat instead, a claim right after damage read random slot records
        # as taken ("all 64 slots are taken") or took a slot whose generation was garbage.
        self._guard_tick()
        self._check_not_lost()
        n = self.seg.claim_slot(gpu, guardian_pid, reap=False)
        # Below the cgroup of the guardian (or of the process registering itself): the
        # command stays in its job's or pod's subtree (freezer.place, cgplace).
        group, placed = self.freezer.place(f"slot-{n}", guardian_pid)
        while group.pids():  # a new command has no process yet: these are orphans
            self._adopt_orphans(n, gpu, group)
            n = self.seg.claim_slot(gpu, guardian_pid, reap=False)
            group, placed = self.freezer.place(f"slot-{n}", guardian_pid)
        if placed.note:
            log.warning("slot %d (pid %d): %s", n, guardian_pid, placed.note.removeprefix("krex: warning: "))
        self._unremoved.pop(group.path, None)
        with contextlib.suppress(KrexError):
            group.thaw()
        s = Slot(
            n, gpu, kind, guardian_pid, group, generation=int(self.seg.raw.slots[n].generation), warm=warm
        )
        s.placement = placed
        # Set before the admit reply: the command cannot have started yet.
        lib.krex_slot_set_warm(self.seg.raw, n, int(warm))
        cur = self.current.get(gpu)
        if cur is not None and cur.word and not cur.thawing:
            # Joining once a region has closed the gate (entering or granted): start frozen
            # so I3 holds for newcomers too. The region's end thaws every slot it did not
            # freeze itself; `thawing` is set, under this lock, when it lists them, so a
            # newcomer is either on that list or not frozen at all.
            with contextlib.suppress(KrexError):
                group.freeze(self.cfg.freeze_timeout_s)
        self.slots[n] = s
        self._publish_queue_caps()
        return s

    def _release(self, n: int, reason: str) -> None:
        with self.lock:
            s = self.slots.pop(n, None)
            if s is None:
                return
            for w in s.core_watch or []:  # (one a region still counts closes after its stop)
                w.close()
            log.info("slot %d on gpu %d released (%s, %s pid %d)", n, s.gpu, reason, s.kind, s.guardian_pid)
            for r in self.current.values():
                if r is not None and r.slot == n and not r.ended.is_set():
                    r.end_reason = reason
                    r.ended.set()
            for q in self.queues.values():
                for r in q:
                    if r.slot == n:
                        r.cancelled = True
                        r.granted.set()
            with contextlib.suppress(KrexError):
                s.group.remove()
            if self.freezer.proc_path(s.group) is not None and os.path.isdir(s.group.path):
                # Still busy (a killed leftover not yet reaped): removed by the reaper once
                # empty, so no group is left in the caller's job or pod cgroup.
                self._unremoved[s.group.path] = s.group
            self.seg.release_slot(n)
            self.pending.drop_slot(n)
            self._publish_queue_caps()
            self._promote()
            self.changed.notify_all()

    def _remove_released(self) -> None:
        """Remove the released slots' groups that were still busy at their release (call
        with self.lock: a new slot may be handed the same group meanwhile)."""
        if not self._unremoved:
            return
        used = {s.group.path for s in self.slots.values()}
        for path, group in list(self._unremoved.items()):
            if path in used:
                del self._unremoved[path]
                continue
            with contextlib.suppress(KrexError, OSError):
                if not group.pids():
                    group.remove()
            if not os.path.isdir(path):
                del self._unremoved[path]

    def _publish_queue_caps(self) -> None:
        """Pacing (interpose/pace.c) bounds the queued GPU work a region's entry must drain,
        while two or more commands share a GPU (alone, nothing waits for it): all of it by the
        GPU's drain budget, each command its share, or, with no budget, each command's by
        queue_cap_ms."""
        cap_us = int(self.cfg.queue_cap_ms * 1000)
        budget_us = int(self.cfg.drain_budget_ms * 1000)
        with self.lock:
            per_gpu = collections.Counter(s.gpu for s in self.slots.values())
        for g in range(self.seg.n_gpus):
            shared = per_gpu[g] >= 2
            # The budget first: a shim that reads it never falls back to the cap meanwhile.
            self.seg.raw.gpus[g].budget_us = budget_us if shared else 0
            self.seg.raw.gpus[g].queue_cap_us = cap_us if shared else 0

    def _slot_of_pid(self, pid: int) -> Slot | None:
        """The slot a process belongs to: its cgroup, else its ancestry."""
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                lines = f.read().splitlines()
            paths_ = [line.split(":", 2)[-1] for line in lines]
            for s in self.slots.values():
                # The group's path as /proc/PID/cgroup names it (a sub-cgroup of it too).
                rel = self.freezer.proc_path(s.group)
                if rel is not None and any(p == rel or p.startswith(rel + "/") for p in paths_):
                    return s
        except OSError:
            pass
        p = pid
        for _ in range(64):
            for s in self.slots.values():
                if _is_root(s, p) or (s.kind == "auto" and p == s.guardian_pid):
                    return s
            st = procfs.pid_stat(p)
            if st is None:
                return None
            p = st.ppid
            if p <= 1:
                return None
        return None

    def _load(self) -> tuple[dict[int, int], dict[int, int]]:
        """Slots per GPU that hold it (leftover processes included), and pre-warmed ones."""
        active = dict.fromkeys(range(self.info.count), 0)
        warm = dict.fromkeys(range(self.info.count), 0)
        for s in self.slots.values():
            (warm if s.warm else active)[s.gpu] += 1
        return active, warm

    def _pick_gpu(self, want: int | None) -> tuple[int, bool] | None:
        """A GPU with a free slot, else one with room for a pre-warmed start: (gpu, warm).
        Call with self.lock. Pre-warmed commands go first (FIFO): a GPU with any is full."""
        self._promote()
        active, warm = self._load()
        gpus = [want] if want is not None else list(active)
        free = [g for g in gpus if active[g] < self.slots_per_gpu(g) and not warm[g]]
        if free:
            return min(free, key=lambda g: active[g]), False
        # A pre-warmed start takes a slot record too: never the last ones (then it queues).
        if len(self.slots) >= lib.KREX_MAX_SLOTS:
            return None
        room = [g for g in gpus if warm[g] < self.cfg.prewarm]
        return (min(room, key=lambda g: warm[g]), True) if room else None

    def _promote(self) -> None:
        """Give each GPU's free slots to its pre-warmed commands, oldest first (on every
        release and admission). Call with self.lock."""
        active, _ = self._load()
        for s in sorted((s for s in self.slots.values() if s.warm), key=lambda s: s.created):
            if active[s.gpu] >= self.slots_per_gpu(s.gpu):
                continue
            s.warm = False
            s.warm_s = round(time.time() - s.created, 6)
            active[s.gpu] += 1
            lib.krex_slot_set_warm(self.seg.raw, s.slot, 0)
            log.info("slot %d on gpu %d: pre-warmed, given the GPU after %.1f s", s.slot, s.gpu, s.warm_s)
            self.changed.notify_all()

    # ----------------------------------------------------------- the regions
    def _gpu_loop(self, gpu: int) -> None:
        """The GPU's worker: runs queued regions in FIFO order, and holds (waits for the end
        of, then closes) regions whose entry ran on the requesting connection's thread."""
        while True:
            with self.lock:
                while self.held[gpu] is None and (
                    self.stop.is_set() or self.current[gpu] is not None or not self.queues[gpu]
                ):
                    if self.stop.is_set() and self.current[gpu] is None:
                        return
                    self.changed.wait(0.5)
                held = self.held[gpu]
                if held is not None:
                    self.held[gpu] = None
                    req, steps = held
                else:
                    req = self.queues[gpu].pop()
                    if req.cancelled:
                        continue
                    self.current[gpu] = req
                    steps = self._region_steps(gpu, req)
            self._drive(gpu, req, steps, to_grant=False)

    def _enter_inline(self, gpu: int, req: Region) -> bool:
        """Run a region's entry on the requesting connection's thread when its GPU is idle
        and nobody queues (FIFO holds: nobody is overtaken): no hand-off to the GPU's worker
        and back before the grant. False when the GPU is busy: the caller queues it."""
        with self.lock:
            if self.stop.is_set() or self.current[gpu] is not None or self.queues[gpu]:
                return False
            self.current[gpu] = req
            self.queues[gpu].start_inline(req.tenant)
        steps = self._region_steps(gpu, req)
        if self._drive(gpu, req, steps, to_grant=True):
            # Granted: the worker holds the region from here (--max-region, END, the exit
            # steps). Handed over only after the reply went out (see _client).
            def hand_over() -> None:
                with self.lock:
                    if not self.stop.is_set():
                        self.held[gpu] = (req, steps)
                        self.changed.notify_all()
                        return
                # Stopping: the worker may be gone; finish here (shutdown ended the region).
                self._drive(gpu, req, steps, to_grant=False)

            req.after_reply = hand_over
        return True

    def _drive(self, gpu: int, req: Region, steps: Generator[None, None, None], to_grant: bool) -> bool:
        """Advance a region's steps: up to its grant (to_grant) or to its end. True when it
        stopped at the grant; once its steps are over, the GPU is free for the next one."""
        try:
            if to_grant:
                if next(steps, "done") is None:
                    return True
            else:
                for _ in steps:
                    pass
        except Exception as e:  # noqa: BLE001 - a bad region must never take the GPU's queue down
            log.exception("gpu %d: region of slot %d pid %d failed; gate reopened", gpu, req.slot, req.pid)
            req.grant = {
                "ok": False,
                "error": f"region failed: {type(e).__name__}: {e}",
                "fix": "see krexd.log; the gate was reopened",
            }
            req.granted.set()
            with contextlib.suppress(Exception):
                cur = self.seg.gate_word(gpu)
                if gate_owner(cur) == req.slot + 1:  # ours: never open someone else's gate
                    self.seg.open_gate(gpu, cur)
        with self.lock:
            # The GPU's exclusive time this region took (entry and region), charged to its
            # tenant before the next region is picked.
            used = float(req.record.get("entry_s") or 0.0) + float(req.record.get("region_s") or 0.0)
            self.queues[gpu].charge(req.tenant, used)
            self.current[gpu] = None
            self.regions_done += 1
            self.changed.notify_all()
        req.released.set()
        return False

    def _run_region(self, gpu: int, req: Region) -> None:
        """A region's steps from queue to journal, on the calling thread."""
        for _ in self._region_steps(gpu, req):
            pass

    def _acquire_gate(self, gpu: int, req: Region) -> int | None:
        """Take the gate for `req` with one compare-and-swap (krex_gate_acquire). While an
        operator pause holds it, wait; a pause whose lease ran out is taken over in the same
        CAS. None when the owner left or the daemon stops meanwhile."""
        gp = self.seg.raw.gpus[gpu]
        while not self.stop.is_set() and not req.ended.is_set():
            cur = int(gp.gate)
            expect = lib.KREX_GATE_OPEN
            if cur != lib.KREX_GATE_OPEN:
                h = self.seg.holder(gpu, cur)
                lapsed = h is not None and h[0] == lib.KREX_HOLDER_PAUSE and 0 < h[2] < int(lib.krex_now_ns())
                if lapsed:
                    expect = cur
                else:
                    lib.krex_futex_wait(ffi.addressof(gp, "gate"), cur, lib.KREX_GATE_RECHECK_NS)
                    continue
            try:
                return self.seg.close_gate(
                    gpu, req.slot, holder=lib.KREX_HOLDER_REGION, holder_pid=self.pid, expect=expect
                )
            except Busy:
                continue
        return None

    def _freeze_choice(
        self, owner: Slot | None, siblings: list[Slot]
    ) -> tuple[str, list[Slot], list[str], dict[int, tuple[int, str]]]:
        """(effective policy, the siblings to freeze, why each one under `gpu`, the sibling
        processes the gate does not hold: pid -> (slot, why)). The processes are judged
        under every policy: under `all` the unheld ones are frozen with the rest, and their
        queued work is still not KREX's to drain (_unheld_work)."""
        chosen = (owner.freeze if owner else None) or self.cfg.freeze_policy
        policy = freezepolicy.effective(chosen, owner.last_rate if owner else None)
        out: list[Slot] = []
        why: list[str] = []
        unheld: dict[int, tuple[int, str]] = {}
        inline = [freezepolicy.INSPECT_INLINE]  # shared by all siblings of this region
        for s in siblings:
            bad = freezepolicy.classify(self._group_pids(s), self.inspector, self._slot_ref(s), inline)
            unheld.update((pid, (s.slot, v.why)) for pid, v in bad if v.unheld)
            if s.kind == "orphan":  # registered in a segment krexd replaced: no gate holds them
                out.append(s)
                why.append(f"slot {s.slot}: processes of a command from before krexd restarted")
            elif bad:
                out.append(s)
                why.append(f"slot {s.slot}: " + "; ".join(v.why for _p, v in bad[:3]))
        if policy == "all":
            return policy, list(siblings), [], unheld
        return policy, out, why, unheld

    def _slot_ref(self, s: Slot) -> freezepolicy.SlotRef:
        """What the processes of slot `s` are judged against (freezepolicy.judge)."""
        raw = self.seg.raw
        addr = int(ffi.cast("uintptr_t", raw))
        if self._seg_id is None or self._seg_id[0] != addr:  # read once per segment krexd maps
            self._seg_id = (addr, freezepolicy.segment_id(addr))
        return freezepolicy.SlotRef(s.slot, s.generation, self.shm_name, self._seg_id[1], raw)

    def _region_steps(self, gpu: int, req: Region) -> Generator[None, None, None]:
        """The region protocol for one request. Yields once, right after the grant: the
        entry (block, stragglers, drain, freeze, pin) may run on one thread and the rest
        (hold until END or --max-region, thaw, open, journal) on another. Its try/finally
        spans both halves, so even a generator dropped at the grant closes its region."""
        # Each reason is (flag, text): the flag is a short code for machines (journal
        # "flags"), the text says what happened. Any reason makes the region contaminated:
        # never silently clean.
        reasons: list[tuple[str, str]] = []
        t: dict[str, float] = {"queue_wait_s": time.monotonic() - req.t_request}
        t0 = time.monotonic()
        t_entry_ns = time.monotonic_ns()
        with self.lock:  # held on to: `release` may drop the slot before the record is made
            owner_slot = self.slots.get(req.slot)
        word = self._acquire_gate(gpu, req)
        self.pending.unqueue(req)  # its gate is closed (or it was dropped): siblings park there now
        if word is None:  # the owner left while queued, or the daemon stops
            req.granted.set()
            return
        req.word = word
        t["block_s"] = time.monotonic() - t0
        frozen: list[Slot] = []
        evicted: cpus.Eviction | None = None
        evict_fut: concurrent.futures.Future[cpus.Eviction] | None = None
        at_close: list[Slot] = []  # this GPU's commands as the gate closed (lent cores)
        old_aff: list[int] | None = None
        region_s = thaw_s = 0.0
        t_grant_ns = t_end_ns = 0
        cut = False
        attest_entry: dict[str, Any] = {}
        attest: dict[str, Any] = {}
        fail_opens0 = 0
        fz: _FreezePlan | None = None
        sib_procs: set[tuple[int, int, int]] = set()
        sib_at_grant: set[tuple[int, int, int]] = set()
        core_watch: dict[Slot, list[coretime.CoreWatch]] = {}
        try:
            # Taken as the gate closes: a sibling that starts or ends its GPU work from here
            # on can overlap the region (sibling-context), entry included.
            sib_procs = self._sibling_gpu_procs(gpu, req.slot)
            self._boost_helpers(sib_procs)  # before the drain request: its acks come sooner
            if self.cfg.lend_cores != "off" or self.partition.degraded:
                # Others may run on the region core (lent, or a degraded partition): move every
                # thread of this GPU's commands but the measuring one off it, while the siblings
                # drain (as a step of its own it took 2-7 ms at p95 on the H200, final6). The
                # frozen ones too: which those are is decided later, and the move costs them
                # nothing. A command admitted from here on starts frozen.
                with self.lock:
                    at_close = [s for s in self.slots.values() if s.gpu == gpu]
                reserved0 = self.partition.slice_for(gpu).reserved
                evict_fut = self.pool.submit(
                    lambda: cpus.evict([p for s in at_close for p in self._group_pids(s)], reserved0, req.tid)
                )
            r = self.seg.wait_inflight(gpu, req.slot, self.cfg.drain_timeout_s)
            t["inflight_s"] = r.seconds
            waits = {"wait_inflight": r.stats}
            if not r.ok:
                reasons.append(
                    (
                        "inflight-timeout",
                        f"in-flight submissions of pids {r.stragglers} did not finish (a call still "
                        "running, or a thread that left a GPU call abnormally: its calls are not gated)",
                    )
                )
            # Each sibling is frozen as soon as it has drained, while the others still
            # drain: entry pays the slowest drain plus one freeze, not every drain then
            # every freeze. The plan is made right after the drain request (its checks
            # run while the GPU finishes the siblings' queued work).
            fz = _FreezePlan(self, gpu, req.slot, frozen, stuck=() if r.ok else r.stragglers)
            waited_on: list[str] = []  # where the siblings a slow drain waits for are

            def slow_drain(owing: set[int]) -> None:
                for p in sorted(owing)[:3]:
                    b = self.seg.proc_brief(p) or {}
                    helper = procfs.thread_line(p, b["helper_tid"]) if b.get("helper_tid") else "helper -"
                    waited_on.append(
                        f"pid {p}: in flight {b.get('inflight')}, LIFE {b.get('life_inflight')}; "
                        f"helper {helper}; main {procfs.thread_line(p, p)}"[:500]
                    )

            # Under `all` (and `adaptive`, which may pick it) every sibling drains, quiet or
            # not: a process whose work the hooks cannot see (a static CUDA runtime in a
            # library it loaded) is covered there, as its freeze covers its later work.
            policy0 = (owner_slot.freeze if owner_slot is not None else "") or self.cfg.freeze_policy
            r = self.seg.drain(
                gpu,
                req.slot,
                self.cfg.drain_timeout_s,
                on_progress=fz.progress,
                on_slow=slow_drain,
                full=policy0 != "gpu",
            )
            t["drain_s"] = r.seconds
            fz.unboost()
            drain_slow = sorted(([p, round(s * 1e3, 1)] for p, s in r.acks.items()), key=lambda x: -x[1])[:3]
            waits["wait_drain"] = r.stats
            drained = r.count
            if not r.ok:
                # Where their threads are (a helper stuck in the driver or the loader): the log
                # has all of it, the reason the first straggler's.
                detail = [procfs.thread_report(p) for p in r.stragglers[:4]]
                for line in detail:
                    log.warning("drain straggler: %s", line)
                reasons.append(
                    (
                        "drain-timeout",
                        f"pids {r.stragglers} did not ack the drain within {self.cfg.drain_timeout_s:g}s "
                        f"({detail[0][:600] if detail else '-'})",
                    )
                )
            if r.partial:
                reasons.append(
                    (
                        "drain-partial",
                        f"pids {r.partial} were capturing a CUDA graph; their earlier work was not drained",
                    )
                )
            unrec = {n: c for n, c in self._unrecorded(gpu).items() if n != req.slot}  # its own are its own
            if unrec:
                reasons.append(
                    (
                        "drain-unknown",
                        f"{sum(unrec.values())} process(es) of slot(s) {sorted(unrec)} that krexd cannot "
                        f"account for (no free process record, all {lib.KREX_MAX_PROCS} taken, or a pid "
                        "namespace of their own): their queued GPU work may not have been drained",
                    )
                )
            t1 = time.monotonic()
            # Siblings that came (or a plan never made) since the first progress call.
            fz.progress(set(), final=True)
            owner, policy, why, running_all = fz.owner, fz.policy, fz.why, fz.siblings
            if fz.life_unfrozen:
                reasons.append(
                    (
                        "life-running",
                        f"pids {sorted(set(fz.life_unfrozen))} were inside a context, module or device "
                        "memory call and belong to no command krexd can freeze",
                    )
                )
            freeze_ms: dict[str, float] = {}
            freeze_slow: dict[str, list[str]] = {}
            for s, f in fz.futs.items():
                try:
                    freeze_ms[str(s.slot)] = round(f.result() * 1e3, 1)
                    if s.group.slow:
                        freeze_slow[str(s.slot)] = s.group.slow
                except (KrexError, OSError) as e:  # OSError: the group vanished mid-freeze
                    with self.lock:
                        gone = s.slot not in self.slots  # the command ended meanwhile: nothing to freeze
                    if not gone:
                        reasons.append(("freeze-failed", f"slot {s.slot} did not freeze: {e}"))
            t["freeze_s"] = time.monotonic() - t1  # what the freeze added after the drain
            # What the siblings the gate does not hold queued before their freeze: no drain
            # reaches it. Waited for where the device shows it, else flagged (unheld.py).
            more, t["unheld_wait_s"] = unheldwork.queued_work(
                self.info.kind, self.attestor, gpu, self._phys(gpu), fz.unheld, self.cfg.drain_timeout_s,
                self._sim_shm_of,
            )  # fmt: skip
            reasons.extend(more)
            # A sibling already inside the kernel's exit cannot be frozen, and its contexts'
            # teardown runs on the GPU: wait for it to be gone, so it ends before the grant.
            t3 = time.monotonic()
            exiting, waited_exit = self._await_exits(gpu, req.slot)
            t["exit_wait_s"] = time.monotonic() - t3
            # A process that ended just before (reaped, so out of every record) may still be
            # torn down by the driver: NVML lists it meanwhile. Waited out, not flagged.
            t3 = time.monotonic()
            waited_exit |= self._await_teardowns(gpu)
            t["teardown_wait_s"] = time.monotonic() - t3
            if exiting:
                reasons.append(
                    (
                        "sibling-context",
                        f"sibling pids {sorted(exiting)} were still exiting {self.cfg.freeze_timeout_s:g}s "
                        "after the gate closed: their contexts' teardown may run inside the region",
                    )
                )
            # The processes that ended during entry ended before the grant; their teardown
            # is over, the scrubbing of their memory is what _settle waits out.
            sib_at_grant = self._sibling_gpu_procs(gpu, req.slot)
            # So did a free of a sibling frozen right after its driver call (no closing stamp).
            ended_pids = waited_exit | {p for p, _s, _t in sib_procs - sib_at_grant}
            freeing = self.seg.frees_inflight(gpu, req.slot)
            ended_ns = time.monotonic_ns() if ended_pids or freeing else 0
            # Sized by what they held (NVML), where it said; a free seen only in flight is not.
            ended_settle = None if freeing else self.attestor.settle_ns(ended_pids)
            t2 = time.monotonic()
            reserved = self.partition.slice_for(gpu).reserved
            try:
                old_aff = cpus.pin_thread(req.tid, reserved)
            except KrexError as e:
                reasons.append(("pin-failed", f"could not pin thread {req.tid}: {e}"))
            if evict_fut is not None:  # the move off the region core, started as the gate closed
                evicted, evict_fut = evict_fut.result(), None
                reasons.extend(self._evict_again(req, at_close, frozen, reserved, evicted))
            t["pin_s"] = time.monotonic() - t2
            reasons.extend(self._trust_checks(gpu, req, t_entry_ns))
            reasons.extend(self._settle(gpu, req.slot, ended_ns, t, ended_settle))
            core_watch, more = self._watch_region_core(gpu, req, frozen, reserved)
            reasons.extend(more)
            t["entry_s"] = time.monotonic() - t0
            req.grant = {
                "ok": True,
                "gpu": gpu,
                "slot": req.slot,
                **{k: round(v, 6) for k, v in t.items()},
                "drained": drained,
                **waits,  # how each wait ended: wake-ups versus re-checks without one
                "frozen_slots": [s.slot for s in frozen],
                "freeze_policy": policy,
                "frozen_early": fz.early,  # frozen while other siblings still drained
                # What entry waited for: the last acks (pid, ms), where the siblings that
                # owed one 25 ms in were, each freeze's time, and threads a slow one waited for.
                "drain_slow": drain_slow,
                "drain_waited_on": waited_on,
                "lent_priority": fz.lent if fz is not None else [],
                "freeze_ms": freeze_ms,
                "freeze_slow": freeze_slow,
                "evicted_threads": len(evicted.moved) if evicted is not None else 0,
                "running_slots": sorted(s.slot for s in set(running_all) - set(frozen)),
                "freeze_why": why,
                # Sibling processes the gate does not hold (all frozen): [pid, slot, why].
                "unheld": [[p, sl, w] for p, (sl, w) in sorted(fz.unheld.items())[:8]],
                "reserved_cpus": reserved,
                "contaminated": bool(reasons),
                "reasons": [text for _f, text in reasons],
                "flags": sorted({f for f, _t in reasons}),
                "freezer": self.freezer.name,
                "partition_degraded": self.partition.degraded,
                "device": self.info.kind,
            }
            if req.label:
                req.grant["label"] = req.label
            req.grant["tenant"] = req.tenant
            fail_opens0 = int(self.seg.raw.gpus[gpu].fail_opens)
            t_grant = time.monotonic()
            adaptive = owner is not None and (owner.freeze or self.cfg.freeze_policy) == "adaptive"
            sub0 = self.seg.slot_submits(req.slot) if adaptive else 0
            t_grant_ns = time.monotonic_ns()
            req.granted.set()
            yield
            # Who was ours at the start: a sibling that is not frozen (gpu policy) may end
            # during the region, and NVML still lists it; it was never foreign. Kept with
            # each process's start time: a pid reused meanwhile is another process.
            known_at_entry = (
                {p: int(lib.krex_pid_start_ticks(p)) for p in self._known_pids()}
                if self.attestor.nvml is not None
                else {}
            )
            attest_entry = self.attestor.sample(gpu)
            own_at_entry = self._own_pids(req)
            if not req.ended.wait(self.cfg.max_region_s):
                req.end_reason = f"max-region ({self.cfg.max_region_s:g}s)"
                cut = True
                reasons.append(
                    (
                        "cut",
                        f"cut by --max-region after {self.cfg.max_region_s:g}s: what the owner ran after "
                        "that was not protected",
                    )
                )
            t_end_ns = time.monotonic_ns()
            region_s = time.monotonic() - t_grant
            reasons.extend(self._region_core_time(core_watch, reserved))
            sib_procs_end = self._sibling_gpu_procs(gpu, req.slot)  # first: the timing is over
            if adaptive and owner is not None and region_s > 0:
                owner.last_rate = (self.seg.slot_submits(req.slot) - sub0) / region_s
            # What could have disturbed the region while it ran.
            fail_opens = int(self.seg.raw.gpus[gpu].fail_opens) - fail_opens0
            if fail_opens > 0:
                reasons.append(
                    (
                        "fail-open",
                        f"{fail_opens} sibling call(s) stopped waiting at the closed gate and went on",
                    )
                )
            reasons.extend(self._trust_checks(gpu, req, t_grant_ns))
            attest_exit = self.attestor.sample(gpu)
            attest, more = self.attestor.judge(
                gpu,
                attest_entry,
                attest_exit,
                lambda: _same_processes(known_at_entry) | self._known_pids(),
                {p: w for p, (_sl, w) in fz.unheld.items()},
            )
            reasons.extend(more)
            skip = own_at_entry | self._own_pids(req) | {f["pid"] for f in attest.get("foreign") or []}
            reasons.extend(
                self._context_changes(
                    gpu, sib_procs, sib_at_grant, sib_procs_end, attest_entry, attest_exit, skip
                )
            )
            if evicted is not None:
                reasons.extend(self._audit_region_core(req, at_close, frozen, reserved))
            stalled = self._stalled_during(t0, time.monotonic())
            if stalled:
                reasons.append(
                    (
                        "daemon-stalled",
                        f"krexd stalled for {stalled:.2f}s during the region (stopped or starved): guardians "
                        "thawed their commands and shims failed open meanwhile",
                    )
                )
        finally:
            for ws in core_watch.values():  # (entry failed after they started)
                for w in ws:
                    w.stop()
            if fz is not None:
                fz.unboost()  # (the drain raised)
            if old_aff is not None:
                with contextlib.suppress(KrexError):
                    cpus.restore_thread(req.tid, old_aff)
                if owner_slot is not None:  # else they would keep the region core for good
                    known = evicted.seen if evicted else set()
                    cpus.unpin_inherited(self._group_pids(owner_slot), reserved, old_aff, req.tid, known)
            if evict_fut is not None:  # entry ended early: put back what the move did
                with contextlib.suppress(Exception):
                    evicted = evict_fut.result()
            cpus.restore_evicted(evicted)
            if evicted is not None:
                # Threads and processes that moved ones started during the region inherited
                # the narrowed mask: else a long-running command would lose the lent cores.
                with contextlib.suppress(KrexError):
                    full = self.partition.command_cpus(gpu, self.cfg.lend_cores)
                    pids = [p for s in at_close for p in self._group_pids(s)]
                    res = self.partition.slice_for(gpu).reserved
                    # Not those that were there as the gate closed (a narrowed mask there is the
                    # command's own) nor the moved ones (restore_evicted's).
                    skip = evicted.before | {tid for tid, _old, _new in evicted.moved} | {req.tid}
                    cpus.unnarrow(pids, res, full, skip, pinned=False)
            t3 = time.monotonic()
            if fz is not None:
                # A freeze still running (an error ended the entry early) would undo the thaw
                # below and leave its sibling frozen: let every started freeze end first.
                concurrent.futures.wait(list(fz.futs.values()), timeout=self.cfg.freeze_timeout_s + 1)
            with self.lock:  # slots admitted during the region started frozen: thaw them too
                req.thawing = True
                late = [
                    s for s in self.slots.values() if s.gpu == gpu and s.slot != req.slot and s not in frozen
                ]
            for f in [self.pool.submit(s.group.thaw) for s in [*frozen, *late]]:
                with contextlib.suppress(KrexError, OSError):
                    f.result()
            thaw_s = time.monotonic() - t3
            if not self.seg.open_gate(gpu, word):
                reasons.append(
                    ("gate-lost", f"the gate of GPU {gpu} no longer held this region's word at its end")
                )
            if fz is not None and t_end_ns:  # after the gate opened: the next region need not wait
                reasons.extend(self._unheld_at_end(fz, frozen))
            reasons = list(dict.fromkeys(reasons))  # the end-of-region checks may repeat the grant's
            if not req.granted.is_set():  # failed before the grant: tell the owner why
                req.grant = {"ok": False, "error": "region setup failed", "reasons": [x for _f, x in reasons]}
                req.granted.set()
        rec = {
            "ts": time.time(),
            "gpu": gpu,
            "owner_slot": req.slot,
            "owner_pid": req.pid,
            "tid": req.tid,
            # The command that held it, for `krex journal` (None once its process is gone).
            "cmd": procfs.cmdline(req.pid, 200),
            **req.grant,
            "region_s": round(region_s, 6),
            "thaw_s": round(thaw_s, 6),
            "end": req.end_reason or "end",
            "siblings_frozen": len(frozen),
            "t_grant_ns": t_grant_ns,
            "t_end_ns": t_end_ns,
            "cut": cut,
            # The verdict at the end: the grant's reasons plus what happened inside.
            "contaminated": bool(reasons),
            "reasons": [text for _f, text in reasons],
            "flags": sorted({f for f, _t in reasons}),
            "attest": attest,
        }
        rec.pop("ok", None)
        if owner_slot is not None and owner_slot.placement is not None and owner_slot.placement.note:
            rec["cgroup_fallback"] = owner_slot.placement.note.removeprefix("krex: warning: ")
        req.record = rec
        if owner_slot is not None:
            with self.lock:  # read by the release's reply
                optin.region_tally([rec], owner_slot.tally)
                optin.auto_labels([rec], owner_slot.auto_labels)
                if len(owner_slot.records) < RELEASE_MAX_RECORDS:
                    owner_slot.records.append(rec)
                else:  # counted (tally), not listed: bounded memory per slot
                    owner_slot.records_dropped += 1
        self._log_region(rec)
        self._journal(rec)

    def _journal(self, rec: dict[str, Any]) -> None:
        """Append a region record. A journal that cannot be written (a directory in
        its place, a full disk) never stops regions: the error is logged once and
        shown by `krex daemon status`."""
        with self._journal_lock:
            try:
                journal.append(self.journal_path, rec)
            except (OSError, KrexError) as e:
                msg = f"cannot write the journal {self.journal_path}: {e}"
                if msg != self.journal_error:
                    log.error("%s; regions are not journaled until it is fixed", msg)
                self.journal_error = msg
            else:
                if self.journal_error:
                    log.warning("the journal %s is writable again", self.journal_path)
                self.journal_error = None

    def _log_region(self, rec: dict[str, Any]) -> None:
        who = f"gpu {rec['gpu']}: region of slot {rec['owner_slot']} pid {rec['owner_pid']} tid {rec['tid']}"
        if rec.get("contaminated"):
            log.warning("%s granted CONTAMINATED: %s", who, "; ".join(rec.get("reasons", [])))
        end = rec.get("end", "end")
        if end != "end":
            log.warning("%s ended by force: %s after %.3f s", who, end, rec.get("region_s", 0.0))
        else:
            log.debug(
                "%s: entry %.2f ms, %.3f s, %d sibling(s) frozen",
                who,
                1e3 * rec.get("entry_s", 0.0),
                rec.get("region_s", 0.0),
                rec.get("siblings_frozen", 0),
            )

    def _phys(self, gpu: int) -> int:
        return self.info.physical[gpu] if gpu < len(self.info.physical) else gpu

    def _sim_shm_of(self, pid: int) -> str | None:
        """The simulated device a process uses (its KREX_SIM_SHM), where krexd read it."""
        f = self.inspector.facts(pid, inspect=False)
        v = f.env.get(b"KREX_SIM_SHM") if f is not None else None
        return v.decode(errors="replace") if v else None

    def _unheld_at_end(self, fz: _FreezePlan, frozen: list[Slot]) -> list[tuple[str, str]]:
        """The siblings a region did not freeze, judged again at its end: a process of
        theirs the gate does not hold now (one that exec'd without the shim, or started
        during the region) may have run GPU work inside it."""
        with self.lock:
            running = [
                s for s in dict.fromkeys(fz.siblings) if s not in frozen and self.slots.get(s.slot) is s
            ]
        bad: dict[int, tuple[int, str]] = {}
        for s in running:
            for pid, v in freezepolicy.classify(self._group_pids(s), self.inspector, self._slot_ref(s)):
                if v.unheld:
                    bad[pid] = (s.slot, v.why)
        if not bad:
            return []
        return [
            (
                unheldwork.FLAG,
                f"at the region's end, sibling processes the gate does not hold ran in commands it did not "
                f"freeze ({unheldwork.describe(bad)}): GPU work of theirs may have run inside it",
            )
        ]

    def _trust_checks(self, gpu: int, req: Region, since_ns: int) -> list[tuple[str, str]]:
        """Run before the grant and again at the region's end: the segment is krexd's own and
        intact, and nothing that lived through an incident could have disturbed the region."""
        self._guard_tick()
        segment = [("segment", text) for text in self.guard.flag(since_ns, self._own_pids(req))]
        return segment + self.mps.flags(gpu, since_ns)

    def _frees_since(self, gpu: int, owner_slot: int, since_ns: int) -> list[tuple[int, int]]:
        """(slot, ns ago) of other commands' slots whose processes freed GPU memory, or exited
        after setting some up, at or after `since_ns` (CLOCK_MONOTONIC, as krex_now_ns). The
        stamps outlive those processes and commands; the owner's slot counts when the stamp is
        of another command that had its number before."""
        gen = self._owner_gen(owner_slot)
        slots, ago = ffi.new("int32_t[64]"), ffi.new("uint64_t[64]")
        n = min(int(lib.krex_recent_frees(self.seg.raw, gpu, owner_slot, gen, since_ns, slots, ago, 64)), 64)
        return [(int(slots[i]), int(ago[i])) for i in range(n)]

    def _owner_gen(self, owner_slot: int) -> int:
        with self.lock:
            s = self.slots.get(owner_slot)
        return s.generation if s is not None else int(self.seg.raw.slots[owner_slot].generation)

    def _settle_until(self, gpu: int, owner_slot: int) -> tuple[int, int]:
        """(until when the GPU may still clear memory other commands freed, the newest of
        their stamps): each slot's stamp carries its own time, sized by the bytes freed where
        the shim could ask the driver, else KREX_FREE_SETTLE_NS (krex_settle_until)."""
        latest = ffi.new("uint64_t *")
        gen = self._owner_gen(owner_slot)
        until = int(lib.krex_settle_until(self.seg.raw, gpu, owner_slot, gen, 0, latest))
        return until, int(latest[0])

    def _running_pids(self, at_close: list[Slot], frozen: list[Slot]) -> dict[Slot, list[int]]:
        """The processes of the commands that were on the GPU as the gate closed, still live
        and not frozen."""
        with self.lock:
            running = [s for s in at_close if s not in frozen and s.slot in self.slots]
        return {s: self._group_pids(s) for s in running}

    def _evict_again(
        self, req: Region, at_close: list[Slot], frozen: list[Slot], reserved: list[int], ev: cpus.Eviction
    ) -> list[tuple[str, str]]:
        """At the grant, after the move started as the gate closed: move the threads and
        processes made meanwhile (looking only at those), and freeze a running sibling with a
        thread pinned to the region core alone (which no move can take off it). The owner's
        own such thread is flagged: it shares the core with the measuring thread."""
        pids = self._running_pids(at_close, frozen)
        cpus.evict([p for ps in pids.values() for p in ps], reserved, req.tid, into=ev)
        out: list[tuple[str, str]] = []
        for s, ps in pids.items():
            stuck = sorted(set(ps) & ev.stuck)
            if not stuck:
                continue
            if s.slot == req.slot:
                out.append(("region-core", f"the owner's pids {stuck} have threads pinned to the region core "
                             f"{cpus.format_cpulist(reserved)}, which the measuring thread shares"))
                continue
            frozen.append(s)  # thawed with the others at the end, whatever happens
            try:
                s.group.freeze(self.cfg.freeze_timeout_s)
            except (KrexError, OSError) as e:
                with self.lock:
                    gone = s.slot not in self.slots
                if not gone:
                    out.append(("freeze-failed", f"slot {s.slot} (threads pinned to the region core) did not "
                                 f"freeze: {e}"))
        return out

    def _watch_region_core(
        self, gpu: int, req: Region, frozen: list[Slot], reserved: list[int]
    ) -> tuple[dict[Slot, list[coretime.CoreWatch]], list[tuple[str, str]]]:
        """At the grant: start counting the time each running sibling's processes (its slot's
        cgroup, every process that comes and goes in it) spend on the region core. Where
        that cannot be counted the region says so if a running sibling might use the core
        (lent, or a degraded partition that shares it)."""
        with self.lock:
            running = [
                s for s in self.slots.values() if s.gpu == gpu and s.slot != req.slot and s not in frozen
            ]
        if not running or not reserved:
            return {}, []
        if self.core_watch_off:
            if self.cfg.lend_cores != "off" and not self.partition.degraded:
                return {}, [("region-core", f"the running siblings' time on the region core cannot be "
                             f"counted ({self.core_watch_off})")]
            return {}, []
        out: dict[Slot, list[coretime.CoreWatch]] = {}
        failed: list[str] = []
        for s in running:
            try:
                if s.core_watch is None:
                    s.core_watch = coretime.watch(s.group.path, reserved)
                for w in s.core_watch:
                    w.start()
                out[s] = s.core_watch
            except (KrexError, OSError) as e:
                with self.lock:
                    if s.slot in self.slots:  # (a slot released meanwhile has nothing left to run)
                        failed.append(f"slot {s.slot}: {e}")
        if not failed:
            return out, []
        return out, [("region-core", "the time some running siblings spend on the region core cannot be "
                      f"counted: {'; '.join(failed)}")]

    def _region_core_time(
        self, watches: dict[Slot, list[coretime.CoreWatch]], reserved: list[int]
    ) -> list[tuple[str, str]]:
        """At the region's end: a running sibling whose processes ran on the region core while
        the region did (one that pinned itself there after the move, a child it started that
        did and ended meanwhile) shared it with the measuring thread."""
        found = []
        for s, ws in list(watches.items()):
            used = [w.stop() for w in ws]
            ns = sum(u.ns for u in used)
            if ns:
                pids = sorted({p for u in used for p in u.pids})
                found.append(f"slot {s.slot} {ns / 1e6:.2f} ms (pids {pids[:8] or 'not sampled'})")
        watches.clear()
        if not found:
            return []
        core = cpus.format_cpulist(reserved)
        return [("region-core", f"processes of running siblings ran on the region core {core} during the "
                 f"region: {', '.join(found)} (those ended by its end included); they shared it with the "
                 "measuring thread")]

    def _audit_region_core(
        self, req: Region, at_close: list[Slot], frozen: list[Slot], reserved: list[int]
    ) -> list[tuple[str, str]]:
        """At the end, before the moved threads get their masks back: a thread of a running
        command (the owner's but the measuring one, or a sibling's) that may run on the
        region core now could have during the region (its command re-widened its mask, or a
        process or thread came after the moves). Commands admitted during the region
        started frozen and are not looked at."""
        pids = self._running_pids(at_close, frozen)
        own = [p for s, ps in pids.items() if s.slot == req.slot for p in ps]
        bad = cpus.audit([p for ps in pids.values() for p in ps], reserved, req.tid, pinned_ok=own)
        if not bad:
            return []
        what = ", ".join(f"pid {p} ({len(t)} thread(s))" for p, t in sorted(bad.items())[:4])
        core = cpus.format_cpulist(reserved)
        return [("region-core", f"threads that may run on the region core {core} were found at the "
                 f"region's end: {what}; they could have shared it with the measuring thread")]

    def _settle(
        self,
        gpu: int,
        owner_slot: int,
        ended_ns: int,
        t: dict[str, float],
        ended_settle_ns: int | None = None,
    ) -> list[tuple[str, str]]:
        """The driver clears freed memory on the GPU after the freeing call returned (or the
        process ended), on a copy-engine channel of its own that no drain orders: wait until
        each other command's latest free may be cleared (its stamp's own time: the bytes it
        freed at KREX_SETTLE_NS_PER_GB where the shim could size it, else
        KREX_FREE_SETTLE_NS), and since `ended_ns` (siblings seen gone during entry) until
        `ended_settle_ns` (sized by the memory they held, Attestor.settle_ns) or else the
        fixed time. Then flag `recent-free` only for frees made meanwhile (no sibling can
        free through a gated call now: a path the gate does not see)."""
        settle = int(lib.KREX_FREE_SETTLE_NS)
        t0 = time.monotonic_ns()
        until, newest = self._settle_until(gpu, owner_slot)
        latest = max(ended_ns, newest)
        if ended_ns:
            after_end = settle if ended_settle_ns is None else ended_settle_ns
            until = max(until, ended_ns + after_end)
            t["ended_settle_s"] = after_end / 1e9
        if until > t0:
            time.sleep((until - t0) / 1e9)
        t["settle_s"] = (time.monotonic_ns() - t0) / 1e9
        new = self._frees_since(gpu, owner_slot, max(latest + 1, time.monotonic_ns() - settle))
        if not new:
            return []
        what = ", ".join(f"slot {s} {ago / 1e6:.0f} ms" for s, ago in new)
        return [
            (
                "recent-free",
                f"other commands freed GPU memory or ended just before the grant ({what} before it), "
                "after krexd had waited for the earlier frees to settle: the driver clears freed memory "
                "on the GPU after the fact",
            )
        ]

    def _await_exits(self, gpu: int, owner_slot: int) -> tuple[set[int], set[int]]:
        """Wait (at most freeze_timeout_s) for sibling processes inside the kernel's exit
        (PF_EXITING, not yet zombies): the freezer cannot stop them, and closing their GPU
        files tears their contexts down on the GPU. Returns (those still exiting at the
        deadline, those it waited for)."""
        probe = lambda: self.seg.exiting(gpu, owner_slot)  # noqa: E731
        return _wait_out(probe, 0.002, self.cfg.freeze_timeout_s, self.stop)

    def _await_teardowns(self, gpu: int) -> set[int]:
        """Wait (at most freeze_timeout_s) while NVML lists a process that has ended: its
        contexts' teardown still runs on the GPU (H200: a sibling reaped just before a grant
        was still listed by NVML, and its region was flagged `foreign-process`). One still
        listed at the deadline is flagged by the attestation. Those it waited for."""
        probe = lambda: self.attestor.listed_gone(gpu)  # noqa: E731
        return _wait_out(probe, 0.005, self.cfg.freeze_timeout_s, self.stop)[1]

    def _sibling_gpu_procs(self, gpu: int, owner_slot: int) -> set[tuple[int, int, int]]:
        """(pid, start time, drain-helper thread) of the other commands' live processes on
        `gpu` that made GPU calls, and of released slots' leftovers: one C pass over the
        records (krex_sibling_procs)."""
        n = lib.KREX_MAX_PROCS
        buf = ffi.new("struct krex_proc_id[]", n)
        got = min(int(lib.krex_sibling_procs(self.seg.raw, gpu, owner_slot, buf, n)), n)
        return {(int(buf[i].pid), int(buf[i].start_ticks), int(buf[i].helper_tid)) for i in range(got)}

    def _boost(self, pid: int, tid: int, name: str | None = None) -> int | None:
        """cpus.boost to helper_nice; None if off, refused (not root: warned once, then
        off), not needed, or `pid` is not of krexd's own user: its records and thread names
        are the command's to write, and raising one's nice back a little needs no privilege,
        so another user's command could keep a boost for good (a shared daemon, `group`)."""
        want = self.cfg.helper_nice
        if want >= 0 or not self._boost_ok or not tid:
            return None
        try:
            if os.stat(f"/proc/{pid}").st_uid != os.geteuid():
                return None
        except OSError:
            return None
        try:
            return cpus.boost(pid, tid, want, name)
        except PermissionError as e:
            self._boost_ok = False
            log.warning(
                "cannot renice threads a region waits for to %d (%s): region entry may wait behind "
                "siblings' CPU work; run krexd as root, or set helper_nice 0",
                want,
                e.strerror,
            )
            return None

    def _boost_helpers(self, procs: Iterable[tuple[int, int, int]]) -> None:
        """Renice the drain helpers of `procs` (pid, start, helper tid) to helper_nice, each
        once: a region's entry waits for every sibling's ack, and a helper at its command's
        nice 0 waited runnable behind that command's CPU-bound threads (H200, CPU-heavy
        family). Only a thread of that pid named krex-drain (a helper tid outlives its
        thread across an exec); only processes of krexd's own user (_boost)."""
        if self.cfg.helper_nice >= 0 or not self._boost_ok:
            return
        with self._boost_lock:
            new = [k for k in procs if k[2] and k not in self._boosted]
        for pid, _st, tid in new:
            self._boost(pid, tid, "krex-drain")
        if new:
            with self._boost_lock:
                self._boosted.update(new)
                if len(self._boosted) > 4 * lib.KREX_MAX_PROCS:  # bounded: forget the dead
                    self._boosted = {k for k in self._boosted if os.path.exists(f"/proc/{k[0]}/task/{k[2]}")}

    def _own_pids(self, req: Region) -> set[int]:
        """The owner and its command's whole process tree (slot group)."""
        with self.lock:
            s = self.slots.get(req.slot)
        return {req.pid, *(self._group_pids(s) if s is not None else [])}

    def _context_changes(
        self,
        gpu: int,
        before: set[tuple[int, int, int]],
        at_grant: set[tuple[int, int, int]],
        after: set[tuple[int, int, int]],
        nvml_entry: dict[str, Any],
        nvml_exit: dict[str, Any],
        skip: set[int],
    ) -> list[tuple[str, str]]:
        """A sibling process that started or ended its GPU work (or exec'd) between the
        gate's closing and the region's end. Setting up or tearing down a GPU context
        (allocations, page tables, scrubbing the memory freed at exit) runs on the GPU
        outside any gated call: under a policy that leaves siblings running it slowed
        kernels over 10 ms by up to 16% in regions that read clean (H200,
        docs/results/h200/goal-run). Frozen siblings cannot; one killed while frozen is
        flagged too. NVML adds processes with a context but no gated call that it listed
        at only one end (`skip`: the owner's own and those already flagged foreign). Not
        seen: such a process that comes and goes between the two NVML samples. `before` is
        taken as the gate closed (a start from then on may have set up a context through a
        path the gate does not see), `at_grant` at the grant: a process that ended before the
        grant was torn down before it (its memory's scrubbing is _settle's)."""
        ent, ext = set(nvml_entry.get("procs") or []), set(nvml_exit.get("procs") or [])
        known_before = {p for p, _s, _t in before}
        # A newcomer registers at its first gated call, which then waits at the closed gate:
        # it has run nothing on the GPU unless a context of its own came first through an
        # ungated path, which completes before that call, so NVML lists it at the end. Not
        # flagged when NVML answered and does not list it (on the H200 every `sibling-context`
        # flag under `gpu` was such a start, docs/results/h200/final). An exec'd process (same
        # pid, new image) still is.
        nvml_ok = "procs" in nvml_exit
        started = {p for p, _s, _t in after - before if p in known_before or not nvml_ok or p in ext}
        ended = {p for p, _s, _t in at_grant - after}
        started |= (ext - ent) - skip
        ended |= (ent - ext) - skip
        if not ended and not started:
            return []

        def some(ps: set[int]) -> str:
            xs = sorted(ps)
            return ", ".join(map(str, xs[:5])) + (" ..." if len(xs) > 5 else "")

        what = "; ".join(f"{k} pid {some(ps)}" for k, ps in (("started", started), ("ended", ended)) if ps)
        return [
            (
                "sibling-context",
                f"sibling processes on GPU {gpu} started or ended their GPU work during the region ({what}): "
                "a GPU context's set-up and teardown run on the GPU outside the gate",
            )
        ]

    def _known_pids(self) -> set[int]:
        """Every process KREX knows on this node: slot trees, registered processes, itself."""
        with self.lock:
            slots = list(self.slots.values())
        pids = {self.pid}
        for s in slots:
            pids.update(self._group_pids(s))
        for n in {int(lib.KREX_PROC_STALE), *range(lib.KREX_MAX_SLOTS)}:
            pids.update(self.seg.slot_pids(n))
        return pids

    # ----------------------------------------------------------- the clients
    def _role(self, pid: int, uid: int, gid: int) -> str | None:
        """The sharing model (docs/architecture.md, threat model): "owner" (root or
        the daemon's user: everything), "member" (in the sharing group, as primary or
        supplementary group: run commands, regions, status; not stop), else None."""
        if uid in (0, os.geteuid()):
            return "owner"
        if self.share_gid in _peer_groups(pid, gid):
            return "member"
        return None

    def _serve(self, c: conns.Conn) -> None:
        """Serve the requests `c` has sent, on this thread; then hand it back to the loop to
        wait for its next one, or, at its end, undo what it owned and close it."""
        conn = c.sock
        keep = False
        try:
            # Blocking, with a kernel send timeout: a Python socket timeout would make
            # every recv poll first, _peer_closed's MSG_DONTWAIT peek included.
            conn.setblocking(True)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _SNDTIMEO)
            while not self.stop.is_set():
                try:
                    m = c.reader.buffered()
                except ProtocolError as e:
                    conn.sendall(encode_reply(e.op, _error(e)))
                    if e.fatal:
                        return
                    continue
                if m is None:
                    if c.eof and c.reader.buf:
                        got, c.reader.buf = len(c.reader.buf), b""
                        cut = ProtocolError(f"truncated frame ({got} bytes, then end of stream)", fatal=True)
                        conn.sendall(encode_reply(cut.op, _error(cut)))
                    keep = not c.eof
                    return
                c.spoke = True
                self._handle(c, m)
        except OSError:
            pass
        finally:
            if keep and not self.stop.is_set():
                self._loop.give_back(c)
            else:
                self._disconnect(c.pid, c.owned)
                with contextlib.suppress(OSError):
                    conn.close()
                self._loop.forget(c)

    def _handle(self, c: conns.Conn, m: Any) -> None:
        """One request of `c`: its handler, then its reply."""
        conn, pid, owned = c.sock, c.pid, c.owned
        msg = m.to_dict()
        try:
            reply = HANDLERS[m.op.name](self, conn, pid, msg, owned)
        except KrexError as e:
            reply = _error(e)
        except Exception as e:  # noqa: BLE001 - a bad request must never kill its connection thread
            log.error("request %.200r from pid %d failed: %s: %s", msg, pid, type(e).__name__, e)
            reply = {
                "ok": False,
                "error": f"internal error: {type(e).__name__}: {e}",
                "kind": "KrexError",
                "fix": "see krexd.log",
            }
        if reply is None:
            return
        try:
            try:
                frame = encode_reply(m.op.code, reply)
            except KrexError as e:  # a reply that does not fit its fixed body: a bug, said so
                log.error("reply to %s for pid %d cannot be sent: %s", m.op.name, pid, e)
                frame = encode_reply(m.op.code, _error(e))
            conn.sendall(frame)
        finally:
            self._after_reply(owned)

    @staticmethod
    def _after_reply(owned: dict[str, Any]) -> None:
        r: Region | None = owned["region"]
        if r is not None and r.after_reply is not None:
            hand_over, r.after_reply = r.after_reply, None
            hand_over()

    def _disconnect(self, pid: int, owned: dict[str, Any]) -> None:
        self._after_reply(owned)  # a region granted inline but never replied to: hand it over first
        r: Region | None = owned["region"]
        if r is not None and not r.ended.is_set():
            r.end_reason = "owner-exit"
            r.cancelled = True
            r.ended.set()
            r.granted.set()
        lost = None
        with self.lock:
            n = owned["guardian"]
            if n is not None and n in self.slots:
                # Closed without a release: the guardian died (SIGKILL, e.g. `timeout -s KILL`)
                # and nobody watches its command any more.
                lost = self.slots[n] if self.slots[n].guardian_connected else None
                self.slots[n].guardian_connected = False
            n = owned["slot"]
            if n is not None and n in self.slots and self.slots[n].kind == "auto":
                self._release(n, "owner-exit")
        if lost is not None:
            self._guardian_lost(lost, "its connection closed without a release")

    def _guardian_lost(self, s: Slot, why: str) -> None:
        """A `krex run` guardian died before its command ended: end the command as a leftover
        is ended (its whole tree, killed), journal it, and free the slot (once its last
        process is gone: the reaper frees a slot whose kill failed)."""
        out = self._leftovers(s.slot, "kill", s)
        log.warning(
            "slot %d: guardian pid %d died (%s); its command was %s: %s",
            s.slot, s.guardian_pid, why, out["action"], [x["pid"] for x in out["leftovers"]],
        )
        rec = {
            "ts": time.time(),
            "event": "guardian-lost",
            "gpu": s.gpu,
            "slot": s.slot,
            "guardian_pid": s.guardian_pid,
            "why": why,
            "action": out["action"],  # killed, kill-failed, or none (nothing of it was left)
            "processes": out["leftovers"],
        }
        if out.get("alive"):
            rec["alive"] = out["alive"]
        self._journal(rec)
        with self.lock:  # (the reaper may have freed it once its processes were gone)
            if self.slots.get(s.slot) is s and out["action"] in ("none", "killed"):
                self._release(s.slot, "guardian-lost")

    # ------------------------------------------------------------- handlers
    # One per request op of KREX_OPS (HANDLERS, through @handles); each gets the connection,
    # the peer's pid (SO_PEERCRED), the request as a dict and the connection's state.

    @handles("hello")
    def _op_hello(
        self, conn: socket.socket, pid: int, msg: dict[str, Any], owned: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "ok": True,
            "pid": self.pid,
            "shm": self.shm_name,
            "gpus": self.info.count,
            "device": self.info.kind,  # so a client needs no GPU discovery of its own
            "role": owned.get("role"),
        }

    @handles("status")
    def _op_status(
        self, conn: socket.socket, pid: int, msg: dict[str, Any], owned: dict[str, Any]
    ) -> dict[str, Any]:
        return {"ok": True, **self.status()}

    @handles("adopt")
    def _op_adopt(
        self, conn: socket.socket, pid: int, msg: dict[str, Any], owned: dict[str, Any]
    ) -> dict[str, Any]:
        return self._adopt(pid, msg, owned)

    @handles("started")
    def _op_started(
        self, conn: socket.socket, pid: int, msg: dict[str, Any], owned: dict[str, Any]
    ) -> dict[str, Any]:
        child = int_field(msg, "pid", required=True)
        assert child is not None
        # Only the peer's own process tree, with its credentials, may join a slot: a
        # pid from the message would otherwise let a member freeze anyone's process.
        _check_own_tree(child, pid, owned["uid"])
        with self.lock:
            s = self.slots.get(owned["guardian"])
            if s is None:
                raise UsageError("`started` before `admit`", "send admit first")
            s.root_pids.update(_roots([child]))
            if self.freezer.name == "signal" or msg.get("join"):
                # join: the guardian could not enter the slot's cgroup itself (a group
                # member); its child waits before exec until the daemon has moved it.
                s.group.add(child)
        return {"ok": True}

    @handles("release")
    def _op_release(
        self, conn: socket.socket, pid: int, msg: dict[str, Any], owned: dict[str, Any]
    ) -> dict[str, Any]:
        n = owned["guardian"]
        out: dict[str, Any] = {"leftovers": [], "action": "none"}
        if n is not None:
            with self.lock:
                slot = self.slots.get(n)
            counters = None
            if msg.get("report") and slot is not None:  # before the release clears its records
                counters = optin.gate_counters(p for p in self.seg.snapshot().procs if p.slot == n)
            policy = "keep" if msg.get("leftovers") == "keep" else "kill"
            out = self._leftovers(n, policy)
            if out["action"] in ("none", "killed"):
                self._release(n, "command-exit")
            else:  # the slot lives on until its last process ends (the reaper frees it)
                with self.lock:
                    if n in self.slots:
                        self.slots[n].guardian_connected = False
            owned["guardian"] = None
            if slot is not None:
                if slot.placement is not None:
                    out["cgroup"] = slot.placement.as_dict()
                if slot.warm or slot.warm_s is not None:  # started pre-warmed: for the report
                    out["prewarm_s"] = slot.warm_s if not slot.warm else round(time.time() - slot.created, 6)
                    out["prewarm_given_gpu"] = not slot.warm
                out["tenant"] = slot.tenant
                out.update(self._slot_regions(slot))
                auto: dict[str, Any] = {}
                out["notes"] = self._release_notes(
                    slot, out, msg.get("auto_dir"), owned["uid"], auto, slot.auto_value
                )
                if counters is not None:
                    self._report_json(slot, counters, out, auto)
        return {"ok": True, **out}

    def _report_json(
        self, s: Slot, counters: dict[str, Any], out: dict[str, Any], auto: dict[str, Any]
    ) -> None:
        """The native guardian's `--report` (optin.run_report), as JSON text it writes as it
        is, adding its exit status: `report_json`, in place of `regions` (not twice in one
        frame). Where the listed regions do not fit in the reply, the list is shortened (the
        later ones go) and `regions_dropped` counts them: the counts still cover every region."""
        regs: list[dict[str, Any]] = out.pop("regions", None) or []
        dropped = int(out.get("regions_dropped") or 0)

        def text(n: int) -> str:
            rel = {**out, "regions": regs[:n], "regions_dropped": dropped + len(regs) - n}
            rep = optin.run_report(
                s.slot, s.gpu, s.admission_wait_s, self.info.kind, s.simulated, counters, rel
            )
            if auto and optin.auto_region_kept(auto):
                rep["auto_region"] = auto
            return json.dumps(rep, indent=2, default=str)

        n = len(regs)
        body = text(n)
        # The reply as it will be encoded (the text escaped once more), with room to spare.
        while n and len(json.dumps({**out, "report_json": body}, default=str)) > MAX_FRAME * 3 // 4:
            n = n * 3 // 4
            body = text(n)
        out["report_json"] = body

    def _release_notes(
        self,
        s: Slot,
        out: dict[str, Any],
        auto_dir: object,
        uid: int,
        auto: dict[str, Any] | None = None,
        value: str = "",
    ) -> list[str]:
        """The notes `krex run` prints after its command (optin.release_notes), for a guardian
        that does not render them itself (interpose/guardian.c). `auto_dir`: the command's
        KREX_AUTO_STATUS_DIR when processes left status files there; read only if it is a
        directory of the peer's own that nobody else may write (never through a link).
        `value`: KREX_AUTO_REGION in the guardian's environment (a warning when it made no
        region). What was read goes into `auto` too (the report's `auto_region`)."""
        report: dict[str, Any] = dict(s.tally) or optin.region_tally([])

        def read(d: Path | None) -> None:  # d None: no status to read (the value alone)
            report["auto_region"] = optin.auto_region_report(
                value, d, [], remove=False, uid=uid, labels=dict(s.auto_labels)
            )
            if auto is not None:
                auto.update(report["auto_region"])

        if not (isinstance(auto_dir, str) and auto_dir):
            if value:  # set, and no process said so
                read(None)
            return optin.release_notes(out, report)
        fd = -1
        try:
            if not os.path.isabs(auto_dir):
                raise PermissionDenied("not an absolute path", "")
            # Opened once, never through a link, and read through that descriptor: the
            # path cannot be swapped for another directory between the checks and the reads.
            fd = os.open(auto_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            st = os.fstat(fd)
            if st.st_uid != uid:
                raise PermissionDenied("not a directory of yours", "")
            if st.st_mode & 0o022:
                raise PermissionDenied("writable by others", "")
            read(Path(f"/proc/self/fd/{fd}"))
        except Exception as e:  # noqa: BLE001 - a client's files must never fail its release
            why = e.strerror if isinstance(e, OSError) else str(e) or type(e).__name__
            if value:  # the value's warning and report all the same, as if no status was left
                read(None)
            return [
                *optin.release_notes(out, report),
                f"krex: warning: krexd could not read the auto-region status in {auto_dir} ({why})",
            ]
        finally:
            if fd >= 0:
                os.close(fd)
        return optin.release_notes(out, report)

    @handles("register")
    def _op_register(
        self, conn: socket.socket, pid: int, msg: dict[str, Any], owned: dict[str, Any]
    ) -> dict[str, Any]:
        s = self._slot_for(pid, msg, owned)
        self._wait_warm(s, pid)  # a process that skipped the shim's own wait (no KREX_SLOT)
        return {"ok": True, "slot": s.slot, "gpu": s.gpu, "shm": self.shm_name}

    @handles("begin")
    def _op_begin(
        self, conn: socket.socket, pid: int, msg: dict[str, Any], owned: dict[str, Any]
    ) -> dict[str, Any]:
        return self._begin(pid, msg, owned)

    @handles("soon")
    def _op_soon(
        self, conn: socket.socket, pid: int, msg: dict[str, Any], owned: dict[str, Any]
    ) -> dict[str, Any]:
        """The caller's command says a region comes soon (an automatic region's target was
        entered; its warm-up runs first): siblings' queues start shrinking now. A process of
        no command gets no slot for it."""
        with self.lock:
            s = self._slot_of_pid(pid)
        if s is None or s.warm:
            return {"ok": True, "soon": False}
        return {"ok": True, "soon": self.pending.announce(s.gpu, s.slot)}

    @handles("end")
    def _op_end(
        self, conn: socket.socket, pid: int, msg: dict[str, Any], owned: dict[str, Any]
    ) -> dict[str, Any]:
        return self._end(pid, owned)

    @handles("shutdown")
    def _op_shutdown(
        self, conn: socket.socket, pid: int, msg: dict[str, Any], owned: dict[str, Any]
    ) -> dict[str, Any]:
        if owned.get("role") != "owner":
            raise PermissionDenied(
                "only the daemon's user or root may stop it", "ask its owner to run `krex daemon stop`"
            )
        self.stop_reason = f"shutdown requested by pid {pid}"
        self.stop.set()
        return {"ok": True}

    def _slot_regions(self, s: Slot) -> dict[str, Any]:
        """The `release` reply's regions, from krexd's own record of the command (never the
        journal), once a region it still had (ended by the release) is recorded: `regions`
        (the first ones, as many as krexd keeps and half a frame holds), `regions_dropped`
        (how many more there were), `region_tally` (the counts over all of them) and, for a
        region that did not finish in time, `regions_unfinished` (it is journaled later)."""
        with self.lock:
            cur = [r for r in self.current.values() if r is not None and r.slot == s.slot]
        pending = [r for r in cur if r.ended.is_set()]
        for r in pending:
            r.released.wait(10)
        out: dict[str, Any] = {}
        if self.journal_error:
            out["journal_error"] = self.journal_error
        with self.lock:
            regs, dropped = list(s.records), s.records_dropped
            tally = {**s.tally, "region_flags": dict(s.tally.get("region_flags") or {})}
        listed = _fit(regs, MAX_FRAME // 2)
        out["regions"] = regs[:listed]
        out["regions_dropped"] = dropped + len(regs) - listed
        out["regions_cap"] = RELEASE_MAX_RECORDS
        out["region_tally"] = tally or optin.region_tally([])
        out["region_auto_labels"] = dict(s.auto_labels)
        unfinished = sum(1 for r in pending if not r.released.is_set())
        if unfinished:
            out["regions_unfinished"] = unfinished
        return out

    def _slot_for(self, pid: int, msg: dict[str, Any], owned: dict[str, Any]) -> Slot:
        with self.lock:
            s = self._slot_of_pid(pid)
            if s is not None:
                return s
            want = int_field(msg, "gpu", 0)
            assert want is not None
            if not 0 <= want < self.info.count:
                raise NotFound(f"unknown GPU {want}", f"this node has {self.info.count} GPU(s)")
            s = self._new_slot(want, "auto", pid)
            s.tenant = _user_name(owned["uid"])
            s.root_pids.update(_roots([pid]))
            with contextlib.suppress(KrexError):
                s.group.add(pid)
            owned["slot"] = s.slot
            return s

    @handles("admit")
    def _admit(
        self, conn: socket.socket, pid: int, msg: dict[str, Any], owned: dict[str, Any]
    ) -> dict[str, Any]:
        want = int_field(msg, "gpu")
        asked = msg.get("device") or "auto"  # the client's --device: the environment's kind
        if asked not in ("auto", "gpu", "sim"):
            raise UsageError(f"unknown device {asked!r}", "use one of: auto, gpu, sim")
        freeze = msg.get("freeze")
        if freeze is not None:
            freezepolicy.check(str(freeze))
        tenant = msg.get("tenant")
        tenant = _user_name(owned["uid"]) if tenant in (None, "") else regionqueue.check_tenant(str(tenant))
        if msg.get("guardian") == "native":
            self._check_native(asked, owned)
        if want is not None and not 0 <= want < self.info.count:
            raise NotFound(
                f"unknown GPU {want}: this node has {self.info.count} GPU(s)",
                "pick a GPU index from `krex status`",
            )
        self._check_not_lost()
        t0 = time.monotonic()
        told = False
        with self.lock:
            while True:
                picked = self._pick_gpu(want)
                if picked is not None:
                    gpu, warm = picked
                    s = self._new_slot(gpu, "run", pid, warm=warm)
                    s.freeze = None if freeze is None else str(freeze)
                    s.tenant = tenant
                    break
                if not told:
                    busy = len(self.slots)
                    ev = {"event": "queued", "slots_busy": busy, "note": optin.queue_note(busy)}
                    conn.sendall(encode_reply("event", ev))
                    told = True
                self.changed.wait(0.5)
                if self.stop.is_set():
                    raise KrexError("daemon is stopping", "try again")
                if _peer_closed(conn):  # Ctrl-C in the queue: never admit a guardian that is gone
                    raise DaemonLost("the client closed its connection while queued", "")
        owned["guardian"] = s.slot
        log.info("slot %d on gpu %d admitted for guardian pid %d", s.slot, gpu, pid)
        if owned.get("role") == "member":
            self._delegate_thaw(s, owned["uid"])
        env_set, env_prepend = self._command_env(s, gpu, asked)
        s.admission_wait_s = round(time.monotonic() - t0, 6)
        s.simulated = self.info.kind == "sim" or asked == "sim"
        value = msg.get("auto_value")
        if isinstance(value, str):
            s.auto_value = value.strip()
        placed = s.placement.as_dict() if s.placement else {}
        return {
            # Taken (the guardian falls back to Python with a krexd that does not say so).
            **({"auto_value": True} if isinstance(value, str) else {}),
            "ok": True,
            "notes": optin.start_notes(
                s.simulated,
                s.warm,
                optin.sim_reason(asked, self.cfg.device),
                cgroup_note=placed.get("note", ""),
            ),
            "cgroup": placed,
            "warm": s.warm,
            "env_set": env_set,
            "env_prepend": env_prepend,
            "slot": s.slot,
            "gpu": gpu,
            "physical": self.info.physical[gpu],
            "vendor": self.info.kind,
            "visible": self.info.visible_token(gpu),
            "generation": s.generation,
            "device": self.info.kind,
            "shm": self.shm_name,
            "group": s.group.path,
            "freezer": self.freezer.name,
            "shared_cpus": self.partition.command_cpus(gpu, self.cfg.lend_cores),
            "admission_wait_s": s.admission_wait_s,
            "tenant": s.tenant,
        }

    def _check_native(self, asked: str, owned: dict[str, Any]) -> None:
        """Refuse, before any slot is taken, what only the Python guardian handles, so the
        native one (interpose/guardian.c) hands the command line to it: the signal freezer
        and a group member's guardian (the child must wait before exec until krexd moves
        it: launcher._DaemonJoin), and --device gpu on a simulated daemon (discovery)."""
        why = None
        if self.freezer.name not in ("cgroup2", "cgroup1"):
            why = f"the {self.freezer.name} freezer"
        elif owned.get("role") == "member":
            why = "a member of the daemon's group"
        elif asked == "gpu" and self.info.kind == "sim":
            why = "--device gpu on a simulated daemon"
        if why:
            raise UsageError(f"the native guardian does not handle {why}", "run it with the Python guardian")

    def _command_env(self, s: Slot, gpu: int, asked: str) -> tuple[dict[str, str], dict[str, list[str]]]:
        """The variables a guardian gives its command (optin.opt_in_parts plus the slot's):
        both guardians apply exactly these. A simulated daemon under `--device gpu` opts in
        as "gpu" (that guardian first checks that a real GPU exists)."""
        kind = "sim" if asked == "sim" or (asked == "auto" and self.info.kind == "sim") else "gpu"
        base = self._opt_in.get(kind)
        if base is None:  # the same for every command of this daemon: made once per kind
            base = self._opt_in[kind] = optin.opt_in_parts(
                kind, self.shm_name, str(self.sock_path), str(paths.log_path())
            )
        put, pre = dict(base[0]), {k: list(v) for k, v in base[1].items()}
        put.update(
            KREX_SLOT=str(s.slot),
            KREX_GPU=str(gpu),
            CUDA_VISIBLE_DEVICES=str(self.info.visible_token(gpu)),
            # The shim compares it with the slot's generation: a process of this command that
            # outlives it never passes the gate of the next command that gets this slot.
            KREX_SLOT_GEN=str(s.generation),
        )
        if self.info.kind == "amd":  # HIP reads HIP_VISIBLE_DEVICES before CUDA_VISIBLE_DEVICES
            put["HIP_VISIBLE_DEVICES"] = str(self.info.physical[gpu])
        put.update(self.mps.command_env(gpu))  # MPS pipe and log directories, the GPU's UUID
        return put, pre

    def _delegate_thaw(self, s: Slot, uid: int) -> None:
        """A member's guardian must be able to thaw its own command if krexd dies or
        hangs (I5): hand it the slot's freeze file, and nothing else."""
        name = {"cgroup2": "cgroup.freeze", "cgroup1": "freezer.state"}.get(self.freezer.name)
        if name:
            with contextlib.suppress(OSError):
                os.chown(os.path.join(s.group.path, name), uid, -1, follow_symlinks=False)

    def _adopt(self, pid: int, msg: dict[str, Any], owned: dict[str, Any]) -> dict[str, Any]:
        """A guardian of a previous daemon reconnects and keeps its slot."""
        n, gpu = int_field(msg, "slot", required=True), int_field(msg, "gpu", required=True)
        assert n is not None and gpu is not None
        if not 0 <= n < lib.KREX_MAX_SLOTS or not 0 <= gpu < self.info.count:
            raise NotFound(f"no slot {n} on GPU {gpu}", "start the command again")
        raw = msg.get("pids", [])
        if not isinstance(raw, list) or not all(isinstance(p, int) and not isinstance(p, bool) for p in raw):
            raise UsageError("field 'pids' must be a list of integers", "send the command's pids")
        pids = set()
        for p in raw:  # the same rule as `started`: only the peer's own tree
            with contextlib.suppress(PermissionDenied, NotFound):
                _check_own_tree(p, pid, owned["uid"])
                pids.add(p)
        with self.lock:
            sp = self.seg.raw.slots[n]
            if sp.state != lib.KREX_SLOT_ACTIVE or sp.owner_pid != pid:
                raise NotFound(f"slot {n} is not held by pid {pid}", "start the command again")
            s = Slot(
                n,
                gpu,
                "run",
                pid,
                self.freezer.group(f"slot-{n}"),
                _roots(pids),
                generation=int(sp.generation),
                warm=bool(sp.warm),
            )
            old = self.slots.get(n)
            if old is not None:
                s.created = old.created  # its place among pre-warmed ones
            self.slots[n] = s
            self._publish_queue_caps()
            owned["guardian"] = n
        return {"ok": True, "slot": n}

    def _wait_warm(self, s: Slot, pid: int) -> None:
        """A pre-warmed command's region or registration waits for its slot, as its GPU calls
        do in the shim: a region must never close the gate for a command whose own GPU calls
        cannot pass yet. Never for a slot released meanwhile, nor for a process that died."""
        with self.lock:
            while s.warm and self.slots.get(s.slot) is s and not self.stop.is_set():
                if not lib.krex_pid_alive(pid, 0):
                    raise NotFound(f"pid {pid} ended while its command waited pre-warmed", "")
                self.changed.wait(0.5)
            if self.slots.get(s.slot) is not s:
                raise NotFound(
                    f"the slot of pid {pid} was released while its command waited pre-warmed",
                    "start the command again",
                )
        if self.stop.is_set():
            raise DaemonLost("the daemon is stopping", "run again; it starts on demand")

    def _begin(self, pid: int, msg: dict[str, Any], owned: dict[str, Any]) -> dict[str, Any]:
        if owned["region"] is not None and not owned["region"].released.is_set():
            raise Busy("this connection already holds a region", "end it first")
        self._check_not_lost()
        s = self._slot_for(pid, msg, owned)
        tid = int_field(msg, "tid") or pid
        if not os.path.exists(f"/proc/{pid}/task/{tid}"):
            raise UsageError(f"thread {tid} is not a thread of pid {pid}", "send your own thread id")
        label = str(msg.get("label") or "")[:200]
        t_request = time.monotonic()
        self._wait_warm(s, pid)
        if not os.path.exists(f"/proc/{pid}/task/{tid}"):
            raise NotFound(f"thread {tid} of pid {pid} ended while its command waited pre-warmed", "")
        req = Region(s.slot, s.gpu, pid, tid, t_request, label=label, tenant=s.tenant)
        owned["region"] = req
        self.pending.queue(req, s.gpu, s.slot)
        try:
            if not self._enter_inline(s.gpu, req):
                with self.lock:
                    self.queues[s.gpu].push(req)
                    self.changed.notify_all()
            req.granted.wait()
        finally:
            self.pending.unqueue(req)
        if req.cancelled:
            if self.stop.is_set():
                raise DaemonLost("region cancelled: the daemon is stopping", "run again; it starts on demand")
            raise KrexError("region cancelled", "the daemon is stopping or the slot was released")
        return req.grant

    def _end(self, pid: int, owned: dict[str, Any]) -> dict[str, Any]:
        req: Region | None = owned["region"]
        if req is None or req.released.is_set() and req.end_reason:
            s = self._slot_of_pid(pid)
            with self.lock:
                cur = [
                    r for r in self.current.values() if r is not None and s is not None and r.slot == s.slot
                ]
            if req is None and not cur:
                raise UsageError("END without BEGIN: this process holds no region", "call begin first")
            if req is None:
                # I6: only the connection that began a region may end it.
                raise Busy(
                    "that region belongs to another connection of your command", "end it where it began"
                )
        assert req is not None
        req.ended.set()
        req.released.wait(10)
        owned["region"] = None
        rec = req.record
        # The verdict up front: a cut or flagged region must never read as a clean one.
        return {
            "ok": True,
            "end": req.end_reason or "end",
            "clean": not rec.get("contaminated", True),
            "cut": bool(rec.get("cut")),
            "flags": rec.get("flags", []),
            "region": rec,
        }

    # ----------------------------------------------------------------- status
    def status(self) -> dict[str, Any]:
        with self.lock:
            return {
                "daemon": {
                    "pid": self.pid,
                    "socket": str(self.sock_path),
                    "uptime_s": round(time.time() - self.started_at, 1),
                    "freezer": self.freezer.name,
                    "freezer_detail": self.freezer.describe(),
                    "device": self.info.kind,
                    "gpus": self.info.count,
                    "shm": self.shm_name,
                    "regions_done": self.regions_done,
                    "max_region_s": self.cfg.max_region_s,
                    "freeze_policy": self.cfg.freeze_policy,
                    "lend_cores": self.cfg.lend_cores,
                    "lend_cores_off": self.lend_off_why,
                    "region_core_watched": self.core_watch_off is None,
                    "nice": os.getpriority(os.PRIO_PROCESS, 0),  # -5 wanted with lend_cores all
                    "drain_budget_ms": self.cfg.drain_budget_ms,
                    "queue_cap_ms": self.cfg.queue_cap_ms,
                    "early_shrink": self.cfg.early_shrink,
                    "idle_exit_s": self.cfg.idle_exit_s,
                    "log": str(paths.state_dir() / "krexd.log"),
                    "settings_from": self.cfg.sources,
                    "journal": str(self.journal_path),
                    "journal_error": self.journal_error,
                    "group": self.share_gid,
                    "stalls": len(self.stalls),
                    "connections": self._loop.stats(),
                },
                "partition": self.partition.to_json(),
                "segment": self.guard.to_json(),
                "slots": [
                    {
                        "slot": s.slot,
                        "gpu": s.gpu,
                        "kind": s.kind,
                        "guardian_pid": s.guardian_pid,
                        "warm": s.warm,
                        "tenant": s.tenant,
                        "pids": self._group_pids(s),
                        "cgroup": s.group.path,  # below its caller's cgroup, or a fallback
                    }
                    for s in self.slots.values()
                ],
                "regions": [
                    {
                        "gpu": g,
                        "slot": r.slot,
                        "pid": r.pid,
                        "tid": r.tid,
                        "tenant": r.tenant,
                        "granted": r.granted.is_set(),
                        "age_s": round(time.monotonic() - r.t_request, 3),
                    }
                    for g, r in self.current.items()
                    if r is not None
                ],
                "queues": {
                    str(g): [{"slot": r.slot, "pid": r.pid, "tenant": r.tenant} for r in q]
                    for g, q in self.queues.items()
                },
                "region_queue": self.cfg.region_queue,
                "tenant_used_s": {str(g): q.shares() for g, q in self.queues.items()},
                "slots_per_gpu": [self.slots_per_gpu(g) for g in range(self.info.count)],
                "prewarm": self.cfg.prewarm,
                "mps": self.mps.status(),
            }


def _version() -> str:
    from krex import __version__

    return __version__


LOG_FORMAT = "%(asctime)s.%(msecs)03d krexd[%(process)d] %(levelname)s %(message)s"


def setup_logging(level: str) -> None:
    """krexd's log: timestamps and pids on stderr, which an on-demand or background
    daemon has redirected to krexd.log. Only the ``krex`` logger; never the root's. A
    handler the CLI put there (`krex daemon start --foreground` runs krexd in its own
    process) goes: it would write every line a second time."""
    lg = logging.getLogger("krex")
    for h in [h for h in lg.handlers if getattr(h, "_krex_cli", False)]:
        lg.removeHandler(h)
    if not any(getattr(h, "_krexd", False) for h in lg.handlers):
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter(LOG_FORMAT, "%Y-%m-%d %H:%M:%S"))
        h._krexd = True  # type: ignore[attr-defined]
        lg.addHandler(h)
    lg.setLevel(level.upper())


def _peer_closed(conn: socket.socket) -> bool:
    """Has the client closed its end? (It sends nothing while it waits for an answer.)"""
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def refuse_a_shared_segment(seg: Segment, name: str, state_dir: Path) -> None:
    """UsageError when another krexd (another state directory: its own lock and socket)
    beats in `seg`: two daemons would hand out the same slots and open each other's gates.
    Its pid is checked only in our pid namespace; from another one the heartbeat decides."""
    h = seg.raw.hdr
    other = int(h.daemon_pid)
    if other <= 0 or other == os.getpid():
        return
    age = seg.heartbeat_age(other)
    if age is None or heartbeat_stale(age):
        return  # gone or hung: taking the segment over is recovery
    if int(h.pidns) == pid_namespace() and lib.krex_pid_alive(other, 0) != 1:
        return
    raise UsageError(
        f"segment {name} is in use by another krexd (pid {other}, beating {age:.1f} s ago), "
        f"with a state directory other than {state_dir}",
        "use that daemon (its KREX_STATE_DIR), stop it, or give this one its own segment: "
        "KREX_SHM=/krex-<name>",
    )


def _check_segment_before_start(cfg: Config) -> None:
    """The same check before the lock and the log, so each of many daemons started at once
    for one command each says why on its own stderr (the starting command reads it there).
    The daemon of our own state directory is left to the lock ("already running")."""
    name = cfg.shm_name or default_name()
    try:
        seg = Segment.attach(name)
    except KrexError:  # none yet, or not one we can read: _open_segment decides
        return
    try:
        if int(seg.raw.hdr.daemon_pid) != paths.lock_holder():
            refuse_a_shared_segment(seg, name, paths.socket_path().parent)
    finally:
        seg.close()


def run(cfg: Config) -> None:
    """Run the daemon in this process until stopped (SIGTERM/SIGINT or `shutdown`).
    Its log lines go to stderr (krexd.log when started in the background)."""
    setup_logging(cfg.log_level)
    d = Daemon(cfg)
    d.start()

    def on_signal(signum: int, _frame: object) -> None:
        d.stop_reason = f"signal {signal.Signals(signum).name}"
        d.stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    d.serve_forever()
    if d.fault:  # not asked to stop: a non-zero status, so a supervisor restarts it
        raise KrexError(d.fault, "see krexd.log; a new krexd starts on demand (systemd: Restart=on-failure)")


def _redirect_output(logfile: Path) -> None:
    """Point stdout and stderr at the log, opened without following symlinks in a
    directory checked first (a shell's `>>log` would follow a planted link)."""
    paths.ensure_dir(logfile.parent, "KREX log directory")
    try:
        fd = paths.open_private(logfile, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    except OSError as e:
        raise KrexError(f"cannot open the log {logfile}: {e.strerror}", "set KREX_STATE_DIR") from e
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main(argv: list[str] | None = None) -> None:
    """`python -m krex.node.daemon` entry used when the daemon is started in the background."""
    import argparse

    ap = argparse.ArgumentParser(prog="krexd")
    ap.add_argument("--device", default="auto")
    config.add_arguments(ap)  # the settings' one table (krex/node/config.py)
    ap.add_argument(
        "--on-demand", action="store_true", help="started by a command: exits when idle (KREX_IDLE_EXIT)"
    )
    ap.add_argument("--log", default=None, help="append stdout and stderr here (in a checked directory)")
    a = ap.parse_args(argv)
    overrides = config.overrides_from(a)
    try:
        cfg = config_from(a.device, overrides, on_demand=a.on_demand)
        _check_segment_before_start(cfg)
        if a.log:
            _redirect_output(Path(a.log))
        run(cfg)
    except KrexError as e:
        ts = time.strftime("%Y-%m-%d %H:%M:%S")
        os.write(2, f"{ts} krexd[{os.getpid()}] ERROR {e}\n  fix: {e.fix}\n".encode())
        raise SystemExit(e.exit_code) from None


if __name__ == "__main__":
    main()
