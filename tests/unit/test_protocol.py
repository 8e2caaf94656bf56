"""The wire protocol (interpose/krex_abi.h, krex/protocol.py): one definition read by
C and by Python. Frames round-trip through the cffi structs, a C program built from
the same header reads and writes the same bytes, and the daemon's handler table
covers every request op."""

from __future__ import annotations

import socket
import struct
import subprocess
from pathlib import Path

import pytest
from helpers import CC, INTERPOSE, REPO

from krex import protocol
from krex.errors import UsageError
from krex.native import ffi, lib
from krex.node.daemon import HANDLERS
from krex.protocol import OPS, REQUESTS, FrameReader, Message, ProtocolError, decode, encode, encode_reply

BODY_OPS = [o for o in OPS.values() if o.request_ctype or o.reply_ctype]


def test_op_table_is_the_headers() -> None:
    """Codes from the C preprocessor (krex_op_rows) equal cffi's KREX_OP_* constants,
    are unique, and the ops the shim uses carry fixed bodies."""
    assert {o.code for o in OPS.values()} == {getattr(lib, f"KREX_OP_{o.name.upper()}") for o in OPS.values()}
    assert len({o.code for o in OPS.values()}) == len(OPS)
    assert set(REQUESTS) == set(OPS) - {"none", "event"}
    for name in ("register", "begin", "admit", "release"):
        assert OPS[name].request_ctype is not None and OPS[name].reply_ctype is not None
    assert OPS["started"].request_ctype == "struct krex_req_started"
    assert OPS["end"].reply_ctype == "struct krex_rep_end"


def test_handler_table_covers_every_request_op() -> None:
    assert set(HANDLERS) == set(REQUESTS)
    assert all(callable(h) for h in HANDLERS.values())


CASES = [
    ({"op": "register", "gpu": 3}, False, None),
    ({"op": "begin", "tid": 123456789012, "gpu": 2, "label": "gemm/fp16"}, False, None),
    ({"op": "end"}, False, None),
    ({"op": "admit", "gpu": 1, "freeze": "gpu"}, False, None),
    ({"op": "hello"}, False, None),
    ({"ok": True, "slot": 5, "gpu": 1, "shm": "/krex-0"}, True, "register"),
    ({"ok": True, "slot": 7, "gpu": 0, "entry_s": 0.001, "frozen_slots": [1, 2]}, True, "begin"),
    ({"ok": True, "clean": False, "cut": True, "end": "max-region", "region": {"x": 1}}, True, "end"),
    ({"ok": False, "error": "busy", "kind": "Busy", "fix": "wait"}, True, "begin"),
    ({"event": "queued", "slots_busy": 3}, True, "admit"),
]


@pytest.mark.parametrize(("msg", "reply", "op"), CASES)
def test_round_trip(msg: dict[str, object], reply: bool, op: str | None) -> None:
    raw = encode_reply(op or "none", msg) if reply else encode(msg)
    back = decode(raw, reply=reply).to_dict()
    assert back == msg


def test_fixed_fields_travel_in_the_struct_not_the_json() -> None:
    """A begin request's tid and gpu sit in struct krex_req_begin at C's offsets, its
    label in the text tail after it (label_str its byte count); only other keys are JSON."""
    raw = encode({"op": "begin", "tid": 77, "gpu": 5, "label": "L", "x": 1})
    hdr = ffi.sizeof("struct krex_msg_hdr")
    size = ffi.sizeof("struct krex_req_begin")
    magic, op, status, blen, jlen = struct.unpack_from("=IHHII", raw)
    assert (magic, op, status) == (lib.KREX_WIRE_MAGIC, lib.KREX_OP_BEGIN, lib.KREX_ST_OK)
    assert blen == size + 2 and jlen == len(b'{"x":1}')
    tid = struct.unpack_from("=q", raw, hdr + ffi.offsetof("struct krex_req_begin", "tid"))[0]
    gpu = struct.unpack_from("=i", raw, hdr + ffi.offsetof("struct krex_req_begin", "gpu"))[0]
    n = struct.unpack_from("=I", raw, hdr + ffi.offsetof("struct krex_req_begin", "label_str"))[0]
    assert (tid, gpu, n) == (77, 5, 2)
    assert raw[hdr + size : hdr + blen] == b"L\0" and raw[hdr + blen :] == b'{"x":1}'
    # Absent fixed fields are zero (the daemon's defaults: tid 0 = the peer's pid, GPU 0).
    m = decode(encode({"op": "begin"}), reply=False)
    assert m.body == {"tid": 0, "gpu": 0} and m.data == {}


