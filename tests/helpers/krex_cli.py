"""The `krex` CLI run in a krex_env world (tests/conftest.py): a command, the daemon's
status, and a plain wait."""

from __future__ import annotations

import json
import subprocess
import sys
import time

KREX = [sys.executable, "-m", "krex.cli.main"]


def krex(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KREX, *args], env=env, capture_output=True, text=True, timeout=timeout)


def status(env: dict[str, str]) -> dict[str, object]:
    return json.loads(krex(env, "status", "--json").stdout)


def wait_for(pred, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    t = time.monotonic() + timeout
    while time.monotonic() < t:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
