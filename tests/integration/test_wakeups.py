"""Protocol steps 3 and 4 without polling: krexd sleeps on the GPU's wake word (krex_abi.h)
and the shim wakes it, when a sibling's call leaves while the gate is closed and when a
drain helper acks. The waits re-check without a wake only every `recheck` seconds, so a
test that gives them a re-check far longer than the work proves the wake came from the
sibling: with sleep-polling, or a shim that does not wake, the wait would end by a
re-check (timeouts >= 1). The fault tests kill the waker: the wait must still end."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
from helpers import Child, Harness, wait_until

from krex.native import lib
from krex.node import procfs

NEVER = 120.0  # a re-check interval far past the work (3 s at most): only a wake ends the wait sooner
COPY_NS = 3_000_000_000  # a 3 s synchronous copy (1 ns per byte): inside a gated call that long


def _sibling_in_call(h: Harness, sib: int, nbytes: int) -> Child:
    """A sibling that registered (first kernel), then sits inside a synchronous copy."""
    # One long gated call, not split into chunks: that is what these waits are about.
    c = h.spawn("actor", ["k:1", "line", f"copy:{nbytes}", "line"], h.env(sib, KREX_COPY_CHUNK_BYTES="0"))
    c.expect(lambda d: d["act"] == "k", 30, "the registering kernel")
    c.send()
    wait_until(
        lambda: (p := h.proc(c.pid)) is not None and p.inflight == 1, 30, "the sibling inside its copy"
    )
    return c


def _close(h: Harness, owner: int) -> None:
    h.seg.set_daemon(os.getpid(), heartbeat_timeout_s=600)
    h.seg.close_gate(0, owner_slot=owner, holder=lib.KREX_HOLDER_REGION)


def test_inflight_wait_is_woken_by_the_leaving_call(harness: Harness) -> None:
    h = harness
    owner, sib = h.claim(), h.claim()
    child = _sibling_in_call(h, sib, COPY_NS)
    _close(h, owner)
    res = h.seg.wait_inflight(0, owner, timeout=NEVER, recheck=NEVER)
    copy = child.expect(lambda d: d["act"] == "copy", 30, "the copy's end")

    assert res.ok and res.count == 0, res
    assert res.stats["scans"] >= 2, f"the copy had ended before the wait began: the test proves nothing {res}"
    assert res.stats["timeouts"] == 0, f"the wait ended by a re-check, not by the sibling's wake: {res}"
    assert res.stats["wakeups"] >= 1, res
    (op,) = [o for o in h.ops(child.pid) if o["api"] == "cudaMemcpy"]
    assert op["end"] <= copy["t1"], "the copy's trace and its report disagree"


def test_drain_wait_is_woken_by_the_ack(harness: Harness) -> None:
    h = harness
    owner, sib = h.claim(), h.claim()
    child = h.spawn("actor", ["k:1500000", "line"], h.env(sib))  # a 1.5 s kernel, queued
    child.expect(lambda d: d["act"] == "k", 30, "the kernel launch")
    _close(h, owner)
    assert h.seg.wait_inflight(0, owner, timeout=30).ok
    res = h.seg.drain(0, owner, timeout=NEVER, recheck=NEVER)

    assert res.ok and res.count == 1 and res.stragglers == [], res
    assert res.stats["scans"] >= 2, f"the helper acked before the wait began: the test proves nothing {res}"
    assert res.stats["timeouts"] == 0, f"the drain wait ended by a re-check, not by the helper's wake: {res}"
    assert res.stats["wakeups"] >= 1, res
    rec = h.proc(child.pid)
    assert rec is not None and rec.drain_ack == int(h.seg.raw.gpus[0].drain_seq)


def _in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def body() -> None:
        out["tid"] = threading.get_native_id()
        out["r"] = fn()

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, out


def _asleep_in_futex(tid: int) -> bool:
    """The waiter thread sleeps on the wake word (its scan is over), not merely entered:
    `waiters` rises before the first scan, so a kill right then races the scan."""
    try:
        wchan = procfs.read(f"/proc/self/task/{tid}/wchan")
        state = procfs.read(f"/proc/self/task/{tid}/stat").rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state == "S" and "futex" in wchan


@pytest.mark.parametrize("step", ["inflight", "drain"])
def test_a_waiter_never_hangs_when_the_waker_dies(harness: Harness, step: str) -> None:
    """SIGKILL the sibling krexd waits for (inside its call, or inside its helper's
    synchronise): no wake ever comes, and the next re-check finds the pid dead."""
    h = harness
    owner, sib = h.claim(), h.claim()
    if step == "inflight":
        child = _sibling_in_call(h, sib, 600 * 10**9)  # a 10-minute copy: only its death ends it
        _close(h, owner)
        t, out = _in_thread(lambda: h.seg.wait_inflight(0, owner, timeout=NEVER, recheck=0.05))
    else:
        child = h.spawn("actor", ["k:600000000", "line"], h.env(sib))  # a 10-minute kernel
        child.expect(lambda d: d["act"] == "k", 30, "the kernel launch")
        _close(h, owner)
        assert h.seg.wait_inflight(0, owner, timeout=30).ok
        t, out = _in_thread(lambda: h.seg.drain(0, owner, timeout=NEVER, recheck=0.05))
        wait_until(lambda: int(h.seg.raw.gpus[0].waiters) == 1, 30, "krexd's drain wait to sleep")
    wait_until(lambda: int(h.seg.raw.gpus[0].waiters) == 1, 30, "the waiter to enter")
    wait_until(lambda: "tid" in out and _asleep_in_futex(out["tid"]), 30, "the waiter to sleep on its word")
    assert t.is_alive(), "the wait ended while its waker still lived"
    os.kill(child.pid, signal.SIGKILL)
    child.popen.wait(timeout=30)
    t.join(timeout=120)

    assert not t.is_alive(), "the waiter hangs after its waker died"
    res = out["r"]
    assert res.ok and res.stragglers == [], res
    assert res.stats["timeouts"] >= 1, f"ended without a re-check: who woke it? {res}"
    assert int(h.seg.raw.gpus[0].waiters) == 0, "the waiter did not sign off"


def test_a_bounded_wait_reports_a_live_straggler(harness: Harness) -> None:
    """A sibling that stays inside its call past the bound: the wait ends at the bound,
    not ok, naming it (krexd then flags the grant)."""
    h = harness
    owner, sib = h.claim(), h.claim()
    child = _sibling_in_call(h, sib, 600 * 10**9)
    _close(h, owner)
    res = h.seg.wait_inflight(0, owner, timeout=0.3)
    assert not res.ok and res.count == 1 and res.stragglers == [child.pid], res
    assert res.stats["timeouts"] >= 1, res


LATE_HIP = r"""
import ctypes, json, sys
class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]
def say(step):
    print(json.dumps({"step": step}), flush=True)
    return sys.stdin.readline()