@pytest.mark.parametrize(
    ("msg", "needle"),
    [
        ({"op": "begin", "tid": "7"}, "must be an integer"),
        ({"op": "begin", "gpu": True}, "must be an integer"),
        ({"op": "register", "gpu": 1.5}, "must be an integer"),
        ({"op": "begin", "tid": 1 << 70}, "does not fit"),
        ({"op": "nope"}, "unknown operation"),
        ({"op": "event"}, "unknown operation"),
    ],
)
def test_bad_requests_are_refused_before_sending(msg: dict[str, object], needle: str) -> None:
    with pytest.raises(UsageError, match=needle):
        encode(msg)


def _frame(op: int, body: bytes = b"", js: bytes = b"", **over: int) -> bytes:
    h = ffi.new("struct krex_msg_hdr *")
    h.magic, h.op, h.body_len, h.json_len = lib.KREX_WIRE_MAGIC, op, len(body), len(js)
    for k, v in over.items():
        setattr(h, k, v)
    return bytes(ffi.buffer(h)) + body + js


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (_frame(999), "unknown operation code 999"),
        (_frame(lib.KREX_OP_EVENT), "not a request"),
        (_frame(lib.KREX_OP_BEGIN, b"\0" * 4), "fixed body of 4 bytes, expected 16"),
        (_frame(lib.KREX_OP_END, b"\0" * 8), "fixed body of 8 bytes, expected 0"),
        (_frame(lib.KREX_OP_HELLO, js=b"[1]"), "not an object"),
        (_frame(lib.KREX_OP_HELLO, js=b"\xff"), "not UTF-8"),
        (_frame(lib.KREX_OP_HELLO, js=b"{x"), "not JSON"),
        (_frame(lib.KREX_OP_HELLO, js=b'{"x": ' + b"[" * 200000 + b"]" * 200000 + b"}"), "nested too deeply"),
        (_frame(lib.KREX_OP_REGISTER, b"\0" * 8, b'{"gpu": 1}'), "belong in the fixed body"),
        (_frame(lib.KREX_OP_HELLO, status=lib.KREX_ST_ERROR), "status"),
    ],
)
def test_unusable_frames_are_protocol_errors(raw: bytes, needle: str) -> None:
    with pytest.raises(ProtocolError, match=needle) as e:
        decode(raw, reply=False)
    assert not e.value.fatal


def test_reader_keeps_a_partial_frame_across_timeouts() -> None:
    a, b = socket.socketpair()
    try:
        raw = encode({"op": "begin", "tid": 9, "gpu": 1, "label": "x" * 100})
        r = FrameReader(b, replies=False)
        b.settimeout(0.05)
        a.sendall(raw[:10])  # not even a whole header
        with pytest.raises(TimeoutError):
            r.read()
        a.sendall(raw[10:40])
        with pytest.raises(TimeoutError):
            r.read()
        a.sendall(raw[40:] + encode({"op": "end"}))
        assert r.read() == {"op": "begin", "tid": 9, "gpu": 1, "label": "x" * 100}
        assert r.read() == {"op": "end"}
        a.close()
        assert r.read() is None  # EOF between frames: the peer is done
    finally:
        b.close()


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (_frame(lib.KREX_OP_HELLO, json_len=lib.KREX_WIRE_MAX + 1), "longer than"),
        (_frame(lib.KREX_OP_HELLO, magic=0x7B226F70), "not a KREX frame"),
        (_frame(lib.KREX_OP_HELLO, js=b"{}", json_len=3), "truncated"),
    ],
)
def test_unreadable_streams_are_fatal(raw: bytes, needle: str) -> None:
    a, b = socket.socketpair()
    try:
        a.sendall(raw)
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(ProtocolError, match=needle) as e:
            FrameReader(b, replies=False).read()
        assert e.value.fatal
    finally:
        a.close()
        b.close()


def test_oversized_message_is_refused_by_the_sender() -> None:
    with pytest.raises(UsageError, match="longer than"):
        encode({"op": "admit", "blob": "x" * lib.KREX_WIRE_MAX})


