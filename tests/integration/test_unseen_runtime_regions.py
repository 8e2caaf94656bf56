"""A sibling left running under `--freeze gpu`, quiet since its last drain, that loads a
library bringing its own CUDA runtime (`__cudaRegisterFatBinary` outside libcudart) and
launches through it, past every hook: just before another command's region, or inside it.
The region is flagged with why (or the sibling's work is drained and it is frozen), never
clean with the sibling's kernel inside it on the simulated GPU's timeline. A sibling whose
drain helper cannot answer the region end's look flags the region, and the end waits for
it at most KREX_LOOK_TIMEOUT_MS. A real krexd, `krex run` guardians, cgroups, the shim."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.krex_world import Krex

from krex.native import lib
from krex.node.shm import Segment

pytestmark = [
    pytest.mark.cgroup,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: real cgroups"),
]

# One counted launch (it registers: a record and a drain helper), then on OUT/sib.go: dlopen a
# library that exports its own CUDA runtime, and launch a kernel of US simulated microseconds
# through the simulated driver's own lookup (no hook counts or gates it), then wait for
# OUT/sib.stop.
SIBLING = r"""
import ctypes, json, os, sys, time
vp = ctypes.c_void_p
class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]
def say(**kw):
    print(json.dumps(kw), flush=True)
def wait_for(path):
    while not os.path.exists(path):
        time.sleep(0.005)
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


def _world(kx: Krex, tmp_path: Path) -> Path:
    kx_env = kx.env
    kx.env = lambda **extra: kx_env(**{"KREX_FREEZE_POLICY": "gpu", **extra})  # type: ignore[method-assign]
    src = tmp_path / "rt.c"
    src.write_text("void __cudaRegisterFatBinary(void) {}\n")
    so = tmp_path / "librt_own.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    return so


def _lines(kx: Krex, name: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in kx.cmds[name].output().splitlines() if x.startswith("{")]


def _step(kx: Krex, name: str, step: str, timeout: float = 30) -> dict[str, Any]:
    def got() -> dict[str, Any] | None:
        if kx.cmds[name].popen.poll() is not None:
            raise AssertionError(f"{name} exited: {kx.cmds[name].output()[-1500:]}")
        return next((d for d in _lines(kx, name) if d.get("step") == step), None)

    found: dict[str, Any] = kx.wait(got, timeout, f"{name}: {step}")
    return found


def _hold(kx: Krex, name: str) -> dict[str, Any]:
    kx.run(name, "hold")
    ready: dict[str, Any] = kx.result(name, "ready", timeout=30)
    return ready


def _end(kx: Krex, name: str, pid: int) -> dict[str, Any]:
    kx.touch(name)
    assert kx.cmds[name].wait(30) == 0, kx.cmds[name].output()
    kx.wait(lambda: [r for r in kx.journal() if r["owner_pid"] == pid], 10, "the journal record")
    rec: dict[str, Any] = [r for r in kx.journal() if r["owner_pid"] == pid][-1]
    return rec


def _quiet_sibling(kx: Krex, so: Path, us: int = 600_000, mode: str = "global") -> int:
    """The sibling, registered, drained by a first region (its record reads quiet since)."""
    kx.start_daemon(slots=4)
    kx.run_argv("sib", [sys.executable, "-c", SIBLING, str(so), str(kx.out), str(us), mode])
    sib = int(_step(kx, "sib", "ready")["pid"])
    first = _hold(kx, "first")
    rec = _end(kx, "first", first["pid"])
    assert not rec["contaminated"], rec["reasons"]

    kx.wait(lambda: _quiet(kx, sib), 10, "the sibling's record to read quiet")
    return sib


def _quiet(kx: Krex, pid: int) -> bool:
    p = next((p for p in kx.snapshot().procs if p.pid == pid), None)
    return p is not None and p.quiet and "unseen-runtime" not in p.flags


def _hidden_op(kx: Krex, sib: int) -> dict[str, Any]:
    ops = [o for o in kx.ops(gpu=0, life=False) if o["pid"] == sib and o["end"] - o["start"] > 500e6]
    assert len(ops) == 1, ops
    return ops[0]


def _overlaps(op: dict[str, Any], rec: dict[str, Any]) -> bool:
    return bool(op["start"] < rec["t_end_ns"] and op["end"] > rec["t_grant_ns"])


def _unseen_reason(rec: dict[str, Any], sib: int) -> bool:
    return any(f"pid {sib}" in r and "unseen-runtime" in r for r in rec["reasons"])


