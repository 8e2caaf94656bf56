"""Protocol step 4 (drain) and invariant I2: when Segment.drain() returns ok, no
work a sibling submitted earlier is still executing on the simulated GPU."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import Child, Harness, stop_process, wait_until

import krex.node.procfs
import krex.node.shm
from krex.native import lib

LONG_US = 600_000  # a 0.6 s kernel (gridDim.x microseconds)


def _close(h: Harness, owner: int) -> None:
    h.seg.set_daemon(os.getpid(), heartbeat_timeout_s=60)
    h.seg.close_gate(0, owner_slot=owner, holder=lib.KREX_HOLDER_REGION)
    r = h.seg.wait_inflight(0, owner, timeout=10)
    assert r.ok, r


def _submitted(c: Child) -> dict:
    d = c.expect(lambda d: d["act"] == "k", 30, "the kernel launch")
    assert d["rc"] == 0
    return d


def test_drain_waits_for_sibling_work(harness: Harness) -> None:
    h = harness
    owner, sib = h.claim(), h.claim()
    child = h.spawn("actor", [f"k:{LONG_US}", "line"], h.env(sib))
    _submitted(child)
    (op,) = h.ops(child.pid)
    t_start = time.monotonic_ns()
    assert t_start < op["end"], (
        "the sibling's kernel ended before the drain began: the test would prove nothing"
    )

    _close(h, owner)
    res = h.seg.drain(0, owner, timeout=10)
    t_ret = time.monotonic_ns()

    assert res.ok, res
    assert res.count == 1 and res.stragglers == [], res
    assert op["end"] <= t_ret, (
        f"I2: drain returned {(op['end'] - t_ret) / 1e6:.1f} ms before the sibling's kernel ended"
    )
    syncs = [e for e in h.events() if e.get("ev") == "sync" and e["pid"] == child.pid]
    assert any(e["until"] >= op["end"] and e["t"] <= t_ret for e in syncs), (
        f"no synchronisation by the sibling's helper covering its kernel: {syncs}"
    )
    assert all(e["tid"] != op["tid"] for e in syncs), "the drain ran on the app thread, not the helper"
    rec = h.proc(child.pid)
    assert rec is not None and rec.drains >= 1
    assert rec.drain_ack == int(h.seg.raw.gpus[0].drain_seq)


def test_a_drain_never_searches_the_library_path_for_a_library_not_loaded(
    harness: Harness, tmp_path: Path
) -> None:
    """The helper looks up HIP's functions at a drain, on a CUDA node too. A dlopen
    (RTLD_NOLOAD) of a library not loaded searches the library path and maps ld.so.cache,
    whose mmap waits for the process's mmap lock (behind its own thread pinning pages for a
    copy: 0.1-0.4 s drains on the H200). Here every HIP name in the path is a FIFO: a
    search opens one and blocks for good, so the drain would time out."""
    from krex.native import LIB_DIR

    h = harness
    fifos = tmp_path / "fifos"
    fifos.mkdir()
    for name in ("libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6"):
        os.mkfifo(fifos / name)
    owner, sib = h.claim(), h.claim()
    env = h.env(sib, LD_LIBRARY_PATH=f"{fifos}:{LIB_DIR}")
    child = h.spawn("actor", [f"k:{LONG_US}", "line"], env)
    _submitted(child)
    _close(h, owner)
    res = h.seg.drain(0, owner, timeout=5)
    assert res.ok and res.count == 1 and res.stragglers == [], (
        f"the drain helper did not ack: {res} ({krex.node.procfs.thread_report(child.pid)[:400]})"
    )
    rec = h.proc(child.pid)
    assert rec is not None and rec.drains >= 1


HIGH_LIB = r"""
import ctypes, json, sys
vp = ctypes.c_void_p
class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]
libc = ctypes.CDLL(None)
libc.mmap.restype = vp
libc.mmap.argtypes = [vp, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
# Take the address the library was linked at, so the loader puts it below: a "negative" load
# bias, DT_STRTAB already relocated and smaller than dlpi_addr.
got = libc.mmap(int(sys.argv[2], 0), 1 << 20, 0, 0x22 | 0x100000, -1, 0)  # PROT_NONE, MAP_FIXED_NOREPLACE
lm = ctypes.CDLL(sys.argv[1])
rt = ctypes.CDLL("libcudart.so.13")
rt.cudaLaunchKernel.argtypes = [vp, Dim3, Dim3, ctypes.POINTER(vp), ctypes.c_size_t, vp]
assert rt.cudaLaunchKernel(vp(0x1234), Dim3(600000, 1, 1), Dim3(1, 1, 1), None, 0, None) == 0
print(json.dumps({"act": "k", "rc": 0, "taken": got == int(sys.argv[2], 0)}), flush=True)
sys.stdin.readline()
"""


def test_a_library_loaded_below_its_link_address_does_not_crash_a_drain(
    harness: Harness, tmp_path: Path
) -> None:
    """The helper reads loaded objects' DT_SONAME: one loaded below the address it was
    linked at (its load bias wraps) must be read where it is, not at base + pointer: read
    at the wrong place it is a SIGSEGV in the helper, and the command is killed."""
    import subprocess
    import sys

    h = harness
    src = tmp_path / "high.c"
    src.write_text("int krex_high(void) { return 1; }\n")
    so, at = tmp_path / "libhigh.so", "0x7fffff000000"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-o", str(so), str(src), "-Wl,-soname,libhigh.so"]
        + [f"-Wl,-Ttext-segment={at}"],
        check=True,
    )
    owner, sib = h.claim(), h.claim()
    child = Child([sys.executable, "-c", HIGH_LIB, str(so), at], h.env(sib))
    h.children.append(child)
    d = _submitted(child)
    assert d["taken"], "the link address was free for the library: the test would prove nothing"
    _close(h, owner)
    res = h.seg.drain(0, owner, timeout=10)
    assert res.ok and res.count == 1, res
    assert child.alive(), child.stderr()


def test_drain_skips_idle_and_owner_processes(harness: Harness) -> None:
    """A sibling that never made a GPU call (a cudaMalloc is one: a LIFE call, it
    registers), and the owner's own busy process, are not waited for: both are
    SIGSTOPped, so waiting on either would time out."""
    h = harness
    owner, sib = h.claim(), h.claim()
    idle = h.spawn("actor", ["line"], h.env(sib))
    idle.expect(lambda d: d["act"] == "start", 30, "its start")
    mine = h.spawn("actor", [f"k:{LONG_US}", "line"], h.env(owner))
    _submitted(mine)
    try:
        for c in (idle, mine):
            stop_process(c.pid)
        _close(h, owner)
        res = h.seg.drain(0, owner, timeout=2)
        assert res.ok and res.count == 0 and res.stragglers == [], res
    finally:
        for c in (idle, mine):
            os.kill(c.pid, signal.SIGCONT)


def test_drain_reports_a_stopped_sibling(harness: Harness) -> None:
    h = harness
    owner, sib = h.claim(), h.claim()
    child = h.spawn("actor", ["k:5", "line"], h.env(sib))
    _submitted(child)
    wait_until(lambda: h.proc(child.pid), 10, "the sibling's process record")
    stop_process(child.pid)
    try:
        _close(h, owner)
        res = h.seg.drain(0, owner, timeout=0.5)
        assert not res.ok, res
        assert res.count == 1 and res.stragglers == [child.pid], res
    finally:
        os.kill(child.pid, signal.SIGCONT)
    # Once it runs again, its helper catches up and acks the pending drain.
    wait_until(lambda: h.proc(child.pid).drain_ack == int(h.seg.raw.gpus[0].drain_seq), 10, "the late ack")
    res = h.seg.drain(0, owner, timeout=10)
    assert res.ok and res.stragglers == [], res


def test_a_sibling_quiet_since_its_last_drain_owes_none(harness: Harness) -> None:
    """A sibling that queued nothing since its last full drain has nothing on the GPU:
    krexd does not wait for its ack (a stopped one would time out), and its helper acks
    without a driver call. Once it submits again, it owes a drain as before (control)."""
    h = harness
    owner, sib = h.claim(), h.claim()
    child = h.spawn("actor", ["k:5", "line", "k:5", "line"], h.env(sib))
    _submitted(child)
    wait_until(lambda: h.proc(child.pid), 10, "the sibling's process record")

    def syncs() -> int:
        return sum(1 for e in h.events() if e.get("ev") == "sync" and e["pid"] == child.pid)

    _close(h, owner)
    res = h.seg.drain(0, owner, timeout=10)  # its kernel is not drained yet: a full drain
    assert res.ok and res.count == 1, res
    wait_until(lambda: syncs() >= 1, 10, "the helper's synchronisation")
    after_first = syncs()
    rec = h.proc(child.pid)
    assert rec is not None and rec.quiet, rec

    # Idle since: a second drain neither waits for it nor makes it synchronise.
    res = h.seg.drain(0, owner, timeout=10)
    assert res.ok and res.count == 0, res
    wait_until(lambda: h.proc(child.pid).drain_ack == int(h.seg.raw.gpus[0].drain_seq), 10, "its cheap ack")
    assert syncs() == after_first, "the helper synchronised although nothing was queued"
    stop_process(child.pid)
    try:
        res = h.seg.drain(0, owner, timeout=0.5)
        assert res.ok and res.count == 0 and res.stragglers == [], res
        # A full drain (policy `all`) still asks it, quiet or not: stopped, it cannot ack.
        res = h.seg.drain(0, owner, timeout=0.5, full=True)
        assert not res.ok and res.stragglers == [child.pid], res
    finally:
        os.kill(child.pid, signal.SIGCONT)
    # (Its helper answers that drain late, once running: before the next kernel, or that
    # answer's full drain would cover it.)
    wait_until(lambda: h.proc(child.pid).drain_ack == int(h.seg.raw.gpus[0].drain_seq), 10, "its late ack")

    # It submits again (the gate open), then stops before any drain: it owes one.
    h.seg.open_gate(0)
    child.send("\n")
    child.expect(lambda d: d["act"] == "k" and d["rc"] == 0, 30, "the second kernel")
    assert not h.proc(child.pid).quiet
    stop_process(child.pid)
    try:
        _close(h, owner)
        res = h.seg.drain(0, owner, timeout=0.5)
        assert not res.ok and res.stragglers == [child.pid], res
    finally:
        os.kill(child.pid, signal.SIGCONT)


def _hidden_kernel_is_drained(h: Harness, child: Child, owner: int) -> None:
    """After one full drain, `child` (which must be flagged unseen-runtime) launches a 0.6 s
    kernel through a path the hooks do not count: the next drain still waits for it."""
    _close(h, owner)
    assert h.seg.drain(0, owner, timeout=10).ok  # a full drain: its stamp is now current
    h.seg.open_gate(0)
    child.send("\n")
    hidden = child.expect(lambda d: d.get("act", d.get("step")) == "hidden", 30, "the hidden launch")
    assert hidden.get("rc", 0) == 0
    op = max(h.ops(child.pid), key=lambda o: o["end"])
    _close(h, owner)
    res = h.seg.drain(0, owner, timeout=10)
    t_ret = time.monotonic_ns()
    assert op["end"] - op["start"] > 500e6, op  # the hidden kernel, not the counted one
    assert res.ok and res.count == 1, res
    assert op["end"] <= t_ret, f"I2: granted {(op['end'] - t_ret) / 1e6:.0f} ms before the hidden one ended"


def test_an_executable_with_its_own_cuda_runtime_is_never_quiet(harness: Harness) -> None:
    """Its launches bypass every hook, so its counts say nothing: every drain synchronises it."""
    h = harness
    owner, sib = h.claim(), h.claim()
    child = h.spawn("staticrt", ["600000"], h.env(sib))
    assert child.expect(lambda d: d["act"] == "counted", 30, "the counted launch")["rc"] == 0
    wait_until(lambda: "unseen-runtime" in h.proc(child.pid).flags, 10, "the unseen-runtime flag")
    _hidden_kernel_is_drained(h, child, owner)


LATE_RUNTIME = r"""
import ctypes, json, sys
vp = ctypes.c_void_p
class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]
def say(step):
    print(json.dumps({"step": step}), flush=True)
    return sys.stdin.readline()
