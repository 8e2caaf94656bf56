"""freezepolicy.Inspector on real processes: what a zombie, a zombie leader with a live
thread and a process without the shim read as (the `gpu` policy freezes a slot for any
process the gate cannot vouch for)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import pytest
from helpers import wait_until

from krex.node import freezepolicy, procfs

# A slot of no segment: no record can hold a process, and no maps can show an attached shim.
REF = freezepolicy.SlotRef(0, 1, "/krex-no-such-segment", None)

_ZOMBIE_LEADER = r"""
import ctypes, os, sys, threading, time
threading.Thread(target=time.sleep, args=(60,)).start()
sys.stdout.write("up\n"); sys.stdout.flush()
ctypes.CDLL(None).syscall(60 if os.uname().machine == "x86_64" else 93, 0)  # SYS_exit: main thread only
"""


def _state(pid: int) -> str:
    st = procfs.pid_stat(pid)
    return st.state if st else "?"


def test_a_zombie_not_reaped_yet_is_gone_not_a_reason_to_freeze() -> None:
    """An exited child its parent has not reaped: /proc/PID/exe no longer reads. It can run
    nothing again, so it must not make its slot ungateable (H200: torch.compile's children)."""
    p = subprocess.Popen(["true"])
    try:
        wait_until(lambda: _state(p.pid) == "Z", 10, "the child to be a zombie")
        insp = freezepolicy.Inspector()
        assert insp.verdict(p.pid, REF) is None
        assert freezepolicy.ungateable([p.pid], insp, REF) == []
        assert freezepolicy.ungateable([p.pid], insp, REF, [0]) == []  # no inline budget either
    finally:
        p.wait()


def test_a_zombie_leader_whose_thread_runs_on_still_freezes_its_slot() -> None:
    """pthread_exit in main: the leader reads Z while another thread of it runs (and could
    submit). Its executable does not read: it is not vouched for."""
    p = subprocess.Popen([sys.executable, "-c", _ZOMBIE_LEADER], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "up\n"
        wait_until(lambda: _state(p.pid) == "Z", 10, "the leader to be a zombie")
        st = procfs.pid_stat(p.pid)
        assert st is not None and st.threads > 1
        why = freezepolicy.ungateable([p.pid], freezepolicy.Inspector(), REF)
        assert len(why) == 1 and "cannot be read" in why[0], why
    finally:
        p.kill()
        p.wait()


def test_a_live_process_without_the_shim_freezes_its_slot() -> None:
    p = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.05)
        why = freezepolicy.ungateable([p.pid], freezepolicy.Inspector(), REF)
        assert len(why) == 1 and "without the KREX shim" in why[0], why
    finally:
        p.kill()
        p.wait()


def _exiting(monkeypatch: pytest.MonkeyPatch, pid: int, exiting: bool) -> None:
    """Make `pid` read as a process past the release of its memory in its exit: its
    executable no longer reads, and (if `exiting`) its stat carries PF_EXITING."""
    real_stat, real_readlink = procfs.pid_stat, os.readlink

    def pid_stat(p: int) -> procfs.Stat | None:
        st = real_stat(p)
        if st is None or p != pid:
            return st
        return dataclasses.replace(st, flags=st.flags | (procfs.PF_EXITING if exiting else 0))

    def readlink(path: str, *a: object, **k: object) -> str:
        if path == f"/proc/{pid}/exe":
            raise FileNotFoundError(path)
        return real_readlink(path)

    monkeypatch.setattr(procfs, "pid_stat", pid_stat)
    monkeypatch.setattr(freezepolicy.os, "readlink", readlink)


@pytest.mark.parametrize("seen", [True, False], ids=["seen-with-shim", "never-seen"])
@pytest.mark.parametrize("exiting", [True, False], ids=["exiting", "not-exiting"])
def test_an_unreadable_executable_of_a_live_process_freezes_its_slot(
    monkeypatch: pytest.MonkeyPatch, seen: bool, exiting: bool
) -> None:
    """Inside its exit (PF_EXITING) or not, seen with the shim before or not: another thread
    may still hold its GPU files (exit_group leaves the leader a zombie first), and only the
    slot's freeze waits for that thread to leave."""
    p = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.05)
        insp = freezepolicy.Inspector(shim_name="libc.so.6")  # sleep maps libc: "has the shim"
        if seen:
            f = insp.facts(p.pid)
            assert f is not None and f.shim, f
        _exiting(monkeypatch, p.pid, exiting)
        why = freezepolicy.ungateable([p.pid], insp, REF)
        assert len(why) == 1 and "cannot be read" in why[0], why
    finally:
        p.kill()
        p.wait()


def test_stat_reads_the_kernel_flags() -> None:
    st = procfs.pid_stat(os.getpid())
    assert st is not None and st.flags != 0 and not st.flags & procfs.PF_EXITING


_HOLDS = r"""
import sys, time
f = open(sys.argv[1], "rb") if sys.argv[1] != "-" else None
sys.stdout.write("up\n"); sys.stdout.flush()
time.sleep(60)
"""


@pytest.mark.parametrize("holds", ["nothing", "device", "gpu-library"])
def test_a_process_is_gpu_less_only_without_gpu_libraries_and_device_files(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch, holds: str
) -> None:
    """gpu_less reads the process now: a plain one is; one holding a GPU device file open
    (a file standing in for /dev/nvidia0 here) or mapping a GPU library (the simulated
    driver's libcuda.so.1, as any program that loads the driver) is not."""
    dev = os.path.join(str(tmp_path), "nvidia0")
    open(dev, "w").close()
    monkeypatch.setattr(freezepolicy, "GPU_DEVICES", (dev,))
    code = _HOLDS
    if holds == "gpu-library":
        lib = os.path.join(os.path.dirname(freezepolicy.__file__), "..", "_lib", "libcuda.so.1")
        code = f"import ctypes; ctypes.CDLL({os.path.realpath(lib)!r})\n" + code
    arg = dev if holds == "device" else "-"
    p = subprocess.Popen([sys.executable, "-c", code, arg], stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline() == b"up\n"
        assert freezepolicy.Inspector().gpu_less(p.pid) == (holds == "nothing")
    finally:
        p.kill()
        p.wait()
    assert not freezepolicy.Inspector().gpu_less(p.pid)  # gone: cannot be read, so not vouched for
