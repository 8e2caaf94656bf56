"""The wire protocol between clients (guardian, region API, shim) and krexd.

Defined ONCE, in interpose/krex_abi.h: the frame header (``struct krex_msg_hdr``),
the operations (the ``KREX_OPS`` table: name, code, request and reply bodies) and
those bodies (``struct krex_req_*`` / ``struct krex_rep_*``, ``struct krex_rep_error``
for every error reply), each a struct and its text tail. The C clients (the shim,
interpose/client.c; the guardian, interpose/guardian_wire.c) build and read the same
structs and write no JSON; this module reads them through cffi, so nothing here
restates a code, a size or a field: a member's name says what it is (krex_abi.h,
"Text tails").

A frame is ``header | body | JSON object``. On the Python side a message is a dict:
``{"op": "begin", "tid": 7, "gpu": 0, "label": "x", "x": 1}`` is sent as a begin frame
whose ``krex_req_begin`` body holds tid, gpu and (in its tail) the label, and whose
JSON holds the rest; a reply's ``ok`` is the header's status. Identity never comes
from the message; the daemon reads it from SO_PEERCRED (invariant I6).

A frame that cannot be used raises ProtocolError; the daemon answers it with an
error reply. Only a frame that leaves the stream unreadable (bad magic, truncated,
longer than KREX_WIRE_MAX) is ``fatal`` and ends the connection."""

from __future__ import annotations

import dataclasses
import json
import socket
import struct
from dataclasses import dataclass
from typing import Any, TypedDict

from krex.errors import UsageError
from krex.native import ffi, lib

HDR = "struct krex_msg_hdr"
HDR_SIZE = int(ffi.sizeof(HDR))
MAX_FRAME = int(lib.KREX_WIRE_MAX)


class ProtocolError(UsageError):
    """A frame that cannot be used. `fatal`: the connection cannot go on. `op`: the
    request op it carried, when it named one (the error reply repeats it; else NONE)."""

    def __init__(self, message: str, fatal: bool = False, op: int = 0) -> None:
        super().__init__(message, "send KREX frames as interpose/krex_abi.h defines them (krex/protocol.py)")
        self.fatal = fatal
        self.op = op


# A body struct's fields, by their names (krex_abi.h, "Text tails"): NAME_str one string,
# NAME_strs a list of them, has_NAME whether the integer NAME is set; padding is none.
_TEXT_SUFFIXES = ("_strs", "_str")
ERROR_CTYPE = "struct krex_rep_error"  # the body of every error reply


@dataclass(frozen=True)
class _Field:
    """One member of a body: `key` its dict name, `kind` int, float, bool, str (NAME_str),
    list (NAME_strs); `flag` the has_NAME member that says an int is set, if any."""

    key: str
    cname: str
    kind: type
    flag: str | None = None


