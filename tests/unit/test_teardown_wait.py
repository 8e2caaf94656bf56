"""Two entry rules that keep regions under the `gpu` policy honest without flagging them in
vain (H200, docs/results/freeze-policies/): krexd waits while NVML still lists a process that has
ended (the driver tears its contexts down), and a newcomer that registered during a region
counts as a start only if NVML lists it at the end. NVML is the fake of krex.device.nvml,
a file the test rewrites; the processes are real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import spawn_with_pid

from krex.device.nvml import FakeNvml, RealNvml
from krex.node.attest import Attestor
from krex.node.config import Config
from krex.node.daemon import Daemon


def _nvml(path: Path, procs: list[int]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"gpus": [{"name": "fake", "uuid": "GPU-fake", "procs": procs}]}))
    tmp.replace(path)


def _ended_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()  # reaped: gone from /proc
    return p.pid


def _attestor(path: Path, procs: list[int]) -> Attestor:
    _nvml(path, procs)
    return Attestor("gpu", [0], FakeNvml(str(path)))


def _learn_local_pids(a: Attestor, known: int) -> None:
    """A region whose NVML samples list a process KREX knows: NVML's pids are krexd's."""
    s = a.sample(0)
    a.judge(0, s, s, lambda: {known})


def test_listed_gone_waits_for_proof_that_nvml_pids_are_ours(tmp_path: Path) -> None:
    dead = _ended_pid()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        a = _attestor(tmp_path / "nvml.json", [dead, live.pid])
        assert a.listed_gone(0) == set()  # host pids in a container would all look gone
        _learn_local_pids(a, live.pid)
        assert a.pids_local and a.listed_gone(0) == {dead}
    finally:
        live.kill()
        live.wait()


def test_a_sample_of_only_unknown_pids_proves_nothing(tmp_path: Path) -> None:
    a = _attestor(tmp_path / "nvml.json", [_ended_pid()])
    _learn_local_pids(a, 1)  # pid 1 is known, but NVML does not list it
    assert not a.pids_local and a.listed_gone(0) == set()


def test_a_zombie_listed_by_nvml_counts_as_ended(tmp_path: Path) -> None:
    z = subprocess.Popen(["true"])
    try:
        time.sleep(0.3)  # ended, not reaped
        a = _attestor(tmp_path / "nvml.json", [z.pid, 1])
        _learn_local_pids(a, 1)
        assert a.listed_gone(0) == {z.pid}
    finally:
        z.wait()


def _daemon(a: Attestor, timeout_s: float = 2.0) -> Any:
    return SimpleNamespace(attestor=a, cfg=Config(freeze_timeout_s=timeout_s), stop=threading.Event())


def test_entry_waits_until_nvml_stops_listing_an_ended_process(tmp_path: Path) -> None:
    path = tmp_path / "nvml.json"
    dead = _ended_pid()
    a = _attestor(path, [1])
    _learn_local_pids(a, 1)
    _nvml(path, [1, dead])
    threading.Timer(0.3, _nvml, (path, [1])).start()  # the driver finishes its teardown
    t0 = time.monotonic()
    assert Daemon._await_teardowns(_daemon(a), 0) == {dead}  # type: ignore[arg-type]
    assert 0.25 <= time.monotonic() - t0 < 1.5


def test_the_wait_is_bounded_by_the_freeze_timeout(tmp_path: Path) -> None:
    path = tmp_path / "nvml.json"
    a = _attestor(path, [1])
    _learn_local_pids(a, 1)
    gone = _ended_pid()
    _nvml(path, [1, gone])
    t0 = time.monotonic()
    assert Daemon._await_teardowns(_daemon(a, 0.1), 0) == {gone}  # type: ignore[arg-type]
    assert 0.1 <= time.monotonic() - t0 < 1.0  # the attestation flags what is still listed


def test_no_ended_process_listed_no_wait(tmp_path: Path) -> None:
    a = _attestor(tmp_path / "nvml.json", [1])
    _learn_local_pids(a, 1)
    assert Daemon._await_teardowns(_daemon(a), 0) == set()  # type: ignore[arg-type]


def _changes(after: set[tuple[int, int, int]], nvml_exit: dict[str, Any]) -> list[tuple[str, str]]:
    before = {(10, 1, 11)}
    out: list[tuple[str, str]] = Daemon._context_changes(
        None,  # type: ignore[arg-type]
        0,
        before,
        before,
        before | after,
        {"procs": []},
        nvml_exit,
        set(),
    )
    return out


def test_a_newcomer_parked_at_the_gate_with_no_context_is_no_start() -> None:
    assert _changes({(20, 1, 21)}, {"procs": []}) == []


def test_a_newcomer_nvml_lists_at_the_end_is_a_start() -> None:
    (flag, text), = _changes({(20, 1, 21)}, {"procs": [20]})
    assert flag == "sibling-context" and "started pid 20" in text


def test_a_newcomer_is_a_start_when_nvml_could_not_tell() -> None:
    for exit_sample in ({}, {"error": "NVMLError: timeout"}):
        (flag, text), = _changes({(20, 1, 21)}, exit_sample)
        assert "started pid 20" in text, exit_sample


def test_an_execd_process_is_a_start_even_without_nvml_listing_it() -> None:
    (flag, text), = _changes({(10, 1, 12)}, {"procs": []})  # same pid, new drain helper
    assert "started pid 10" in text


# Cases at the edges of these rules.


def _learn_local(a: Attestor, known: set[int]) -> None:
    s = a.sample(0)
    a.judge(0, s, s, lambda: known)
    assert a.pids_local


# --- F1: "NVML could not be asked" reads as "NVML lists nothing" ------------------------


def _fake_pynvml(compute_error: Exception) -> types.ModuleType:
    m = types.ModuleType("pynvml")
    m.NVML_CLOCK_SM = 1  # type: ignore[attr-defined]
    m.nvmlInit = lambda: None  # type: ignore[attr-defined]
    m.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    m.nvmlDeviceGetHandleByIndex = lambda i: ("h", i)  # type: ignore[attr-defined]
    m.nvmlDeviceGetClockInfo = lambda h, c: 1980  # type: ignore[attr-defined]
    m.nvmlDeviceGetCurrentClocksEventReasons = lambda h: 1  # type: ignore[attr-defined]

    def compute(h: Any) -> list[Any]:
        raise compute_error

    m.nvmlDeviceGetComputeRunningProcesses = compute  # type: ignore[attr-defined]
    m.nvmlDeviceGetGraphicsRunningProcesses = lambda h: []  # type: ignore[attr-defined]  # compute-only GPU
    return m


def test_newcomer_is_flagged_when_nvml_failed_to_list_compute_processes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real NVML wrapper swallowed the compute-process query's error (e.g. NVMLError
    'Function Not Found' for *_v3 with an old driver, 'Unknown Error', 'GPU is lost') and
    returns []; the sample then has "procs": [] and no "error", so the newcomer rule treats
    it as 'NVML answered and does not list it' and drops the start. Expected: a newcomer
    is a start when NVML could not be asked (rule 2)."""

    class NVMLError(Exception):
        pass

    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(NVMLError("Function Not Found")))
    a = Attestor("gpu", [0], RealNvml())
    entry, exit_ = a.sample(0), a.sample(0)
    before = {(10, 1, 11)}
    out = Daemon._context_changes(
        None,  # type: ignore[arg-type]
        0,
        before,
        before,
        before | {(20, 1, 21)},  # a newcomer (maybe with an ungated context NVML would list)
        entry,
        exit_,
        set(),
    )
    assert out and "started pid 20" in out[0][1], (exit_, out)


