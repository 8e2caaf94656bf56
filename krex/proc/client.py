"""Talking to krexd, and starting it on demand so a fresh machine needs no set-up.

No call here can hang on a daemon that is stopped or hung: connecting and sending
time out (KREX_CONNECT_TIMEOUT_MS), and a wait for a reply re-checks the daemon's
heartbeat in the segment every KREX_CLIENT_POLL_NS. Once the heartbeat is older
than KREX_HEARTBEAT_TIMEOUT_NS (or the daemon has been stopped that long) the call
fails with Timeout and says why. Replies that should come at once have a hard cap
as well; an admission or a region may wait as long as the daemon is alive."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from krex import paths
from krex.errors import Busy, DaemonLost, KrexError, NotFound, PermissionDenied, Timeout, UsageError
from krex.native import lib
from krex.node import procfs
from krex.node.shm import HEARTBEAT_TIMEOUT_S, heartbeat_stale
from krex.protocol import FrameReader, encode, peer_cred

_KINDS: dict[str, type[KrexError]] = {
    "UsageError": UsageError,
    "NotFound": NotFound,
    "Busy": Busy,
    "Timeout": Timeout,
    "PermissionDenied": PermissionDenied,
    "DaemonLost": DaemonLost,
}
_log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = lib.KREX_CONNECT_TIMEOUT_MS / 1e3
POLL_S = lib.KREX_CLIENT_POLL_NS / 1e9
START_WAIT_S = lib.KREX_DAEMON_START_WAIT_MS / 1e3
REPLY_TIMEOUT_S = lib.KREX_REPLY_TIMEOUT_MS / 1e3  # requests krexd answers at once (status, release, ...)
LONG_OPS = ("admit", "begin")  # these wait for a slot or a region: no hard cap


def proc_state(pid: int) -> str | None:
    """The one-letter state of a process (R, S, T, Z, ...), None when it is gone."""
    st = procfs.pid_stat(pid)
    return None if st is None else st.state


class Client:
    """One connection to the daemon. Requests on one connection are serialised;
    a region belongs to the connection that began it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = FrameReader(sock, replies=True)
        self.lock = threading.Lock()
        self.daemon_pid = peer_cred(sock)[0]
        self._seg: Any = None
        self._seg_tried = False

    @classmethod
    def connect(cls, path: Path | None = None, autostart: bool = False, device: str = "auto") -> Client:
        p = path or paths.socket_path()
        if path is None:
            paths.check_for_client()
        try:
            return cls(_connect(p))
        except (FileNotFoundError, ConnectionRefusedError):
            holder = paths.lock_holder(p.with_suffix(".lock"))
            if holder is not None:
                # A daemon holds the lock but its socket is gone: it binds a new one
                # within a poll (krexd re-creates a removed socket). Wait for that.
                return cls(_connect_when_back(p, holder))
            if not autostart:
                raise NotFound(f"no KREX daemon at {p}", "start it with `krex daemon start`") from None
        start_background(device=device, on_demand=True)
        return cls(_connect(p))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        if self._seg is not None:
            self._seg.close()
            self._seg = None

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            self.sock.sendall(encode(msg))
        except TimeoutError:
            raise Timeout(
                f"the KREX daemon (pid {self.daemon_pid}) does not read its socket",
                f"check `krex status`; if it is stopped or hung, `kill -CONT {self.daemon_pid}` or "
                "`krex daemon stop`",
            ) from None
        except OSError:  # EPIPE, ECONNRESET (never a SIGPIPE: Python ignores it)
            # A refused connection gets its refusal and is closed before the request may be
            # sent: the reason is waiting in the socket, and it, not "gone", is the answer.
            refusal = self._pending_refusal()
            if refusal is not None:
                raise refusal from None
            raise DaemonLost(
                f"the KREX daemon (pid {self.daemon_pid}) closed the connection", "check `krex daemon status`"
            ) from None

    def _pending_refusal(self) -> KrexError | None:
        """The error krexd sent before it closed this connection, if one is waiting."""
        try:
            self.sock.settimeout(0.05)
            msg = self.reader.read()
        except (OSError, KrexError):
            return None
        if not isinstance(msg, dict) or msg.get("ok", True):
            return None
        kind = _KINDS.get(str(msg.get("kind")), KrexError)
        return kind(str(msg.get("error", "request refused")), str(msg.get("fix", "")))

    def _stuck(self, since: dict[str, float]) -> str | None:
        """Why the daemon will not answer (dead, stopped or hung past the heartbeat
        timeout), or None while it may still answer."""
        now = time.monotonic()
        state = proc_state(self.daemon_pid)
        if state is None or state in ("Z", "X"):
            return f"the KREX daemon (pid {self.daemon_pid}) is gone"
        age = self._heartbeat_age()
        if state in ("T", "t"):
            since.setdefault("stopped", now)
        else:
            since.pop("stopped", None)
        if heartbeat_stale(age):
            return (
                f"the KREX daemon (pid {self.daemon_pid}) is not responding: no heartbeat for {age:.1f} s "
                f"(process state {state}{', stopped' if state in ('T', 't') else ''})"
            )
        if "stopped" in since and now - since["stopped"] > HEARTBEAT_TIMEOUT_S:
            return f"the KREX daemon (pid {self.daemon_pid}) is stopped (state {state})"
        return None

    def _heartbeat_age(self) -> float | None:
        if not self._seg_tried:
            self._seg_tried = True
            from krex.node.shm import Segment, default_name

            with contextlib.suppress(KrexError):
                self._seg = Segment.attach(default_name())
        return None if self._seg is None else self._seg.heartbeat_age(self.daemon_pid)

    def recv(self, timeout: float | None = REPLY_TIMEOUT_S) -> dict[str, Any]:
        self.sock.settimeout(POLL_S)
        t0 = time.monotonic()
        since: dict[str, float] = {}
        while True:
            try:
                msg = self.reader.read()
            except TimeoutError:
                why = self._stuck(since)
                if why is None and timeout is not None and time.monotonic() - t0 > timeout:
                    why = f"the KREX daemon (pid {self.daemon_pid}) did not answer within {timeout:g} s"
                if why:
                    raise Timeout(
                        why,
                        f"`kill -CONT {self.daemon_pid}` if it was stopped; else `krex daemon stop` "
                        "(a new one starts on demand)",
                    ) from None
                continue
            except OSError:  # ECONNRESET and the like: the daemon is gone
                msg = None
            if msg is None:
                raise DaemonLost(
                    f"the KREX daemon (pid {self.daemon_pid}) closed the connection",
                    "check `krex daemon status`",
                )
            return msg

    def request(
        self, msg: dict[str, Any], on_event: Any = None, timeout: float | None = REPLY_TIMEOUT_S
    ) -> dict[str, Any]:
        """Send `msg` and return the reply. `timeout` caps the wait; admission and
        region requests wait as long as the daemon beats."""
        if msg.get("op") in LONG_OPS:
            timeout = None
        with self.lock:
            self.send(msg)
            while True:
                reply = self.recv(timeout)
                if "event" in reply:
                    if on_event:
                        on_event(reply)
                    continue
                break
        if not reply.get("ok", False):
            kind = _KINDS.get(str(reply.get("kind")), KrexError)
            raise kind(str(reply.get("error", "request failed")), str(reply.get("fix", "")))
        return reply