@dataclass(frozen=True)
class Body:
    """A fixed body: its struct, its members, and the texts of its tail in their order."""

    ctype: str
    size: int
    fields: tuple[_Field, ...]

    @property
    def texts(self) -> tuple[_Field, ...]:
        return tuple(f for f in self.fields if f.kind in (str, list))

    def pack(self, op: str, values: dict[str, Any]) -> bytes:
        """The struct then its tail, from dict values (absent keys: zero, none, empty)."""
        c = ffi.new(f"{self.ctype} *")
        tail = []
        for f in self.fields:
            v = values.get(f.key)
            if f.kind in (str, list):
                raw = _text(op, f, v)
                setattr(c, f.cname, len(raw))
                tail.append(raw)
                continue
            if v is None:
                continue
            if f.flag:
                setattr(c, f.flag, True)
            try:
                setattr(c, f.cname, v)
            except (OverflowError, TypeError) as e:
                raise UsageError(
                    f"{op}: field {f.key!r} = {v!r} does not fit {self.ctype}: {e}",
                    f"send {f.key!r} as an integer in range",
                ) from None
        return bytes(ffi.buffer(c)) + b"".join(tail)

    def unpack(self, op: Op, raw: bytes) -> dict[str, Any]:
        """The dict values of a body (struct and tail); ProtocolError when the tail does not
        add up or a text is not NUL-ended UTF-8."""
        if len(raw) < self.size:
            raise ProtocolError(
                f"{op.name}: fixed body of {len(raw)} bytes, expected {self.size} (its struct) and its texts",
                op=op.code,
            )
        c = ffi.new(f"{self.ctype} *")
        ffi.memmove(c, raw[: self.size], self.size)
        lens = [int(getattr(c, f.cname)) for f in self.texts]
        if self.size + sum(lens) != len(raw):
            raise ProtocolError(
                f"{op.name}: fixed body of {len(raw)} bytes, expected {self.size + sum(lens)} "
                f"(its struct and its texts of {lens} bytes)",
                op=op.code,
            )
        out: dict[str, Any] = {}
        at = self.size
        for f in self.fields:
            if f.kind not in (str, list):
                if f.flag is None or getattr(c, f.flag):
                    out[f.key] = f.kind(getattr(c, f.cname))
                continue
            n = int(getattr(c, f.cname))
            strs = _strings(op, f, raw[at : at + n])
            at += n
            if f.kind is list:
                out[f.key] = strs
            elif strs:
                if len(strs) != 1:
                    raise ProtocolError(
                        f"{op.name}: {f.key!r} holds {len(strs)} strings, not one", op=op.code
                    )
                out[f.key] = strs[0]
        return out


def _text(op: str, f: _Field, v: Any) -> bytes:
    """A text of the tail from a dict value: str (or None) for NAME_str; for NAME_strs a
    list of str or int, or a map (each key, then its value or its value's items)."""
    if v is None:
        return b""
    if f.kind is str:
        items = [v] if isinstance(v, str) else None
    elif isinstance(v, dict):
        items = []
        for k, x in v.items():
            items += [k, *(x if isinstance(x, (list, tuple)) else [x])]
    else:
        items = list(v) if isinstance(v, (list, tuple)) else None
    if items is None or not all(
        isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool)) for x in items
    ):
        what = "a string" if f.kind is str else "a list of strings"
        raise UsageError(
            f"{op}: field {f.key!r} must be {what}, not {json.dumps(v, default=repr)[:40]}",
            f"send {f.key!r} as {what}",
        )
    texts = [str(x) for x in items]
    if any("\0" in t for t in texts):
        raise UsageError(f"{op}: field {f.key!r} holds a NUL character", f"send {f.key!r} without NULs")
    try:
        return b"".join(t.encode("utf-8") + b"\0" for t in texts)
    except UnicodeEncodeError:
        raise UsageError(
            f"{op}: field {f.key!r} is not valid Unicode", f"send {f.key!r} as UTF-8 text"
        ) from None


def _strings(op: Op, f: _Field, raw: bytes) -> list[str]:
    if not raw:
        return []
    if not raw.endswith(b"\0"):
        raise ProtocolError(f"{op.name}: text {f.key!r} does not end in a NUL", op=op.code)
    try:
        return raw[:-1].decode("utf-8").split("\0")
    except UnicodeDecodeError:
        raise ProtocolError(f"{op.name}: text {f.key!r} is not UTF-8", op=op.code) from None


def _make_body(ctype: str) -> Body:
    members = ffi.typeof(ctype).fields
    names = {name for name, _f in members}
    fields = []
    for name, f in members:
        if name.startswith("pad") or (name.startswith("has_") and name[4:] in names):
            continue
        suffix = next((x for x in _TEXT_SUFFIXES if name.endswith(x)), None)
        if suffix:
            fields.append(_Field(name.removesuffix(suffix), name, list if suffix == "_strs" else str))
            continue
        cn = f.type.cname
        kind = bool if cn == "_Bool" else float if cn in ("double", "float") else int
        flag = f"has_{name}" if f"has_{name}" in names else None
        fields.append(_Field(name, name, kind, flag))
    return Body(ctype, int(ffi.sizeof(ctype)), tuple(fields))


