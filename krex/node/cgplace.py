"""Where a slot's cgroup goes: below the cgroup of the process that asked for the slot.

A command must stay in the cgroup subtree it was started in: the memory and device limits,
the accounting and the kill of its Slurm job, Kubernetes pod or systemd scope apply to that
subtree only. So krexd makes a slot's group as ``<caller's cgroup>/krex-<root>-slot-N``,
where the caller is the `krex run` guardian (or the process that registered itself). Where
that is impossible (a cgroup krexd may not write, one outside its cgroup namespace, a
threaded subtree, ``cgroup.max.depth``), it tries krexd's own delegated subtree when it runs
as a systemd service, then its default root ``<mount>/<root>/slot-N``, and says so: the
Placement's note goes into `krex run`'s output, its report, krexd's log and the region
records.

cgroup v2's no-internal-process rule (a non-root cgroup that enables domain controllers for
its children may hold no process) never stands in the way: the caller's cgroup holds the
caller, so it enables no such controller (or it is the root, where the default root is
below it anyway); a child made there needs none, and what runs in it is charged to, and
limited by, the caller's cgroup and its ancestors. The freezer needs no controller
(``cgroup.freeze`` is in every non-root v2 cgroup; the v1 freezer nests freely).

Groups made below callers are listed in a small registry in krexd's state directory, so
that a restarted krexd and the watchdog find them again (recovery, thaw, removal).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from krex import paths
from krex.node import mounts, procfs

__all__ = [
    "Placement",
    "Registry",
    "cgroup_of",
    "dir_in_mount",
    "is_slot_dir",
    "mount_root",
    "nested_name",
    "ns_base",
    "proc_path",
    "service_cgroup",
]

_SLOT_DIR = re.compile(r"^(?:slot-\d+|krex-.+-slot-\d+)$")
_NESTED_SLOT = re.compile(r"^krex-.+-slot-\d+$")


def nested_name(root_name: str, slot_name: str) -> str:
    """The directory name of a slot group made below a caller's cgroup."""
    return f"krex-{root_name.replace('/', '-')}-{slot_name}"


def is_slot_dir(name: str, nested_only: bool = False) -> bool:
    """Whether a cgroup directory name is a KREX slot group's (either layout)."""
    return bool((_NESTED_SLOT if nested_only else _SLOT_DIR).fullmatch(name))


def cgroup_of(pid: int | str, v2: bool) -> str | None:
    """The cgroup of `pid` ("self" too) as /proc/PID/cgroup shows it: in the v2 hierarchy,
    or (v2 False) in the v1 hierarchy that has the freezer. None if unknown."""
    try:
        lines = procfs.read(f"/proc/{pid}/cgroup").splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if (v2 and parts[0] == "0" and parts[1] == "") or (not v2 and "freezer" in parts[1].split(",")):
            return parts[2]
    return None


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p]


def dir_in_mount(cg_path: str, mount_point: str, root: str, base: tuple[str, ...] = ()) -> str | None:
    """The directory of cgroup `cg_path` (as /proc/PID/cgroup shows it) in a mount of its
    hierarchy whose root is `root` (mountinfo's field). Both are relative to the reader's
    cgroup namespace; `base` (ns_base) is where that namespace's root lies in a mount of the
    tree above it (the host's /sys/fs/cgroup in a container: `root` is "/.."s). None when
    the mount does not show it (another namespace's tree, a mount of another subtree)."""
    want = _parts(cg_path)
    if cg_path.endswith(" (deleted)"):
        return None
    if base:
        rel = _resolve([*base, *want])
        return None if rel is None else os.path.join(mount_point, *rel)
    top = _parts(root)
    if want[: len(top)] != top or ".." in want[len(top) :]:
        return None
    return os.path.join(mount_point, *want[len(top) :])


def proc_path(directory: str, mount_point: str, root: str, base: tuple[str, ...] = ()) -> str:
    """The inverse of dir_in_mount: how /proc/PID/cgroup names `directory`."""
    rel = _parts(os.path.relpath(directory, mount_point)) if directory != mount_point else []
    if base:
        same = len(os.path.commonprefix([list(base), rel]))
        return "/" + "/".join([".."] * (len(base) - same) + rel[same:])
    return "/" + "/".join(_parts(root) + rel)


def _resolve(parts: list[str]) -> list[str] | None:
    out: list[str] = []
    for p in parts:
        if p != "..":
            out.append(p)
        elif not out:
            return None  # above the mount's root
        else:
            out.pop()
    return out


