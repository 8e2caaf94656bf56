"""Where KREX keeps its node state: socket, lock, journal."""

from __future__ import annotations

import os
from pathlib import Path

from krex.errors import PermissionDenied, UsageError


def state_dir() -> Path:
    """$KREX_STATE_DIR, else /run/krex for root, else a per-user directory."""
    raw = os.environ.get("KREX_STATE_DIR")
    if raw:
        p = Path(raw)
    elif os.geteuid() == 0:
        p = Path("/run/krex")
    else:
        base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/krex-{os.getuid()}"
        p = Path(base) / "krex" if os.environ.get("XDG_RUNTIME_DIR") else Path(base)
    return p


def ensure_state_dir() -> Path:
    p = state_dir()
    try:
        p.mkdir(mode=0o750, parents=True, exist_ok=True)
    except OSError as e:
        raise PermissionDenied(
            f"cannot create the KREX state directory {p}: {e.strerror}",
            "set KREX_STATE_DIR to a writable directory",
        ) from e
    if not os.access(p, os.W_OK):
        raise PermissionDenied(
            f"the KREX state directory {p} is not writable", "set KREX_STATE_DIR to a writable directory"
        )
    return p


def socket_path() -> Path:
    raw = os.environ.get("KREX_SOCKET")
    if raw:
        if len(raw.encode()) > 100:
            raise UsageError(
                f"KREX_SOCKET={raw!r} is longer than a Unix socket path may be",
                "use a path of at most 100 bytes",
            )
        return Path(raw)
    return state_dir() / "krexd.sock"


def journal_path() -> Path:
    return Path(os.environ.get("KREX_JOURNAL") or state_dir() / "journal.jsonl")


def lock_path() -> Path:
    return socket_path().with_suffix(".lock")