_BODIES: dict[str, Body] = {}


def _body(ctype: str | None) -> Body | None:
    """The Body of a struct, made on first use. setdefault: racing threads share one."""
    if ctype is None:
        return None
    b = _BODIES.get(ctype)
    return b if b is not None else _BODIES.setdefault(ctype, _make_body(ctype))


@dataclass(frozen=True)
class Op:
    """One row of KREX_OPS: the cffi type names of its request and reply bodies (None:
    JSON only). Every error reply's body is ERROR_CTYPE."""

    name: str  # lower case, as the dict messages spell it: "begin"
    code: int
    request_ctype: str | None
    reply_ctype: str | None

    def body(self, reply: bool, status: int = int(lib.KREX_ST_OK)) -> Body | None:
        if status != lib.KREX_ST_OK:
            return _body(ERROR_CTYPE)
        return _body(self.reply_ctype if reply else self.request_ctype)


def _load_ops() -> dict[str, Op]:
    rows = ffi.new("const struct krex_op_row **")
    n = int(lib.krex_op_rows(rows))
    ops: dict[str, Op] = {}
    for i in range(n):
        r = rows[0][i]
        name = ffi.string(r.name).decode().lower()
        req, rep = (ffi.string(x).decode() for x in (r.request, r.reply))
        rq = None if req == "none" else f"struct {req}"
        rp = None if rep == "none" else f"struct {rep}"
        ops[name] = Op(name, int(r.code), rq, rp)
    return ops


OPS: dict[str, Op] = _load_ops()
BY_CODE: dict[int, Op] = {op.code: op for op in OPS.values()}
# What a client may ask (NONE and EVENT only ever come from krexd).
REQUESTS = tuple(n for n in OPS if n not in ("none", "event"))


@dataclass
class Message:
    """One frame, decoded. `body`: the values of its body (the op's struct and tail, or an
    error reply's), by their dict names; `data`: the JSON object."""

    op: Op
    status: int = int(lib.KREX_ST_OK)
    body: dict[str, Any] = dataclasses.field(default_factory=dict)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    reply: bool = False

    @property
    def ok(self) -> bool:
        return self.status == int(lib.KREX_ST_OK)

    def to_dict(self) -> dict[str, Any]:
        """The dict form the daemon's handlers and the client's callers use."""
        out = dict(self.data)
        out.update(self.body)
        if self.op.name == "event":
            return out
        if self.reply:
            out["ok"] = self.ok
        else:
            out["op"] = self.op.name
        return out

    @classmethod
    def from_dict(cls, msg: dict[str, Any], reply: bool = False, op: str | int | None = None) -> Message:
        """Split a dict into the op's body and the JSON rest. A request names its op in
        msg["op"]; a reply's op is given (`op`), its status is msg["ok"]; an event is a
        reply dict with an "event" key."""
        rest = dict(msg)
        if reply:
            if "event" in rest:
                o = OPS["event"]
            else:
                o = BY_CODE.get(op, OPS["none"]) if isinstance(op, int) else OPS[op or "none"]
            ok = bool(rest.pop("ok", True)) or o.name == "event"
            status = int(lib.KREX_ST_OK if ok else lib.KREX_ST_ERROR)
        else:
            name = rest.pop("op", None)
            if name not in REQUESTS:
                raise UsageError(f"unknown operation {name!r}", f"send one of {', '.join(REQUESTS)}")
            o, status = OPS[name], int(lib.KREX_ST_OK)
        b = o.body(reply, status)
        body: dict[str, Any] = {}
        for f in b.fields if b is not None else ():
            v = rest.pop(f.key, None)
            if v is not None:
                body[f.key] = _field_value(o, f, v)
        return cls(o, status, body, rest, reply)

    def encode(self) -> bytes:
        b = self.op.body(self.reply, self.status)
        raw = b.pack(self.op.name, self.body) if b is not None else b""
        js = json.dumps(self.data, separators=(",", ":")).encode() if self.data else b""
        if len(raw) + len(js) > MAX_FRAME:
            raise UsageError(
                f"{self.op.name}: message of {len(raw) + len(js)} bytes, longer than {MAX_FRAME}",
                "send less (the limit is KREX_WIRE_MAX)",
            )
        h = ffi.new(f"{HDR} *")
        h.magic, h.op, h.status, h.body_len, h.json_len = (
            lib.KREX_WIRE_MAGIC,
            self.op.code,
            self.status,
            len(raw),
            len(js),
        )
        return bytes(ffi.buffer(h)) + raw + js