def ns_base(mount_point: str, root: str, v2: bool) -> tuple[str, ...]:
    """Where this process's cgroup namespace root lies in a mount whose root is above it
    (`root` is "/.." k times: a container's view of the host's cgroup tree), as components
    below the mount point: found as the directory k levels down whose cgroup below it (this
    process's own) lists this process. () when the mount is not above, or it is not found."""
    ups = _parts(root)
    own = _parts(cgroup_of("self", v2) or "/..")
    if not ups or any(p != ".." for p in ups) or ".." in own:
        return ()
    level = [mount_point]
    for _ in ups:
        nxt: list[str] = []
        for d in level:
            with contextlib.suppress(OSError), os.scandir(d) as it:
                nxt += [e.path for e in it if e.is_dir(follow_symlinks=False)]
        level = nxt
    me = str(os.getpid())
    for d in level:
        with contextlib.suppress(OSError):
            if me in procfs.read(os.path.join(d, *own, "cgroup.procs")).split():
                return tuple(_parts(os.path.relpath(d, mount_point)))
    return ()


def mount_root(mount_point: str) -> str:
    """mountinfo's root of the cgroup mount at `mount_point` ("/" when not found)."""
    with contextlib.suppress(Exception):
        for m in mounts.read_mounts():
            if m.mount_point == mount_point and m.fstype in ("cgroup", "cgroup2"):
                return m.root
    return "/"


def service_cgroup(v2: bool) -> str | None:
    """krexd's own cgroup when systemd runs it as a service (INVOCATION_ID set, the cgroup
    a `*.service`): the subtree `Delegate=yes` hands over. None otherwise: another
    daemon's cgroup (a job's, a pod's) is no place for other callers' commands."""
    if not os.environ.get("INVOCATION_ID"):
        return None
    own = cgroup_of("self", v2)
    return own if own and own.rstrip("/").endswith(".service") else None


@dataclass(frozen=True)
class Placement:
    """Where a slot's group went and why. `where`: "caller" (below the caller's cgroup, or
    the caller is at the hierarchy's root), "daemon" (krexd's delegated subtree), "root"
    (krexd's default root), "none" (the signal freezer moves no process)."""

    group: str  # the group's directory ("" for none)
    caller: str  # the caller's cgroup as /proc/PID/cgroup shows it ("" unknown)
    where: str
    reason: str = ""  # why not below the caller's cgroup

    @property
    def note(self) -> str:
        """`krex run`'s warning when the command left its caller's subtree; else ""."""
        if self.where in ("caller", "none"):
            return ""
        into = "krexd's own delegated cgroup subtree" if self.where == "daemon" else "krexd's cgroup root"
        return (
            f"krex: warning: the command runs in {into} ({self.group}), outside the cgroup "
            f"{self.caller or '(unknown)'} that `krex run` was started in ({self.reason}): the "
            "limits, accounting and kill of that job, pod or scope do not reach it"
        )

    def as_dict(self) -> dict[str, str]:
        out = {"group": self.group, "caller": self.caller, "placement": self.where}
        if self.note:
            out["note"] = self.note
            out["reason"] = self.reason
        return out


class Registry:
    """{group directory: slot name} of the groups made below callers' cgroups, as a JSON
    file (written whole, atomically). An entry is written before its directory is made, and
    dropped after it is removed, so a krexd killed in between leaves an entry, never an
    unknown group. Entries are trusted only if they name a directory of `mount` called as
    nested_name says (a planted entry cannot point krexd at another cgroup)."""

    def __init__(self, path: Path, mount: str, root_name: str) -> None:
        self.path = path
        self.mount = mount
        self.root_name = root_name
        self._lock = threading.Lock()

    def _valid(self, group: object, name: object) -> bool:
        if not isinstance(group, str) or not isinstance(name, str) or not re.fullmatch(r"slot-\d+", name):
            return False
        norm = os.path.normpath(group)
        return (
            norm == group
            and norm.startswith(self.mount.rstrip("/") + "/")
            and os.path.basename(norm) == nested_name(self.root_name, name)
        )

    def load(self) -> dict[str, str]:
        try:
            data = json.loads(procfs.read(str(self.path)))
        except (OSError, ValueError):
            return {}
        groups = data.get("groups") if isinstance(data, dict) else None
        if not isinstance(groups, dict):
            return {}
        return {g: n for g, n in groups.items() if self._valid(g, n)}

    def _save(self, groups: dict[str, str]) -> None:
        if not groups:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            return
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        fd = paths.open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, json.dumps({"groups": groups}, sort_keys=True).encode())
        finally:
            os.close(fd)
        os.replace(tmp, self.path)

    def add(self, group: str, name: str) -> None:
        with self._lock:
            groups = self.load()
            if groups.get(group) != name:
                groups[group] = name
                self._save(groups)

    def drop(self, group: str) -> None:
        with self._lock:
            groups = self.load()
            if groups.pop(group, None) is not None:
                self._save(groups)
