"""The wire protocol between clients (guardian, region API, shim) and krexd.

Defined ONCE, in interpose/krex_abi.h: the frame header (``struct krex_msg_hdr``),
the operations (the ``KREX_OPS`` table: name, code, fixed request and reply
bodies) and those bodies (``struct krex_req_*`` / ``struct krex_rep_*``). The shim
builds and reads the same structs in C (interpose/client.c); this module reads
them through cffi, so nothing here restates a code, a size or a field.

A frame is ``header | fixed body | JSON object``. On the Python side a message is
a dict, as before: ``{"op": "begin", "tid": 7, "gpu": 0, "label": "x"}`` is sent
as a begin frame whose ``krex_req_begin`` body holds tid and gpu, and whose JSON
holds the label; a reply's ``ok`` is the header's status. Identity never comes from
the message; the daemon reads it from SO_PEERCRED (invariant I6).

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


def _body_class(ctype: str) -> type:
    """A frozen dataclass with the struct's fields (padding left out), zero by default."""
    fields = []
    for name, f in ffi.typeof(ctype).fields:
        if name.startswith("pad"):
            continue
        kind = bool if f.type.cname == "_Bool" else int
        fields.append((name, kind, dataclasses.field(default=kind())))
    camel = "".join(w.title() for w in ctype.split()[-1].removeprefix("krex_").split("_"))
    return dataclasses.make_dataclass(camel, fields, frozen=True)


_BODIES: dict[str, type] = {}


def _body(ctype: str | None) -> type | None:
    """The body dataclass of a struct, made on first use (`krex run` sends only JSON-only
    ops: it never pays for make_dataclass). setdefault: racing threads share one class."""
    if ctype is None:
        return None
    cls_ = _BODIES.get(ctype)
    return cls_ if cls_ is not None else _BODIES.setdefault(ctype, _body_class(ctype))


@dataclass(frozen=True)
class Op:
    """One row of KREX_OPS. `request` / `reply`: the dataclass of the fixed body
    (None: JSON only); `ctypes` the cffi type names behind them."""

    name: str  # lower case, as the dict messages spell it: "begin"
    code: int
    request_ctype: str | None
    reply_ctype: str | None

    @property
    def request(self) -> type | None:
        return _body(self.request_ctype)

    @property
    def reply(self) -> type | None:
        return _body(self.reply_ctype)

    def body(self, reply: bool) -> tuple[type | None, str | None]:
        return (self.reply, self.reply_ctype) if reply else (self.request, self.request_ctype)


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
    """One frame, decoded. `body`: the op's fixed-body dataclass (None when the op
    has none, or for an error reply); `data`: the JSON object."""

    op: Op
    status: int = int(lib.KREX_ST_OK)
    body: Any = None
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    reply: bool = False

    @property
    def ok(self) -> bool:
        return self.status == int(lib.KREX_ST_OK)

    def to_dict(self) -> dict[str, Any]:
        """The dict form the daemon's handlers and the client's callers use."""
        out = dict(self.data)
        if self.body is not None:
            out.update(dataclasses.asdict(self.body))
        if self.op.name == "event":
            return out
        if self.reply:
            out["ok"] = self.ok
        else:
            out["op"] = self.op.name
        return out

    @classmethod
    def from_dict(cls, msg: dict[str, Any], reply: bool = False, op: str | int | None = None) -> Message:
        """Split a dict into the op's fixed body and the JSON rest. A request names its
        op in msg["op"]; a reply's op is given (`op`), its status is msg["ok"]; an event
        is a reply dict with an "event" key."""
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
        cls_, _ctype = o.body(reply)
        body = None
        if cls_ is not None and status == lib.KREX_ST_OK:
            kw = {}
            for f in dataclasses.fields(cls_):
                v = rest.pop(f.name, None)
                if v is not None:
                    kw[f.name] = _field_value(o, f, v)
            body = cls_(**kw)
        return cls(o, status, body, rest, reply)

    def encode(self) -> bytes:
        cls_, ctype = self.op.body(self.reply)
        raw = b""
        if self.body is not None and ctype is not None:
            c = ffi.new(f"{ctype} *")
            for k, v in dataclasses.asdict(self.body).items():
                try:
                    setattr(c, k, v)
                except (OverflowError, TypeError) as e:
                    raise UsageError(
                        f"{self.op.name}: field {k!r} = {v!r} does not fit {ctype}: {e}",
                        f"send {k!r} as an integer in range",
                    ) from None
            raw = bytes(ffi.buffer(c))
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


def _field_value(op: Op, f: dataclasses.Field[Any], v: Any) -> Any:
    want = f.type if isinstance(f.type, type) else {"int": int, "bool": bool}[str(f.type)]
    if want is bool and isinstance(v, bool):
        return v
    if want is int and isinstance(v, int) and not isinstance(v, bool):
        return v
    raise UsageError(
        f"{op.name}: field {f.name!r} must be {'a boolean' if want is bool else 'an integer'}, "
        f"not {json.dumps(v, default=repr)[:40]}",
        f"send {f.name!r} as {'a boolean' if want is bool else 'an integer'}",
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
    cls_, ctype = op.body(reply)
    want = int(ffi.sizeof(ctype)) if ctype and status == lib.KREX_ST_OK else 0
    if blen != want:
        raise ProtocolError(f"{op.name}: fixed body of {blen} bytes, expected {want}", op=code)
    body = None
    if cls_ is not None and want:
        c = ffi.new(f"{ctype} *")
        ffi.memmove(c, frame[HDR_SIZE : HDR_SIZE + blen], blen)
        body = cls_(**{f.name: getattr(c, f.name) for f in dataclasses.fields(cls_)})
    data: dict[str, Any] = {}
    if jlen:
        raw = frame[HDR_SIZE + blen : HDR_SIZE + blen + jlen]
        try:
            obj = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise ProtocolError(f"{op.name}: JSON part is not UTF-8", op=code) from None
        except ValueError as e:
            raise ProtocolError(f"{op.name}: JSON part is not JSON ({e})", op=code) from None
        if not isinstance(obj, dict):
            raise ProtocolError(
                f"{op.name}: JSON part is a JSON {type(obj).__name__}, not an object", op=code
            )
        dup = sorted(k for k in obj if body is not None and k in dataclasses.asdict(body))
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
