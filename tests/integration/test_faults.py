"""Faults: a KREX failure never kills, hangs or loses a user's work.

Each test reproduces one fault on the simulated GPU in an isolated KREX world
(the `kx` fixture of conftest.py, or `krex_env`): the daemon stopped or killed
inside a region, a hung (SIGSTOPped) daemon, an interrupted pause, a deleted
socket and racing daemon starts, a broken journal, bad input, `./prog`, and the
exit status that `krex run` reserves for its own failures. No timed asserts:
waits are generous, and how long recovery took is only reported."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_until
from helpers.krex_world import KREX, WORKER, Cmd, Krex, backend_or_skip, frozen_reason, hold_with_siblings

from krex.native import LIB_DIR, ffi, lib, shim_path
from krex.node import procfs
from krex.node.shm import Segment
from krex.protocol import FrameReader, encode

HB_TIMEOUT_S = lib.KREX_HEARTBEAT_TIMEOUT_NS / 1e9


def krex(env: dict[str, str], *args: str, timeout: float = 60, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KREX, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        **kw,
    )


def no_traceback(p: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in p.stderr + p.stdout, p.stderr[-3000:]


# ============================================================ the daemon goes away inside a region


def _c_owner(kx: Krex, bins: dict[str, Path]) -> subprocess.Popen[str]:
    """`krex run -- actor k:50 begin k:50 line end k:50`: a C region owner (krex.h) that
    waits inside its region until the test writes a line."""
    p = subprocess.Popen(
        [
            *KREX,
            "run",
            "--device",
            "sim",
            "--report",
            str(kx.out / "c.report.json"),
            "--",
            str(bins["actor"]),
            "k:50",
            "begin",
            "k:50",
            "line",
            "end",
            "k:50",
        ],
        env=kx.env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    kx.popens.append(p)  # type: ignore[arg-type]
    return p


def _read_line(p: subprocess.Popen[str], act: str, timeout: float = 30) -> dict[str, Any]:
    assert p.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        if line.startswith("{"):
            d = json.loads(line)
            if d["act"] == act:
                return d
    raise AssertionError(f"no {act!r} line; rc={p.poll()} stderr={p.stderr.read() if p.stderr else ''}")


@pytest.mark.parametrize("how", ["stop", "sigkill"])
def test_c_owner_survives_losing_the_daemon_inside_its_region(
    kx: Krex, bins: dict[str, Path], how: str
) -> None:
    d = kx.start_daemon(slots=3)
    p = _c_owner(kx, bins)
    begin = _read_line(p, "begin")
    assert begin["rc"] == 0, begin
    kx.wait(lambda: not kx.gate_open(), 10, "the region to hold the gate")
    if how == "stop":
        assert kx.krex("daemon", "stop").returncode == 0
    else:
        d.kill()
        d.wait(10)
    assert p.stdin is not None
    p.stdin.write("go\n")
    p.stdin.flush()
    end = _read_line(p, "end")
    rc = p.wait(60)
    # Before: SIGPIPE at KREX_REGION_END (exit 141). Now END says the region was lost.
    assert rc == 0, (rc, p.stderr.read() if p.stderr else "")
    assert end["rc"] < 0, end
    report = json.loads((kx.out / "c.report.json").read_text())
    # The region is journaled whichever way it ended: by the daemon that stopped it, or by the
    # guardian that saw the daemon die while its command held the gate.
    assert len(report["regions"]) == 1, report
    reg = report["regions"][0]
    if how == "stop":
        assert reg["end"] == "daemon-stop", reg
    else:
        assert reg["end"] == "daemon-lost" and reg["contaminated"] and reg["recorded_by"] == "guardian", reg
        assert [e["event"] for e in report["daemon_events"]] == ["daemon-lost"], report
        assert report["daemon_events"][0]["region_cut"] is True


@pytest.mark.parametrize("how", ["stop", "sigkill"])
def test_python_owner_survives_losing_the_daemon_inside_its_region(kx: Krex, how: str) -> None:
    d = kx.start_daemon(slots=3)
    ready = hold_with_siblings(kx, "h1")
    if how == "stop":
        assert kx.krex("daemon", "stop").returncode == 0
    else:
        d.kill()
        d.wait(10)
    kx.touch("own")
    assert kx.cmds["own"].wait(60) == 0, kx.cmds["own"].output()
    res = kx.result("own")
    out = kx.cmds["own"].output()
    assert "Traceback" not in out, out
    assert "error" not in res, res
    assert res["unprotected"] is True and res["lost"], res
    assert "lost the KREX daemon" in out
    assert res["pid"] == ready["pid"]
    # The sibling was thawed (by the stopping daemon, or by its own guardian).
    assert kx.advances("h1", timeout=30)


# ============================================================ a hung daemon


def test_hung_daemon_neither_freezes_siblings_nor_hangs_clients(kx: Krex) -> None:
    d = kx.start_daemon(slots=3)
    hold_with_siblings(kx, "h1")
    h1 = kx.progress("h1")[2]
    os.kill(d.pid, signal.SIGSTOP)
    t_stop = time.monotonic()
    try:
        # The sibling's guardian is not frozen: it sees the stale heartbeat and thaws its command,
        # whose shim then fails open on the gate of a holder that no longer beats.
        wait_until(lambda: frozen_reason(h1) is None, 30, "h1's guardian to thaw it")
        assert kx.advances("h1", timeout=30), "h1 stayed stuck behind the hung daemon"
        recovered_s = time.monotonic() - t_stop
        # Every client call gives up with a clear error instead of hanging.
        for args in (["status"], ["daemon", "status"], ["run", "--device", "sim", "--", "true"]):
            t0 = time.monotonic()
            p = kx.krex(*args, timeout=60)
            took = time.monotonic() - t0
            no_traceback(p)
            text = p.stdout + p.stderr
            assert "not responding" in text or "stopped" in text, (args, text)
            print(f"krex {' '.join(args)} against a hung daemon: rc {p.returncode} in {took:.2f} s")
            if args[0] == "run":
                assert p.returncode == 125, p.stderr
        # The owner leaves its region: END gives up (the region is marked unprotected), no hang.
        kx.touch("own")
        assert kx.cmds["own"].wait(60) == 0, kx.cmds["own"].output()
        res = kx.result("own")
        assert res["unprotected"] is True and res["lost"], res
        # `krex daemon stop` stops even a stopped daemon (SIGTERM + SIGCONT).
        p = kx.krex("daemon", "stop", timeout=60)
        assert p.returncode == 0, p.stderr
        assert d.wait(30) is not None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(d.pid, signal.SIGCONT)
    print(f"sibling thawed {recovered_s:.2f} s after SIGSTOP of krexd (heartbeat timeout {HB_TIMEOUT_S:g} s)")
    kx.wait(lambda: kx.frozen_groups() == [], 10, "no frozen group")


def _watchdogs(daemon_pid: int) -> list[int]:
    kids = procfs.descendants([daemon_pid], procfs.proc_table())
    return [p for p in kids if "krex.node.watchdog" in (procfs.cmdline(p, 200) or "")]


@pytest.mark.parametrize("how", ["sigstop", "sigkill", "killpg", "watchdog-killed-first"])
def test_watchdog_thaws_a_sibling_that_has_no_guardian(kx: Krex, how: str) -> None:
    """A self-registered process (`krex env`, no `krex run`) has no guardian: krexd's
    watchdog, a process of its own, thaws it when krexd hangs or dies. It is in a session
    of its own, so SIGKILL to krexd's process group spares it (`killpg`), and krexd starts
    a new one when it dies (`watchdog-killed-first`)."""
    d = kx.start_daemon(slots=3)
    env = kx.env(LD_PRELOAD=str(shim_path()), KREX_SOCKET=str(kx.sock), LD_LIBRARY_PATH=str(LIB_DIR))
    log = kx.out / "auto.log"
    with open(log, "wb") as f:
        p = subprocess.Popen(
            [sys.executable, str(WORKER), "hammer", str(kx.out), "--name", "auto", "--us", "50"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    kx.popens.append(p)
    kx.cmds["auto"] = Cmd("auto", p, log, kx)
    auto = kx.wait_running("auto")
    assert any(s["kind"] == "auto" for s in kx.status()["slots"])
    kx.run("own", "hold")
    kx.result("own", "ready", timeout=30)
    assert kx.stands_still("auto") and frozen_reason(auto) is not None
    if how == "sigstop":
        os.kill(d.pid, signal.SIGSTOP)
    elif how == "killpg":
        os.killpg(d.pid, signal.SIGKILL)  # (the test daemon leads a session of its own)
    else:
        if how == "watchdog-killed-first":
            (first,) = _watchdogs(d.pid)
            os.kill(first, signal.SIGKILL)
            wait_until(lambda: [w for w in _watchdogs(d.pid) if w != first], 10, "krexd to start a watchdog")
        d.kill()
    try:
        wait_until(lambda: frozen_reason(auto) is None, 30, "the watchdog to thaw the sibling")
        assert kx.advances("auto", timeout=30)  # its shim then fails open on the stale gate
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(d.pid, signal.SIGCONT)


def test_a_region_that_spans_a_daemon_stall_is_contaminated(kx: Krex) -> None:
    d = kx.start_daemon(slots=3)
    hold_with_siblings(kx, "h1")
    os.kill(d.pid, signal.SIGSTOP)
    h1 = kx.progress("h1")[2]
    wait_until(lambda: frozen_reason(h1) is None, 30, "h1's guardian to thaw it")
    assert kx.advances("h1", timeout=30)  # h1 runs inside the region: it must not be journaled clean
    os.kill(d.pid, signal.SIGCONT)
    kx.touch("own")
    assert kx.cmds["own"].wait(60) == 0, kx.cmds["own"].output()
    kx.wait(lambda: [r for r in kx.journal() if r.get("owner_slot") is not None], 10, "the journal record")
    rec = kx.journal()[-1]
    assert rec["contaminated"] and any("stalled" in r for r in rec["reasons"]), rec
    assert "did not beat" in kx.daemon_log(), kx.daemon_log()[-2000:]


# ============================================================ an interrupted pause


def _straggler(seg: Segment) -> subprocess.Popen[bytes]:
    """A live process whose record says it is inside a gated call forever."""
    sleeper = subprocess.Popen(["sleep", "600"])
    slot = seg.claim_slot(0)
    idx = lib.krex_proc_register(seg.raw, slot, 0, sleeper.pid)
    assert idx >= 0
    seg.raw.procs[idx].inflight = 1
    return sleeper


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_pause_reopens_the_gate(krex_env: dict[str, str], sig: int) -> None:
    seg = Segment.create(krex_env["KREX_SHM"], n_gpus=1)
    sleeper = _straggler(seg)
    try:
        p = subprocess.Popen(
            [*KREX, "pause", "--gpu", "0", "--timeout", "300"],
            env=krex_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_until(lambda: seg.snapshot().gates[0].closed, 30, "the pause to close the gate")
        p.send_signal(sig)
        _, err = p.communicate(timeout=30)
        assert p.returncode == 130, err
        assert "aborted" in err and "Traceback" not in err, err
        g = seg.snapshot().gates[0]
        assert not g.closed, g  # before: closed, with a 599 s lease, blocking every new command
    finally:
        sleeper.kill()
        sleeper.wait()
        seg.close()


# ============================================================ a deleted socket, racing starts


def test_deleted_socket_is_recreated_and_stop_finds_the_daemon(kx: Krex) -> None:
    d = kx.start_daemon(slots=2)
    kx.sock.unlink()
    # Before: `krex run` said a daemon was already running, `daemon status/stop` that none was.
    p = kx.krex("run", "--device", "sim", "--", "true")
    assert p.returncode == 0, p.stderr
    st = kx.krex("daemon", "status", "--json")
    assert st.returncode == 0 and json.loads(st.stdout)["daemon"]["pid"] == d.pid, st.stderr
    # Found by its lock even while it cannot answer: stopped, and its socket gone again.
    os.kill(d.pid, signal.SIGSTOP)
    kx.sock.unlink()
    stop = kx.krex("daemon", "stop", timeout=60)
    assert stop.returncode == 0, stop.stderr
    assert f"pid {d.pid}" in stop.stdout
    assert d.wait(30) is not None


def test_concurrent_daemon_starts_report_the_one_that_runs(kx: Krex) -> None:
    kx.state.mkdir(exist_ok=True)
    for attempt in range(3):
        procs = [
            subprocess.Popen(
                [*KREX, "daemon", "start", "--device", "sim"],
                env=kx.env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(3)
        ]
        outs = [(p.wait(60), *p.communicate()) for p in procs]
        pid = json.loads(kx.krex("daemon", "status", "--json").stdout)["daemon"]["pid"]
        ok = [o for o in outs if o[0] == 0]
        assert len(ok) == 1, outs  # before: all three said "krexd started (pid N)" with rc 0
        assert f"krexd started (pid {pid}," in ok[0][1], ok
        for rc, _out, err in outs:
            if rc != 0:
                assert rc == 6 and f"already running (pid {pid})" in err, err
        assert kx.krex("daemon", "stop").returncode == 0, attempt


# ============================================================ the journal


BAD_LINES = [b"[1,2,3]\n", b'"str"\n', b'{"ts":"x"}\n', b"\xff\xfe{not utf-8}\n", b"{torn", b"\n"]


def _region_cmd() -> list[str]:
    return [sys.executable, "-c", "import krex\nwith krex.region():\n    pass\n"]


def test_bad_journal_lines_are_skipped_and_counted(krex_env: dict[str, str], tmp_path: Path) -> None:
    state = Path(krex_env["KREX_STATE_DIR"])
    state.mkdir(parents=True, exist_ok=True)
    (state / "journal.jsonl").write_bytes(b"".join(BAD_LINES[:-2]) + b"{torn\n")
    rep = tmp_path / "r.json"
    p = krex(krex_env, "run", "--device", "sim", "--report", str(rep), "--", *_region_cmd())
    no_traceback(p)
    assert p.returncode == 0, p.stderr
    r = json.loads(rep.read_text())
    # The report's regions come from krexd's `release` reply, not from reading the journal,
    # so its bad lines cost the report nothing (and are not counted there).
    assert len(r["regions"]) == 1 and "journal_skipped_lines" not in r, r
    j = krex(krex_env, "journal", "--json")
    assert j.returncode == 0 and json.loads(j.stdout) == r["regions"], j.stderr
    assert "5 malformed line(s) skipped" in j.stderr
    # `krex batch` does not mark every command failed either.
    batch = tmp_path / "cmds.json"
    batch.write_text(json.dumps([_region_cmd(), ["true"]]))
    b = krex(
        krex_env,
        "batch",
        "-j",
        "2",
        "--device",
        "sim",
        "--out",
        str(tmp_path / "out"),
        str(batch),
        timeout=120,
    )
    no_traceback(b)
    assert b.returncode == 0, b.stdout + b.stderr


def test_journal_replaced_by_a_directory_is_not_fatal(krex_env: dict[str, str], tmp_path: Path) -> None:
    state = Path(krex_env["KREX_STATE_DIR"])
    (state / "journal.jsonl").mkdir(parents=True)
    rep = tmp_path / "r.json"
    p = krex(krex_env, "run", "--device", "sim", "--report", str(rep), "--", *_region_cmd())
    no_traceback(p)
    assert p.returncode == 0, p.stderr
    r = json.loads(rep.read_text())
    # krexd's own error (the report's regions come from krexd, so they are not lost with it).
    err = r["journal_error"]
    assert "cannot write the journal" in err and "is a directory" in err.lower(), r
    assert len(r["regions"]) == 1 and r["regions"][0]["owner_slot"] == r["slot"], r
    st = krex(krex_env, "daemon", "status", "--json")
    assert "journal" in json.loads(st.stdout)["daemon"]["journal_error"]
    log = (state / "krexd.log").read_text()
    assert "cannot write the journal" in log and "Traceback" not in log, log


def test_journal_rotates_by_size_and_readers_see_across_rotation(krex_env: dict[str, str]) -> None:
    # About two records (each about 1 KB: the grant's timings, flags and the command line).
    env = dict(krex_env, KREX_JOURNAL_MAX_BYTES="2500")
    code = "import krex\nfor _ in range(12):\n    with krex.region():\n        pass\n"
    p = krex(env, "run", "--device", "sim", "--", sys.executable, "-c", code, timeout=120)
    assert p.returncode == 0, p.stderr
    state = Path(env["KREX_STATE_DIR"])
    files = [state / "journal.jsonl", state / "journal.jsonl.1", state / "journal.jsonl.2"]
    assert all(f.exists() for f in files), list(state.iterdir())
    assert all(f.stat().st_size <= 2500 for f in files), [f.stat().st_size for f in files]
    assert not (state / "journal.jsonl.3").exists()
    recs = json.loads(krex(env, "journal", "-n", "1000", "--json").stdout)
    assert 3 <= len(recs) < 12 and recs == sorted(recs, key=lambda r: r["ts"])


# ============================================================ bad input


def test_report_into_a_missing_directory_is_refused_before_running(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    p = krex(
        krex_env,
        "run",
        "--device",
        "sim",
        "--report",
        "/nonexistent/dir/r.json",
        "--",
        "sh",
        "-c",
        f"touch {marker}; exit 7",
    )
    no_traceback(p)
    assert not marker.exists(), "the command ran although its report could not be written"
    assert p.returncode == 125 and "/nonexistent/dir" in p.stderr and "fix:" in p.stderr, p.stderr


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e308", "0", "-5"])
@pytest.mark.parametrize("opt", ["--for", "--timeout"])
def test_pause_refuses_non_finite_or_huge_durations(krex_env: dict[str, str], opt: str, value: str) -> None:
    seg = Segment.create(krex_env["KREX_SHM"], n_gpus=1)
    try:
        p = krex(krex_env, "pause", "--gpu", "0", opt, value)
        no_traceback(p)
        assert p.returncode == 2 and opt in p.stderr and "fix:" in p.stderr, p.stderr
        assert not seg.snapshot().gates[0].closed
    finally:
        seg.close()


@pytest.mark.parametrize("opt", ["--max-region", "--idle-exit"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_daemon_start_refuses_non_finite_durations(krex_env: dict[str, str], opt: str, value: str) -> None:
    p = krex(krex_env, "daemon", "start", "--device", "sim", opt, value)
    no_traceback(p)
    assert p.returncode == 2 and opt in p.stderr, p.stderr


@pytest.mark.parametrize("content", [b"true\n\x00\x01\x02binary\n", b'[["echo", "a\\u0000b"]]'])
def test_binary_batch_file_is_refused(krex_env: dict[str, str], tmp_path: Path, content: bytes) -> None:
    f = tmp_path / "cmds.txt"
    f.write_bytes(content)
    p = krex(krex_env, "batch", "-j", "1", "--device", "sim", str(f))
    no_traceback(p)
    assert p.returncode == 2 and "NUL" in p.stderr and "fix:" in p.stderr, p.stderr


def frame(
    op: int,
    body: bytes = b"",
    js: bytes = b"",
    *,
    magic: int | None = None,
    status: int = 0,
    body_len: int | None = None,
    json_len: int | None = None,
) -> bytes:
    """A KREX frame built by hand (krex_abi.h's header through cffi), so it may lie."""
    h = ffi.new("struct krex_msg_hdr *")
    h.magic = lib.KREX_WIRE_MAGIC if magic is None else magic
    h.op, h.status = op, status
    h.body_len = len(body) if body_len is None else body_len
    h.json_len = len(js) if json_len is None else json_len
    return bytes(ffi.buffer(h)) + body + js


def _begin_body(tid: int = 0, gpu: int = 0) -> bytes:
    b = ffi.new("struct krex_req_begin *")
    b.tid, b.gpu = tid, gpu
    return bytes(ffi.buffer(b))


def _body(ctype: str, **fields: int) -> bytes:
    b = ffi.new(f"{ctype} *")
    for k, v in fields.items():
        setattr(b, k, v)
    return bytes(ffi.buffer(b))


# Frames the daemon can read past: each gets an error reply on a connection that goes on.
MALFORMED = [
    # The guardian's binary bodies (a struct and its text tail), cut short or padded out.
    frame(lib.KREX_OP_ADMIT, b"\0" * 4),
    frame(lib.KREX_OP_ADMIT, _body("struct krex_req_admit", device_str=40) + b"sim\0"),
    frame(lib.KREX_OP_ADMIT, _body("struct krex_req_admit", device_str=4) + b"sim\0" + b"x" * 64),
    frame(lib.KREX_OP_ADMIT, _body("struct krex_req_admit", device_str=3) + b"sim"),
    frame(lib.KREX_OP_ADMIT, _body("struct krex_req_admit", tenant_str=3) + b"\xff\xfe\0"),
    frame(lib.KREX_OP_ADMIT, _body("struct krex_req_admit", device_str=0xFFFFFFFF)),
    frame(lib.KREX_OP_STARTED, b"\0" * 3),
    frame(lib.KREX_OP_RELEASE, _body("struct krex_req_release", leftovers_str=5) + b"keep"),
    frame(lib.KREX_OP_BEGIN, _body("struct krex_req_begin", label_str=9) + b"L\0"),
    frame(lib.KREX_OP_HELLO, js=b"[1,2,3]"),
    frame(lib.KREX_OP_HELLO, js=b'"op"'),
    frame(lib.KREX_OP_HELLO, js=b"{not json"),
    frame(lib.KREX_OP_HELLO, js=b"\xff\xfe"),
    frame(999),
    frame(lib.KREX_OP_NONE),
    frame(lib.KREX_OP_EVENT, js=b'{"event": "queued"}'),
    frame(lib.KREX_OP_HELLO, status=lib.KREX_ST_ERROR),
    frame(lib.KREX_OP_ADMIT, js=b'{"gpu": "zero"}'),
    frame(lib.KREX_OP_ADMIT, js=b'{"gpu": true}'),
    frame(lib.KREX_OP_STARTED),
    frame(lib.KREX_OP_STARTED, js=b'{"pid": "1"}'),
    frame(lib.KREX_OP_BEGIN, _begin_body(), b'{"tid": [1]}'),
    frame(lib.KREX_OP_BEGIN, b"\0\0\0\0"),
    frame(lib.KREX_OP_REGISTER),
    frame(lib.KREX_OP_END, _begin_body()),
    frame(lib.KREX_OP_ADOPT, js=b'{"slot": 0}'),
    frame(lib.KREX_OP_ADOPT, js=b'{"slot": 999999, "gpu": 0}'),
    frame(lib.KREX_OP_ADOPT, js=b'{"slot": 0, "gpu": 0, "pids": "x"}'),
]


def _connect(sock_path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(str(sock_path))
    return s


def _exchange(
    sock_path: Path, payload: bytes, shut: bool = False, fatal: bool = False
) -> tuple[dict[str, Any] | None, bool]:
    """Send `payload` on a new connection (`shut`: then end our side); the reply, and
    whether the daemon ended the connection after it (waited for long when `fatal`,
    a moment otherwise: a connection that goes on shows nothing to wait for)."""
    s = _connect(sock_path)
    try:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it may stop reading
            s.sendall(payload)
            if shut:
                s.shutdown(socket.SHUT_WR)
        reader = FrameReader(s, replies=True)
        reply = reader.read()
        try:
            s.settimeout(30 if fatal else 0.3)
            closed = reader.read() is None
        except TimeoutError:
            closed = False
        return reply, closed
    finally:
        s.close()


def test_malformed_socket_messages_get_an_error_reply(kx: Krex) -> None:
    kx.start_daemon(slots=2)
    for m in MALFORMED:
        r, closed = _exchange(kx.sock, m)
        assert r is not None, f"{m!r}: the daemon dropped the connection without a reply"
        assert r["ok"] is False and r["error"] and r["kind"] in ("UsageError", "NotFound"), (m, r)
        assert not closed, f"{m!r}: the connection ended after a frame it could read past"
    # Frames that leave the stream unreadable: an error reply, then the connection ends.
    fatal = [
        (frame(lib.KREX_OP_HELLO, js=b"{}", json_len=lib.KREX_WIRE_MAX + 1), "longer than", False),
        (frame(lib.KREX_OP_HELLO, magic=0x0A7D7B), "not a KREX frame", False),
        (frame(lib.KREX_OP_HELLO, js=b"{}", json_len=100), "truncated", True),
        (frame(lib.KREX_OP_HELLO)[:7], "truncated", True),
        (
            frame(lib.KREX_OP_ADMIT, _body("struct krex_req_admit"), body_len=lib.KREX_WIRE_MAX + 1),
            "longer than",
            False,
        ),
        (frame(lib.KREX_OP_ADMIT, _body("struct krex_req_admit"), body_len=200), "truncated", True),
        (frame(lib.KREX_OP_STARTED, _body("struct krex_req_started"))[:20], "truncated", True),
    ]
    for m, needle, shut in fatal:
        r, closed = _exchange(kx.sock, m, shut, fatal=True)
        assert r is not None and r["ok"] is False and needle in r["error"], (m, r)
        assert closed, f"{m!r}: the connection went on after an unreadable frame"
    # A bad frame does not spoil the connection: the next message on it is answered.
    s = _connect(kx.sock)
    s.sendall(MALFORMED[0] + encode({"op": "hello"}))
    reader = FrameReader(s, replies=True)
    first, second = reader.read(), reader.read()
    s.close()
    assert first is not None and second is not None
    assert first["ok"] is False and second["ok"] is True and second["pid"] == kx.daemon.pid  # type: ignore[union-attr]
    assert kx.status()["daemon"]["pid"] == kx.daemon.pid  # type: ignore[union-attr]
    log = kx.daemon_log()
    assert "Traceback" not in log, log[-3000:]


# ============================================================ ./prog


def test_run_a_relative_path_with_a_slash(krex_env: dict[str, str], tmp_path: Path) -> None:
    prog = tmp_path / "victim"
    prog.write_text('#!/bin/sh\necho "ran $1"\n')
    prog.chmod(0o755)
    p = krex(krex_env, "run", "--device", "sim", "--", "./victim", "x", cwd=tmp_path)
    assert p.returncode == 0 and "ran x" in p.stdout, p.stderr  # before: 127, command not found: victim
    batch = tmp_path / "cmds.json"
    batch.write_text(json.dumps([["./victim", "y"]]))
    b = krex(
        krex_env,
        "batch",
        "-j",
        "1",
        "--device",
        "sim",
        "--out",
        str(tmp_path / "out"),
        str(batch),
        cwd=tmp_path,
        timeout=120,
    )
    assert b.returncode == 0, b.stdout + b.stderr
    assert "ran y" in next((tmp_path / "out").glob("cmd-*.stdout")).read_text()


# ============================================================ exit 125


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--gpu", "5", "--", "true"], "unknown GPU 5"),
        (["--gpu", "abc", "--", "true"], "abc"),
        (["--"], "no command given"),
    ],
    ids=["unknown-gpu", "bad-option", "no-command"],
)
def test_krex_failures_exit_125_and_land_in_the_report(
    krex_env: dict[str, str], tmp_path: Path, args: list[str], needle: str
) -> None:
    rep = tmp_path / "r.json"
    p = krex(krex_env, "run", "--device", "sim", "--report", str(rep), *args)
    no_traceback(p)
    assert p.returncode == 125 and needle in p.stderr, p.stderr  # before: 3 (or 2), like a command's own
    if args[0] != "--gpu" or args[1] != "abc":  # click refuses the option before our code runs
        r = json.loads(rep.read_text())
        assert r["exit_status"] == 125 and needle in r["krex_error"]["message"], r


