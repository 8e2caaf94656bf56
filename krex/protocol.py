"""The wire protocol between clients (guardian, region API, shim) and krexd:
one JSON object per line over a Unix stream socket. Identity never comes from
the message; the daemon reads it from SO_PEERCRED (invariant I6).

A malformed line (not UTF-8, not JSON, not an object, too long) raises
ProtocolError; the daemon answers it with an error reply instead of dropping
the connection, and only an over-long line ends the connection (the rest of it
cannot be told apart from the next message)."""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from krex.errors import UsageError

MAX_LINE = 1 << 20

# Operations. The C shim speaks the same protocol (interpose/client.c).
OPS = ("hello", "admit", "started", "release", "adopt", "register", "begin", "end", "status", "shutdown")


class ProtocolError(UsageError):
    """A line that is not a JSON object. `fatal`: the connection cannot go on."""

    def __init__(self, message: str, fatal: bool = False) -> None:
        super().__init__(message, "send one JSON object per line, as krex/protocol.py describes")
        self.fatal = fatal


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
        """Next message, or None at EOF. Raises ProtocolError for a malformed line
        (the line is consumed, so the next read gets the next message)."""
        while b"\n" not in self.buf:
            if len(self.buf) > MAX_LINE:
                self.buf = b""
                raise ProtocolError(f"message longer than {MAX_LINE} bytes", fatal=True)
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        if len(line) > MAX_LINE:
            raise ProtocolError(f"message longer than {MAX_LINE} bytes", fatal=True)
        try:
            obj = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            raise ProtocolError("message is not UTF-8") from None
        except ValueError as e:
            raise ProtocolError(f"message is not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise ProtocolError(f"message is a JSON {type(obj).__name__}, not an object")
        return obj


def int_field(
    msg: dict[str, Any], key: str, default: int | None = None, required: bool = False
) -> int | None:
    """msg[key] as an int (bools and floats refused); `default` when absent or null."""
    v = msg.get(key)
    if v is None:
        if required:
            raise UsageError(f"field {key!r} is missing", f"send {key!r} as an integer")
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise UsageError(
            f"field {key!r} must be an integer, not {json.dumps(v)[:40]}", f"send {key!r} as an integer"
        )
    return v
