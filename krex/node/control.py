"""Operator controls that need no daemon: pause and resume a GPU's gate."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

from krex.errors import Busy, UsageError
from krex.native import ffi, lib
from krex.node.shm import Segment, StepResult, gate_owner, raise_stragglers

DEFAULT_PAUSE_LEASE_S = lib.KREX_PAUSE_LEASE_MS / 1e3
MAX_PAUSE_LEASE_S = lib.KREX_PAUSE_LEASE_MAX_MS / 1e3
DEFAULT_PAUSE_TIMEOUT_S = lib.KREX_PAUSE_TIMEOUT_MS / 1e3
MAX_PAUSE_TIMEOUT_S = lib.KREX_PAUSE_TIMEOUT_MAX_MS / 1e3


@dataclass
class PauseResult:
    gpu: int
    gate_word: int
    inflight: StepResult
    drain: StepResult
    lease_s: float


def pause(
    seg: Segment,
    gpu: int,
    timeout: float = DEFAULT_PAUSE_TIMEOUT_S,
    lease_s: float = DEFAULT_PAUSE_LEASE_S,
    wait_s: float | None = None,
) -> PauseResult:
    """Take the gate with no owner, wait for in-flight submissions, drain.

    Taking the gate is one compare-and-swap (krex_gate_acquire): while a region
    holds it, the pause waits up to `wait_s` (default: `timeout`) for the region
    to end, then is refused with Busy (exit 6). A pause and a region never both
    hold the gate. A pause that lapsed (its lease ran out) may be taken over.

    The pause outlives the caller: it holds until resume() or until the lease
    runs out, after which shims fail open (invariant I5). On a timeout the gate
    is opened again, so a failed pause leaves nothing behind."""
    seg.check_gpu(gpu)
    if not (math.isfinite(timeout) and 0 < timeout <= MAX_PAUSE_TIMEOUT_S):
        raise UsageError(
            f"--timeout {timeout:g} must be a number of seconds in (0, {MAX_PAUSE_TIMEOUT_S:g}]",
            f"pass e.g. --timeout {DEFAULT_PAUSE_TIMEOUT_S:g}",
        )
    if not (math.isfinite(lease_s) and 0 < lease_s <= MAX_PAUSE_LEASE_S):
        raise UsageError(
            f"--for {lease_s:g} must be a number of seconds in (0, {MAX_PAUSE_LEASE_S:g}] "
            f"({MAX_PAUSE_LEASE_S / 86400:g} days)",
            f"pass e.g. --for {DEFAULT_PAUSE_LEASE_S:g}; renew a longer pause with another `krex pause`",
        )
    word = _acquire(seg, gpu, lease_s, timeout if wait_s is None else wait_s)
    try:
        inflight = seg.wait_inflight(gpu, None, timeout)
        if not inflight.ok:
            raise_stragglers("waiting for in-flight submissions", gpu, inflight, timeout)
        drain = seg.drain(gpu, None, timeout)
        if not drain.ok:
            raise_stragglers("draining", gpu, drain, timeout)
    except BaseException:
        # A timeout, Ctrl-C or SIGTERM while waiting: give back what we took, and only
        # that (one compare-and-swap: the word is reopened only if it is still ours).
        seg.open_gate(gpu, word)
        raise
    return PauseResult(gpu, word, inflight, drain, lease_s)


def _acquire(seg: Segment, gpu: int, lease_s: float, wait_s: float) -> int:
    deadline = time.monotonic() + wait_s
    while True:
        cur = seg.gate_word(gpu)
        # A pause may replace a pause (renewal, or one whose lease ran out), never a region.
        is_pause = cur != lib.KREX_GATE_OPEN and gate_owner(cur) == lib.KREX_OWNER_NONE
        expect = cur if is_pause else lib.KREX_GATE_OPEN
        try:
            return seg.close_gate(
                gpu,
                None,
                holder=lib.KREX_HOLDER_PAUSE,
                holder_pid=os.getpid(),
                lease_s=lease_s,
                expect=expect,
            )
        except Busy:
            left = deadline - time.monotonic()
            cur = seg.gate_word(gpu)
            if left <= 0:
                raise Busy(
                    f"GPU {gpu} is held by {seg.describe_holder(gpu, cur)}",
                    "wait for it to end (or pass a longer --timeout), then pause again",
                ) from None
            if cur != lib.KREX_GATE_OPEN:
                lib.krex_futex_wait(ffi.addressof(seg.raw.gpus[gpu], "gate"), cur, int(min(left, 0.05) * 1e9))


def resume(seg: Segment, gpu: int) -> bool:
    """Open a paused gate. Returns False if it was not paused."""
    seg.check_gpu(gpu)
    word = seg.gate_word(gpu)
    if word == lib.KREX_GATE_OPEN:
        return False
    if gate_owner(word) != lib.KREX_OWNER_NONE:
        raise Busy(
            f"GPU {gpu} is held by a region of slot {gate_owner(word) - 1}, not by a pause",
            "regions end by themselves; `krex status` shows who holds it",
        )
    if not seg.open_gate(gpu, word):
        return resume(seg, gpu)  # it changed under us: look again
    return True
