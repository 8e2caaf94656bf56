"""The region journal: one JSON line per region, appended by krexd.

A journal is read by every `krex run --report`, `krex journal` and `krex batch`,
so one bad line (a torn write after a crash, a hand edit, a stray byte) must never
break them: lines that are not a JSON object with a numeric "ts" are skipped and
counted. The file rotates by size (`journal.jsonl` -> `.1` -> `.2`), so it never
grows without bound; readers read the rotated files too, oldest first."""

from __future__ import annotations

import json
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from krex.errors import KrexError, NotFound, error_kind
from krex.paths import open_private

DEFAULT_MAX_BYTES = 16 << 20
_READ_FIX = ("run as krexd's user, or as a member of the group it shares its state with "
             "(krexd's `group` setting)")
KEEP = 2  # rotated files kept: journal.jsonl.1, journal.jsonl.2


def max_bytes() -> int:
    """$KREX_JOURNAL_MAX_BYTES, else 16 MiB. A bad value falls back to the default:
    the daemon must not fail over its journal."""
    raw = os.environ.get("KREX_JOURNAL_MAX_BYTES", "")
    try:
        v = int(raw)
    except ValueError:
        return DEFAULT_MAX_BYTES
    return v if v > 0 else DEFAULT_MAX_BYTES


def rotated(path: Path, n: int) -> Path:
    return path.with_name(f"{path.name}.{n}")


def _rotate(path: Path, keep: int) -> None:
    for n in range(keep, 1, -1):
        src = rotated(path, n - 1)
        if src.exists():
            os.replace(src, rotated(path, n))
    os.replace(path, rotated(path, 1))


def append(path: Path, record: dict[str, Any], limit: int | None = None, keep: int = KEEP) -> None:
    """Append one record (one O_APPEND write, so readers never see half a line).
    Before the file would pass `limit` bytes it is rotated. Never follows a symlink
    nor writes a file that is not ours (paths.open_private). Single writer: krexd
    serialises its calls. Raises OSError or KrexError; krexd records and goes on."""
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    limit = max_bytes() if limit is None else limit
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    fd = open_private(path, flags)
    try:
        size = os.fstat(fd).st_size
        if size and size + len(line) > limit:
            os.close(fd)
            fd = -1
            _rotate(path, keep)
            fd = open_private(path, flags)
        os.write(fd, line)
    finally:
        if fd >= 0:
            os.close(fd)


@dataclass
class Read:
    records: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0  # lines that were not a valid record


def _valid(obj: Any) -> bool:
    if not isinstance(obj, dict):
        return False
    ts = obj.get("ts")
    return isinstance(ts, (int, float)) and not isinstance(ts, bool) and math.isfinite(ts)


def _read_file(p: Path, out: deque[dict[str, Any]], res: Read) -> None:
    try:
        with open(p, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return
    except IsADirectoryError:
        raise KrexError(
            f"the journal {p} is a directory, not a file", f"remove or rename {p}; krexd recreates it"
        ) from None
    except OSError as e:
        raise error_kind(e)(f"cannot read the journal {p}: {e.strerror}", _READ_FIX) from None
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for raw in lines:
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw.decode("utf-8"))
        except ValueError:  # includes UnicodeDecodeError: a torn line, a stray byte
            res.skipped += 1
            continue
        if _valid(obj):
            out.append(obj)
        else:
            res.skipped += 1


def read_counted(path: Path, last: int | None = None) -> Read:
    """Records of `path` and its rotated files, oldest first; bad lines are counted
    in `skipped`. Raises NotFound when there is no journal at all."""
    files = [rotated(path, n) for n in range(KEEP, 0, -1)] + [path]
    try:
        present = [f for f in files if os.path.lexists(f) or f.exists()]
    except OSError as e:  # its directory is not ours to read (another user's shared daemon)
        raise error_kind(e)(f"cannot read the journal {path}: {e.strerror}", _READ_FIX) from None
    if not present:
        raise NotFound(
            f"no journal at {path}: no region has run yet",
            "run a command that marks a region, e.g. krex run -- python bench.py",
        )
    res = Read()
    out: deque[dict[str, Any]] = deque(maxlen=last)
    for f in files:
        _read_file(f, out, res)
    res.records = list(out)
    return res


def when(rec: dict[str, Any]) -> str:
    """A record's end time, local, as `MM-DD HH:MM:SS` ('-' when it has none)."""
    ts = rec.get("ts")
    if not isinstance(ts, (int, float)):
        return "-"
    return time.strftime("%m-%d %H:%M:%S", time.localtime(ts))


def one_line(text: Any) -> str:
    """A record's free text (a label, a command line) on one line."""
    return "" if text is None else str(text).replace("\r", "\\r").replace("\n", "\\n")


def read(path: Path, last: int | None = None) -> list[dict[str, Any]]:
    return read_counted(path, last).records