def test_a_runtime_loaded_by_a_quiet_sibling_just_before_a_region_never_leaves_it_clean(
    kx: Krex, tmp_path: Path
) -> None:
    """Loaded and launched through right after the owner's first region drained the sibling
    (its helper's next look between drains is up to a second away), and the owner's next
    region begins at once: its drain request makes the helper look before it acks as quiet,
    and krexd judges the records again at the end. Flagged, or drained (its kernel over by
    the grant) and frozen: never clean with the kernel inside it."""
    so = _world(kx, tmp_path)
    kx.start_daemon(slots=4)
    kx.run_argv("sib", [sys.executable, "-c", SIBLING, str(so), str(kx.out), "2000000"])  # 2 s
    sib = int(_step(kx, "sib", "ready")["pid"])
    go = kx.out / "b.go"
    kx.run("b", "regions", "-n", "1", "--kernels", "0", "--sleep-ms", "200", "--go", str(go), "--prime")
    kx.wait(lambda: (kx.out / "b.waiting").exists(), 30, "the owner's first region")
    kx.wait(lambda: _quiet(kx, sib), 10, "the sibling's record to read quiet")
    kx.touch("sib", "go")
    _step(kx, "sib", "hidden")
    go.touch()
    res = kx.result("b", timeout=30)
    assert not res["errors"] and len(res["regions"]) == 1, res
    kx.wait(lambda: len([r for r in kx.journal() if r["owner_pid"] == res["pid"]]) == 2, 10, "the journal")
    rec = [r for r in kx.journal() if r["owner_pid"] == res["pid"]][-1]
    kx.touch("sib")
    op = _hidden_op(kx, sib)
    if not rec["contaminated"]:
        assert not _overlaps(op, rec), (
            f"clean, with the sibling's hidden kernel inside it: op {op['start']}..{op['end']}, "
            f"region {rec['t_grant_ns']}..{rec['t_end_ns']}, frozen {rec['frozen_slots']}"
        )
    else:
        assert "unheld-sibling" in rec["flags"] and _unseen_reason(rec, sib), rec["reasons"]


def test_a_runtime_loaded_by_a_running_sibling_during_a_region_flags_it_at_its_end(
    kx: Krex, tmp_path: Path
) -> None:
    """Quiet and held as the region began, so it keeps running; inside the region it loads
    the library and launches through it: the end's look round sees the flag."""
    so = _world(kx, tmp_path)
    sib = _quiet_sibling(kx, so)
    ready = _hold(kx, "b")
    assert not ready["grant"]["frozen_slots"], ready["grant"]
    kx.touch("sib", "go")
    _step(kx, "sib", "hidden")
    time.sleep(0.1)
    rec = _end(kx, "b", ready["pid"])
    kx.touch("sib")
    assert _overlaps(_hidden_op(kx, sib), rec)
    assert "unheld-sibling" in rec["flags"] and _unseen_reason(rec, sib), rec["reasons"]
    assert rec.get("look_s") is not None and rec["look_s"] < lib.KREX_LOOK_TIMEOUT_MS / 1e3, rec.get("look_s")


def test_a_runtime_in_a_library_loaded_rtld_local_is_seen_too(kx: Krex, tmp_path: Path) -> None:
    """A library loaded RTLD_LOCAL is outside the global scope that a lookup by name
    (dlsym(RTLD_DEFAULT)) searches: the helper reads every loaded object's own symbols, so
    its runtime flags the region it loaded and launched in all the same."""
    so = _world(kx, tmp_path)
    sib = _quiet_sibling(kx, so, mode="local")
    ready = _hold(kx, "b")
    assert not ready["grant"]["frozen_slots"], ready["grant"]
    kx.touch("sib", "go")
    _step(kx, "sib", "hidden")
    time.sleep(0.1)
    rec = _end(kx, "b", ready["pid"])
    kx.touch("sib")
    assert _overlaps(_hidden_op(kx, sib), rec)
    assert "unheld-sibling" in rec["flags"] and _unseen_reason(rec, sib), rec["reasons"]


