"""krexd's server: the listening socket, the connections (conns.ConnLoop hands each request
to a connection thread), dispatch through HANDLERS, and the requests any client may send
(hello, soon, shutdown). Who a peer is comes from SO_PEERCRED, never from the message (I6)."""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import struct
import threading
from typing import Any

from krex import paths
from krex.errors import KrexError, PermissionDenied
from krex.node import conns
from krex.node.admission import Admission, _status_fields
from krex.node.region import Region
from krex.node.state import HANDLERS, _error, handles, log
from krex.protocol import ProtocolError, encode_reply

# How long a connection thread waits for another request to serve before it ends (seconds).
CONN_THREAD_IDLE_S = 30.0
# A reply or event a client does not read for this long ends its connection (seconds).
SEND_TIMEOUT_S = 30
_SNDTIMEO = struct.pack("ll", SEND_TIMEOUT_S, 0)  # struct timeval


def _peer_groups(pid: int, gid: int) -> set[int]:
    """The peer's primary and supplementary groups (SO_PEERCRED has only the primary)."""
    st = _status_fields(pid)
    return {gid, *st.get("Gid", []), *st.get("Groups", [])}


class Server(Admission):
    """The Daemon's part that accepts, reads, dispatches and answers."""

    def _listen(self) -> socket.socket:
        p = self.sock_path
        paths.ensure_dir(p.parent, "KREX socket directory")
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)  # no window in which anyone but us may connect
        try:
            s.bind(str(p))
            # 0660, group = the sharing group: the owner and its group may connect, nobody else.
            os.chown(p, -1, self.share_gid, follow_symlinks=False)
            os.chmod(p, 0o660)
            self._sock_ino = os.stat(p, follow_symlinks=False).st_ino
        except OSError as e:
            s.close()
            raise KrexError(
                f"cannot create socket {p}: {e.strerror}", "set KREX_SOCKET to a writable path"
            ) from e
        finally:
            os.umask(old)
        s.listen(128)
        return s

    def _relisten(self) -> None:
        """The listening socket failed: bind a new one (the lock says the path is ours)."""
        try:
            new = self._listen()
        except KrexError as e:
            log.error("cannot make a new listening socket: %s", e)
            return
        old, self._server = self._server, new
        if old is not None:
            with contextlib.suppress(OSError):
                old.close()

    def _hand_over(self, c: conns.Conn) -> None:
        """Serve a connection's request on an idle connection thread, else on a new one. A
        thread waits CONN_THREAD_IDLE_S for another request once it handed its connection
        back: starting a thread for each was 6% of krexd's time per command (16 at once,
        16 cores), on the thread that accepts."""
        with self._idle_lock:
            if self._idle_threads:
                self._idle_threads -= 1
                self._conns.put(c)
                return
        threading.Thread(target=self._conn_thread, args=(c,), daemon=True).start()

    def _conn_thread(self, c: conns.Conn) -> None:
        while True:
            self._serve(c)
            with self._idle_lock:
                self._idle_threads += 1
            try:
                c = self._conns.get(timeout=CONN_THREAD_IDLE_S)
            except queue.Empty:
                with self._idle_lock:
                    # A connection handed over just now (under this lock) is served; else
                    # this thread leaves, counted out under the same lock.
                    try:
                        c = self._conns.get_nowait()
                    except queue.Empty:
                        self._idle_threads -= 1
                        return

    def _check_socket(self) -> None:
        """Someone removed (or replaced) our socket: clients would find no daemon
        while we hold the lock. Bind a fresh one; we still own the path (the lock)."""
        try:
            ino: int | None = os.stat(self.sock_path, follow_symlinks=False).st_ino
        except OSError:
            ino = None
        if ino == self._sock_ino:
            return
        try:
            new = self._listen()
        except KrexError as e:
            log.error("socket %s vanished and cannot be re-created: %s", self.sock_path, e)
            self._sock_ino = ino  # do not retry every 0.2 s
            return
        assert self._server is not None
        self._server.close()
        self._server = new
        log.warning("socket %s was removed or replaced; re-created it", self.sock_path)

    def _role(self, pid: int, uid: int, gid: int) -> str | None:
        """The sharing model (docs/architecture.md, threat model): "owner" (root or
        the daemon's user: everything), "member" (in the sharing group, as primary or
        supplementary group: run commands, regions, status; not stop), else None."""
        if uid in (0, os.geteuid()):
            return "owner"
        if self.share_gid in _peer_groups(pid, gid):
            return "member"
        return None

    def _serve(self, c: conns.Conn) -> None:
        """Serve the requests `c` has sent, on this thread; then hand it back to the loop to
        wait for its next one, or, at its end, undo what it owned and close it."""
        conn = c.sock
        keep = False
        try:
            # Blocking, with a kernel send timeout: a Python socket timeout would make
            # every recv poll first, _peer_closed's MSG_DONTWAIT peek included.
            conn.setblocking(True)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _SNDTIMEO)
            while not self.stop.is_set():
                try:
                    m = c.reader.buffered()
                except ProtocolError as e:
                    conn.sendall(encode_reply(e.op, _error(e)))
                    if e.fatal:
                        return
                    continue
                if m is None:
                    if c.eof and c.reader.buf:
                        got, c.reader.buf = len(c.reader.buf), b""
                        cut = ProtocolError(f"truncated frame ({got} bytes, then end of stream)", fatal=True)
                        conn.sendall(encode_reply(cut.op, _error(cut)))
                    keep = not c.eof
                    return
                c.spoke = True
                self._handle(c, m)
        except OSError:
            pass
        finally:
            if keep and not self.stop.is_set():
                self._loop.give_back(c)
            else:
                self._disconnect(c.pid, c.owned)
                with contextlib.suppress(OSError):
                    conn.close()
                self._loop.forget(c)

    def _handle(self, c: conns.Conn, m: Any) -> None:
        """One request of `c`: its handler, then its reply."""
        conn, pid, owned = c.sock, c.pid, c.owned
        msg = m.to_dict()
        try:
            reply = HANDLERS[m.op.name](self, conn, pid, msg, owned)
        except KrexError as e:
            reply = _error(e)
        except Exception as e:  # noqa: BLE001 - a bad request must never kill its connection thread
            log.error("request %.200r from pid %d failed: %s: %s", msg, pid, type(e).__name__, e)
            reply = {
                "ok": False,
                "error": f"internal error: {type(e).__name__}: {e}",
                "kind": "KrexError",
                "fix": "see krexd.log",
            }
        if reply is None:
            return
        try:
            try:
                frame = encode_reply(m.op.code, reply)
            except KrexError as e:  # a reply that does not fit its fixed body: a bug, said so
                log.error("reply to %s for pid %d cannot be sent: %s", m.op.name, pid, e)
                frame = encode_reply(m.op.code, _error(e))
            conn.sendall(frame)
        finally:
            self._after_reply(owned)

    @staticmethod
    def _after_reply(owned: dict[str, Any]) -> None:
        r: Region | None = owned["region"]
        if r is not None and r.after_reply is not None:
            hand_over, r.after_reply = r.after_reply, None
            hand_over()

    def _disconnect(self, pid: int, owned: dict[str, Any]) -> None:
        self._after_reply(owned)  # a region granted inline but never replied to: hand it over first
        r: Region | None = owned["region"]
        if r is not None and not r.ended.is_set():
            r.end_reason = "owner-exit"
            r.cancelled = True
            r.ended.set()
            r.granted.set()
        lost = None
        with self.lock:
            n = owned["guardian"]
            if n is not None and n in self.slots:
                # Closed without a release: the guardian died (SIGKILL, e.g. `timeout -s KILL`)
                # and nobody watches its command any more.
                lost = self.slots[n] if self.slots[n].guardian_connected else None
                self.slots[n].guardian_connected = False
            n = owned["slot"]
            if n is not None and n in self.slots and self.slots[n].kind == "auto":
                self._release(n, "owner-exit")
        if lost is not None:
            self._guardian_lost(lost, "its connection closed without a release")

    # ------------------------------------------------------------- handlers
    # One per request op of KREX_OPS (HANDLERS, through @handles); each gets the connection,
    # the peer's pid (SO_PEERCRED), the request as a dict and the connection's state. The
    # guardian's are admission.py's, begin and end regions.py's, status daemon.py's.
    @handles("hello")
    def _op_hello(
        self, conn: socket.socket, pid: int, msg: dict[str, Any], owned: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "ok": True,
            "pid": self.pid,
            "shm": self.shm_name,
            "gpus": self.info.count,
            "device": self.info.kind,  # so a client needs no GPU discovery of its own
            "role": owned.get("role"),
        }

    @handles("soon")
    def _op_soon(
        self, conn: socket.socket, pid: int, msg: dict[str, Any], owned: dict[str, Any]
    ) -> dict[str, Any]:
        """The caller's command says a region comes soon (an automatic region's target was
        entered; its warm-up runs first): siblings' queues start shrinking now. A process of
        no command gets no slot for it."""
        with self.lock:
            s = self._slot_of_pid(pid)
        if s is None or s.warm:
            return {"ok": True, "soon": False}
        return {"ok": True, "soon": self.pending.announce(s.gpu, s.slot)}

    @handles("shutdown")
    def _op_shutdown(
        self, conn: socket.socket, pid: int, msg: dict[str, Any], owned: dict[str, Any]
    ) -> dict[str, Any]:
        if owned.get("role") != "owner":
            raise PermissionDenied(
                "only the daemon's user or root may stop it", "ask its owner to run `krex daemon stop`"
            )
        self.stop_reason = f"shutdown requested by pid {pid}"
        self.stop.set()
        # How long the stop may take beyond its usual seconds (the MPS control daemons' quit),
        # so that `krex daemon stop` waits for it rather than giving up.
        return {"ok": True, "stop_wait_s": self.mps.stop_bound_s()}
