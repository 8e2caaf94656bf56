"""Operator controls that need no daemon: pause and resume a GPU's gate."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from krex.errors import Busy, UsageError
from krex.native import lib
from krex.shm import Segment, StepResult, raise_stragglers

DEFAULT_PAUSE_LEASE_S = 600.0
MAX_PAUSE_LEASE_S = 7 * 86400.0
MAX_PAUSE_TIMEOUT_S = 86400.0


@dataclass
class PauseResult:
    gpu: int
    gate_word: int
    inflight: StepResult
    drain: StepResult
    lease_s: float


def pause(
    seg: Segment, gpu: int, timeout: float = 10.0, lease_s: float = DEFAULT_PAUSE_LEASE_S
) -> PauseResult:
    """Close the gate with no owner, wait for in-flight submissions, drain.

    The pause outlives the caller: it holds until resume() or until the lease
    runs out, after which shims fail open (invariant I5). On a timeout the gate
    is opened again, so a failed pause leaves nothing behind."""
    seg.check_gpu(gpu)
    if not (math.isfinite(timeout) and 0 < timeout <= MAX_PAUSE_TIMEOUT_S):
        raise UsageError(
            f"--timeout {timeout:g} must be a number of seconds in (0, {MAX_PAUSE_TIMEOUT_S:g}]",
            "pass e.g. --timeout 10",
        )
    if not (math.isfinite(lease_s) and 0 < lease_s <= MAX_PAUSE_LEASE_S):
        raise UsageError(
            f"--for {lease_s:g} must be a number of seconds in (0, {MAX_PAUSE_LEASE_S:g}] (7 days)",
            "pass e.g. --for 600; renew a longer pause with another `krex pause`",
        )
    g = seg.raw.gpus[gpu]
    if g.gate != lib.KREX_GATE_OPEN and g.holder == lib.KREX_HOLDER_REGION:
        raise Busy(
            f"GPU {gpu} is inside a region of slot {g.owner_slot}",
            "wait for the region to end, then pause again",
        )
    word = seg.close_gate(gpu, None, holder=lib.KREX_HOLDER_PAUSE, holder_pid=os.getpid(), lease_s=lease_s)
    try:
        inflight = seg.wait_inflight(gpu, None, timeout)
        if not inflight.ok:
            raise_stragglers("waiting for in-flight submissions", gpu, inflight, timeout)
        drain = seg.drain(gpu, None, timeout)
        if not drain.ok:
            raise_stragglers("draining", gpu, drain, timeout)
    except BaseException:
        # A timeout, Ctrl-C or SIGTERM while waiting: give back what we took, and only
        # that (the gate word is still ours unless someone has reopened it since).
        if seg.gate_word(gpu) == word:
            seg.open_gate(gpu)
        raise
    return PauseResult(gpu, word, inflight, drain, lease_s)


def resume(seg: Segment, gpu: int) -> bool:
    """Open a paused gate. Returns False if it was not paused."""
    seg.check_gpu(gpu)
    g = seg.raw.gpus[gpu]
    if g.gate == lib.KREX_GATE_OPEN:
        return False
    if g.holder == lib.KREX_HOLDER_REGION:
        raise Busy(
            f"GPU {gpu} is held by a region of slot {g.owner_slot}, not by a pause",
            "regions end by themselves; `krex status` shows who holds it",
        )
    seg.open_gate(gpu)
    return True