def test_command_statuses_pass_through_unchanged(krex_env: dict[str, str], tmp_path: Path) -> None:
    rep = tmp_path / "r.json"
    for code in (0, 3, 6, 124, 126, 127):
        p = krex(krex_env, "run", "--device", "sim", "--report", str(rep), "--", "sh", "-c", f"exit {code}")
        assert p.returncode == code, p.stderr
        r = json.loads(rep.read_text())
        assert r["exit_status"] == code and "krex_error" not in r
    assert krex(krex_env, "run", "--device", "sim", "--", "/nonexistent/x").returncode == 127
    assert math.isfinite(HB_TIMEOUT_S)


def test_a_guardian_killed_while_its_command_waits_before_exec_leaves_no_process(kx: Krex) -> None:
    """Under SIGSTOP freezing the command waits before exec until krexd has its pid. If
    the guardian dies in that wait (here: SIGKILL while a slow krexd has not answered), the
    waiting child must end too, not stay forever as a pre-exec copy of the guardian."""
    backend_or_skip(kx, "signal")
    slow = (  # krexd answers `started` with join 3 s late
        "import sys, time, krex.node.daemon as d\n"
        "started = d.HANDLERS['started']\n"
        "d.HANDLERS['started'] = lambda *a: (time.sleep(3), started(*a))[1]\n"
        "d.main(sys.argv[1:])\n"
    )
    kx.state.mkdir(exist_ok=True)
    d = subprocess.Popen(
        [sys.executable, "-c", slow, "--device", "sim", "--slots-per-gpu", "3", "--freezer", "signal"],
        env=kx.env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    kx.popens.append(d)
    wait_until(lambda: kx.sock.exists() and kx.status().get("slots") == [], 20, "the slow krexd")
    g = subprocess.Popen(
        [*KREX, "run", "--device", "sim", "--", "sleep", "30"],
        env=kx.env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    kx.popens.append(g)
    wait_until(lambda: procfs.descendants([g.pid], procfs.proc_table()) - {g.pid}, 30, "the command's fork")
    (child,) = procfs.descendants([g.pid], procfs.proc_table()) - {g.pid}
    assert not (procfs.cmdline(child, 200) or "").startswith("sleep"), "it exec'd: this proves nothing"
    os.kill(g.pid, signal.SIGKILL)
    g.wait(10)
    wait_until(lambda: procfs.pid_stat(child) is None, 10, "the waiting child to end with its guardian")


@pytest.mark.parametrize("policy", ["all", "gpu"])
def test_a_command_from_before_krexd_restarted_on_a_fresh_segment_is_frozen_and_keeps_its_slot(
    kx: Krex, policy: str
) -> None:
    """The segment's name unlinked and krexd killed before it linked
    it again, the next krexd makes a fresh segment and adopts no slot. A command still running
    from before is registered in the old segment, whose gate nobody closes: it must not pass
    a new command's regions. Before, the new command got its slot number (and its group, so
    the old processes counted as the new owner's own) and its regions read clean while the old
    hammer ran in them. Now the group's processes keep the number and are frozen in every
    region, under every policy."""
    base_env = kx.env
    kx.env = lambda **extra: base_env(KREX_FREEZE_POLICY=policy, **extra)  # type: ignore[method-assign]
    d = kx.start_daemon(slots=3)
    kx.run("old", "hammer", "--us", "50")
    old = kx.wait_running("old")
    old_slot = next(s["slot"] for s in kx.status()["slots"])
    os.kill(d.pid, signal.SIGSTOP)  # so it cannot link the name again
    Path("/dev/shm" + kx.shm).unlink()
    d.kill()
    os.kill(d.pid, signal.SIGCONT)
    d.wait(timeout=30)
    kx.start_daemon(slots=3)
    assert kx.advances("old", timeout=30)  # outside regions it runs on
    kx.run("own", "hold")
    ready = kx.result("own", "ready", timeout=30)
    slots = {s["slot"]: s for s in kx.status()["slots"]}
    assert old_slot in slots and slots[old_slot]["kind"] == "orphan", slots
    own_slot = ready["grant"]["slot"]
    assert own_slot != old_slot, "the new command got the old command's slot number"
    assert frozen_reason(old) is not None and kx.stands_still("old"), "the old hammer ran inside the region"
    kx.touch("own")
    assert kx.cmds["own"].wait(60) == 0, kx.cmds["own"].output()
    kx.wait(lambda: frozen_reason(old) is None, 10, "the old hammer thawed after the region")
    assert "of a command from before this krexd" in kx.daemon_log()
