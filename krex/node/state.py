"""What every part of krexd shares: the state the Daemon holds (DaemonState, its attributes
declared once, set in Daemon.__init__ and start), the ONE request dispatch table (HANDLERS,
filled by @handles), and the journal's writer.

The Daemon is built in layers, each a class of its own module that may use those below it:
DaemonState -> Slots (slots.py) -> Loops (loops.py) -> RegionChecks (regionchecks.py) ->
Regions (regions.py: it runs each region as a RegionRun of region.py, over the layers
below) -> Admission (admission.py) -> Server (server.py) -> Daemon (daemon.py)."""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import socket
import subprocess
import threading
from collections.abc import Callable, Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from krex.device.gpus import GpuInfo
from krex.errors import KrexError
from krex.node import conns, cpus, freezepolicy, journal, procfs, regionqueue
from krex.node.attest import Attestor
from krex.node.config import Config
from krex.node.exits import Exits
from krex.node.freezer import Freezer, Group
from krex.node.mps import Mps
from krex.node.pending import Pending
from krex.node.segguard import SegmentGuard
from krex.node.shm import Segment
from krex.protocol import REQUESTS, ProtocolError

if TYPE_CHECKING:
    from krex.node.region import Region
    from krex.node.server import Server
    from krex.node.slots import Slot

log = logging.getLogger("krex.node.daemon")  # one logger for krexd: it runs as __main__ under -m
# A request handler: (daemon, connection, peer pid from SO_PEERCRED, request, the connection's
# state) -> reply. HANDLERS is the ONE dispatch table, an op of KREX_OPS -> its handler, filled
# by @handles on the Daemon's methods; tests/unit/test_protocol.py checks it covers every request op.
Handler = Callable[["Server", socket.socket, int, dict[str, Any], dict[str, Any]], "dict[str, Any] | None"]
HANDLERS: dict[str, Handler] = {}
# A method of one of the Daemon's layers that handles a request (its `self`: that layer).
H = TypeVar("H", bound=Callable[..., "dict[str, Any] | None"])


def handles(op: str) -> Callable[[H], H]:
    def register(fn: H) -> H:
        if op not in REQUESTS or op in HANDLERS:
            raise RuntimeError(f"handler for {op!r}: not a request op of KREX_OPS, or one already has one")
        HANDLERS[op] = fn
        return fn

    return register


def _error(e: KrexError) -> dict[str, Any]:
    kind = "UsageError" if isinstance(e, ProtocolError) else type(e).__name__
    return {"ok": False, "error": str(e), "fix": e.fix, "kind": kind}


class DaemonState:
    """The Daemon's attributes, each declared once (Daemon.__init__ and start set them)."""

    cfg: Config
    lock: threading.RLock  # krexd's one lock: slots, queues, current regions
    changed: threading.Condition  # on `lock`: a slot, a queue or a region changed
    stop: threading.Event
    stop_reason: str
    fault: str | None  # why krexd stopped without being asked to
    started_at: float
    pid: int
    info: GpuInfo
    mps: Mps  # the GPUs' MPS control daemons (off unless asked for)
    sock_path: Path
    journal_path: Path
    shm_name: str
    share_gid: int
    _lock_fd: int | None
    _journal_lock: threading.Lock
    journal_error: str | None
    stalls: list[tuple[float, float]]  # (start, end) monotonic: heartbeat gaps past the timeout
    _last_beat: float
    _fail_opens: list[int]
    _sock_ino: int | None
    _server: socket.socket | None
    freezer: Freezer
    partition: cpus.Partition
    core_watch_off: str | None
    lend_off_why: str | None
    slots: dict[int, Slot]
    queues: dict[int, regionqueue.FifoQueue[Region] | regionqueue.FairQueue[Region]]
    current: dict[int, Region | None]
    held: dict[int, tuple[Region, Generator[None, None, None]] | None]
    regions_done: int
    last_busy: float
    seg: Segment
    guard: SegmentGuard
    pending: Pending
    pool: concurrent.futures.ThreadPoolExecutor
    inspector: freezepolicy.Inspector
    _seg_id: tuple[int, tuple[int, int] | None] | None
    _boosted: set[tuple[int, int, int]]
    _boost_lock: threading.Lock
    _boost_ok: bool
    attestor: Attestor
    exits: Exits
    _conns: queue.SimpleQueue[conns.Conn]
    _idle_threads: int
    _loop: conns.ConnLoop
    _idle_lock: threading.Lock
    _opt_in: dict[str, tuple[dict[str, str], dict[str, list[str]]]]
    _tag_scan: procfs.FreshScan[dict[int, dict[bytes, set[bytes]]]]
    _unremoved: dict[str, Group]  # released slots' groups still busy
    _watchdog: subprocess.Popen[bytes] | None
    _watchdog_started: float

    def _journal(self, rec: dict[str, Any]) -> None:
        """Append a region record. A journal that cannot be written (a directory in
        its place, a full disk) never stops regions: the error is logged once and
        shown by `krex daemon status`."""
        with self._journal_lock:
            try:
                journal.append(self.journal_path, rec)
            except (OSError, KrexError) as e:
                msg = f"cannot write the journal {self.journal_path}: {e}"
                if msg != self.journal_error:
                    log.error("%s; regions are not journaled until it is fixed", msg)
                self.journal_error = msg
            else:
                if self.journal_error:
                    log.warning("the journal %s is writable again", self.journal_path)
                self.journal_error = None
