"""A sibling that loads a library bringing its own CUDA runtime (`__cudaRegisterFatBinary`
outside libcudart) and launches through it past every hook, and the steps of a world around
it: a real krexd under `--freeze gpu`, `krex run` guardians, the simulated GPU's timeline."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from helpers.krex_world import Krex

# One counted launch (it registers: a record and a drain helper), then on OUT/sib.go: dlopen a
# library that exports its own CUDA runtime, and launch a kernel of US simulated microseconds
# through the simulated driver's own lookup (no hook counts or gates it), then wait for
# OUT/sib.stop.
# What every sibling script starts with: its imports, a dim3, a JSON line out, a wait for a file.
PREAMBLE = r"""
import ctypes, json, os, sys, time
vp = ctypes.c_void_p
class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]
def say(**kw):
    print(json.dumps(kw), flush=True)
def wait_for(path):
    while not os.path.exists(path):
        time.sleep(0.005)
"""

SIBLING = (
    PREAMBLE
    + r"""
lib_path, out, us = sys.argv[1], sys.argv[2], int(sys.argv[3])
mode = ctypes.RTLD_LOCAL if sys.argv[4:] == ["local"] else ctypes.RTLD_GLOBAL
cu = ctypes.CDLL("libcuda.so.1")
rt = ctypes.CDLL("libcudart.so.13")
rt.cudaLaunchKernel.argtypes = [vp, Dim3, Dim3, ctypes.POINTER(vp), ctypes.c_size_t, vp]
assert rt.cudaLaunchKernel(vp(0x1234), Dim3(5, 1, 1), Dim3(1, 1, 1), None, 0, None) == 0  # counted
assert rt.cudaDeviceSynchronize() == 0
say(step="ready", pid=os.getpid())
wait_for(os.path.join(out, "sib.go"))
ctypes.CDLL(lib_path, mode=mode)
if us == 0:  # a load only
    say(step="loaded")
    wait_for(os.path.join(out, "sib.stop"))
    sys.exit(0)
pfn = vp()
assert cu.simgpu_cu_gpa(b"cuLaunchKernel", ctypes.byref(pfn), ctypes.c_uint64(0)) == 0
L = ctypes.CFUNCTYPE(ctypes.c_int, vp, *([ctypes.c_uint] * 7), vp, vp, vp)(pfn.value)
assert L(vp(0x1234), us, 1, 1, 1, 1, 1, 0, None, None, None) == 0  # through no hook
say(step="hidden", t=time.monotonic_ns())
wait_for(os.path.join(out, "sib.stop"))
"""
)


def world(kx: Krex, tmp_path: Path) -> Path:
    kx_env = kx.env
    kx.env = lambda **extra: kx_env(**{"KREX_FREEZE_POLICY": "gpu", **extra})  # type: ignore[method-assign]
    src = tmp_path / "rt.c"
    src.write_text("void __cudaRegisterFatBinary(void) {}\n")
    so = tmp_path / "librt_own.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    return so


def lines(kx: Krex, name: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in kx.cmds[name].output().splitlines() if x.startswith("{")]


def step(kx: Krex, name: str, step: str, timeout: float = 30) -> dict[str, Any]:
    def got() -> dict[str, Any] | None:
        if kx.cmds[name].popen.poll() is not None:
            raise AssertionError(f"{name} exited: {kx.cmds[name].output()[-1500:]}")
        return next((d for d in lines(kx, name) if d.get("step") == step), None)

    found: dict[str, Any] = kx.wait(got, timeout, f"{name}: {step}")
    return found


def hold(kx: Krex, name: str) -> dict[str, Any]:
    kx.run(name, "hold")
    ready: dict[str, Any] = kx.result(name, "ready", timeout=30)
    return ready


def end(kx: Krex, name: str, pid: int) -> dict[str, Any]:
    kx.touch(name)
    assert kx.cmds[name].wait(30) == 0, kx.cmds[name].output()
    kx.wait(lambda: [r for r in kx.journal() if r["owner_pid"] == pid], 10, "the journal record")
    rec: dict[str, Any] = [r for r in kx.journal() if r["owner_pid"] == pid][-1]
    return rec


def quiet_sibling(kx: Krex, so: Path, us: int = 600_000, mode: str = "global", script: str = SIBLING) -> int:
    """The sibling (`script`, SIBLING's arguments), registered, drained by a first region
    (its record reads quiet since)."""
    kx.start_daemon(slots=4)
    kx.run_argv("sib", [sys.executable, "-c", script, str(so), str(kx.out), str(us), mode])
    sib = int(step(kx, "sib", "ready")["pid"])
    first = hold(kx, "first")
    rec = end(kx, "first", first["pid"])
    assert not rec["contaminated"], rec["reasons"]

    kx.wait(lambda: quiet(kx, sib), 10, "the sibling's record to read quiet")
    return sib


def load_in_region(kx: Krex, sib: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A region whose grant froze no sibling, inside which the quiet sibling loads its
    library and launches its hidden kernel: (the region's journal record, that kernel's op)."""
    ready = hold(kx, "b")
    assert not ready["grant"]["frozen_slots"], ready["grant"]
    kx.touch("sib", "go")
    step(kx, "sib", "hidden")
    time.sleep(0.1)
    rec = end(kx, "b", ready["pid"])
    kx.touch("sib")
    op = hidden_op(kx, sib)
    assert overlaps(op, rec), (op, rec["t_grant_ns"], rec["t_end_ns"])
    return rec, op


def quiet(kx: Krex, pid: int) -> bool:
    p = next((p for p in kx.snapshot().procs if p.pid == pid), None)
    return p is not None and p.quiet and "unseen-runtime" not in p.flags


def hidden_op(kx: Krex, sib: int) -> dict[str, Any]:
    ops = [o for o in kx.ops(gpu=0, life=False) if o["pid"] == sib and o["end"] - o["start"] > 500e6]
    assert len(ops) == 1, ops
    return ops[0]


def overlaps(op: dict[str, Any], rec: dict[str, Any]) -> bool:
    return bool(op["start"] < rec["t_end_ns"] and op["end"] > rec["t_grant_ns"])


def unseen_reason(rec: dict[str, Any], sib: int) -> bool:
    return any(f"pid {sib}" in r and "unseen-runtime" in r for r in rec["reasons"])