def _connect(p: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.settimeout(CONNECT_TIMEOUT_S)
    try:
        s.connect(str(p))
    except PermissionError as e:
        s.close()
        raise PermissionDenied(
            f"permission denied connecting to {p}", "run as the daemon's user or a member of its group"
        ) from e
    except TimeoutError:
        s.close()
        raise Timeout(
            f"connecting to the KREX daemon at {p} timed out (its backlog is full: stopped or hung?)",
            "check `krex status`; `krex daemon stop` finds it by its lock",
        ) from None
    except OSError:
        s.close()
        raise
    _check_daemon_identity(s, p)
    return s


def _check_daemon_identity(s: socket.socket, p: Path) -> None:
    """Talk only to a daemon run by us or by root. Another user's daemon (a socket in a
    directory of theirs that KREX_STATE_DIR or KREX_SOCKET names, or one planted) would
    hand us a segment and a cgroup of its choosing."""
    pid, uid, _ = peer_cred(s)
    if uid in (os.geteuid(), 0):
        return
    s.close()
    try:
        import pwd

        who = f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, ImportError):
        who = f"uid {uid}"
    raise PermissionDenied(
        f"the KREX daemon at {p} (pid {pid}) runs as {who}, neither as you (uid {os.geteuid()}) nor as "
        "root: refusing to talk to it (another user's daemon would choose what your commands run with)",
        "use your own daemon (unset KREX_STATE_DIR and KREX_SOCKET, or point them at a directory of "
        "yours), or a daemon run by root and shared with your group (`krex daemon start --group G` as root)",
    )


