"""Freezing the sibling commands of a region on the CPU (region protocol, step 5).

Three backends share one interface and `detect()` picks the first that works (the signal
backend lives in krex/node/sigfreezer.py):

- ``cgroup2``: write ``cgroup.freeze`` and wait until ``cgroup.events`` says ``frozen 1``.
  Works with the v2 hierarchy mounted at /sys/fs/cgroup (pure) or /sys/fs/cgroup/unified (hybrid).
- ``cgroup1``: the v1 freezer controller (``freezer.state``: FROZEN, wait while it reads FREEZING).
- ``signal``: SIGSTOP/SIGCONT of process trees, for machines where no cgroup is writable.
  Its state lives in a small JSON file per group so that a restarted daemon can still thaw.

A slot's group goes below the cgroup of the process that asked for the slot
(``<caller's cgroup>/krex-<root_name>-<slot_name>``: `place()`, krex/node/cgplace.py says
why and where else), or in the default root ``<hierarchy>/<root_name>/<slot_name>``, whose
parent never holds processes itself. Nothing here ever kills a process; the library never
prints. Reading /proc is krex/node/procfs.py, finding the hierarchies krex/node/mounts.py.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import os
import re
import select
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from krex import paths
from krex.errors import KrexError, NotFound, PermissionDenied, Timeout, UsageError, error_kind
from krex.native import lib
from krex.node import cgplace, mounts, procfs
from krex.node.cgplace import Placement

FREEZE_TIMEOUT_S = lib.KREX_FREEZE_TIMEOUT_MS / 1e3  # krexd's default; a freeze or thaw gives up after it

__all__ = [
    "BACKENDS",
    "Freezer",
    "Group",
    "Placement",
    "detect",
    "leave_slot_groups",
    "preexec_join",
]

BACKENDS = ("cgroup2", "cgroup1", "signal")

_NAME_RE = re.compile(r"^[A-Za-z0-9_+@:=-][A-Za-z0-9_.+@:=-]{0,199}$")
_FIX_ROOT = "run krexd as root, or delegate a writable cgroup subtree to the user running it"
_FIX_RO = "the cgroup filesystem is mounted read-only (a container without cgroup access?)"


# ---------------------------------------------------------------------------------------------
# errors and names


def _error(exc: OSError, what: str, fix: str = "") -> KrexError:
    kind = error_kind(exc)
    if not fix and kind is PermissionDenied:
        fix = _FIX_RO if exc.errno == errno.EROFS else _FIX_ROOT
    return kind(f"{what}: {exc.strerror or exc}", fix)


def _check_name(kind: str, name: str, allow_slash: bool = False) -> str:
    parts = name.split("/") if allow_slash else [name]
    for part in parts:
        if not _NAME_RE.fullmatch(part) or part.startswith("cgroup."):
            raise UsageError(
                f"invalid {kind} {name!r}",
                "use letters, digits and _.+@:=- (no leading dot, not 'cgroup.*', at most 200 characters)",
            )
    return name


def _sleep_step(step: float) -> float:
    time.sleep(step)
    return min(step * 2, 0.005)


def _noop() -> None:
    return None


def leave_slot_groups(pid: int = 0) -> list[str]:
    """Move `pid` (default: this process) out of any KREX slot cgroup. krexd calls it at
    start: a daemon started on demand by a command's process (the region API, the shim) is
    born in that command's slot group, and would freeze itself with it in another command's
    region. It goes to the cgroup the group was made below (the caller's: krexd stays in the
    job or pod that started it), or, from the default root, to the hierarchy's root.
    Returns the groups it left."""
    pid = pid or os.getpid()
    left: list[str] = []
    try:
        lines = procfs.read(f"/proc/{pid}/cgroup").splitlines()
    except OSError:
        return left
    found = mounts.read_mounts()
    v2, v1 = mounts.cgroup2_mounts(found), mounts.cgroup1_freezer_mounts(found)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, ctrl, path = parts
        comps = path.split("/")
        at = [i for i, c in enumerate(comps) if cgplace.is_slot_dir(c)]
        if not at:
            continue
        slot_path = "/".join(comps[: at[-1] + 1])
        for mount in v2 if hid == "0" else (v1 if "freezer" in ctrl.split(",") else []):
            slot_dir = cgplace.dir_in_mount(slot_path, mount, cgplace.mount_root(mount))
            if slot_dir is None or not os.path.isdir(slot_dir):
                continue
            nested = cgplace.is_slot_dir(comps[at[-1]], nested_only=True)
            for target in [os.path.dirname(slot_dir)] * nested + [mount]:
                with contextlib.suppress(OSError):
                    procfs.write(os.path.join(target, "cgroup.procs"), str(pid))
                    left.append(slot_dir)
                    break
            break
    return left


def preexec_join(group_path: str) -> Callable[[], None]:
    """A `subprocess` preexec_fn that moves the child into a cgroup before it execs.

    The child writes its own pid into ``cgroup.procs``, so its first instruction already runs
    inside the group and every process it forks inherits the group. For the signal backend (whose
    group path is not a cgroup) this is a no-op; register the child with ``Group.add()``.
    """
    procs = os.path.join(group_path, "cgroup.procs") if group_path else ""
    if not procs or not os.path.isfile(procs):
        return _noop

    def join() -> None:
        # Raw os.open/os.write, no buffered file object: this runs between fork and exec.
        fd = os.open(procs, os.O_WRONLY)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)

    return join


# ---------------------------------------------------------------------------------------------
# interface


class Group(abc.ABC):
    """One slot's set of processes that is frozen and thawed as a whole."""

    backend: str = ""

    def __init__(self, name: str, path: str) -> None:
        # Threads a slow freeze had not stopped yet, read once it passed _SLOW_FREEZE_S:
        # the region record says what a freeze waited for (empty: it was quick).
        self.slow: list[str] = []
        self.name = name
        self.path = path  # cgroup directory, or the signal backend's state file
        self.on_removed: Callable[[str], None] | None = None  # its Freezer forgets it

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} at {self.path}>"

    @abc.abstractmethod
    def add(self, pid: int) -> None:
        """Put a process, and the descendants it already has, into the group."""

    @abc.abstractmethod
    def pids(self) -> list[int]: ...

    @abc.abstractmethod
    def freeze(self, timeout: float = FREEZE_TIMEOUT_S) -> float:
        """Freeze and return the seconds until the kernel reported every process stopped.

        On Timeout the freeze stays requested (stragglers stop once they can); call thaw()."""

    @abc.abstractmethod
    def thaw(self, timeout: float = FREEZE_TIMEOUT_S) -> float: ...

    @abc.abstractmethod
    def is_frozen(self) -> bool: ...

    @abc.abstractmethod
    def freeze_requested(self) -> bool:
        """Whether someone asked for this group to be frozen (even if not every process is yet)."""

    @abc.abstractmethod
    def remove(self) -> None:
        """Thaw and forget the group. Processes still in it keep running; nothing is killed."""

    def preexec(self) -> Callable[[], None]:
        return preexec_join(self.path)

    def kill_all(self, pids: Iterable[int]) -> None:
        """SIGKILL these processes (a finished command's leftovers). A frozen group is thawed
        once the signal is queued: a task with SIGKILL pending exits without running user code,
        which the cgroup v1 freezer needs before the signal can land."""
        for pid in pids:
            if pid <= 0 or pid in procfs.self_and_ancestors():
                continue
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(KrexError, OSError):
            if self.freeze_requested() or self.is_frozen():
                self.thaw()

    def _guard(self, pid: int) -> None:
        # Freezing the daemon (or what it runs under) would deadlock the region protocol.
        if pid <= 0 or pid in procfs.self_and_ancestors():
            raise UsageError(
                f"refusing to put pid {pid} into freezer group {self.name}: it is this process or one "
                "of its ancestors",
                "add only the command's process tree",
            )

    def _timeout(self, what: str, timeout: float, stragglers: list[int]) -> Timeout:
        return Timeout(
            f"{what} {self.backend} group {self.name} did not finish within {timeout:g}s; "
            f"{len(stragglers)} process(es) did not stop: {stragglers}",
            "a process in uninterruptible sleep (D state, e.g. inside a driver call) stops only when the "
            "call returns; raise the timeout or mark the region contaminated",
            stragglers=stragglers,
        )