cu = ctypes.CDLL("libcuda.so.1")
rt = ctypes.CDLL("libcudart.so.13")
rt.cudaLaunchKernel.argtypes = [vp, Dim3, Dim3, ctypes.POINTER(vp), ctypes.c_size_t, vp]
assert rt.cudaLaunchKernel(vp(0x1234), Dim3(5, 1, 1), Dim3(1, 1, 1), None, 0, None) == 0  # counted
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)  # a library that exports its own CUDA runtime
say("loaded")
pfn = vp()
assert cu.simgpu_cu_gpa(b"cuLaunchKernel", ctypes.byref(pfn), ctypes.c_uint64(0)) == 0
L = ctypes.CFUNCTYPE(ctypes.c_int, vp, *([ctypes.c_uint] * 7), vp, vp, vp)(pfn.value)
assert L(vp(0x1234), 600000, 1, 1, 1, 1, 1, 0, None, None, None) == 0  # 0.6 s, through no hook
say("hidden")
"""


def test_a_library_loaded_later_with_its_own_cuda_runtime_makes_a_process_never_quiet(
    harness: Harness, tmp_path: Path
) -> None:
    """The helper looks again at what is loaded between drains (every second): a library
    dlopen()ed since that exports a CUDA runtime flags the process before a drain skips it."""
    import subprocess
    import sys

    h = harness
    src = tmp_path / "rt.c"
    src.write_text("void __cudaRegisterFatBinary(void) {}\n")
    so = tmp_path / "librt_static.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    owner, sib = h.claim(), h.claim()
    child = Child([sys.executable, "-c", LATE_RUNTIME, str(so)], h.env(sib))
    h.children.append(child)
    child.expect(lambda d: d.get("step") == "loaded", 60, "the library loaded")
    wait_until(lambda: "unseen-runtime" in h.proc(child.pid).flags, 10, "the unseen-runtime flag")
    _hidden_kernel_is_drained(h, child, owner)


def test_a_teardown_after_a_last_drain_that_could_not_run_does_not_wait_again(harness: Harness) -> None:
    """The exit's last drain gives up (another thread is inside a long copy); the teardown's
    stream-ordered calls then go on at once, not 0.5 s each waiting for that drain again."""
    h = harness
    sib = h.claim()
    child = h.spawn("exitasync", [], h.env(sib, KREX_COPY_CHUNK_BYTES="0"))
    assert child.expect(lambda d: d["act"] == "start", 30, "its start")["rc"] == 0
    done = child.expect(lambda d: d["act"] == "teardown", 30, "its teardown")
    assert done["ms"] < 1000, f"10 async allocations and frees at exit took {done['ms']:.0f} ms"


FORK_AFTER_RUNTIME = r"""
import ctypes, json, os, sys
vp = ctypes.c_void_p
class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]
rt = ctypes.CDLL("libcudart.so.13")
rt.cudaLaunchKernel.argtypes = [vp, Dim3, Dim3, ctypes.POINTER(vp), ctypes.c_size_t, vp]
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)  # loaded before the first GPU call and the fork
assert rt.cudaLaunchKernel(vp(0x1234), Dim3(5, 1, 1), Dim3(1, 1, 1), None, 0, None) == 0
pid = os.fork()
if pid == 0:
    assert rt.cudaLaunchKernel(vp(0x1234), Dim3(5, 1, 1), Dim3(1, 1, 1), None, 0, None) == 0
    print(json.dumps({"step": "child", "pid": os.getpid()}), flush=True)
    sys.stdin.readline()
    os._exit(0)
