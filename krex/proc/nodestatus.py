"""What `krex status` shows, gathered: the daemon's live state (regions, queues, the
segment's health) and the shared segment's snapshot (gates, slots, processes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from krex.errors import KrexError, NotFound
from krex.node.shm import Segment, Snapshot
from krex.protocol import StatusReply

__all__ = ["NodeStatus", "read_status", "segment_line"]


@dataclass
class NodeStatus:
    snap: Snapshot
    # krexd's status reply; empty when no daemon answered (daemon_error says why)
    live: StatusReply = field(default_factory=lambda: StatusReply())
    daemon_error: str = "no daemon running"


def _ask_daemon() -> tuple[StatusReply, str]:
    from .client import Client

    try:  # regions and queues live in the daemon, not in shared memory
        c = Client.connect()
        try:
            return cast(StatusReply, c.request({"op": "status"})), "no daemon running"
        finally:
            c.close()
    except NotFound:
        return StatusReply(), "no daemon running"
    except KrexError as e:
        return StatusReply(), str(e)


def read_status() -> NodeStatus:
    """The daemon's reply and the segment's snapshot; KrexError when there is no segment,
    or when a running daemon's segment cannot be attached (said as such, not as "nothing
    has run")."""
    live, daemon_error = _ask_daemon()
    try:
        with Segment.attach() as seg:
            snap = seg.snapshot()
    except KrexError as e:
        if not live:
            raise
        raise KrexError(
            f"krexd (pid {live['daemon']['pid']}) runs but its segment cannot be attached: {e}; "
            f"krexd says: {segment_line(live.get('segment') or {})}",
            "see `krex doctor`; stop the commands, then `krex daemon stop`",
        ) from None
    return NodeStatus(snap, live, daemon_error)


def segment_line(st: dict[str, Any]) -> str:
    """One line on the segment's health from krexd's status reply (its "segment" part)."""
    if not st:
        return "unknown"
    if st.get("lost"):
        return f"LOST: {st['lost']}"
    n = len(st.get("incidents") or [])
    if not n:
        return "ok"
    tainted = len(st.get("tainted_alive") or [])
    return (
        f"RECOVERED from {n} incident(s); {tainted} process(es) that lived through one still run "
        "(regions with them as siblings are flagged)"
    )