class Freezer(abc.ABC):
    """A backend plus the parent group (or state directory) holding one group per slot."""

    name: str = ""
    _manual_thaw: str = ""

    def __init__(self, root: str) -> None:
        self.root = root
        self.fallback_reasons: list[str] = []  # why detect() skipped the backends before this one
        self._own: set[str] = set()  # paths of the groups this Freezer handed out

    def group(self, slot_name: str, parent: str | None = None) -> Group:
        """The group of one slot, made if needed. Without `parent`: the slot's existing group
        wherever it is (what a restarted krexd finds again), else a new one in the default
        root. With `parent` (a cgroup directory; the default root's own for that layout): a
        new one below it, unless the slot's existing group still holds processes: then that
        one (krexd adopts them as orphans). One group per slot: an empty one elsewhere is
        removed."""
        _check_name("slot name", slot_name)
        existing = self._existing(slot_name)
        live = next((g for g in existing if g.pids()), None)
        if live is not None:
            group = live
        elif parent is None and existing:
            group = existing[0]
        else:
            group = self._create(slot_name, parent)
            for old in existing:
                if old.path != group.path:
                    with contextlib.suppress(KrexError, OSError):
                        old.remove()
        self._own.add(group.path)
        return group

    def place(self, slot_name: str, pid: int) -> tuple[Group, Placement]:
        """The group of a new slot asked for by process `pid`, and where it went. The signal
        freezer moves no process: the command stays wherever it was started."""
        group = self.group(slot_name)
        return group, Placement(group.path, "", "none")

    def proc_path(self, group: Group) -> str | None:
        """How /proc/PID/cgroup names the group (None: it is not a cgroup)."""
        return None

    def leftover_groups(self) -> list[Group]:
        """Groups that exist but were not handed out by this Freezer: a previous daemon's."""
        return [g for g in self._all() if g.path not in self._own]

    def leftovers(self) -> list[str]:
        return sorted(g.name for g in self.leftover_groups())

    def thaw_all(self) -> int:
        """Thaw every group of this root (nested ones too) that is frozen or being frozen
        (the watchdog's rescue when krexd hangs); removes nothing. Returns how many."""
        n = 0
        for group in self._all():
            with contextlib.suppress(KrexError, OSError):
                if group.freeze_requested() or group.is_frozen():
                    group.thaw()
                    n += 1
        return n

    def recover(self) -> int:
        """Thaw every leftover group and remove the empty ones. Returns how many were thawed.

        Keeps going past a group that fails, so one bad group cannot keep the others frozen."""
        self._thaw_root()
        thawed = 0
        failures: list[str] = []
        for group in self.leftover_groups():
            try:
                if group.freeze_requested() or group.is_frozen():
                    group.thaw()
                    thawed += 1
                if not group.pids():
                    group.remove()
            except KrexError as exc:
                failures.append(f"{group.path}: {exc}")
        self._prune()
        if failures:
            raise KrexError(
                f"recover() left {len(failures)} group(s) of {self.root} unrecovered: " + "; ".join(failures),
                f"thaw them by hand: {self._manual_thaw}",
            )
        return thawed

    def _existing(self, slot_name: str) -> list[Group]:
        """The slot's groups that exist: in the default root first, then nested ones."""
        out: list[Group] = []
        with contextlib.suppress(NotFound):
            out.append(self._open(slot_name, create=False))
        return out + [g for g in self._nested() if g.name == slot_name]

    def _all(self) -> list[Group]:
        out: list[Group] = []
        for name in self._list():
            with contextlib.suppress(KrexError, OSError):
                out.append(self._open(name, create=False))
        return out + self._nested()

    def _nested(self) -> list[Group]:
        """Groups made below callers' cgroups (none for the signal freezer)."""
        return []

    def _create(self, slot_name: str, parent: str | None) -> Group:
        return self._open(slot_name, create=True)

    def _prune(self) -> None:
        """Forget what names groups that no longer exist (krexd only: one writer)."""
        return None

    def remove_root(self) -> bool:
        """Remove the parent group if no slot group is left in it (daemon shutdown)."""
        if self._list():
            return False
        try:
            os.rmdir(self.root)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return True

    @abc.abstractmethod
    def describe(self) -> str: ...

    @abc.abstractmethod
    def _open(self, name: str, create: bool) -> Group: ...

    @abc.abstractmethod
    def _list(self) -> list[str]: ...

    @abc.abstractmethod
    def _thaw_root(self) -> None: ...

    def _fallback_note(self) -> str:
        return f" (skipped: {'; '.join(self.fallback_reasons)})" if self.fallback_reasons else ""


