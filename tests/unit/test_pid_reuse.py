"""A slot's root processes are known by pid AND start time: once a root has died, a new
process that the kernel gives the same pid is not a member of the slot (krexd would
otherwise freeze it in a sibling's region, or attribute its registration to the slot).
The reuse is real: the next pid is set through /proc/sys/kernel/ns_last_pid (root)."""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

import pytest
from helpers import spawn_with_pid

from krex.node import daemon

NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"


@pytest.mark.skipif(not os.access(NS_LAST_PID, os.W_OK), reason="needs root to choose the next pid")
def test_a_process_that_reuses_a_dead_roots_pid_is_not_a_root() -> None:
    first = subprocess.Popen(["sleep", "60"])
    group: Any = None  # _is_root never looks at the group
    slot = daemon.Slot(0, 0, "run", os.getpid(), group, daemon._roots([first.pid]))
    assert daemon._is_root(slot, first.pid), "the live root itself is not recognised: the test proves nothing"

    first.kill()
    first.wait()
    # Start times are in clock ticks (10 ms): a real reuse comes after the pid space wrapped.
    time.sleep(0.05)
    assert not daemon._is_root(slot, first.pid), "a dead root still counts"
    second = spawn_with_pid(first.pid)
    assert second is not None, f"could not get pid {first.pid} again"
    try:
        assert not daemon._is_root(slot, second.pid), "an unrelated process with the root's old pid is a root"
    finally:
        second.kill()
        second.wait()


def test_roots_drops_a_pid_that_is_already_gone() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert daemon._roots([gone.pid, os.getpid()]) == {os.getpid(): daemon._roots([os.getpid()])[os.getpid()]}
