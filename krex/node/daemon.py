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
krex/protocol.py); each op has one handler in HANDLERS (krex/node/state.py); who
they are comes from SO_PEERCRED, never from the message (I6). Every region ends: on
END, when its owner's connection closes or its pid dies, when --max-region runs
out, or when the daemon stops (I4).

The Daemon is built in layers, one module each (the list is krex/node/state.py's):
the slots (slots.py), the background threads (loops.py), the checks around a region
(regionchecks.py), the queues and GPU workers (regions.py: each region runs as a
RegionRun, the protocol of region.py), the guardians' requests (admission.py) and the
server (server.py); records.py defines what regions send and leave. This module starts
and stops it, and answers `status`."""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import grp
import logging
import os
import queue
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from krex import paths
from krex.device.gpus import discover
from krex.errors import Busy, KrexError, NotFound, PermissionDenied, UsageError
from krex.native import lib
from krex.node import config, conns, coretime, cpus, freezepolicy, freezer, mps, procfs, regionqueue
from krex.node.admission import _fit
from krex.node.attest import Attestor
from krex.node.config import Config, config_from
from krex.node.exits import Exit, Exits
from krex.node.loops import HEARTBEAT_S
from krex.node.pending import Pending
from krex.node.region import Region
from krex.node.segguard import SegmentGuard, remove_world
from krex.node.server import Server
from krex.node.shm import (
    HEARTBEAT_TIMEOUT_S,
    Segment,
    default_name,
    gate_owner,
    heartbeat_stale,
    pid_namespace,
)
from krex.node.slots import RELEASE_MAX_RECORDS, Slot, _is_root, _roots
from krex.node.state import HANDLERS, handles, log
from krex.protocol import StatusReply

# What tests, the CLI and `python -m krex.node.daemon` import from here. The Daemon's layers
# are krex/node/state.py's list.
__all__ = [
    "HANDLERS",
    "HEARTBEAT_S",
    "HEARTBEAT_TIMEOUT_S",
    "RELEASE_MAX_RECORDS",
    "Daemon",
    "Region",
    "Slot",
    "_fit",
    "_is_root",
    "_roots",
    "main",
    "refuse_a_shared_segment",
    "run",
    "setup_logging",
]


class Daemon(Server):
    """krexd: its state (DaemonState) set up, its threads started, served until stopped."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.stop = threading.Event()
        self.stop_reason = ""
        self._fail_opens = []
        self.started_at = time.time()
        self.pid = os.getpid()
        self.info = discover(cfg.device)
        self.mps = mps.Mps(cfg, self.info)  # checks only; its control daemons start in start()
        self.sock_path = paths.socket_path()
        self.journal_path = paths.journal_path()
        self.shm_name = cfg.shm_name or default_name()
        self.share_gid = _group_id(cfg.group)
        self._lock_fd = None
        self._journal_lock = threading.Lock()
        self.journal_error = None
        self.stalls = []  # (start, end) monotonic: heartbeat gaps past the timeout
        self._last_beat = time.monotonic()
        self._sock_ino = None
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
        self.lend_off_why = None
        if self.core_watch_off and cfg.lend_cores != "off" and not self.partition.degraded:
            # Lent, a region core could run a sibling's process that ends before any audit
            # sees it: never unflagged, so not lent where that time cannot be counted.
            self.lend_off_why = f"region cores are not lent: {self.core_watch_off}"
            cfg.lend_cores = "off"
        self.slots = {}
        # Each GPU's queued regions, in the order they get the GPU (fair between tenants by
        # default: krex/node/regionqueue.py).
        weights = regionqueue.parse_weights(cfg.tenant_weights)
        self.queues = {
            g: regionqueue.make(cfg.region_queue, weights) for g in range(self.info.count)
        }
        self.current = dict.fromkeys(range(self.info.count))
        # A region granted on its connection's thread, for the GPU's worker to hold and close.
        self.held = dict.fromkeys(
            range(self.info.count)
        )
        self.regions_done = 0
        self.last_busy = time.monotonic()
        # Regions queued or announced, published so that siblings' queues shrink early.
        self.pending = Pending(lambda: self.seg, self.info.count, cfg.early_shrink)
        self._server = None
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="freeze")
        self.inspector = freezepolicy.Inspector()
        # (the segment's address, its freezepolicy.segment_id): read once per segment
        self._seg_id = None
        # (pid, start time, helper tid) reniced to helper_nice: the start time tells a reused
        # pid apart (its new helper is reniced too)
        self._boosted = set()
        self._boost_lock = threading.Lock()
        self._boost_ok = True  # False once a renice was refused (not root): not tried again
        self.attestor = Attestor.for_device(self.info.kind, self.info.physical)
        self.exits = Exits(self.attestor.settle_ns, self._process_killed)
        self._conns = queue.SimpleQueue()
        self._idle_threads = 0  # connection threads waiting on _conns
        self._loop = conns.ConnLoop(self._role, self._hand_over, {0, os.geteuid()}, self.share_gid)
        self.fault = None  # why krexd stopped without being asked to
        self._idle_lock = threading.Lock()
        self._opt_in = {}  # per kind
        # The deep leftover scan reads every process's environment: 16 releases at once
        # ran 16 scans (half of krexd's CPU per command on a 16-core node); now they share.
        tag = f"KREX_SHM={self.shm_name}".encode()
        self._tag_scan = procfs.FreshScan(lambda: procfs.environ_scan(tag, (b"KREX_SLOT", b"KREX_SLOT_GEN")))
        self._unremoved = {}  # released slots' groups still busy

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
        try:
            self._open_segment()
        except BaseException:
            self.mps.stop()  # a start that fails leaves no control daemon behind
            raise
        self.seg.fixed_gpus = self.info.count
        self.seg.on_ended = self.exits.add
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

    def _process_killed(self, x: Exit) -> None:
        """A process with GPU state ended without its exit handlers (krex/node/exits.py): on
        an MPS GPU, a client killed maybe mid-kernel, its command's root or not."""
        if self.mps.mode == "off" or x.gpu < 0:
            return
        what = (f"a process of the command in slot {x.slot}" if x.slot >= 0
                else "a process that outlived its command")
        f = self.mps.process_killed(x.gpu, x.pid, what)
        if f is not None:
            self._journal({"event": "mps-client-fault", "ts": f.ts, "gpu": x.gpu, "slot": x.slot,
                           "pid": x.pid, "signal": f.signame(), "command": what})

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
            "slots_per_gpu": c.slots_per_gpu
            if c.slots_per_gpu
            else [self.slots_per_gpu(g) for g in range(self.info.count)],
            "prewarm": c.prewarm,
            "max_region_s": c.max_region_s,
            "idle_exit_s": c.idle_exit_s if c.idle_exit_s is not None else "never",
            "freezer": c.freezer or f"auto ({self.freezer.name})",
            "freeze_policy": c.freeze_policy,
            "freeze_timeout_s": c.freeze_timeout_s,
            "drain_timeout_s": c.drain_timeout_s,
            "lend_cores": c.lend_cores,
            "drain_budget_ms": c.drain_budget_ms,
            "pace_tokens": c.pace_tokens,
            "queue_cap_ms": c.queue_cap_ms,
            "early_shrink": c.early_shrink,
            "life_freeze": c.life_freeze,
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
        log.info(
            "recovery: %d group(s) thawed, %d gate(s) reopened, %d record(s) reaped, %d slot(s) adopted",
            rec["thawed"],
            rec["reopened"],
            rec["reaped"],
            rec["adopted"],
        )

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

    @handles("status")
    def _op_status(
        self, conn: socket.socket, pid: int, msg: dict[str, Any], owned: dict[str, Any]
    ) -> dict[str, Any]:
        return {"ok": True, **self.status()}

    def status(self) -> StatusReply:
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
                    "pace_tokens": self.cfg.pace_tokens,
                    "queue_cap_ms": self.cfg.queue_cap_ms,
                    "early_shrink": self.cfg.early_shrink,
                    "life_freeze": self.cfg.life_freeze,
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


def _group_id(name: str | None) -> int:
    if name is None:
        return os.getegid()
    try:
        return int(name) if name.isdigit() else grp.getgrnam(name).gr_gid
    except KeyError:
        raise NotFound(f"no group {name!r}", "give an existing group name or gid (see /etc/group)") from None


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