def _connect_when_back(p: Path, holder: int) -> socket.socket:
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        try:
            return _connect(p)
        except (FileNotFoundError, ConnectionRefusedError):
            time.sleep(0.05)
    raise NotFound(
        f"the KREX daemon (pid {holder}) holds {p.with_suffix('.lock')} but does not answer on {p} "
        "(its socket is missing)",
        f"`krex daemon stop` stops it by its lock (or `kill {holder}`); then start again",
    )


def daemon_alive(path: Path | None = None) -> bool:
    try:
        _connect(path or paths.socket_path()).close()
        return True
    except (OSError, KrexError):
        return False


def hello(path: Path | None = None) -> dict[str, Any]:
    c = Client(_connect(path or paths.socket_path()))
    try:
        return c.request({"op": "hello"}, timeout=10.0)
    finally:
        c.close()


@dataclass
class Started:
    pid: int  # the daemon that answers
    ours: bool  # False: another one won the race (or already ran) and ours exited


def start_background(
    device: str = "auto",
    settings: Mapping[str, Any] | None = None,
    wait_s: float = START_WAIT_S,
    on_demand: bool = False,
) -> Started:
    """Start krexd detached (own session, no inherited descriptors, log in the
    state directory) and wait until a daemon answers on the socket: the one way to
    start it (`krex daemon start`, the start on demand, `krex bench`). ``settings``:
    {Config field: value} passed on its command line (krex.node.config.KEYS).
    Concurrent starts are safe: only one takes the lock; the others exit 6 and this
    returns the daemon that answers, with `ours` telling which case it was.
    ``on_demand``: started for a command, it exits when idle."""
    import subprocess  # here: `krex run` imports this module and seldom starts krexd

    from krex.node.config import daemon_argv

    paths.ensure_state_dir()
    sock = paths.socket_path()
    log = paths.log_path()
    args = daemon_argv(device, log, settings, on_demand=on_demand)
    _log.info("starting krexd: %s (log %s)", " ".join(args), log)
    # stderr is a pipe until krexd has opened its log: an error before that (a refused
    # state directory, say) reaches us rather than a log that could not be opened.
    proc = subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        close_fds=True,
        env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
    )
    assert proc.stderr is not None
    os.set_blocking(proc.stderr.fileno(), False)
    try:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if daemon_alive(sock):
                with contextlib.suppress(KrexError, OSError):
                    pid = int(hello(sock)["pid"])
                    if pid != proc.pid:
                        proc.wait(wait_s)  # ours lost the lock: it exits at once
                    return Started(pid, pid == proc.pid)
            rc = proc.poll()
            if rc is not None and rc != Busy.exit_code:
                early = (proc.stderr.read() or b"").decode(errors="replace")
                raise _start_error(rc, early, log)
            # rc == Busy: another daemon holds the lock; wait for it to answer.
            time.sleep(0.05)
    finally:
        proc.stderr.close()
    raise Timeout(f"the KREX daemon did not answer on {sock} within {wait_s:g}s", f"see {log}")


def _start_error(rc: int, early: str, log: Path) -> KrexError:
    """The daemon's own error (`... krexd[PID] ERROR ...` / `  fix: ...`), with its kind
    recovered from the exit status, so `daemon start` exits as krexd did."""
    import re

    msg = fix = ""
    text = early if early.strip() else _log_tail(log, joined=False)
    for line in text.splitlines():
        m = re.search(r"krexd(?:\[\d+\] ERROR |: error: )(.*)$", line)
        if m:
            msg = m.group(1)
        elif line.strip().startswith("fix: "):
            fix = line.strip()[len("fix: ") :]
    if not msg:
        tail = " | ".join(text.strip().splitlines()[-2:]) or "(no output)"
        return KrexError(f"the KREX daemon exited at start (status {rc}): {tail}", f"see {log}")
    kind = next((k for k in _KINDS.values() if k.exit_code == rc), KrexError)
    return kind(f"the KREX daemon could not start: {msg}", f"{fix}; see {log}" if fix else f"see {log}")


def _log_tail(log: Path, joined: bool = True) -> str:
    try:
        fd = os.open(log, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return "(no log)"
    try:
        size = os.fstat(fd).st_size
        os.lseek(fd, max(0, size - 600), os.SEEK_SET)
        tail = os.read(fd, 600).decode(errors="replace")
    finally:
        os.close(fd)
    return " | ".join(tail.strip().splitlines()[-2:]) if joined else tail
