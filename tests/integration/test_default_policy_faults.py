"""The default freeze policy (`gpu`) under krexd faults: a sibling is left running and parked
at the gate, not frozen. The fault tests of test_faults.py pin `all` (TEST_POLICY); these run
the default. From an adversarial review of 328fe3f."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
from test_regions import Krex, frozen_reason, kx

__all__ = ["kx"]  # the fixture, used by name


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