# ---------------------------------------------------------------------------------------------
# cgroups (shared by v1 and v2)


class _CgroupGroup(Group):
    def add(self, pid: int) -> None:
        self._guard(pid)
        self._move(pid, missing_ok=False)
        # Children forked before the move stay where they were; chase them until none is left
        # outside (each pass moves one more generation).
        for _ in range(64):
            inside = set(self.pids())
            outside = procfs.descendants([pid], procfs.proc_table()) - inside
            if not outside:
                return
            for child in sorted(outside):
                self._move(child, missing_ok=True)
        raise KrexError(
            f"the process tree of pid {pid} keeps forking outside group {self.name}",
            "start the command with preexec_join() so that it is in the group before it execs",
        )

    def _move(self, pid: int, missing_ok: bool) -> None:
        try:
            procfs.write(os.path.join(self.path, "cgroup.procs"), str(pid))
        except OSError as exc:
            if missing_ok and exc.errno in (errno.ESRCH, errno.ENOENT):
                return  # it exited meanwhile
            if exc.errno == errno.ESRCH:
                raise NotFound(f"no process {pid} to add to group {self.name}") from exc
            raise _error(exc, f"cannot move pid {pid} into {self.path}") from exc

    def _tree(self) -> list[str]:
        """This group's directory and every one below it, parents first. os.scandir, not
        os.walk: a cgroup directory holds dozens of interface files, and os.walk made a
        string of each (7% of krexd's time per command on a 16-core node)."""
        out = [self.path]
        for d in out:  # grows while it is walked: breadth first
            try:
                with os.scandir(d) as it:
                    out.extend(e.path for e in it if e.is_dir(follow_symlinks=False))
            except OSError:
                continue
        return out

    def pids(self) -> list[int]:
        found: set[int] = set()
        for dirpath in self._tree():
            try:
                text = procfs.read(os.path.join(dirpath, "cgroup.procs"))
            except OSError:
                continue
            found.update(int(x) for x in text.split())
        return sorted(found)

    def remove(self) -> None:
        if not os.path.isdir(self.path):
            if self.on_removed is not None:  # removed by someone else (a guardian krexd left)
                self.on_removed(self.path)
            return
        self.thaw()
        # rmdir of a populated cgroup fails with EBUSY, which is what keeps this from ever
        # touching a live process: such a group is left in place, thawed, for recover() later.
        for dirpath in reversed(self._tree()):  # children before their parents
            try:
                os.rmdir(dirpath)
            except OSError as exc:
                if exc.errno in (errno.EBUSY, errno.ENOTEMPTY):
                    return
                if exc.errno != errno.ENOENT:
                    raise _error(exc, f"cannot remove cgroup {dirpath}") from exc
        if self.on_removed is not None:
            self.on_removed(self.path)

    def _slow_snapshot(self) -> list[str]:
        return procfs.unfrozen_threads(self.pids()) or ["(every thread stopped by now)"]

    def _stragglers(self) -> list[int]:
        pids = self.pids()
        return [p for p in pids if procfs.still_running(p)] or pids