# --- F2: a zombie leader whose other threads run on is not an ended process -------------

_ZOMBIE_LEADER = r"""
import ctypes, os, sys, threading, time
threading.Thread(target=time.sleep, args=(60,)).start()
sys.stdout.write("up\n"); sys.stdout.flush()
ctypes.CDLL(None).syscall(60 if os.uname().machine == "x86_64" else 93, 0)  # SYS_exit: main thread only
"""


def test_a_zombie_leader_with_live_threads_is_not_waited_for(tmp_path: Path) -> None:
    """A process whose main thread called pthread_exit shows state Z in /proc/PID/stat while
    its other threads (and GPU context) live on; krex_pid_alive already counts it alive.
    listed_gone counts it ended, so every region entry waits the whole freeze_timeout_s
    (2 s by default) while such a process is on the GPU, in vain, and then runs _settle.
    Expected: not 'gone', no wait."""
    p = subprocess.Popen([sys.executable, "-c", _ZOMBIE_LEADER], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "up\n"
        time.sleep(0.3)
        with open(f"/proc/{p.pid}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] == "Z"  # leader zombie ...
        assert len(os.listdir(f"/proc/{p.pid}/task")) >= 1  # ... its thread runs on
        path = tmp_path / "nvml.json"
        _nvml(path, [1, p.pid])
        a = Attestor("gpu", [0], FakeNvml(str(path)))
        _learn_local(a, {1})
        t0 = time.monotonic()
        waited = Daemon._await_teardowns(_daemon(a, 1.0), 0)  # type: ignore[arg-type]
        took = time.monotonic() - t0
        assert p.pid not in a.listed_gone(0)
        assert not waited and took < 0.5, took
    finally:
        p.kill()
        p.wait()


# --- F3: a transient NVML error ends the wait as if the teardown were over --------------


def test_an_nvml_error_during_the_wait_does_not_end_it(tmp_path: Path) -> None:
    """listed_gone returns set() on an NVML error, and _await_teardowns intersects with it:
    one failed poll ends the wait while the driver still tears the process down (the
    fake's file briefly unreadable stands for a timed-out NVML call). Expected: an error
    is no answer; keep waiting (to the bound) until NVML stops listing the pid."""
    path = tmp_path / "nvml.json"
    dead = subprocess.Popen(["true"])
    dead.wait()
    _nvml(path, [1])
    a = Attestor("gpu", [0], FakeNvml(str(path)))
    _learn_local(a, {1})
    _nvml(path, [1, dead.pid])

    def glitch() -> None:
        path.rename(path.with_name("away.json"))  # NVML call fails
        time.sleep(0.05)
        path.with_name("away.json").rename(path)  # answers again: still listed

    threading.Timer(0.1, glitch).start()
    threading.Timer(0.6, _nvml, (path, [1])).start()  # the teardown really ends here
    t0 = time.monotonic()
    assert Daemon._await_teardowns(_daemon(a, 2.0), 0)  # type: ignore[arg-type]
    took = time.monotonic() - t0
    assert took >= 0.55, f"the wait ended at the NVML error, {took:.3f}s in"


# --- F4: pid reuse hides an ended process from the wait --------------------------------


def test_a_listed_pid_reused_by_a_new_process_is_still_waited_for(tmp_path: Path) -> None:
    """NVML listed pid X for process S (krexd saw it in a sample); S ends and is reaped while
    the driver tears it down, and X is reused by a new process N. listed_gone only asks
    whether X exists, so it does not wait; if N is a process KREX knows (a sibling's new
    process, or the next owner), the attestation does not call X foreign either, and with
    X listed at both ends the region reads clean while S's teardown ran in it. Expected:
    krexd tells N from S (start time versus when NVML listed X) and waits."""
    path = tmp_path / "nvml.json"
    s = subprocess.Popen(["sleep", "30"])
    x = s.pid
    _nvml(path, [1, x])
    a = Attestor("gpu", [0], FakeNvml(str(path)))
    _learn_local(a, {1})  # a region's samples listed X, then S's process
    time.sleep(0.05)  # start times count clock ticks (10 ms): a reuse is always later than that
    s.kill()
    s.wait()  # reaped; NVML still lists X (teardown)
    n = spawn_with_pid(x) if os.geteuid() == 0 else None
    if n is None:
        pytest.skip("cannot force pid reuse here (needs write access to ns_last_pid)")
    try:
        threading.Timer(0.4, _nvml, (path, [1])).start()  # the teardown ends
        t0 = time.monotonic()
        waited = Daemon._await_teardowns(_daemon(a, 2.0), 0)  # type: ignore[arg-type]
        assert waited and time.monotonic() - t0 >= 0.35
    finally:
        n.kill()
        n.wait()


# ------------------------------------------------ the settle after an exit, sized by NVML

GB = 2**30


def _nvml_mem(path: Path, mem: dict[int, int]) -> None:
    path.write_text(
        json.dumps({"gpus": [{"procs": sorted(mem), "mem": {str(p): b for p, b in mem.items()}}]})
    )


def test_the_settle_after_an_exit_is_sized_by_the_memory_nvml_gave(tmp_path: Path) -> None:
    from krex.native import lib

    path = tmp_path / "nvml.json"
    _nvml_mem(path, {1: 1 * GB, 7001: 2 * GB, 7002: 64 * GB})
    a = Attestor("gpu", [0], FakeNvml(str(path)))
    assert a.settle_ns({7001}) is None  # NVML's pids not known to be ours yet
    _learn_local_pids(a, 1)
    per_gb, floor = int(lib.KREX_SETTLE_NS_PER_GB), int(lib.KREX_SETTLE_MIN_NS)
    assert a.settle_ns({7001}) == max(floor, 2 * per_gb)
    # The most any of them held, past the fixed 100 ms where a process held more than ~33 GB.
    assert a.settle_ns({7001, 7002}) == 64 * per_gb > int(lib.KREX_FREE_SETTLE_NS)
    assert a.settle_ns({7001, 4242}) is None  # one NVML never gave: unknown
    # A later, smaller figure does not lower what was seen (memory freed before the exit).
    _nvml_mem(path, {1: 1 * GB, 7001: 1})
    a.sample(0)
    assert a.settle_ns({7001}) == max(floor, 2 * per_gb)
    # No figure (NVML in a container reports none): unknown.
    path.write_text(json.dumps({"gpus": [{"procs": [1, 7003]}]}))
    a.sample(0)
    assert a.settle_ns({7003}) is None


def _settle_daemon() -> Any:
    from krex.node.exits import Exits

    return SimpleNamespace(_frees_since=lambda *a: [], _settle_until=lambda *a: (0, 0),
                           _owner_gen=lambda s: 1,
                           seg=SimpleNamespace(reap_records=lambda: 0), exits=Exits(lambda pids: None))


def test_the_settle_waits_the_sized_time_after_an_end_and_the_fixed_one_without() -> None:
    from krex.native import lib

    fixed = int(lib.KREX_FREE_SETTLE_NS) / 1e9
    for sized_ns, lo, hi in ((10_000_000, 0.009, fixed * 0.6), (None, fixed * 0.95, fixed * 2)):
        t: dict[str, float] = {}
        reasons = Daemon._settle(_settle_daemon(), 0, 0, time.monotonic_ns(), t, sized_ns)  # type: ignore[arg-type]
        assert reasons == [] and lo <= t["settle_s"] < hi, (sized_ns, t)
        assert t["ended_settle_s"] == (fixed if sized_ns is None else sized_ns / 1e9)