sys.stdin.readline()
os.waitpid(pid, 0)
"""


def test_a_fork_child_of_a_process_with_a_runtime_the_hooks_cannot_see_is_flagged_too(
    harness: Harness, tmp_path: Path
) -> None:
    """The child's record is new: its helper looks at what is loaded again (the loader's
    counters it inherited from its parent must not make it skip the look)."""
    import subprocess
    import sys

    h = harness
    src = tmp_path / "rt.c"
    src.write_text("void __cudaRegisterFatBinary(void) {}\n")
    so = tmp_path / "librt_static.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    sib = h.claim()
    parent = Child([sys.executable, "-c", FORK_AFTER_RUNTIME, str(so)], h.env(sib))
    h.children.append(parent)
    child = parent.expect(lambda d: d.get("step") == "child", 60, "the fork child's launch")["pid"]
    for pid, who in ((parent.pid, "the parent"), (child, "the fork child")):
        wait_until(lambda p=pid: "unseen-runtime" in getattr(h.proc(p), "flags", []), 10, f"{who}'s flag")
    parent.send("\n")
    parent.send("\n")


class _PreemptedLib:
    """krex.native.lib, except that the controller loses the CPU right after
    krex_drain_request until the sibling's helper has acked (as can happen on a
    loaded 2-core machine): a deterministic replay of that interleaving."""

    def __init__(self, real: Any, acked: Callable[[int], bool]) -> None:
        self._real = real
        self._acked = acked

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def krex_drain_request(self, shm: Any, gpu: int) -> int:
        seq = int(self._real.krex_drain_request(shm, gpu))
        wait_until(lambda: self._acked(seq), 10, "the helper's ack")
        return seq


def test_drain_count_survives_controller_preemption(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = harness
    owner, sib = h.claim(), h.claim()
    child = h.spawn("actor", ["k:5", "line"], h.env(sib))
    _submitted(child)
    wait_until(lambda: h.proc(child.pid), 10, "the sibling's process record")
    _close(h, owner)
    preempted = _PreemptedLib(lib, lambda seq: h.proc(child.pid).drain_ack == seq)
    monkeypatch.setattr(krex.node.shm, "lib", preempted)
    res = h.seg.drain(0, owner, timeout=10)
    assert res.ok, res
    assert h.proc(child.pid).drains == 1, "the sibling's helper drained"
    assert res.count == 1, f"count {res.count}, but 1 sibling drained"


CTOR_RUNTIME_LIB = r"""
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
void __cudaRegisterFatBinary(void) {}
extern int cudaMalloc(void **p, size_t n);
extern int simgpu_cu_gpa(const char *symbol, void **pfn, uint64_t flags);
typedef int (*cu_launch)(const void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         void *, void **, void **);
/* Its constructor (under dlopen: the loader's lock held) makes the process's first gated
 * call, a LIFE one, then launches through its own runtime, past every hook. */
