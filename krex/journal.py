"""The region journal: one JSON line per region, appended by krexd."""

from __future__ import annotations

import json
import os
from collections import deque
from pathlib import Path
from typing import Any

from krex.errors import NotFound


def append(path: Path, record: dict[str, Any]) -> None:
    line = json.dumps(record, separators=(",", ":")) + "\n"
    # One O_APPEND write per record: concurrent readers never see half a line.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read(path: Path, last: int | None = None) -> list[dict[str, Any]]:
    if not path.exists():
        raise NotFound(
            f"no journal at {path}: no region has run yet",
            "run a command that marks a region, e.g. krex run -- python bench.py",
        )
    out: deque[dict[str, Any]] = deque(maxlen=last)
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue  # a torn last line after a crash
    return list(out)
