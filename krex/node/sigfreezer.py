"""The signal freezer backend: SIGSTOP/SIGCONT of process trees, for machines where no
cgroup is writable (krex/node/freezer.py has the interface and picks the backend). Its state
lives in a small JSON file per group, so that a restarted daemon can still thaw, and beside
it a marker file (FROZEN_SUFFIX) that exists while the group is held stopped: the native
guardian asks it (one access(2)) before it forwards a SIGCONT, and reads no JSON."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterable

from krex import paths
from krex.errors import KrexError, NotFound
from krex.node import procfs
from krex.node.freezer import FREEZE_TIMEOUT_S, Freezer, Group, _error, _sleep_step

__all__ = ["SignalFreezer"]

FROZEN_SUFFIX = ".frozen"  # <state file><FROZEN_SUFFIX>: exists while the group is held stopped


class _SignalGroup(Group):
    """A process tree stopped with SIGSTOP.

    Members are the recorded roots, their descendants, and every process ever seen in the tree
    (so a grandchild orphaned to init is still frozen). (pid, start time) pairs guard against
    pid reuse. The state file lets a new daemon thaw what a dead one stopped."""

    backend = "signal"

    def __init__(self, name: str, path: str) -> None:
        super().__init__(name, path)
        self._frozen = False
        self._roots: dict[int, int] = {}
        self._known: dict[int, int] = {}
        self._load()

    def _load(self) -> None:
        try:
            data = json.loads(procfs.read(self.path))
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            raise KrexError(f"unreadable freezer state {self.path}: {exc}", "delete the file") from exc
        self._frozen = bool(data.get("frozen", False))
        self._roots = {int(p): int(s) for p, s in data.get("roots", [])}
        self._known = {int(p): int(s) for p, s in data.get("known", [])}

    def _mark(self) -> None:
        """The marker follows the intent: made before the first SIGSTOP, gone before the
        first SIGCONT of a thaw (a guardian that sees it keeps a forwarded SIGCONT back)."""
        marker = self.path + FROZEN_SUFFIX
        try:
            if self._frozen:
                with open(marker, "w", encoding="utf-8"):
                    pass
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(marker)
        except OSError as exc:
            raise _error(exc, f"cannot write freezer marker {marker}") from exc

    def _save(self) -> None:
        self._mark()
        data = {
            "name": self.name,
            "frozen": self._frozen,
            "roots": sorted(self._roots.items()),
            "known": sorted(self._known.items()),
        }
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(data, f)
            os.replace(tmp, self.path)
        except OSError as exc:
            raise _error(exc, f"cannot write freezer state {self.path}") from exc

    def _members(self) -> dict[int, int]:
        members = procfs.tree({**self._known, **self._roots})
        exclude = procfs.self_and_ancestors()
        return {p: s for p, s in members.items() if p not in exclude}

    def _remember(self, members: dict[int, int]) -> None:
        # Forgetting the dead keeps the file small; remembering the living keeps orphans tracked.
        if members != self._known:
            self._known = dict(members)
            self._save()

    def add(self, pid: int) -> None:
        self._guard(pid)
        st = procfs.pid_stat(pid)
        if st is None:
            raise NotFound(f"no process {pid} to add to group {self.name}")
        self._roots[pid] = st.start
        members = self._members()
        self._known = members
        self._save()
        if self._frozen:
            # Like a cgroup: a process joining a frozen group is frozen too.
            self._signal(members, signal.SIGSTOP)

    def pids(self) -> list[int]:
        return sorted(self._members())

    def _signal(self, pids: Iterable[int], sig: signal.Signals) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                continue
            except OSError as exc:
                raise _error(exc, f"cannot send {sig.name} to pid {pid}") from exc

    def freeze(self, timeout: float = FREEZE_TIMEOUT_S) -> float:
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        members = self._members()
        # Record the intent and the tree first: if we die halfway, recover() knows what to SIGCONT.
        self._frozen = True
        self._known = members
        self._save()
        step = 0.0002
        while True:
            running = [p for p in members if not procfs.stopped(p)]
            if running:
                self._signal(running, signal.SIGSTOP)
            else:
                # All stopped; done unless a child was forked just before its parent stopped.
                latest = self._members()
                if latest.keys() == members.keys():
                    return time.perf_counter() - t0
                members = latest
                self._remember(members)
                continue
            if time.monotonic() >= deadline:
                stragglers = sorted(p for p in members if not procfs.stopped(p))
                raise self._timeout("freezing", timeout, stragglers)
            step = _sleep_step(step)

    def thaw(self, timeout: float = FREEZE_TIMEOUT_S) -> float:
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        members = self._members()
        self._frozen = False
        self._known = members
        self._save()
        self._signal(members, signal.SIGCONT)
        step = 0.0002
        while True:
            still = sorted(p for p in members if "T" in procfs.task_states(p))
            if not still:
                return time.perf_counter() - t0
            if time.monotonic() >= deadline:
                raise self._timeout("thawing", timeout, still)
            self._signal(still, signal.SIGCONT)
            step = _sleep_step(step)

    def is_frozen(self) -> bool:
        return self._frozen and all(procfs.stopped(p) for p in self._members())

    def freeze_requested(self) -> bool:
        return self._frozen

    def remove(self) -> None:
        self.thaw()
        for path in (self.path, self.path + FROZEN_SUFFIX):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


class SignalFreezer(Freezer):
    name = "signal"
    _manual_thaw = "kill -CONT <pid> for each pid in the group's state file, then delete the file"

    @classmethod
    def probe(cls, root_name: str) -> SignalFreezer:
        # In KREX's state directory (krex.paths: its rules, its checks), beside the
        # daemon's socket and journal, so a restarted daemon or its watchdog finds it.
        return cls(os.path.join(paths.ensure_state_dir(), "freezer", root_name, "signal"))

    def __init__(self, root: str) -> None:
        super().__init__(root)
        try:
            os.makedirs(root, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise _error(exc, f"cannot create freezer state directory {root}") from exc

    def _open(self, name: str, create: bool) -> Group:
        path = os.path.join(self.root, f"{name}.json")
        if not create and not os.path.exists(path):
            raise NotFound(f"no freezer group {path}")
        group = _SignalGroup(name, path)
        if create and not os.path.exists(path):
            group._save()
        return group

    def _list(self) -> list[str]:
        try:
            return sorted(e[: -len(".json")] for e in os.listdir(self.root) if e.endswith(".json"))
        except FileNotFoundError:
            return []

    def _thaw_root(self) -> None:
        return None

    def remove_root(self) -> bool:
        if not super().remove_root():
            return False
        # Also drop the per-root_name directory above "signal" when it is empty.
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(self.root))
        return True

    def describe(self) -> str:
        return f"signal: SIGSTOP/SIGCONT of process trees, state in {self.root}" + self._fallback_note()