__attribute__((constructor)) static void init(void) {
    void *d = NULL, *pfn = NULL;
    int rc = cudaMalloc(&d, 256);
    if (rc == 0) rc = simgpu_cu_gpa("cuLaunchKernel", &pfn, 0);
    if (rc == 0) rc = ((cu_launch)pfn)((const void *)0x1234, 600000, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    char line[64];
    int n = snprintf(line, sizeof line, "{\"step\": \"hidden\", \"rc\": %d}\n", rc);
    if (write(1, line, (size_t)n) < 0) return;
    struct timespec ts = {0, 300000000};
    nanosleep(&ts, NULL); /* still inside the dlopen */
}
"""

CTOR_RUNTIME = r"""
import ctypes, json, sys
ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
ctypes.CDLL("libcudart.so.13")
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
print(json.dumps({"step": "loaded"}), flush=True)
sys.stdin.readline()
"""


def test_a_first_gated_call_in_a_runtime_library_constructor_is_not_quiet_before_the_helper_looked(
    harness: Harness, tmp_path: Path
) -> None:
    """A library that carries its own CUDA runtime makes the process's first gated call (a
    LIFE one) in its constructor, then launches through that runtime, unseen, while the
    dlopen still holds the loader's lock (its drain helper, looking at what is loaded,
    waits for it). Until the helper has looked, the record must not read as drained: a
    region's drain waits for the hidden kernel rather than skip the process."""
    import subprocess
    import sys

    h = harness
    src = tmp_path / "rt.c"
    src.write_text(CTOR_RUNTIME_LIB)
    so = tmp_path / "libctor_rt.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    owner, sib = h.claim(), h.claim()
    child = Child([sys.executable, "-c", CTOR_RUNTIME, str(so)], h.env(sib))
    h.children.append(child)
    assert child.expect(lambda d: d.get("step") == "hidden", 60, "the hidden launch")["rc"] == 0
    _close(h, owner)
    res = h.seg.drain(0, owner, timeout=10)
    t_ret = time.monotonic_ns()
    op = max(h.ops(child.pid, life=False), key=lambda o: o["end"])
    assert op["end"] - op["start"] > 500e6, op
    assert res.ok, res
    assert op["end"] <= t_ret, (
        f"I2: granted {(op['end'] - t_ret) / 1e6:.0f} ms before the hidden kernel ended: {res}"
    )
    child.expect(lambda d: d.get("step") == "loaded", 30, "the dlopen's end")
    child.send("\n")
