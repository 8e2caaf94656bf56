"""The default freeze policy (`gpu`) under krexd faults: a sibling is left running and parked
at the gate, not frozen. The fault tests of test_faults.py pin `all` (TEST_POLICY); these run
the default."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
from helpers.krex_world import Krex, frozen_reason


@pytest.mark.parametrize("how", ["sigstop", "killpg"])
def test_default_policy_sibling_recovers_when_krexd_dies_mid_region(kx: Krex, how: str) -> None:
    kx_env = kx.env
    kx.env = lambda **extra: {  # type: ignore[method-assign]
        k: v for k, v in kx_env(**extra).items() if k != "KREX_FREEZE_POLICY"
    }
    d = kx.start_daemon(slots=3)
    kx.run("h1", "hammer", "--us", "50")
    kx.wait_running("h1")
    kx.run("own", "hold")
    ready = kx.result("own", "ready", timeout=30)
    assert ready["grant"]["freeze_policy"] == "gpu", ready["grant"]
    assert kx.stands_still("h1") and frozen_reason(kx.progress("h1")[2]) is None  # parked, not frozen
    t0 = time.monotonic()
    try:
        if how == "sigstop":
            os.kill(d.pid, signal.SIGSTOP)
        else:
            os.killpg(d.pid, signal.SIGKILL)
        assert kx.advances("h1", timeout=30), "h1 stayed parked behind a dead/hung daemon"
        print(f"{how}: h1 ran again after {time.monotonic() - t0:.2f} s")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(d.pid, signal.SIGCONT)
        kx.touch("own")
        kx.touch("h1.stop") if hasattr(kx, "touch") else None


def test_a_daemon_killed_mid_region_leaves_no_thread_off_or_on_the_region_core(kx: Krex) -> None:
    """Lent cores (the default): krexd killed inside a region leaves the owner's measuring
    thread pinned to the region core and every other thread of the GPU's commands moved off
    it. The next krexd, recovering their slots, gives them their masks back."""
    import psutil

    kx_env = kx.env
    kx.env = lambda **extra: {  # type: ignore[method-assign]
        k: v for k, v in kx_env(**extra).items() if k not in ("KREX_FREEZE_POLICY", "KREX_LEND_CORES")
    }
    d = kx.start_daemon(slots=3)
    assert kx.status()["daemon"]["lend_cores"] == "all"
    h1 = kx.run("h1", "hammer", "--us", "50")
    kx.wait_running("h1")
    own = kx.run("own", "hold")
    ready = kx.result("own", "ready", timeout=30)
    reserved = set(ready["grant"]["reserved_cpus"])
    assert reserved and ready["grant"]["evicted_threads"] >= 1, ready["grant"]

    def threads() -> dict[int, set[int]]:
        out: dict[int, set[int]] = {}
        for c in (h1, own):
            for p in psutil.Process(c.popen.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error, OSError):
                    for t in p.threads():
                        out[t.id] = set(os.sched_getaffinity(t.id))
        return out

    inside = threads()
    assert any(m == reserved for m in inside.values()), "the measuring thread is pinned"
    assert any(m and not m & reserved for m in inside.values()), "the others are moved off"
    try:
        os.killpg(d.pid, signal.SIGKILL)
        d.wait(timeout=10)
        kx.start_daemon(slots=3)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            after = threads()
            if all(reserved <= m for m in after.values()):
                break
            time.sleep(0.1)
        assert all(reserved <= m for m in after.values()), (reserved, after)
    finally:
        kx.touch("own")
        kx.touch("h1.stop") if hasattr(kx, "touch") else None
