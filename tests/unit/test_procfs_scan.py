"""The deep leftover scan's parts (krex/node/procfs.py): environ_scan reads every
process's environment and must match whole entries only; FreshScan lets concurrent
releases share one scan but never hands a caller a scan that began before it asked.
And krexd's admission environment, made once per kind, must still be each slot's own."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from krex.node import daemon, optin, procfs

NAMES = (b"KREX_SLOT", b"KREX_SLOT_GEN")


def _spawn(env: list[bytes]) -> subprocess.Popen[bytes]:
    """`sleep 30` with exactly these environment entries (repeats and odd ones included:
    execve takes them as they are, unlike os.environ)."""
    code = (
        "import ctypes, sys\n"
        "env = [e.encode() for e in sys.argv[1:]]\n"
        "arr = (ctypes.c_char_p * (len(env) + 1))(*env, None)\n"
        "argv = (ctypes.c_char_p * 3)(b'sleep', b'30', None)\n"
        "ctypes.CDLL(None, use_errno=True).execve(b'/bin/sleep', argv, arr)\n"
        "sys.exit('execve failed')\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code, *(e.decode() for e in env)])
    # Wait for the exec: until then the child's environment is this test's.
    deadline = time.monotonic() + 10
    while Path(f"/proc/{p.pid}/cmdline").read_bytes() != b"sleep\x0030\x00":
        assert time.monotonic() < deadline and p.poll() is None, "the child never exec'd"
        time.sleep(0.01)
    return p


def test_environ_scan_matches_whole_entries_only() -> None:
    shm = f"/krex-scan-{os.getpid()}".encode()
    big = b"PAD=" + b"x" * 100_000  # environments this large exist; the scan must not choke
    cases = {
        "tagged": [big, b"KREX_SHM=" + shm, b"KREX_SLOT=3", b"KREX_SLOT_GEN=7"],
        "repeats": [b"KREX_SLOT=4", b"KREX_SHM=" + shm, b"KREX_SLOT=5"],
        "other-shm": [b"KREX_SHM=" + shm + b"x", b"KREX_SLOT=3", b"KREX_SLOT_GEN=7"],
        "in-a-value": [b"X=KREX_SHM=" + shm, b"KREX_SLOT=3", b"KREX_SLOT_GEN=7"],
        "shm-only": [b"KREX_SHM=" + shm, b"Y=KREX_SLOT=9", b"KREX_SLOT_GENX=1"],
    }
    procs = {k: _spawn(env) for k, env in cases.items()}
    try:
        found = procfs.environ_scan(b"KREX_SHM=" + shm, NAMES)
        got = {k: found.get(p.pid) for k, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    assert got == {
        "tagged": {b"KREX_SLOT": {b"3"}, b"KREX_SLOT_GEN": {b"7"}},
        "repeats": {b"KREX_SLOT": {b"4", b"5"}, b"KREX_SLOT_GEN": set()},
        "other-shm": None,
        "in-a-value": None,
        "shm-only": {b"KREX_SLOT": set(), b"KREX_SLOT_GEN": set()},
    }


def test_environ_scan_needs_a_shared_prefix() -> None:
    with pytest.raises(ValueError):
        procfs.environ_scan(b"A=1", [b"B"])


def test_fresh_scan_never_hands_out_a_scan_that_began_before_the_call() -> None:
    release_first = threading.Event()
    runs: list[int] = []

    def scan() -> int:
        runs.append(len(runs) + 1)
        if len(runs) == 1:
            release_first.wait(10)  # run 1 goes on while the others ask
        return runs[-1]

    fs = procfs.FreshScan(scan)
    got: dict[str, int] = {}
    first = threading.Thread(target=lambda: got.update(a=fs.get()))
    first.start()
    while not runs:
        time.sleep(0.001)
    later = [threading.Thread(target=lambda k=k: got.update({k: fs.get()})) for k in "bcd"]  # type: ignore[misc]
    for t in later:
        t.start()
    time.sleep(0.2)  # b, c and d now wait for run 1 to end
    release_first.set()
    for t in [first, *later]:
        t.join(10)
    # a gets run 1; b, c and d asked while it ran, so they share run 2 (one run, not three).
    assert got == {"a": 1, "b": 2, "c": 2, "d": 2}
    assert runs == [1, 2]
    assert fs.get() == 3  # alone: a run of its own


def test_fresh_scan_a_failed_run_fails_its_runner_and_the_next_caller_runs_again() -> None:
    calls = iter([RuntimeError("boom"), 5])

    def scan() -> int:
        v = next(calls)
        if isinstance(v, Exception):
            raise v
        return v

    fs = procfs.FreshScan(scan)
    with pytest.raises(RuntimeError):
        fs.get()
    assert fs.get() == 5


def test_admission_env_is_made_once_per_kind_and_stays_each_slots_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[str] = []
    real = optin.opt_in_parts

    def counting(kind: str, *a: Any) -> Any:
        made.append(kind)
        return real(kind, *a)

    monkeypatch.setattr(optin, "opt_in_parts", counting)
    info = SimpleNamespace(kind="sim", physical=[0, 1], visible_token=lambda g: str(g))
    no_mps = SimpleNamespace(command_env=lambda g: {})  # MPS off (krex/node/mps.py)
    d: Any = SimpleNamespace(_opt_in={}, shm_name="/krex-x", sock_path="/tmp/x.sock", info=info, mps=no_mps)

    def env(slot: int, gen: int, gpu: int, asked: str) -> tuple[dict[str, str], dict[str, list[str]]]:
        s = SimpleNamespace(slot=slot, generation=gen)
        return daemon.Daemon._command_env(d, s, gpu, asked)  # type: ignore[arg-type]

    put1, pre1 = env(3, 7, 0, "sim")
    put1["KREX_SLOT"] = "scribbled"  # a caller's change must never reach the next slot
    pre1["LD_PRELOAD"][0] = "scribbled"
    put2, pre2 = env(4, 8, 1, "auto")
    env(5, 9, 0, "gpu")
    assert made == ["sim", "gpu"]  # once per kind, not once per command
    want_put, want_pre = real("sim", "/krex-x", "/tmp/x.sock", str(daemon.paths.log_path()))
    assert pre2 == want_pre
    assert put2 == {
        **want_put,
        "KREX_SLOT": "4",
        "KREX_GPU": "1",
        "CUDA_VISIBLE_DEVICES": "1",
        "KREX_SLOT_GEN": "8",
    }