_REREAD_S = 0.0001  # cgroup.events re-read step while a v2 freeze or thaw is young
_REREAD_FOR_S = 0.02
_SLOW_FREEZE_S = _REREAD_FOR_S  # a freeze this long gets a snapshot of what it waits for


class _Cgroup2Group(_CgroupGroup):
    backend = "cgroup2"

    def kill_all(self, pids: Iterable[int]) -> None:
        # cgroup.kill (Linux 5.14+) also gets what forks while we enumerate.
        with contextlib.suppress(OSError):
            procfs.write(os.path.join(self.path, "cgroup.kill"), "1")
        super().kill_all(pids)

    def freeze(self, timeout: float = FREEZE_TIMEOUT_S) -> float:
        return self._set(True, timeout)

    def thaw(self, timeout: float = FREEZE_TIMEOUT_S) -> float:
        return self._set(False, timeout)

    def is_frozen(self) -> bool:
        try:
            return procfs.keyed(procfs.read(os.path.join(self.path, "cgroup.events")), "frozen") == "1"
        except OSError:
            return False

    def freeze_requested(self) -> bool:
        try:
            return procfs.read(os.path.join(self.path, "cgroup.freeze")).strip() == "1"
        except OSError:
            return False

    def _set(self, frozen: bool, timeout: float) -> float:
        t0 = time.perf_counter()
        self.slow = []
        try:
            procfs.write(os.path.join(self.path, "cgroup.freeze"), "1" if frozen else "0")
        except OSError as exc:
            raise _error(exc, f"cannot write {self.path}/cgroup.freeze") from exc
        if not self._wait_events("1" if frozen else "0", time.monotonic() + timeout, frozen):
            if frozen:
                raise self._timeout("freezing", timeout, self._stragglers())
            raise self._timeout("thawing", timeout, [])
        return time.perf_counter() - t0

    def _wait_events(self, want: str, deadline: float, freezing: bool = False) -> bool:
        # cgroup.events supports poll(POLLPRI), but the kernel sends that notification through
        # a workqueue: it came 10-20 ms late in about one freeze in ten (benchmarks/freeze_latency.py:
        # 8 groups, p90 11.6 ms woken by poll against 3.1 ms re-reading). So the file is re-read
        # every _REREAD_S for the first _REREAD_FOR_S (a freeze takes 1-3 ms), then polled.
        path = os.path.join(self.path, "cgroup.events")
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise _error(exc, f"cannot open {path}") from exc
        try:
            poller = select.poll()
            poller.register(fd, select.POLLPRI | select.POLLERR)
            reread_until = time.monotonic() + _REREAD_FOR_S
            while True:
                os.lseek(fd, 0, os.SEEK_SET)
                if procfs.keyed(os.read(fd, 4096).decode(), "frozen") == want:
                    return True
                now = time.monotonic()
                left = deadline - now
                if left <= 0:
                    return False
                if now < reread_until:
                    time.sleep(_REREAD_S)
                else:
                    if freezing and not self.slow:
                        self.slow = self._slow_snapshot()
                    poller.poll(min(left, 0.05) * 1000)
        finally:
            os.close(fd)