C_PEER = r"""
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include "krex_abi.h"
/* Writes a register and a begin request as the shim does, then reads an end reply. */
static void put(enum krex_op op, const void *body, uint32_t len) {
    struct krex_msg_hdr h = {KREX_WIRE_MAGIC, (uint16_t)op, 0, len, 0};
    fwrite(&h, sizeof h, 1, stdout);
    if (len) fwrite(body, len, 1, stdout);
}
int main(void) {
    struct krex_req_register reg = {.gpu = 3};
    struct krex_req_begin beg = {.tid = 4242, .gpu = 1};
    put(KREX_OP_REGISTER, &reg, sizeof reg);
    put(KREX_OP_BEGIN, &beg, sizeof beg);
    put(KREX_OP_END, NULL, 0);
    fflush(stdout);
    struct krex_msg_hdr h;
    struct krex_rep_end rep;
    if (fread(&h, sizeof h, 1, stdin) != 1 || h.magic != KREX_WIRE_MAGIC || h.op != KREX_OP_END) return 2;
    if (h.body_len != sizeof rep || fread(&rep, sizeof rep, 1, stdin) != 1) return 3;
    char js[256] = {0};
    if (h.json_len >= sizeof js || fread(js, 1, h.json_len, stdin) != h.json_len) return 4;
    fprintf(stderr, "status=%u clean=%d cut=%d json=%s\n", h.status, rep.clean, rep.cut, js);
    return 0;
}
"""


