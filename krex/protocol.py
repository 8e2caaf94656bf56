"""The wire protocol between clients (guardian, region API, shim) and krexd:
one JSON object per line over a Unix stream socket. Identity never comes from
the message; the daemon reads it from SO_PEERCRED (invariant I6)."""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

MAX_LINE = 1 << 20

# Operations. The C shim speaks the same protocol (interpose/shim.c: region client).
OPS = ("hello", "admit", "started", "release", "adopt", "register", "begin", "end", "status", "shutdown")


def peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def encode(msg: dict[str, Any]) -> bytes:
    return (json.dumps(msg, separators=(",", ":")) + "\n").encode()


class LineReader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def read(self) -> dict[str, Any] | None:
        """Next message, or None at EOF."""
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.buf += chunk
            if len(self.buf) > MAX_LINE:
                raise ValueError("message too long")
        line, self.buf = self.buf.split(b"\n", 1)
        obj = json.loads(line)
        if not isinstance(obj, dict):
            raise ValueError("message is not an object")
        return obj
