"""A run that collects no test fails with a message (tests/conftest.py), never passes as
pytest's exit 5: CI treats 5 as a run to look at, not as green, and a suite that silently
stopped collecting would look like one that passed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MESSAGE = "no tests were collected: the suite is broken"


def _pytest(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "selection",
    [
        ["tests/helpers"],  # a folder of the suite that holds no test module
        ["tests/unit/test_collection_guard.py", "-k", "no_test_has_this_name"],  # all deselected
    ],
    ids=["no-test-modules", "all-deselected"],
)
def test_a_run_that_collects_nothing_fails_with_the_guards_message(selection: list[str]) -> None:
    p = _pytest(*selection)
    assert p.returncode == 1, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert MESSAGE in p.stdout + p.stderr, p.stdout[-2000:] + p.stderr[-2000:]

