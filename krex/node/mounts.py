"""/proc/self/mountinfo: which cgroup hierarchies are mounted where."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from krex.errors import NotFound

MOUNTINFO = "/proc/self/mountinfo"


@dataclass(frozen=True)
class Mount:
    mount_point: str
    root: str  # the hierarchy path that is visible at mount_point
    fstype: str
    options: tuple[str, ...]  # per-mount options (rw/ro, ...)
    super_options: tuple[str, ...]  # per-superblock options (v1 controllers live here)


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    mounts: list[Mount] = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if sep < 6 or len(fields) < sep + 4:
            continue
        mounts.append(
            Mount(
                mount_point=_unescape(fields[4]),
                root=_unescape(fields[3]),
                fstype=fields[sep + 1],
                options=tuple(fields[5].split(",")),
                super_options=tuple(fields[sep + 3].split(",")),
            )
        )
    return mounts


def read_mounts() -> list[Mount]:
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as f:
            return parse_mountinfo(f.read())
    except OSError as exc:
        raise NotFound(f"cannot read {MOUNTINFO}: {exc.strerror}", "mount /proc") from exc


def cgroup2_mounts(mounts: Iterable[Mount]) -> list[str]:
    """Mount points of the v2 hierarchy, the canonical places first (pure, then hybrid)."""
    order = {"/sys/fs/cgroup": 0, "/sys/fs/cgroup/unified": 1}
    found = [m.mount_point for m in mounts if m.fstype == "cgroup2"]
    return sorted(dict.fromkeys(found), key=lambda p: order.get(p, 2))


def cgroup1_freezer_mounts(mounts: Iterable[Mount]) -> list[str]:
    found = [m.mount_point for m in mounts if m.fstype == "cgroup" and "freezer" in m.super_options]
    return list(dict.fromkeys(found))