ctypes.CDLL("libcuda.so.1")
rt = ctypes.CDLL("libcudart.so.13")
vp = ctypes.c_void_p
rt.cudaLaunchKernel.argtypes = [vp, Dim3, Dim3, ctypes.POINTER(vp), ctypes.c_size_t, vp]
assert rt.cudaLaunchKernel(vp(0x1234), Dim3(1, 1, 1), Dim3(1, 1, 1), None, 0, None) == 0
rt.cudaDeviceSynchronize()
say("cuda")
mode = ctypes.RTLD_GLOBAL if sys.argv[2:] == ["global"] else ctypes.DEFAULT_MODE
hip = ctypes.CDLL(sys.argv[1], mode=mode)  # loaded only now: after the helper's first drain
p = vp()
assert hip.hipMalloc(ctypes.byref(p), ctypes.c_size_t(64)) == 0
assert hip.hipMemset(p, 0, ctypes.c_size_t(64)) == 0  # HIP work queued: the next drain owes a HIP sync
say("hip")
"""


def _drop_soname(path: Path) -> None:
    """Turn the library's DT_SONAME entry into DT_DEBUG (ignored in a shared library)."""
    import struct

    b = bytearray(path.read_bytes())
    phoff, phentsize, phnum = struct.unpack_from("<Q", b, 32)[0], *struct.unpack_from("<HH", b, 54)
    for i in range(phnum):
        p_type, _fl, p_offset, _va, _pa, p_filesz = struct.unpack_from("<IIQQQQ", b, phoff + i * phentsize)
        if p_type != 2:  # PT_DYNAMIC
            continue
        for off in range(p_offset, p_offset + p_filesz, 16):
            if struct.unpack_from("<q", b, off)[0] == 14:  # DT_SONAME
                struct.pack_into("<q", b, off, 21)  # DT_DEBUG
                path.write_bytes(bytes(b))
                return
    raise AssertionError(f"{path} has no DT_SONAME")