def test_a_sibling_inside_a_slow_library_load_answers_the_look_at_once(kx: Krex, tmp_path: Path) -> None:
    """A sibling inside a dlopen whose constructors take long (a cuBLAS or cuDNN load: the
    loader's big lock held meanwhile) as the region ends: its helper's look takes no lock a
    dlopen holds, so it acks within the bound and the region stays clean (the library brings
    no runtime). A look through dlsym would wait for the whole load and flag the region."""
    _world(kx, tmp_path)
    src = tmp_path / "slow.c"
    marker = kx.out / "slow.loading"
    src.write_text(
        "#include <stdio.h>\n#include <unistd.h>\n"
        f'__attribute__((constructor)) static void slow(void) {{ fclose(fopen("{marker}", "w")); '
        "usleep(1500000); }\n"
    )
    so = tmp_path / "libslow.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    sib = _quiet_sibling(kx, so, us=0)
    ready = _hold(kx, "b")
    assert not ready["grant"]["frozen_slots"], ready["grant"]
    kx.touch("sib", "go")
    kx.wait(marker.exists, 30, "the sibling inside the library's constructor")
    rec = _end(kx, "b", ready["pid"])
    still_loading = not any(d.get("step") == "loaded" for d in _lines(kx, "sib"))
    kx.touch("sib")
    assert still_loading, "the load ended before the region did: the test would prove nothing"
    assert not rec["contaminated"], rec["reasons"]
    assert rec.get("look_s") is not None and rec["look_s"] < lib.KREX_LOOK_TIMEOUT_MS / 1e3, rec.get("look_s")
    flags = next((p.flags for p in kx.snapshot().procs if p.pid == sib), None)
    assert flags is not None and "unseen-runtime" not in flags, flags


def test_a_running_sibling_that_cannot_answer_the_look_flags_the_region_within_its_bound(
    kx: Krex, tmp_path: Path
) -> None:
    """Stopped (by someone else than krexd) while a region runs: its helper cannot look at
    what it loaded. The region is flagged, and its end waits for it no longer than the
    bound."""
    so = _world(kx, tmp_path)
    sib = _quiet_sibling(kx, so)
    ready = _hold(kx, "b")
    assert not ready["grant"]["frozen_slots"], ready["grant"]
    os.kill(sib, signal.SIGSTOP)
    try:
        time.sleep(0.05)
        rec = _end(kx, "b", ready["pid"])
    finally:
        os.kill(sib, signal.SIGCONT)
    kx.touch("sib", "go")
    kx.touch("sib")
    assert "unheld-sibling" in rec["flags"], rec["reasons"]
    assert any(f"[{sib}]" in r and "did not look" in r for r in rec["reasons"]), rec["reasons"]
    bound = lib.KREX_LOOK_TIMEOUT_MS / 1e3
    assert bound <= rec["look_s"] < bound + 0.25, rec["look_s"]


def test_a_look_is_owed_by_a_live_helper_until_it_acks_and_by_an_exit_until_its_own_look() -> None:
    """krex_look_pending on a record of a live process: owed from the request until the
    helper's ack; by a process inside its exit (its helper stopped) until its exit handler
    looked; never by a record with no helper (krexd judges it unheld) or of another pid."""
    name = f"/krex-look-{os.getpid()}"
    child = subprocess.Popen(["sleep", "30"])
    try:
        with Segment.create(name, n_gpus=1) as seg:
            raw = seg.raw
            i = int(lib.krex_proc_register(raw, 2, 0, child.pid))
            p = raw.procs[i]
            p.helper_tid = child.pid

            def owed(seq: int) -> bool:
                return child.pid in seg.wait_look(0, [child.pid, 1], seq, 0.0).stragglers

            seq = seg.look_request(0)
            assert int(raw.gpus[0].look_seq) == seq == int(raw.gpus[0].drain_seq)
            assert owed(seq) and not seg.wait_look(0, [1], seq, 0.0).stragglers
            p.look_ack = seq
            assert not owed(seq)
            seq = seg.look_request(0)
            assert owed(seq)
            p.helper_tid = 0
            assert not owed(seq)  # no helper, not exiting: judged by its record instead
            p.flags |= lib.KREX_PF_IN_EXIT
            assert owed(seq)
            p.exit_looked = 1
            assert not owed(seq)
            assert seg.bypass_procs(0, 1) == {}
            p.flags |= lib.KREX_PF_UNSEEN
            start = int(lib.krex_pid_start_ticks(child.pid))
            assert seg.bypass_procs(0, 1) == {(child.pid, start): int(lib.KREX_PF_UNSEEN)}
            assert seg.bypass_procs(0, 2) == {}  # the owner's own
    finally:
        child.kill()
        child.wait()
        Segment.unlink(name)
