"""Which siblings a region freezes (protocol step 5 as a policy, issue 11).

The gate already keeps every sibling process that has the shim loaded off the GPU: a
submission either was counted in flight before the gate closed (and the daemon waited for
it) or parks at the closed gate. Freezing such a process adds nothing for the GPU; it only
stops its CPU work (imports, compilation, input generation) for the length of the region.

Policies:
  gpu       (the default) freeze only the siblings the gate cannot hold: a slot with a process that does
            not have the shim mapped (LD_PRELOAD dropped, a static executable), or whose
            executable links the CUDA runtime statically (its launches bypass every symbol
            hook). Every other sibling keeps running on its own cores and parks at the gate
            if it submits. A sibling inside a context, module or device-memory call, or in its
            exit after one, is frozen too (daemon.py's _FreezePlan).
  all       freeze every sibling's whole tree (the paper's protocol).
  adaptive  `all` for a short, launch-bound region (the owner's previous region of this
            command submitted faster than ADAPTIVE_RATE per second, or it is the first
            one), else `gpu`.

What `gpu` cannot see: a library dlopen()ed later that carries a static CUDA runtime, a
process that re-executes the same executable without LD_PRELOAD (its verdict is cached by
pid, start time and executable), and one that maps a file named like the shim without
preloading it (calls it bound before stay ungated). Each needs a deliberate effort; `all`
covers them.

Why `gpu` is the default: on the H200 (docs/results/h200/final2/, one run, 40 regions a
cell) it made 10% more commands a minute than `all` at C=16 and as many at C=8, its p95
inflation was under the paper's in every band, and it flagged no region for a sibling's
context start or end."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from krex.device import elfcheck
from krex.node import procfs

POLICIES = ("all", "gpu", "adaptive")
DEFAULT = "gpu"
# New processes a region inspects itself (about 1 ms each); the rest wait for the inspector thread.
INSPECT_INLINE = 8
# Submissions per second above which a region counts as launch-bound (adaptive): a region of
# kernels shorter than ~0.2 ms each, where host-side CPU noise is a visible part of a timing.
ADAPTIVE_RATE = 5000.0
SHIM_NAME = "libkrex_interpose.so"
# A process without the shim in its maps may only not have mapped it yet (the loader of a
# process that just exec'd): that verdict is read again after this long. On the H200, such a
# verdict cached for good froze one command's slot in all 26 regions of its life (final5).
RECHECK_S = 0.5


@dataclass(frozen=True)
class Verdict:
    gateable: bool
    why: str = ""
    final: bool = True  # False: may change while the process lives (read again after RECHECK_S)


class Inspector:
    """Per-process verdicts, cached by (pid, start time, executable): reading a process's
    maps costs about a millisecond (more for a process that imported torch), and commands
    live for many regions. A region inspects at most INSPECT_INLINE new processes itself; past
    that it asks with `inspect=False`: a process not inspected yet reads as not gateable (its
    slot is frozen: the safe side) and is queued, and krexd's inspector thread
    (`inspect_pending`, `seen`) inspects it off the region's path. On the
    H200, first inspections of a family's fresh compile workers made a region's entry wait
    66-90 ms with nothing left to drain (docs/results/h200/final5)."""

    def __init__(self, shim_name: str = SHIM_NAME) -> None:
        self.shim_name = shim_name
        self._cache: dict[tuple[int, int, str], Verdict] = {}
        self._static: dict[tuple[str, int, int], bool] = {}
        self._lock = threading.Lock()  # the cache is shared by region threads and the inspector's
        self._pending: set[tuple[int, int, str]] = set()
        self._pids: set[int] = set()  # pids with some verdict cached
        # pid -> (the key of its verdict that may change, when it goes stale); one per pid
        self._recheck: dict[int, tuple[tuple[int, int, str], float]] = {}
        self.wanted = threading.Event()  # set when a region queued a process to inspect

    def verdict(self, pid: int, inspect: bool = True) -> Verdict | None:
        """None: the process is gone."""
        return self._verdict(pid, inspect)[0]

    def _verdict(self, pid: int, inspect: bool) -> tuple[Verdict | None, bool]:
        """(the verdict, whether this call read the process's maps: ungateable's budget)."""
        st = procfs.pid_stat(pid)
        # An ended process not reaped yet (a zombie whose only thread is its dead leader)
        # runs nothing again, and its files, GPU ones too, are closed; its executable no
        # longer reads. Taken as gone: torch.compile's short-lived children leave such zombies,
        # and slots were frozen for processes whose executable did not read (25-130 ms of
        # entry on the H200, session 29). Not "X": a leader released mid-exec reads so.
        if st is None or (st.state == "Z" and st.threads == 1):
            return None, False
        ticks = st.start
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:  # a kernel thread, or gone, or not ours to read: cannot vouch for it
            if not _alive(pid):
                return None, False
            # Inside its exit too (PF_EXITING): its leader's memory is released, but another
            # thread may still hold its GPU files, and the slot's freeze ends only once that
            # thread has left (after its contexts' teardown).
            return Verdict(False, f"pid {pid}: its executable cannot be read"), False
        key = (pid, ticks, exe)
        with self._lock:
            v = self._cache.get(key)
            rc = self._recheck.get(pid)
            if v is not None and not v.final and (rc is None or rc[0] != key or time.monotonic() >= rc[1]):
                v = None  # stale: read again
            if v is None and not inspect:
                self._pending.add(key)
        if v is not None:
            return v, False
        if not inspect:
            self.wanted.set()
            why = f"pid {pid} ({os.path.basename(exe)}): not inspected yet (now queued)"
            return Verdict(False, why), False
        v = self._inspect(pid, exe)
        with self._lock:
            if len(self._cache) > 65536:
                self._cache.clear()
                self._pids.clear()
                self._recheck.clear()
            self._cache[key] = v
            self._pids.add(pid)
            if v.final:
                self._recheck.pop(pid, None)
            else:
                self._recheck[pid] = (key, time.monotonic() + RECHECK_S)
            self._pending.discard(key)
        return v, True

    def seen(self, pid: int) -> bool:
        """Whether some verdict for this pid is cached (any start time or executable) and
        none of its verdicts has gone stale."""
        with self._lock:
            if pid not in self._pids:
                return False
            rc = self._recheck.get(pid)
            return rc is None or time.monotonic() < rc[1]

    def inspect_pending(self) -> int:
        """Inspect the processes regions queued; how many. Forgets the stale verdicts of
        processes that have ended."""
        with self._lock:
            todo = list(self._pending)
            self._pending.clear()
            for pid in [p for p in self._recheck if not _alive(p)]:
                del self._recheck[pid]
        for pid, _ticks, _exe in todo:
            self.verdict(pid)  # (a pid that ended or exec'd meanwhile gets its own key)
        return len(todo)

    def _inspect(self, pid: int, exe: str) -> Verdict:
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                maps = f.read()
        except OSError as e:
            return Verdict(False, f"pid {pid}: cannot read its maps ({e.strerror})", final=False)
        if self.shim_name.encode() not in maps:
            why = f"pid {pid} ({os.path.basename(exe)}) runs without the KREX shim"
            return Verdict(False, why, final=False)
        if self._static_cudart(pid, exe):
            return Verdict(False, f"pid {pid} ({os.path.basename(exe)}) links the CUDA runtime statically")
        return Verdict(True)

    def _static_cudart(self, pid: int, exe: str) -> bool:
        path = f"/proc/{pid}/exe"  # the file the process runs, even if renamed or deleted
        try:
            st = os.stat(path)
        except OSError:
            return False
        key = (exe, st.st_dev, st.st_ino)
        if key not in self._static:
            self._static[key] = elfcheck.inspect(path).static_cudart
        return self._static[key]


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def ungateable(pids: Iterable[int], inspector: Inspector, inline: list[int] | None = None) -> list[str]:
    """Why these processes cannot be held by the gate (empty: all can). `inline`: a budget
    (one number, spent as used) of processes not inspected yet that may be inspected now;
    past it such a process counts as one that cannot (Inspector). None: no limit."""
    out: list[str] = []
    for pid in pids:
        v, read = inspector._verdict(pid, inline is None or inline[0] > 0)
        if inline is not None and read:
            inline[0] -= 1
        if v is not None and not v.gateable:
            out.append(v.why)
    return out


def effective(policy: str, last_rate: float | None) -> str:
    """The policy a region applies: `adaptive` resolves to `all` or `gpu`."""
    if policy != "adaptive":
        return policy
    return "all" if last_rate is None or last_rate > ADAPTIVE_RATE else "gpu"


def check(policy: str) -> str:
    from krex.errors import UsageError

    if policy not in POLICIES:
        raise UsageError(f"unknown freeze policy {policy!r}", f"use one of: {', '.join(POLICIES)}")
    return policy