class _Cgroup1Group(_CgroupGroup):
    backend = "cgroup1"

    def _state(self) -> str:
        try:
            return procfs.read(os.path.join(self.path, "freezer.state")).strip()
        except OSError as exc:
            raise _error(exc, f"cannot read {self.path}/freezer.state") from exc

    def _request(self, state: str) -> None:
        try:
            procfs.write(os.path.join(self.path, "freezer.state"), state)
        except OSError as exc:
            raise _error(exc, f"cannot write {self.path}/freezer.state") from exc

    def freeze(self, timeout: float = FREEZE_TIMEOUT_S) -> float:
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        self.slow = []
        self._request("FROZEN")
        step, last_push = 0.0002, time.monotonic()
        while self._state() != "FROZEN":
            now = time.monotonic()
            if not self.slow and time.perf_counter() - t0 > _SLOW_FREEZE_S:
                self.slow = self._slow_snapshot()
            if now >= deadline:
                raise self._timeout("freezing", timeout, self._stragglers())
            if now - last_push > 0.1:
                # Writing FROZEN again makes the kernel retry tasks that slipped past it.
                self._request("FROZEN")
                last_push = now
            step = _sleep_step(step)
        return time.perf_counter() - t0

    def thaw(self, timeout: float = FREEZE_TIMEOUT_S) -> float:
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        self._request("THAWED")
        step = 0.0002
        while self._state() != "THAWED":
            if time.monotonic() >= deadline:
                raise self._timeout("thawing", timeout, [])
            step = _sleep_step(step)
        return time.perf_counter() - t0

    def is_frozen(self) -> bool:
        try:
            return self._state() == "FROZEN"
        except KrexError:
            return False

    def freeze_requested(self) -> bool:
        try:
            return procfs.read(os.path.join(self.path, "freezer.self_freezing")).strip() == "1"
        except OSError:
            return False


