"""krexd waits, before a grant, for sibling processes inside the kernel's exit (the freezer
cannot stop them; closing their GPU files tears their contexts down): Daemon._await_exits
on a stub segment, and krex_sibling_exiting on real processes (a live one and a zombie are
no exiting ones)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

from krex.native import ffi, lib
from krex.node.config import Config
from krex.node.daemon import Daemon


class _Seg:
    def __init__(self, rounds: list[set[int]]) -> None:
        self.rounds = rounds
        self.calls = 0

    def exiting(self, gpu: int, owner_slot: int) -> set[int]:
        self.calls += 1
        return self.rounds[min(self.calls - 1, len(self.rounds) - 1)]


def _stub(seg: _Seg, timeout_s: float = 1.0) -> Any:
    return SimpleNamespace(seg=seg, cfg=Config(freeze_timeout_s=timeout_s), stop=threading.Event())


def test_waits_until_the_exiting_sibling_is_gone() -> None:
    seg = _Seg([{41}, {41}, {41}, set()])
    left, waited = Daemon._await_exits(_stub(seg), 0, 1)  # type: ignore[arg-type]
    assert left == set() and waited == {41} and seg.calls == 4


def test_gives_up_at_the_freeze_timeout_and_says_who_is_left() -> None:
    seg = _Seg([{41, 42}, {42}])
    t0 = time.monotonic()
    left, waited = Daemon._await_exits(_stub(seg, 0.05), 0, 1)  # type: ignore[arg-type]
    assert left == {42} and waited == {41, 42} and 0.05 <= time.monotonic() - t0 < 1.0


def test_no_exiting_sibling_no_wait() -> None:
    seg = _Seg([set()])
    assert Daemon._await_exits(_stub(seg), 0, 1) == (set(), set())  # type: ignore[arg-type]
    assert seg.calls == 1


def test_krex_sibling_exiting_skips_live_and_zombie_processes(tmp_path: Any) -> None:
    """Records with life_inflight held (the exit hold) for a live sleeping process and for a
    zombie: neither is inside the kernel's exit, so neither is reported."""
    from krex.node.shm import Segment

    name = f"/krex-t-exiting-{os.getpid()}"
    seg = Segment.create(name, 1)
    try:
        live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        zombie = subprocess.Popen(["true"])
        time.sleep(0.3)  # `true` has ended, unreaped: a zombie
        for pid in (live.pid, zombie.pid):
            i = int(lib.krex_proc_register(seg.raw, 0, 0, pid))
            assert i >= 0
            seg.raw.procs[i].has_ctx = 1
            seg.raw.procs[i].life_inflight = 1
        pids = ffi.new("int64_t[8]")
        assert int(lib.krex_sibling_exiting(seg.raw, 0, 5, pids, 8)) == 0
        live.kill()
        live.wait()
        zombie.wait()
    finally:
        seg.close()
        Segment.unlink(name)