def test_c_and_python_read_each_others_frames(tmp_path: Path) -> None:
    src = tmp_path / "peer.c"
    src.write_text(C_PEER)
    exe = tmp_path / "peer"
    subprocess.run([CC, "-Wall", "-Werror", f"-I{INTERPOSE}", "-o", str(exe), str(src)], check=True)
    reply = encode_reply("end", {"ok": True, "clean": False, "cut": True, "end": "max-region"})
    p = subprocess.run([str(exe)], input=reply, capture_output=True, timeout=60, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert p.stderr.decode().strip() == 'status=0 clean=0 cut=1 json={"end":"max-region"}'
    a, b = socket.socketpair()
    try:
        a.sendall(p.stdout)
        a.close()
        r = FrameReader(b, replies=False)
        got = [r.read() for _ in range(3)]
        assert got == [{"op": "register", "gpu": 3}, {"op": "begin", "tid": 4242, "gpu": 1}, {"op": "end"}]
        assert r.read() is None
    finally:
        b.close()


def test_message_bodies_follow_the_structs() -> None:
    """The bodies' members are the cffi struct fields (padding and has_NAME left out,
    NAME_str and NAME_strs named NAME)."""
    for o in BODY_OPS:
        for ctype in (o.request_ctype, o.reply_ctype):
            if ctype is None:
                continue
            names = [n for n, _ in ffi.typeof(ctype).fields if not n.startswith(("pad", "has_"))]
            keys = [n.removesuffix("_strs").removesuffix("_str") for n in names]
            b = o.body(ctype == o.reply_ctype)
            assert b is not None and [f.key for f in b.fields] == keys
    m = Message.from_dict({"ok": True, "clean": True, "cut": False}, reply=True, op="end")
    assert m.body == {"clean": True, "cut": False} and m.ok
    assert protocol.MAX_FRAME == lib.KREX_WIRE_MAX


def test_wire_timings_are_the_headers() -> None:
    """The client's waits are read from krex_abi.h, not restated (before: a daemon
    started on demand was waited for 15.0 s, written out in client.py)."""
    import inspect

    from krex.proc import client

    assert client.CONNECT_TIMEOUT_S == lib.KREX_CONNECT_TIMEOUT_MS / 1e3
    assert client.POLL_S == lib.KREX_CLIENT_POLL_NS / 1e9
    assert client.HEARTBEAT_TIMEOUT_S == lib.KREX_HEARTBEAT_TIMEOUT_NS / 1e9
    wait = inspect.signature(client.start_background).parameters["wait_s"].default
    assert wait == lib.KREX_DAEMON_START_WAIT_MS / 1e3
    assert "15.0" not in inspect.getsource(client.start_background)


# The guardian's frames (guardian.c): every one a struct and its text tail, no JSON.
GUARDIAN_CASES = [
    (
        {
            "op": "admit",
            "gpu": 0,
            "guardian": "native",
            "device": "sim",
            "freeze": "gpu",
            "tenant": "t",
            "auto_value": "do_bench",
        },
        False,
        None,
    ),
    ({"op": "admit", "device": "auto"}, False, None),  # no gpu: krexd picks one (has_gpu 0)
    ({"op": "started", "pid": 4242, "join": True}, False, None),
    (
        {"op": "release", "report": True, "exit_status": 0, "leftovers": "keep", "auto_dir": "/tmp/a b"},
        False,
        None,
    ),
    (
        {
            "op": "release",
            "report": True,
            "exit_status": 137,
            "stalled_ts": 1700000000.5,
            "stall_age_s": 2.25,
            "resumed_ts": 1700000004.0,
            "leftovers": "kill",
            "extra": '{"daemon_started": true}',
        },
        False,
        None,
    ),
    (
        {"op": "release", "report": False, "leftovers": "kill", "exit_pid": 77, "exit_status": 137,
         "exit_signal": 9, "exit_command": "python3 bench.py"},
        False,
        None,
    ),
    (
        {
            "ok": True,
            "slot": 3,
            "gpu": 1,
            "admission_wait_s": 0.25,
            "auto_value": True,
            "device": "sim",
            "shm": "/krex-0",
            "group": "/sys/fs/cgroup/krex/slot-3",
            "freezer": "cgroup2",
            "env_set": ["KREX_SLOT", "3", "KREX_GPU", "1"],
            "env_prepend": ["LD_PRELOAD", "/x/libkrex.so", ": "],
            "shared_cpus": ["0", "5"],
            "notes": ["krex: simulated", "é ünïcode"],
        },
        True,
        "admit",
    ),
    ({"ok": True, "notes": [], "report_json": '{"slot": 3}'}, True, "release"),
    ({"ok": True, "notes": ["one"]}, True, "release"),
    ({"ok": False, "error": "unknown GPU 9", "fix": "pick one", "kind": "NotFound"}, True, "admit"),
    ({"ok": False, "error": "no fix"}, True, "started"),
    ({"event": "queued", "slots_busy": 2, "note": "krex: queued"}, True, "admit"),
]


@pytest.mark.parametrize(("msg", "reply", "op"), GUARDIAN_CASES)
def test_guardian_frames_round_trip_without_json(msg: dict[str, object], reply: bool, op: str | None) -> None:
    raw = encode_reply(op or "none", msg) if reply else encode(msg)
    assert struct.unpack_from("=IHHII", raw)[4] == 0, "a guardian frame carries no JSON"
    assert decode(raw, reply=reply).to_dict() == msg


def test_maps_travel_as_key_value_lists() -> None:
    """krexd's env_set ({NAME: value}) and env_prepend ({NAME: [value, separators]}) go as
    flat lists, each key then its value's strings (krex_rep_admit)."""
    raw = encode_reply(
        "admit",
        {
            "ok": True,
            "slot": 0,
            "gpu": 0,
            "env_set": {"A": "1"},
            "env_prepend": {"P": ["v", ":"]},
            "shared_cpus": [2, 3],
        },
    )
    back = decode(raw, reply=True).to_dict()
    assert back["env_set"] == ["A", "1"] and back["env_prepend"] == ["P", "v", ":"]
    assert back["shared_cpus"] == ["2", "3"]


def _admit_body(**lens: int) -> bytes:
    c = ffi.new("struct krex_req_admit *")
    for k, v in lens.items():
        setattr(c, k, v)
    return bytes(ffi.buffer(c))


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"\0" * 4, "fixed body of 4 bytes"),
        (_admit_body(tenant_str=4) + b"abc", "expected"),  # a tail shorter than its lengths
        (_admit_body(tenant_str=2) + b"abc", "expected"),  # longer
        (_admit_body(tenant_str=3) + b"abc", "does not end in a NUL"),
        (_admit_body(tenant_str=3) + b"\xff\xfe\0", "not UTF-8"),
        (_admit_body(tenant_str=4) + b"a\0b\0", "not one"),
    ],
)
def test_malformed_tails_are_protocol_errors(body: bytes, needle: str) -> None:
    with pytest.raises(ProtocolError, match=needle) as e:
        decode(_frame(lib.KREX_OP_ADMIT, body), reply=False)
    assert not e.value.fatal and e.value.op == lib.KREX_OP_ADMIT


def test_texts_refuse_what_c_could_not_read() -> None:
    with pytest.raises(UsageError, match="NUL"):
        encode({"op": "admit", "tenant": "a\0b"})
    with pytest.raises(UsageError, match="must be a string"):
        encode({"op": "admit", "tenant": 7})