class _CgroupFreezer(Freezer):
    _group_cls: type[_CgroupGroup]

    def __init__(self, root: str, mount: str) -> None:
        super().__init__(root)
        self.mount = mount
        self.mount_root = cgplace.mount_root(mount)
        # In a container shown the host's tree: where its cgroup namespace sits in it.
        self.ns_base = cgplace.ns_base(mount, self.mount_root, self.name == "cgroup2")
        self.root_name = os.path.relpath(root, mount)
        where = _registry_path(None, self.root_name, self.name)
        self.registry = cgplace.Registry(where, mount, self.root_name)

    def place(self, slot_name: str, pid: int) -> tuple[Group, Placement]:
        """Below the cgroup of `pid` when krexd can make a group there; else, as a systemd
        service, below krexd's own (delegated) cgroup; else in the default root. A reason is
        kept for each place skipped (Placement.note)."""
        v2 = self.name == "cgroup2"
        caller = cgplace.cgroup_of(pid, v2) or ""
        reasons: list[str] = []
        tries: list[tuple[str, str]] = []
        here = cgplace.dir_in_mount(caller, self.mount, self.mount_root, self.ns_base) if caller else None
        if here is None:
            reasons.append(
                f"krexd does not see cgroup {caller} in {self.mount} (another cgroup namespace)"
                if caller
                else f"cannot read /proc/{pid}/cgroup"
            )
        else:  # the hierarchy's root itself: the default root is below it
            top = os.path.normpath(here) == os.path.normpath(self.mount)
            tries.append((self.root if top else here, "caller"))
        svc = cgplace.service_cgroup(v2)
        own = cgplace.dir_in_mount(svc, self.mount, self.mount_root, self.ns_base) if svc else None
        if own is not None and own not in (here, self.mount) and os.path.isdir(own):
            tries.append((own, "daemon"))
        tries.append((self.root, "root"))
        for i, (parent, where) in enumerate(tries):
            try:
                group = self.group(slot_name, parent)
                if parent != self.root:
                    self._check_usable(group)
            except KrexError as exc:
                if i == len(tries) - 1:
                    raise
                reasons.append(str(exc))
                continue
            return group, Placement(group.path, caller, where, "; ".join(reasons))
        raise AssertionError("unreachable: the default root is the last try")

    def _check_usable(self, group: Group) -> None:
        return None

    def proc_path(self, group: Group) -> str | None:
        return cgplace.proc_path(group.path, self.mount, self.mount_root, self.ns_base)

    def _at(self, name: str, path: str) -> Group:
        group = self._group_cls(name, path)
        group.on_removed = self._forget
        return group

    def _open(self, name: str, create: bool) -> Group:
        return self._at(name, self._make_dir(name, create))

    def _nested(self) -> list[Group]:
        return [self._at(n, p) for p, n in sorted(self.registry.load().items()) if os.path.isdir(p)]

    def _create(self, slot_name: str, parent: str | None) -> Group:
        if parent is None or os.path.normpath(parent) == os.path.normpath(self.root):
            return self._open(slot_name, create=True)
        path = os.path.join(parent, cgplace.nested_name(self.root_name, slot_name))
        try:  # listed before it is made: a krexd killed in between leaves no unknown group
            self.registry.add(path, slot_name)
        except (OSError, KrexError) as exc:
            raise KrexError(f"cannot list {path} in {self.registry.path}: {exc}") from exc
        try:
            os.mkdir(path)
        except FileExistsError:
            pass
        except OSError as exc:
            self.registry.drop(path)
            raise _error(exc, f"cannot create cgroup {path}") from exc
        return self._at(slot_name, path)

    def _forget(self, path: str) -> None:
        self._own.discard(path)
        with contextlib.suppress(OSError, KrexError):
            self.registry.drop(path)

    def _prune(self) -> None:
        for path in self.registry.load():
            if not os.path.isdir(path):
                self._forget(path)

    def remove_root(self) -> bool:
        if not super().remove_root():
            return False
        with contextlib.suppress(OSError):  # the registry's directory, once nothing is listed
            os.rmdir(self.registry.path.parent)
        return True

    def _list(self) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise _error(exc, f"cannot list {self.root}") from exc

    def _make_dir(self, name: str, create: bool) -> str:
        path = os.path.join(self.root, name)
        if create:
            try:
                os.makedirs(path, exist_ok=True)
            except OSError as exc:
                raise _error(exc, f"cannot create cgroup {path}") from exc
        elif not os.path.isdir(path):
            raise NotFound(f"no freezer group {path}")
        return path


