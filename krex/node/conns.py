"""krexd's connections: accepted, and waited on between requests, by one selector.

A connection costs krexd a thread only while one of its requests is being served
(`dispatch`); between requests (a guardian watching its command, a registered shim, a
region held open) it waits in the selector, and so does one that has not sent a whole
frame yet. Any member of the daemon's group may connect, so nothing here trusts a peer
to be reasonable:

- a peer process holds at most PER_PID connections, a user other than root and the
  daemon's own at most PER_UID; all of them together stay RESERVE descriptors below
  the descriptor limit (the journal, cgroup files and the segment need those), and at
  that bound the connection that has been silent longest makes room for the new one;
- a connection that has not sent a whole first frame within SILENT_S of connecting,
  or that starts a frame and does not finish it within SILENT_S, is closed;
- accept() failing for want of descriptors or memory is waited out (BACKOFF_S, logged
  once per LOG_EVERY_S); any other failure of the listening socket makes a new one,
  and only when that keeps failing does the loop give up (its caller then stops krexd
  with a non-zero status).

The selector and the tables are the loop thread's; workers hand a connection back
with `give_back` (a wake-up through a socket pair) and report a closed one with
`forget`."""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import queue
import resource
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from krex.errors import Busy, KrexError, PermissionDenied
from krex.protocol import FrameReader, encode_reply, peer_cred

log = logging.getLogger("krex.node.daemon")

PER_PID = 64  # connections of one peer process (one per region thread, a registration, a guardian)
PER_UID = 256  # connections of one user other than root and krexd's own
RESERVE = 128  # descriptors kept free of connections, below RLIMIT_NOFILE
SILENT_S = 10.0  # to send a whole first frame, and to finish any frame once begun
BACKOFF_S = 0.1  # accept() out of descriptors or memory: wait this long before the next try
LOG_EVERY_S = 10.0
RELISTEN_TRIES = 5  # new listening sockets made in a row before the loop gives up
_SCARCE = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_TRANSIENT = (errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN)


