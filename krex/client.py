"""Talking to krexd, and starting it on demand so a fresh machine needs no set-up."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from krex import paths
from krex.errors import Busy, KrexError, NotFound, PermissionDenied, Timeout, UsageError
from krex.protocol import LineReader, encode

_KINDS: dict[str, type[KrexError]] = {
    "UsageError": UsageError,
    "NotFound": NotFound,
    "Busy": Busy,
    "Timeout": Timeout,
    "PermissionDenied": PermissionDenied,
}
_log = logging.getLogger(__name__)


class Client:
    """One connection to the daemon. Requests on one connection are serialised;
    a region belongs to the connection that began it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = LineReader(sock)
        self.lock = threading.Lock()

    @classmethod
    def connect(cls, path: Path | None = None, autostart: bool = False, device: str = "auto") -> Client:
        p = path or paths.socket_path()
        try:
            return cls(_connect(p))
        except (FileNotFoundError, ConnectionRefusedError):
            if not autostart:
                raise NotFound(f"no KREX daemon at {p}", "start it with `krex daemon start`") from None
        start_background(device=device, on_demand=True)
        return cls(_connect(p))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.sendall(encode(msg))

    def recv(self) -> dict[str, Any]:
        msg = self.reader.read()
        if msg is None:
            raise KrexError("the KREX daemon closed the connection", "check `krex daemon status`")
        return msg

    def request(self, msg: dict[str, Any], on_event: Any = None) -> dict[str, Any]:
        with self.lock:
            self.send(msg)
            while True:
                reply = self.recv()
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
    try:
        s.connect(str(p))
    except PermissionError as e:
        s.close()
        raise PermissionDenied(
            f"permission denied connecting to {p}", "run as the daemon's user or a member of its group"
        ) from e
    except OSError:
        s.close()
        raise
    return s


def daemon_alive(path: Path | None = None) -> bool:
    try:
        _connect(path or paths.socket_path()).close()
        return True
    except OSError:
        return False


def start_background(
    device: str = "auto",
    idle_exit_s: float | None = None,
    extra: list[str] | None = None,
    wait_s: float = 15.0,
    on_demand: bool = False,
) -> int:
    """Start krexd detached (own session, log in the state directory) and wait
    until its socket answers. Returns its pid. ``on_demand``: started for a command,
    it exits when idle (settings: krex.config)."""
    sd = paths.ensure_state_dir()
    sock = paths.socket_path()
    args = [sys.executable, "-m", "krex.daemon", "--device", device, *(extra or [])]
    if idle_exit_s is not None:
        args += ["--idle-exit", str(idle_exit_s)]
    if on_demand:
        args.append("--on-demand")
    _log.info("starting krexd: %s (log %s)", " ".join(args), sd / "krexd.log")
    log = open(sd / "krexd.log", "ab")  # noqa: SIM115 - handed to the child
    try:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            close_fds=True,
            env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
        )
    finally:
        log.close()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if daemon_alive(sock):
            _log.info("krexd pid %d answers on %s", proc.pid, sock)
            return proc.pid
        rc = proc.poll()
        if rc is not None:
            tail = (sd / "krexd.log").read_text(errors="replace")[-600:]
            if "already running" in tail and daemon_alive(sock):
                return proc.pid
            raise KrexError(
                f"the KREX daemon exited at start (status {rc}): {tail.strip().splitlines()[-2:]}",
                f"see {sd / 'krexd.log'}",
            )
        time.sleep(0.05)
    raise Timeout(f"the KREX daemon did not answer on {sock} within {wait_s:g}s", f"see {sd / 'krexd.log'}")
