"""Two entry rules that keep regions under the `gpu` policy honest without flagging them in
vain (H200, docs/results/h200/final): krexd waits while NVML still lists a process that has
ended (the driver tears its contexts down), and a newcomer that registered during a region
counts as a start only if NVML lists it at the end. NVML is the fake of krex.device.nvml,
a file the test rewrites; the processes are real."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from krex.device.nvml import FakeNvml
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
    assert Daemon._await_teardowns(_daemon(a), 0) is True  # type: ignore[arg-type]
    assert 0.25 <= time.monotonic() - t0 < 1.5


def test_the_wait_is_bounded_by_the_freeze_timeout(tmp_path: Path) -> None:
    path = tmp_path / "nvml.json"
    a = _attestor(path, [1])
    _learn_local_pids(a, 1)
    _nvml(path, [1, _ended_pid()])
    t0 = time.monotonic()
    assert Daemon._await_teardowns(_daemon(a, 0.1), 0) is True  # type: ignore[arg-type]
    assert 0.1 <= time.monotonic() - t0 < 1.0  # the attestation flags what is still listed


def test_no_ended_process_listed_no_wait(tmp_path: Path) -> None:
    a = _attestor(tmp_path / "nvml.json", [1])
    _learn_local_pids(a, 1)
    assert Daemon._await_teardowns(_daemon(a), 0) is False  # type: ignore[arg-type]


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