def _field_value(op: Op, f: _Field, v: Any) -> Any:
    """A dict value checked against its member's kind (texts are checked as they pack)."""
    if f.kind in (str, list):
        return v
    if f.kind is bool and isinstance(v, bool):
        return v
    if f.kind is int and isinstance(v, int) and not isinstance(v, bool):
        return v
    if f.kind is float and isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    what = {bool: "a boolean", int: "an integer", float: "a number"}[f.kind]
    raise UsageError(
        f"{op.name}: field {f.key!r} must be {what}, not {json.dumps(v, default=repr)[:40]}",
        f"send {f.key!r} as {what}",
    )


def encode(msg: dict[str, Any]) -> bytes:
    """A request dict as a frame."""
    return Message.from_dict(msg).encode()


def encode_reply(op: str | int, msg: dict[str, Any]) -> bytes:
    """A reply (or event) dict as a frame answering `op`."""
    return Message.from_dict(msg, reply=True, op=op).encode()


def peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def decode(frame: bytes, reply: bool) -> Message:
    """One whole frame (header included) as a Message; ProtocolError if unusable."""
    h = ffi.cast(f"{HDR} *", ffi.from_buffer(frame))
    code, status, blen, jlen = int(h.op), int(h.status), int(h.body_len), int(h.json_len)
    op = BY_CODE.get(code)
    if op is None:
        raise ProtocolError(f"unknown operation code {code}")
    if not reply and op.name not in REQUESTS:
        raise ProtocolError(f"{op.name} is not a request")
    if status not in (lib.KREX_ST_OK, lib.KREX_ST_ERROR) or (not reply and status != lib.KREX_ST_OK):
        raise ProtocolError(f"{op.name}: status {status} is not a KREX_ST_* value", op=code)
    b = op.body(reply, status)
    if b is None and blen:
        raise ProtocolError(f"{op.name}: fixed body of {blen} bytes, expected 0", op=code)
    body = b.unpack(op, frame[HDR_SIZE : HDR_SIZE + blen]) if b is not None else {}
    data: dict[str, Any] = {}
    if jlen:
        raw = frame[HDR_SIZE + blen : HDR_SIZE + blen + jlen]
        try:
            obj = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise ProtocolError(f"{op.name}: JSON part is not UTF-8", op=code) from None
        except ValueError as e:
            raise ProtocolError(f"{op.name}: JSON part is not JSON ({e})", op=code) from None
        except RecursionError:  # nesting deeper than the parser's stack: never a KREX message
            raise ProtocolError(f"{op.name}: JSON part is nested too deeply", op=code) from None
        if not isinstance(obj, dict):
            raise ProtocolError(
                f"{op.name}: JSON part is a JSON {type(obj).__name__}, not an object", op=code
            )
        dup = sorted(k for k in obj if b is not None and k in {f.key for f in b.fields})
        if dup:
            raise ProtocolError(f"{op.name}: field(s) {dup} belong in the fixed body, not the JSON", op=code)
        data = obj
    return Message(op, status, body, data, reply)