class Cgroup2Freezer(_CgroupFreezer):
    name = "cgroup2"
    _group_cls = _Cgroup2Group
    _manual_thaw = "echo 0 > <group>/cgroup.freeze"

    @classmethod
    def probe(cls, mount: str, root_name: str) -> Cgroup2Freezer:
        root = os.path.join(mount, root_name)
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as exc:
            raise _error(exc, f"cannot create cgroup {root}") from exc
        if not os.path.exists(os.path.join(root, "cgroup.freeze")):
            raise NotFound(
                f"{root} has no cgroup.freeze: the kernel's cgroup v2 has no freezer",
                "use Linux >= 5.2, or the cgroup1/signal backend",
            )
        try:
            # Thawing the parent is harmless (we never freeze it) and proves we may write.
            procfs.write(os.path.join(root, "cgroup.freeze"), "0")
        except OSError as exc:
            raise _error(exc, f"cannot write {root}/cgroup.freeze") from exc
        return cls(root, mount)

    def _check_usable(self, group: Group) -> None:
        # A child of a threaded cgroup is "domain invalid": no process may enter it.
        with contextlib.suppress(OSError):
            if procfs.read(os.path.join(group.path, "cgroup.type")).strip() == "domain invalid":
                group.remove()
                raise KrexError(f"{os.path.dirname(group.path)} is in a threaded cgroup subtree")

    def _thaw_root(self) -> None:
        with contextlib.suppress(OSError):
            procfs.write(os.path.join(self.root, "cgroup.freeze"), "0")

    def describe(self) -> str:
        layout = (
            "pure" if self.mount == "/sys/fs/cgroup" else "hybrid" if "unified" in self.mount else "other"
        )
        return (
            f"cgroup2: cgroup.freeze, slot groups below each command's caller, else under {self.root} "
            f"(v2 mounted at {self.mount}, {layout})"
            + self._fallback_note()
        )


class Cgroup1Freezer(_CgroupFreezer):
    name = "cgroup1"
    _group_cls = _Cgroup1Group
    _manual_thaw = "echo THAWED > <group>/freezer.state"

    @classmethod
    def probe(cls, mount: str, root_name: str) -> Cgroup1Freezer:
        root = os.path.join(mount, root_name)
        try:
            os.makedirs(root, exist_ok=True)
            procfs.write(os.path.join(root, "freezer.state"), "THAWED")
        except OSError as exc:
            raise _error(exc, f"cannot set up v1 freezer group {root}") from exc
        return cls(root, mount)

    def _thaw_root(self) -> None:
        with contextlib.suppress(OSError):
            procfs.write(os.path.join(self.root, "freezer.state"), "THAWED")

    def describe(self) -> str:
        return (
            f"cgroup1: freezer.state, slot groups below each command's caller, else under {self.root} "
            f"(v1 freezer at {self.mount})" + self._fallback_note()
        )


