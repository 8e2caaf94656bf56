"""The simulated GPU's timeline dates an operation from the moment it was queued
(interpose/sim/simgpu.c, simgpu_submit), never from the moment its call began.

A caller stopped inside a submitting call (preempted, or frozen for another command's
region) queues nothing while it is stopped. Had the device model kept the clock it read
on entry, the op would be placed, once the caller ran again, into time that passed
meanwhile: behind the work another process queued during the stop, or at the stale clock
on an idle device, and a trace checker would see it run inside a region it never touched
(a "false clean" of the chaos test, tests/helpers/chaos.py). KREX_SIM_STALL_MS stops the
first submission between its read of the clock and its queueing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from krex.native import sim_dir

pytestmark = pytest.mark.timeout(60)

STALL_MS = 300
KERNEL_NS = 1_000_000

# A process that submits one kernel of KERNEL_NS to the simulated device, straight through
# the device model (no runtime, no shim), and says when its call began and ended.
SUBMIT = """
import ctypes, json, os, sys
lib = ctypes.CDLL(os.path.join(sys.argv[1], "libkrexsim.so"))
lib.simgpu_now.restype = ctypes.c_uint64
lib.simgpu_submit.restype = ctypes.c_uint64
lib.simgpu_submit.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64,
                              ctypes.c_uint64, ctypes.c_int]
t0 = lib.simgpu_now()
print(json.dumps({"pid": os.getpid(), "t0": t0}), flush=True)
end = lib.simgpu_submit(b"cuLaunchKernel", 0, None, int(sys.argv[2]), 0, 0)
print(json.dumps({"pid": os.getpid(), "t0": t0, "end": end, "t1": lib.simgpu_now()}), flush=True)
"""


@pytest.fixture
def sim_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """Its own device timeline and trace file."""
    shm = f"/krex-test-tl-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KREX_") and k != "LD_PRELOAD"}
    env["KREX_SIM_SHM"] = shm
    env["KREX_SIM_TRACE"] = str(tmp_path / "trace.jsonl")
    yield env
    Path("/dev/shm", shm.lstrip("/")).unlink(missing_ok=True)


def _submitter(env: dict[str, str], stall_ms: int = 0) -> subprocess.Popen[str]:
    extra = {"KREX_SIM_STALL_MS": str(stall_ms)} if stall_ms else {}
    return subprocess.Popen(
        [sys.executable, "-c", SUBMIT, str(sim_dir()), str(KERNEL_NS)],
        env={**env, **extra},
        stdout=subprocess.PIPE,
        text=True,
    )


def _finish(p: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0, out
    res = json.loads(out.strip().splitlines()[-1])
    assert isinstance(res, dict)
    return res


def _op(env: dict[str, str], pid: int) -> dict[str, Any]:
    lines = Path(env["KREX_SIM_TRACE"]).read_text().splitlines()
    ops = [r for r in map(json.loads, lines) if r.get("ev") == "op" and r["pid"] == pid]
    assert len(ops) == 1, ops
    return ops[0]


def test_an_op_stopped_on_an_idle_device_starts_when_it_is_queued(sim_env: dict[str, str]) -> None:
    """Nothing else runs: the stopped op starts once its caller runs again, not at the clock
    it read before the stop."""
    res = _finish(_submitter(sim_env, STALL_MS))
    op = _op(sim_env, res["pid"])
    assert op["start"] >= res["t0"] + STALL_MS * 1_000_000, (op, res)
    assert op["start"] <= res["t1"] and op["end"] == op["start"] + KERNEL_NS
    assert res["end"] == op["end"]


def test_an_op_stopped_while_another_process_runs_is_queued_behind_that_work(
    sim_env: dict[str, str],
) -> None:
    """Another process queues and runs a kernel while the first is stopped inside its call:
    the stopped op runs after that kernel and after its own stop, never inside that time."""
    stopped = _submitter(sim_env, STALL_MS)
    assert stopped.stdout is not None
    first = json.loads(stopped.stdout.readline())
    time.sleep(STALL_MS / 1000 / 3)  # inside the stop
    other = _finish(_submitter(sim_env))
    res = _finish(stopped)
    op, theirs = _op(sim_env, first["pid"]), _op(sim_env, other["pid"])
    assert theirs["end"] < res["t0"] + STALL_MS * 1_000_000, "not vacuous: the other ran during the stop"
    assert op["start"] >= res["t0"] + STALL_MS * 1_000_000, (op, theirs, res)
    assert op["start"] >= theirs["end"] and op["start"] <= res["t1"]