def raise_fd_limit() -> None:
    """Take the hard descriptor limit as the soft one (1,024 soft is common): each
    connection waiting in the selector is a descriptor."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


class LoopFailed(Exception):
    """The listening socket keeps failing: krexd can no longer be reached."""


@dataclass(eq=False)
class Conn:
    """One client connection and what it owns (its region, slot, guardian slot)."""

    sock: socket.socket
    pid: int
    uid: int
    gid: int
    role: str
    t_open: float
    reader: FrameReader = field(init=False)
    owned: dict[str, Any] = field(init=False)
    spoke: bool = False  # a whole frame came: no longer silent
    partial_since: float | None = None  # the first byte of a frame not yet whole
    eof: bool = False

    def __post_init__(self) -> None:
        self.reader = FrameReader(self.sock, replies=False)
        self.owned = {"region": None, "slot": None, "guardian": None, "uid": self.uid, "role": self.role}


def _refusal(e: KrexError) -> bytes:
    return encode_reply("none", {"ok": False, "error": str(e), "fix": e.fix, "kind": type(e).__name__})


class ConnLoop:
    def __init__(
        self,
        role_of: Callable[[int, int, int], str | None],
        dispatch: Callable[[Conn], None],
        owner_uids: set[int],
        share_gid: int,
    ) -> None:
        self.role_of = role_of
        self.dispatch = dispatch
        self.owner_uids = owner_uids
        self.share_gid = share_gid
        self.sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._back: queue.SimpleQueue[Conn] = queue.SimpleQueue()
        self._lock = threading.Lock()  # the tables below: workers forget, the loop adds
        self.open: set[Conn] = set()
        self.by_pid: collections.Counter[int] = collections.Counter()
        self.by_uid: collections.Counter[int] = collections.Counter()
        self.waiting: dict[Conn, None] = {}  # in the selector, oldest first
        self.refused = 0
        self.evicted = 0
        self._server: socket.socket | None = None
        self._paused_until = 0.0
        self._last_log: dict[str, float] = {}

    # ------------------------------------------------------------------ workers' side
    def give_back(self, c: Conn) -> None:
        """A worker is done with `c` until its next request: wait for it in the selector."""
        self._back.put(c)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def forget(self, c: Conn) -> None:
        """`c` is closed (by a worker)."""
        with self._lock:
            if c in self.open:
                self.open.discard(c)
                self.by_pid[c.pid] -= 1
                self.by_uid[c.uid] -= 1
                if self.by_pid[c.pid] <= 0:
                    del self.by_pid[c.pid]
                if self.by_uid[c.uid] <= 0:
                    del self.by_uid[c.uid]

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "open": len(self.open),
                "waiting": len(self.waiting),
                "limit": self.limit(),
                "refused": self.refused,
                "evicted": self.evicted,
            }

    # ------------------------------------------------------------------ the loop
    @staticmethod
    def limit() -> int:
        """How many connections may be open at once: RESERVE below RLIMIT_NOFILE (read each
        time: an operator may lower it while krexd runs)."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            soft = 1 << 20
        return max(16, soft - RESERVE)

    def run(
        self,
        stop: threading.Event,
        server: Callable[[], socket.socket | None],
        tick: Callable[[], None],
        relisten: Callable[[], None],
    ) -> None:
        """Serve until `stop`. `server()`: the listening socket now (`tick` may replace it);
        `relisten()`: make a new one after the old one failed. Raises LoopFailed when new
        ones keep failing."""
        failures = 0
        last_tick = last_expire = 0.0
        while not stop.is_set():
            self._watch_server(server())
            for key, _ev in self.sel.select(timeout=0.2):
                if key.data == "wake":
                    with contextlib.suppress(OSError):
                        while self._wake_r.recv(4096):
                            pass
                elif key.data == "server":
                    try:
                        self._accept_some(key.fileobj)  # type: ignore[arg-type]
                        failures = 0
                    except OSError as e:
                        failures += 1
                        self._log("listen", f"the listening socket failed ({e}); making a new one")
                        if failures > RELISTEN_TRIES:
                            raise LoopFailed(f"accept keeps failing: {e}") from e
                        self._drop_server()
                        time.sleep(min(1.0, 0.1 * failures))
                        relisten()
                else:
                    self._readable(key.data)
            self._take_back()
            now = time.monotonic()
            if now - last_expire >= 0.1:  # a scan of the waiting connections: not per event
                last_expire = now
                self._expire(now)
            if now - last_tick >= 0.2:
                last_tick = now
                tick()

    def _watch_server(self, srv: socket.socket | None) -> None:
        if srv is not self._server:
            self._drop_server()
        paused = time.monotonic() < self._paused_until
        if srv is not None and self._server is None and not paused:
            srv.setblocking(False)
            self.sel.register(srv, selectors.EVENT_READ, "server")
            self._server = srv

    def _drop_server(self) -> None:
        if self._server is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self.sel.unregister(self._server)
            self._server = None

    def _log(self, what: str, msg: str) -> None:
        now = time.monotonic()
        if now - self._last_log.get(what, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._last_log[what] = now
            log.error("%s", msg)

    def _accept_some(self, srv: socket.socket) -> None:
        for _ in range(64):  # then the other sockets get their turn
            try:
                sock, _addr = srv.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in _TRANSIENT:
                    continue
                if e.errno in _SCARCE:
                    # The backlog keeps it: stop polling the socket for a moment rather
                    # than spin, and make room where some connection was only silent.
                    self._evict_silent()
                    self._log(
                        "scarce",
                        f"accept failed: {e.strerror}: out of file descriptors or memory "
                        f"({len(self.open)} connections open); waiting, not exiting",
                    )
                    self._paused_until = time.monotonic() + BACKOFF_S
                    self._drop_server()
                    return
                raise
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        try:
            pid, uid, gid = peer_cred(sock)
        except OSError:
            sock.close()
            return
        role = self.role_of(pid, uid, gid)
        why: KrexError | None = None
        if role is None:
            why = PermissionDenied(
                f"permission denied: uid {uid} is neither this daemon's user nor a member "
                f"of its group (gid {self.share_gid})",
                "ask its owner to add you to that group, or run your own daemon",
            )
        else:
            with self._lock:
                if self.by_pid[pid] >= PER_PID:
                    why = Busy(
                        f"pid {pid} already holds {self.by_pid[pid]} connections to krexd "
                        f"(at most {PER_PID})",
                        "close connections you no longer use",
                    )
                elif uid not in self.owner_uids and self.by_uid[uid] >= PER_UID:
                    why = Busy(
                        f"uid {uid} already holds {self.by_uid[uid]} connections to krexd "
                        f"(at most {PER_UID})",
                        "close connections you no longer use",
                    )
                full = len(self.open) >= self.limit()
            if why is None and full and not self._evict_silent():
                why = Busy(
                    f"krexd has {len(self.open)} connections open, as many as its descriptor limit allows",
                    "close idle connections, or raise krexd's RLIMIT_NOFILE (LimitNOFILE= in its unit)",
                )
        if why is not None:
            with contextlib.suppress(OSError):
                sock.send(_refusal(why), socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            sock.close()
            self.refused += 1
            if role is not None:
                self._log("refused", f"connection refused: {why}")
            return
        assert role is not None
        c = Conn(sock, pid, uid, gid, role, time.monotonic())
        with self._lock:
            self.open.add(c)
            self.by_pid[pid] += 1
            self.by_uid[uid] += 1
        self._wait_on(c)

    def _wait_on(self, c: Conn) -> None:
        try:
            self.sel.register(c.sock, selectors.EVENT_READ, c)
        except (OSError, ValueError):  # closed meanwhile
            self._close(c)
            return
        self.waiting[c] = None

    def _unwait(self, c: Conn) -> None:
        self.waiting.pop(c, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self.sel.unregister(c.sock)

    def _close(self, c: Conn) -> None:
        """Close a connection that never had a request served (nothing of it to undo)."""
        self._unwait(c)
        with contextlib.suppress(OSError):
            c.sock.close()
        self.forget(c)

    def _evict_silent(self) -> bool:
        """Close the connection that has been silent longest (never sent a whole frame)."""
        for c in self.waiting:
            if not c.spoke and not c.reader.buf:
                self._close(c)
                self.evicted += 1
                return True
        return False

    def _readable(self, c: Conn) -> None:
        try:
            data = c.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            c.reader.buf += data
            if not c.reader.ready():
                if c.partial_since is None:
                    c.partial_since = time.monotonic()
                return
        else:
            c.eof = True
        self._unwait(c)
        c.partial_since = None
        if not c.spoke and c.eof and not c.reader.buf:
            self._close(c)  # connected and left (daemon_alive): nothing to serve
            return
        self.dispatch(c)

    def _take_back(self) -> None:
        while True:
            try:
                c = self._back.get_nowait()
            except queue.Empty:
                return
            c.sock.setblocking(False)
            if c.reader.buf and c.partial_since is None:
                c.partial_since = time.monotonic()
            self._wait_on(c)

    def _expire(self, now: float) -> None:
        late = [
            c
            for c in self.waiting
            if (not c.spoke and now - c.t_open > SILENT_S)
            or (c.partial_since is not None and now - c.partial_since > SILENT_S)
        ]
        for c in late:
            if c.spoke:  # it may own a slot or a region: its worker undoes that
                self._unwait(c)
                c.eof = True
                c.reader.buf = b""
                self.dispatch(c)
            else:
                self._close(c)

    def close(self) -> None:
        self._drop_server()
        for s in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                s.close()
        self.sel.close()
