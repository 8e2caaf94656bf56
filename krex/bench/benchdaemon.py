"""The KREX daemon `krex bench` starts for its krex cells (krex.bench.run): started with the
settings the cells need, stopped when another setting is needed and at the end."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from krex.errors import KrexError
from krex.protocol import StatusReply
from krex.worlds import daemon_status

__all__ = ["running", "start", "started_note", "stop"]

# How long a stop waits for krexd to exit, beyond what krexd says its MPS control daemons'
# quit may take: a next start needs the old krexd gone.
STOP_WAIT_S = 10.0


def running() -> StatusReply | None:
    """The running daemon's status, None when none runs."""
    return daemon_status()


def start(dev: str, slots: int, prewarm: int = 0, lend: str = "", mps: bool = False) -> bool:
    """Start a daemon with these settings (`mps`: MPS on, as `krex daemon start --mps`);
    False when another one answered instead."""
    from krex.proc.client import start_background

    settings: dict[str, Any] = {"idle_exit_s": 600.0, "slots_per_gpu": max(1, min(64, slots))}
    settings["prewarm"] = prewarm
    if lend:
        settings["lend_cores"] = lend
    if mps:
        settings["mps"] = "on"
    got = start_background(device=dev, settings=settings)
    return bool(getattr(got, "ours", True))


def stop() -> None:
    """Ask the running daemon to shut down and wait until it has exited (up to STOP_WAIT_S and
    what it says quitting its MPS control daemons may take)."""
    from krex.proc.client import Client, daemon_alive

    extra_s = 0.0
    with contextlib.suppress(KrexError, OSError):
        c = Client.connect()
        try:
            extra_s = float(c.request({"op": "shutdown"}).get("stop_wait_s") or 0.0)
        finally:
            c.close()
    deadline = time.monotonic() + STOP_WAIT_S + extra_s
    while daemon_alive() and time.monotonic() < deadline:
        time.sleep(0.05)


def started_note(slots: int, prewarm: int, lend: str, mps: bool) -> str:
    """The note that the bench started a daemon with these settings for some of its cells."""
    return (
        f"started a KREX daemon ({slots} slots per GPU, prewarm {prewarm}"
        + (f", lend_cores {lend}" if lend else "")
        + (", MPS on" if mps else "")
        + ") for "
        + ("the krex-mps cells" if mps else "the krex cells" if not prewarm else f"the +pw{prewarm} cells")
        + "; stopped at the end"
    )