class FrameReader:
    """Reads frames from a stream socket. Bytes of a frame not yet complete are kept
    across socket timeouts, so a caller may poll with a short timeout."""

    def __init__(self, sock: socket.socket, replies: bool) -> None:
        self.sock = sock
        self.replies = replies
        self.buf = b""

    def _frame_len(self) -> int | None:
        """Bytes the frame at the head of the buffer has in all, once its header is in;
        ProtocolError when that header makes the stream unreadable."""
        if len(self.buf) < HDR_SIZE:
            return None
        h = ffi.cast(f"{HDR} *", ffi.from_buffer(self.buf[:HDR_SIZE]))
        if int(h.magic) != lib.KREX_WIRE_MAGIC:
            raise ProtocolError(
                f"not a KREX frame (magic 0x{int(h.magic):08x}); a client of another version?", fatal=True
            )
        total = int(h.body_len) + int(h.json_len)
        if total > MAX_FRAME:
            op = BY_CODE.get(int(h.op))
            raise ProtocolError(
                f"message longer than {MAX_FRAME} bytes",
                fatal=True,
                op=op.code if op and op.name in REQUESTS else 0,
            )
        return HDR_SIZE + total

    def _need(self) -> int | None:
        try:
            return self._frame_len()
        except ProtocolError:
            self.buf = b""
            raise

    def ready(self) -> bool:
        """Is a whole frame buffered, or a header that ends the stream (so `buffered`
        has something to say without reading)?"""
        try:
            need = self._frame_len()
        except ProtocolError:
            return True
        return need is not None and len(self.buf) >= need

    def buffered(self) -> Message | None:
        """The next frame if it is already buffered, else None; never reads. Raises
        ProtocolError as read_message does."""
        need = self._need()
        if need is None or len(self.buf) < need:
            return None
        frame, self.buf = self.buf[:need], self.buf[need:]
        return decode(frame, self.replies)

    def read_message(self) -> Message | None:
        """Next frame, or None at EOF between frames. Raises ProtocolError for an
        unusable frame (consumed, so the next read gets the next one)."""
        while True:
            m = self.buffered()
            if m is not None:
                return m
            chunk = self.sock.recv(65536)
            if not chunk:
                if self.buf:
                    got, self.buf = len(self.buf), b""
                    raise ProtocolError(f"truncated frame ({got} bytes, then end of stream)", fatal=True)
                return None
            self.buf += chunk

    def read(self) -> dict[str, Any] | None:
        m = self.read_message()
        return None if m is None else m.to_dict()


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


# ------------------------------------------------------------------- the status reply's shape


class StatusSlot(TypedDict):
    """A slot in krexd's status reply."""

    slot: int
    gpu: int
    kind: str
    guardian_pid: int
    warm: bool
    tenant: str | None
    pids: list[int]
    cgroup: str


class StatusRegion(TypedDict):
    """A region being entered or held, in krexd's status reply."""

    gpu: int
    slot: int
    pid: int
    tid: int
    tenant: str | None
    granted: bool
    age_s: float


class QueueEntry(TypedDict):
    """A region request waiting in a GPU's queue."""

    slot: int
    pid: int
    tenant: str | None


class StatusReply(TypedDict, total=False):
    """krexd's answer to `status` (Daemon.status; `ok` is added by the wire). The parts
    other commands also print (partition, segment, MPS) stay as their owners render them."""

    ok: bool
    daemon: dict[str, Any]  # pid, socket, device, settings, journal, counters
    partition: dict[str, Any]  # cpus.Partition.to_json
    segment: dict[str, Any]  # segguard's view of the segment: incidents, lost
    slots: list[StatusSlot]
    regions: list[StatusRegion]
    queues: dict[str, list[QueueEntry]]  # per GPU
    region_queue: str
    tenant_used_s: dict[str, dict[str, float]]  # per GPU: exclusive seconds per tenant
    slots_per_gpu: list[int]
    prewarm: int
    mps: dict[str, Any]  # mps.Mps.status
