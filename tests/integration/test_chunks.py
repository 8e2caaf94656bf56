"""Large copies and memsets split into gated chunks (the tables' chunk column,
KREX_COPY_CHUNK_BYTES): the same bytes land in the same places, the first error is
returned and ends the sequence, each chunk is one gated submission, a graph capture
keeps its copy whole, and a region's in-flight wait is bounded by one chunk, not by a
sibling's whole copy (the contrast with splitting off is asserted too)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO, Harness, clean_env, wait_until

from krex.native import lib

CHUNK = 1 << 20  # KREX_COPY_CHUNK_MIN_BYTES: the smallest the shim takes
BYTES = 5 * CHUNK + 1004  # not a multiple of any chunk: a short last chunk


def _chunks(line: dict[str, Any], chunk: int) -> int:
    per = chunk // line["esz"]
    return math.ceil((BYTES // line["esz"]) / per)


def _ops_during(h: Harness, pid: int, call: dict[str, Any]) -> list[dict[str, Any]]:
    return [o for o in h.ops(pid) if o["api"] == call["name"] and call["t0"] <= o["submit"] <= call["t1"]]


def _run(h: Harness, args: list[str], **env: str) -> tuple[int, list[dict[str, Any]]]:
    slot = h.claim()
    c = h.run("chunks", args, h.env(slot, KREX_SIM_MOVE_BYTES="1", **env))
    assert c.popen.returncode == 0, c.stderr
    return c.pid, [d for d in c.lines if "name" in d or "done_bytes" in d]


@pytest.mark.parametrize("chunk", [CHUNK, 0], ids=["split", "off"])
def test_split_calls_leave_the_same_bytes(harness: Harness, chunk: int) -> None:
    h = harness
    pid, lines = _run(h, ["run", str(BYTES)], KREX_COPY_CHUNK_BYTES=str(chunk))
    calls = [d for d in lines if "name" in d]
    assert len(calls) >= 50, "fewer chunked rows than the tables have"
    bad = [c["name"] for c in calls if c["rc"] != 0 or c["ok"] != 1]
    assert not bad, f"wrong bytes or return code: {bad}"
    for c in calls:
        want = _chunks(c, chunk) if chunk else 1
        got = len(_ops_during(h, pid, c))
        assert got == want, f"{c['name']}: {got} gated submissions, want {want} (one per chunk)"


@pytest.mark.parametrize("value", ["-1", "1", "12x"])
def test_a_chunk_size_that_is_no_byte_count_or_too_small_is_flagged_and_not_taken(
    harness: Harness, value: str
) -> None:
    """KREX_COPY_CHUNK_BYTES=-1 once meant "never split" (strtoull wraps it), =1 made every
    copy thousands of calls: a value that is not a byte count gets the default, one below
    KREX_COPY_CHUNK_MIN_BYTES gets that minimum, and the process record says so
    (`chunk-setting`), never silently."""
    h = harness
    assert lib.KREX_COPY_CHUNK_MIN_BYTES >= 1 << 20  # =1 must not make a copy thousands of calls
    nbytes = 2 * lib.KREX_COPY_CHUNK_MIN_BYTES + 1004
    slot = h.claim()
    c = h.run("chunks", ["run", str(nbytes), "cudaMemcpy"],
              h.env(slot, KREX_SIM_MOVE_BYTES="1", KREX_COPY_CHUNK_BYTES=value))
    assert c.popen.returncode == 0, c.stderr
    (call,) = [d for d in c.lines if d.get("name") == "cudaMemcpy"]
    want = 3 if value == "1" else 1  # the minimum; the default (64 MiB) for the rest
    assert call["ok"] == 1 and len(_ops_during(h, c.pid, call)) == want
    a = h.spawn("actor", ["k:1", "line"], h.env(h.claim(), KREX_COPY_CHUNK_BYTES=value))
    a.expect(lambda d: d["act"] == "k", 30, "the registering kernel")
    p = h.proc(a.pid)
    assert p is not None and "chunk-setting" in p.flags, p
    a.send()
    assert a.wait(30) == 0


@pytest.mark.parametrize("value", ["-1", "1"])
def test_krex_run_warns_of_a_chunk_size_it_will_not_take(tmp_path: Path, value: str) -> None:
    """`krex run` says what the shim will use instead (the native guardian hands such a value
    to Python's door, which warns and execs it back)."""
    from helpers import private_world
    from helpers.krex_world import KREX

    env = {**private_world("chunk"), "KREX_COPY_CHUNK_BYTES": value}
    p = subprocess.run([*KREX, "run", "--device", "sim", "--", "true"],
                       env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    subprocess.run([*KREX, "daemon", "stop"], env=env, capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr
    want = "is not a byte count" if value == "-1" else "is below the smallest chunk"
    assert "krex: warning: KREX_COPY_CHUNK_BYTES=" in p.stderr and want in p.stderr, p.stderr


def test_names_every_required_entry(harness: Harness) -> None:
    h = harness
    _, lines = _run(h, ["run", "4096"])
    names = {d["name"] for d in lines if "name" in d}
    need = {
        "cudaMemcpy",
        "cudaMemcpyAsync",
        "cudaMemset",
        "cudaMemsetAsync",
        "cudaMemcpy_ptds",
        "cudaMemcpyAsync_ptsz",
        "cudaMemset_ptds",
        "cudaMemsetAsync_ptsz",
        "cuMemcpy",
        "cuMemcpyAsync",
        "cuMemcpyHtoD_v2",
        "cuMemcpyDtoH_v2",
        "cuMemcpyDtoD_v2",
        "cuMemcpyHtoDAsync_v2",
        "cuMemcpyDtoHAsync_v2",
        "cuMemcpyDtoDAsync_v2",
        "cuMemsetD8_v2",
        "cuMemsetD16_v2",
        "cuMemsetD32_v2",
        "cuMemsetD8Async",
        "cuMemsetD16Async",
        "cuMemsetD32Async",
        "hipMemcpy",
        "hipMemcpyAsync",
        "hipMemset",
        "hipMemsetAsync",
        "hipMemsetD16",
        "hipMemsetD32Async",
        "hipMemcpyHtoD",
    }
    assert need <= names, sorted(need - names)


@pytest.mark.parametrize(
    "name", ["cudaMemcpy", "cudaMemsetAsync", "cuMemsetD32_v2", "hipMemsetD16Async", "cuMemcpyDtoHAsync_v2"]
)
def test_first_error_ends_the_sequence(harness: Harness, name: str) -> None:
    """The simulated GPU fails the 3rd call: the wrapper returns its code at once,
    two whole chunks were done and nothing after them."""
    h = harness
    slot = h.claim()
    c = h.run(
        "chunks",
        ["run", str(BYTES), name],
        h.env(slot, rc=7, KREX_SIM_MOVE_BYTES="1", KREX_SIM_RC_AFTER="2", KREX_COPY_CHUNK_BYTES=str(CHUNK)),
    )
    (done,) = [d for d in c.lines if "done_bytes" in d]
    (call,) = [d for d in c.lines if d.get("name") == name]
    assert call["rc"] == 7
    assert len(_ops_during(h, c.pid, call)) == 3, "the sequence went on after the failing chunk"
    per = CHUNK // call["esz"] * call["esz"]
    assert done["done_bytes"] == 2 * per, done


def test_no_split_while_capturing(harness: Harness) -> None:
    h = harness
    pid, lines = _run(h, ["capture", str(BYTES)], KREX_COPY_CHUNK_BYTES=str(CHUNK))
    by = {d["capturing"]: d for d in lines if "capturing" in d}
    assert by[1]["ok"] == 1 and by[0]["ok"] == 1
    assert len(_ops_during(h, pid, by[1])) == 1, "a captured copy must stay one node"
    assert len(_ops_during(h, pid, by[0])) == math.ceil(BYTES / CHUNK)


def test_outside_krex_nothing_is_split(harness: Harness) -> None:
    h = harness
    c = h.run(
        "chunks",
        ["run", str(BYTES), "cudaMemcpy"],
        h.env(None, krex=False, KREX_SIM_MOVE_BYTES="1", KREX_COPY_CHUNK_BYTES=str(CHUNK)),
    )
    (call,) = [d for d in c.lines if d.get("name") == "cudaMemcpy"]
    assert call["ok"] == 1 and len(_ops_during(h, c.pid, call)) == 1


def _inflight_wait(h: Harness, chunk: str) -> float:
    """A sibling inside a 400 ms synchronous copy; close the gate, time the in-flight wait."""
    owner, sib = h.claim(), h.claim()
    c = h.spawn(
        "actor", ["k:1", "line", f"copy:{400_000_000}", "line"], h.env(sib, KREX_COPY_CHUNK_BYTES=chunk)
    )
    c.expect(lambda d: d["act"] == "k", 30, "the registering kernel")
    c.send()
    wait_until(
        lambda: (p := h.proc(c.pid)) is not None and p.inflight == 1, 30, "the sibling inside its copy"
    )
    time.sleep(0.05)
    h.seg.set_daemon(os.getpid(), heartbeat_timeout_s=600)
    h.seg.close_gate(0, owner_slot=owner, holder=lib.KREX_HOLDER_REGION)
    t0 = time.monotonic()
    res = h.seg.wait_inflight(0, owner, timeout=10, recheck=0.01)
    dt = time.monotonic() - t0
    assert res.ok, res
    h.seg.open_gate(0)
    c.expect(lambda d: d["act"] == "copy", 30, "the copy's end")
    return dt


def test_inflight_wait_is_one_chunk(harness: Harness) -> None:
    """4 MiB chunks are 4.2 ms on the simulated GPU (1 ns per byte): the wait ends
    after the chunk in progress. Unsplit, it lasts the rest of the 400 ms copy."""
    split = _inflight_wait(harness, str(4 << 20))
    whole = _inflight_wait(harness, "0")
    assert split < 0.05, f"in-flight wait {split * 1e3:.1f} ms with 4 MiB chunks (one chunk: 4.2 ms)"
    assert whole > 0.15, f"in-flight wait {whole * 1e3:.1f} ms unsplit: the test shows no contrast"


def test_region_entry_bounded_under_krex_run(tmp_path: Path) -> None:
    """End to end: 2 siblings under `krex run --device sim` copying 256 MiB each way in a
    loop, an owner taking regions (benchmarks/gpu_entry_copies.py, both cases)."""
    env = clean_env()
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "gpu_entry_copies.py"),
            "--device",
            "sim",
            "--siblings",
            "2",
            "--regions",
            "15",
            "--sim-mib",
            "256",
            "--chunk-bytes",
            str(4 << 20),
            "--out",
            str(tmp_path),
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    s = json.loads(r.stdout.strip().splitlines()[-1])
    on, off = s["chunked"], s["unchunked"]
    # Two siblings serialise on the simulated GPU: at most ~2 chunks (8.4 ms) in flight.
    assert on["inflight_max_ms"] < 50, on
    assert on["p50_ms"] < 50, on
    assert off["inflight_p50_ms"] > 100, f"no contrast: unchunked entry is short too {off}"
    assert off["p50_ms"] > 4 * on["p50_ms"], (on, off)