@pytest.mark.parametrize("how", ["by-soname", "renamed-file", "no-soname-linked", "versioned-file-only"])
def test_drain_helper_finds_a_runtime_loaded_after_its_first_drain(
    harness: Harness, tmp_path: Path, how: str
) -> None:
    """The helper looks its vendor functions up once and again only when the process
    loaded (or unloaded) a library since: a HIP runtime loaded after the first drain, with
    work queued through it, is synchronised by the next one. Also from a file of another
    name (found by its DT_SONAME: the helper asks only for names a loaded object has), and
    from one with no DT_SONAME that the soname reaches through a link (found as the library
    the hooks already call into). And from a file named like ROCm 6's (libamdhip64.so.6)
    whose soname is none of ours, while every HIP soname we know is a FIFO in the library
    path: a lookup that searched the path would hang there."""
    import shutil
    import sys

    from krex.native import LIB_DIR

    h = harness
    lib_arg = "libamdhip64.so"
    env = h.env(None, krex=False)
    if how != "by-soname":
        lib = tmp_path / "libvendorhip.so"
        lib_arg = str(lib)
        shutil.copy(LIB_DIR / "libamdhip64.so", lib)
    if how == "no-soname-linked":
        _drop_soname(lib)
        links = tmp_path / "links"
        links.mkdir()
        (links / "libamdhip64.so").symlink_to(lib)
        env["LD_LIBRARY_PATH"] = f"{links}:{LIB_DIR}"
    extra: list[str] = []
    if how == "versioned-file-only":
        rocm, fifos = tmp_path / "rocm", tmp_path / "fifos"
        rocm.mkdir()
        fifos.mkdir()
        lib = rocm / "libamdhip64.so.6"
        b = (LIB_DIR / "libamdhip64.so").read_bytes()
        assert b.count(b"libamdhip64.so\0") == 1
        lib.write_bytes(b.replace(b"libamdhip64.so\0", b"libamdhip64.s6\0"))
        lib.chmod(0o755)
        for name in ("libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6"):
            os.mkfifo(fifos / name)
        env["LD_LIBRARY_PATH"] = f"{fifos}:{LIB_DIR}"
        lib_arg, extra = str(lib), ["global"]  # global: our hooks resolve it without a search
    owner, sib = h.claim(), h.claim()
    env = h.env(sib, LD_LIBRARY_PATH=env["LD_LIBRARY_PATH"])
    child = Child([sys.executable, "-c", LATE_HIP, lib_arg, *extra], env)
    h.children.append(child)
    child.expect(lambda d: d.get("step") == "cuda", 60, "the CUDA part")
    _close(h, owner)
    assert h.seg.drain(0, owner, timeout=30).ok

    def syncs() -> list[str]:
        return [e["api"] for e in h.events() if e.get("ev") == "sync" and e["pid"] == child.pid]

    first = syncs()
    assert first and not any(a.startswith("hip") for a in first), first
    h.seg.open_gate(0)  # hipMalloc is a LIFE call: it would wait at the closed gate
    child.send()
    child.expect(lambda d: d.get("step") == "hip", 60, "the HIP runtime loaded")
    _close(h, owner)
    res = h.seg.drain(0, owner, timeout=30)
    assert res.ok, res
    later = syncs()[len(first) :]
    assert "hipDeviceSynchronize" in later, f"the drain after HIP was loaded did not synchronise HIP: {later}"
