"""Case 2 of the trust issue: a pause and a region can never both hold a gate.

Two real processes race on one segment with the very calls krexd and `krex pause` use:
one takes the gate for regions (Segment.close_gate with an owner slot), the other
pauses and resumes (krex.node.control.pause / resume). Whoever believes it holds the gate
checks, while it holds it, that the gate word is still its own. Before gate ownership
was one compare-and-swap, a check-then-store let each overwrite the other."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time

import pytest

from krex.errors import Busy
from krex.native import lib
from krex.node import control
from krex.node.shm import Segment

SECONDS = 3.0


def _region_loop(name: str, stop_at: float, q: mp.Queue) -> None:  # type: ignore[type-arg]
    seg = Segment.attach(name)
    held = lost = refused = 0
    while time.monotonic() < stop_at:
        try:
            w = seg.close_gate(0, owner_slot=0, holder=lib.KREX_HOLDER_REGION, holder_pid=os.getpid())
        except Busy:
            refused += 1
            continue
        held += 1
        for _ in range(50):  # the region "runs": its word must stay in the gate
            if seg.gate_word(0) != w:
                lost += 1
                break
        if seg.gate_word(0) == w:
            seg.open_gate(0, w)
    q.put(("region", held, lost, refused))


def _pause_loop(name: str, stop_at: float, q: mp.Queue) -> None:  # type: ignore[type-arg]
    seg = Segment.attach(name)
    held = lost = refused = 0
    while time.monotonic() < stop_at:
        try:
            r = control.pause(seg, 0, timeout=0.001 + 0.05, lease_s=30, wait_s=0)
        except Busy:
            refused += 1
            continue
        held += 1
        for _ in range(50):
            if seg.gate_word(0) != r.gate_word:
                lost += 1
                break
        with contextlib.suppress(Busy):
            control.resume(seg, 0)
    q.put(("pause", held, lost, refused))


@pytest.mark.timeout(120)
def test_pause_and_region_never_both_hold_the_gate(harness) -> None:  # type: ignore[no-untyped-def]
    ctx = mp.get_context("fork")
    q: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    stop_at = time.monotonic() + SECONDS
    procs = [
        ctx.Process(target=_region_loop, args=(harness.name, stop_at, q)),
        ctx.Process(target=_pause_loop, args=(harness.name, stop_at, q)),
    ]
    for p in procs:
        p.start()
    res = {}
    for _ in procs:
        kind, held, lost, refused = q.get(timeout=60)
        res[kind] = (held, lost, refused)
    for p in procs:
        p.join(30)
    # Not vacuous: both sides really took the gate many times while the other tried.
    assert res["region"][0] > 50 and res["pause"][0] > 50, res
    assert res["region"][2] + res["pause"][2] > 0, f"the two never contended: {res}"
    assert res["region"][1] == 0, f"a pause overwrote a held region {res['region'][1]} times: {res}"
    assert res["pause"][1] == 0, f"a region overwrote a held pause {res['pause'][1]} times: {res}"


def test_pause_is_refused_while_a_region_holds(harness) -> None:  # type: ignore[no-untyped-def]
    seg = harness.seg
    w = seg.close_gate(0, owner_slot=0, holder=lib.KREX_HOLDER_REGION)
    with pytest.raises(Busy):
        control.pause(seg, 0, timeout=1, lease_s=10, wait_s=0.2)
    assert seg.gate_word(0) == w
    seg.open_gate(0, w)
    r = control.pause(seg, 0, timeout=1, lease_s=10, wait_s=0.2)
    with pytest.raises(Busy):
        seg.close_gate(0, owner_slot=0, holder=lib.KREX_HOLDER_REGION)
    assert seg.gate_word(0) == r.gate_word
    assert control.resume(seg, 0)


def test_pause_waits_for_a_running_region(harness) -> None:  # type: ignore[no-untyped-def]
    import threading

    seg = harness.seg
    w = seg.close_gate(0, owner_slot=0, holder=lib.KREX_HOLDER_REGION)
    t = threading.Timer(0.3, lambda: seg.open_gate(0, w))
    t.start()
    r = control.pause(seg, 0, timeout=5, lease_s=10, wait_s=10)
    t.join()
    assert seg.gate_word(0) == r.gate_word and r.gate_word != w
    assert control.resume(seg, 0)
