"""The guardian's watch over krexd while its command runs (invariant I5): if krexd dies
or stops beating, thaw the command (it keeps running) and, when the loss cut the
command's region, journal that region as cut and contaminated."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from krex.errors import KrexError

if TYPE_CHECKING:
    from krex.node.shm import Segment

__all__ = ["Guardian", "Stop", "journal_cut_region", "with_contextlib_thaw"]


class Stop:
    """threading.Event for the watcher, plus a pipe its select() wakes on, so the
    guardian need not wait out a poll interval when the command has ended."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.r, self.w = os.pipe()

    def set(self) -> None:
        self.event.set()
        with contextlib.suppress(OSError):
            os.write(self.w, b"x")

    def is_set(self) -> bool:
        return self.event.is_set()

    def close(self) -> None:
        for fd in (self.r, self.w):
            with contextlib.suppress(OSError):
                os.close(fd)


def with_contextlib_thaw(backend: str, group_path: str, pids: list[int]) -> None:
    """Thaw our own command without the daemon (I5): write the cgroup's freeze
    file (krexd hands it to the guardian's user at admission), or SIGCONT the
    command's process group and every descendant (the signal freezer stops trees)."""
    with contextlib.suppress(KrexError, OSError):
        if backend == "cgroup2":
            Path(group_path, "cgroup.freeze").write_text("0")
        elif backend == "cgroup1":
            Path(group_path, "freezer.state").write_text("THAWED")
    from krex.node import procfs

    for pid in pids:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGCONT)
        with contextlib.suppress(OSError):  # on a terminal it shares our group (_on_terminal)
            os.kill(pid, signal.SIGCONT)
        for d in procfs.descendants([pid], procfs.proc_table()) - {pid}:
            with contextlib.suppress(OSError):
                os.kill(d, signal.SIGCONT)


class Guardian:
    """The part of `krex run` that is never frozen (I5): it watches krexd through its
    admission connection (krexd's end closed = the daemon died) and through the
    heartbeat in the segment (stale = the daemon is stopped or hung). Either way it
    thaws its own command, within the heartbeat timeout; if the daemon died during
    this command's region it journals that region itself, as cut and contaminated."""

    def __init__(
        self,
        daemon_pid: int,
        sock_fd: int,
        shm: str,
        slot: int,
        gpu: int,
        backend: str,
        group_path: str,
        child_pid: list[int],
        notify: Callable[[str], None],
    ) -> None:
        self.daemon_pid, self.sock_fd, self.shm, self.slot, self.gpu = daemon_pid, sock_fd, shm, slot, gpu
        self.backend, self.group_path, self.child_pid, self.notify = backend, group_path, child_pid, notify
        self.events: list[dict[str, object]] = []

    def watch(self, stop: Stop) -> None:
        import select

        from krex.native import lib
        from krex.node.shm import Segment, heartbeat_stale

        poll_ms = int(lib.KREX_GUARDIAN_POLL_NS // 1_000_000)
        seg: Segment | None = None
        with contextlib.suppress(KrexError):
            seg = Segment.attach(self.shm)
        try:
            # The admission connection itself: krexd writes to it only to answer a request,
            # and POLLRDHUP (unlike POLLIN) fires only when krexd's end is closed, i.e. it
            # died. A second connection would cost every command a connect and krexd a thread.
            p = select.poll()
            p.register(self.sock_fd, select.POLLRDHUP)
            p.register(stop.r, select.POLLIN)
            stale = False
            while not stop.is_set():
                ev = dict(p.poll(poll_ms))
                if stop.is_set():
                    return
                if ev.get(self.sock_fd):
                    self._lost(seg, "krexd exited")
                    return
                age = None if seg is None else seg.heartbeat_age(self.daemon_pid)
                if heartbeat_stale(age):
                    if not stale and not stop.is_set():
                        stale = True
                        with_contextlib_thaw(self.backend, self.group_path, self.child_pid)
                        self.events.append(
                            {"event": "daemon-stalled", "ts": time.time(), "heartbeat_age_s": round(age, 3)}
                        )
                        self.notify(
                            f"krex: krexd (pid {self.daemon_pid}) stopped beating ({age:.1f} s); your "
                            "command was thawed and keeps running"
                        )
                elif stale:
                    stale = False
                    self.events.append({"event": "daemon-resumed", "ts": time.time()})
        finally:
            if seg is not None:
                seg.close()

    def _lost(self, seg: Segment | None, why: str) -> None:
        from krex.native import lib

        with_contextlib_thaw(self.backend, self.group_path, self.child_pid)
        ev: dict[str, object] = {"event": "daemon-lost", "ts": time.time(), "why": why, "region_cut": False}
        if seg is not None:
            gp = seg.raw.gpus[self.gpu]
            ours = gp.holder == lib.KREX_HOLDER_REGION and gp.owner_slot == self.slot
            if gp.gate != lib.KREX_GATE_OPEN and ours:
                # Our command's region lost its daemon: nobody else will journal it.
                ev["region_cut"] = True
                age = (int(lib.krex_now_ns()) - int(gp.closed_ns)) / 1e9
                journal_cut_region(
                    self.gpu, self.slot, self.child_pid[0] if self.child_pid else 0, why, age, time.time()
                )
        self.events.append(ev)
        self.notify("krex: the daemon went away; your command was thawed and keeps running")


def journal_cut_region(gpu: int, slot: int, owner_pid: int, why: str, age: float, ts: float) -> None:
    """Journal a region of our command that lost its daemon (`age` seconds after it began,
    at `ts`): nobody else will. The Python guardian at the loss; the native one's
    finisher (krex.proc.finish) after its command."""
    from krex import paths
    from krex.node import journal

    rec = {
        "ts": ts,
        "gpu": gpu,
        "owner_slot": slot,
        "owner_pid": owner_pid,
        "end": "daemon-lost",
        "contaminated": True,
        "reasons": [f"{why} during the region after {age:.3f} s: from then on it was not exclusive"],
        "flags": ["daemon-lost"],
        "region_s": round(age, 6),
        "recorded_by": "guardian",
    }
    with contextlib.suppress(OSError, KrexError):
        journal.append(paths.journal_path(), rec)