# ---------------------------------------------------------------------------------------------
# detection


def _make(backend: str, root_name: str) -> Freezer:
    if backend == "signal":
        from krex.node.sigfreezer import SignalFreezer  # imports this module

        return SignalFreezer.probe(root_name)
    found = mounts.read_mounts()
    if backend == "cgroup2":
        points = mounts.cgroup2_mounts(found)
        if not points:
            raise NotFound(
                f"no cgroup v2 hierarchy is mounted (none in {mounts.MOUNTINFO})",
                "mount -t cgroup2 none /sys/fs/cgroup, or choose the cgroup1 or signal freezer",
            )
        probe2: Callable[[str, str], Freezer] = Cgroup2Freezer.probe
        return _first(points, root_name, probe2)
    points = mounts.cgroup1_freezer_mounts(found)
    if not points:
        raise NotFound(
            f"no cgroup v1 freezer hierarchy is mounted (none in {mounts.MOUNTINFO})",
            "mount -t cgroup -o freezer freezer /sys/fs/cgroup/freezer, or choose another freezer",
        )
    probe1: Callable[[str, str], Freezer] = Cgroup1Freezer.probe
    return _first(points, root_name, probe1)


def _first(points: list[str], root_name: str, probe: Callable[[str, str], Freezer]) -> Freezer:
    errors: list[KrexError] = []
    for point in points:
        try:
            return probe(point, root_name)
        except KrexError as exc:
            errors.append(exc)
    # A permission problem is the more useful report: it is the one an operator can fix.
    denied = [e for e in errors if isinstance(e, PermissionDenied)]
    raise (denied or errors)[0]


def root_name_for(shm_name: str) -> str:
    """The parent group of a daemon serving segment `shm_name` (one per segment: two daemons
    on other segments never share groups)."""
    return shm_name.strip("/").replace("/", "-") or "krex"


def _registry_path(state_dir: str | None, root_name: str, backend: str) -> Path:
    base = Path(state_dir) if state_dir else paths.state_dir()
    return base / "freezer" / root_name.replace("/", "-") / f"{backend}-groups.json"


def remove_leftovers(shm_name: str, state_dir: str | None = None) -> None:
    """Thaw and remove the empty groups a killed daemon of `shm_name` left (in its default
    root, and those below callers' cgroups listed in `state_dir`, default: this process's
    state directory), and their parent, under every cgroup backend that works here (tests'
    and checks' clean-up; a daemon's own start recovers them instead)."""
    for backend in ("cgroup2", "cgroup1"):
        with contextlib.suppress(KrexError):
            fz = _make(backend, root_name_for(shm_name))
            if isinstance(fz, _CgroupFreezer):
                fz.registry.path = _registry_path(state_dir, fz.root_name, fz.name)
            with contextlib.suppress(KrexError):
                fz.recover()
            fz.remove_root()


def detect(prefer: str | None = None, root_name: str = "krex") -> Freezer:
    """Return a working freezer: `prefer` forces one backend, None tries cgroup2, cgroup1, signal.

    A forced backend that cannot work raises NotFound or PermissionDenied with a fix."""
    if prefer is not None and prefer not in BACKENDS:
        raise UsageError(f"unknown freezer backend {prefer!r}", f"choose one of {', '.join(BACKENDS)}")
    _check_name("freezer root name", root_name, allow_slash=True)
    if prefer is not None:
        return _make(prefer, root_name)
    reasons: list[str] = []
    for backend in ("cgroup2", "cgroup1"):
        try:
            freezer = _make(backend, root_name)
        except KrexError as exc:  # any reason a cgroup backend cannot work means: try the next one
            reasons.append(f"{backend}: {exc}")
            continue
        freezer.fallback_reasons = reasons
        return freezer
    freezer = _make("signal", root_name)
    freezer.fallback_reasons = reasons
    return freezer
