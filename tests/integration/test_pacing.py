"""Bounded queues (interpose/pace.c): while commands share a GPU, each keeps no more GPU
work queued than runs in about the GPU's `queue_cap_us`, so a region's drain of siblings'
queued work is short. Each test runs the unpaced case beside the paced one, so it proves
the bound is pacing's and not the simulator's."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
from helpers import Child, Harness
from helpers.krex_world import Krex

from krex.native import lib
from krex.node.shm import Segment

KERNEL_US = 5_000  # 5 ms simulated kernels
CAP_MS = 15
# Between two checks a thread queues KREX_PACE_EVERY more launches: the bound on what is
# left queued after its last launch. The slack covers scheduling on a loaded CI machine.
BOUND_S = (CAP_MS + lib.KREX_PACE_EVERY * KERNEL_US / 1e3 + 40) / 1e3


def _set_cap(h: Harness, ms: int) -> None:
    h.seg.raw.gpus[0].queue_cap_us = ms * 1000  # what krexd publishes while commands share the GPU


def _queue(h: Harness, slot: int, n: int, extra: tuple[str, ...] = ()) -> tuple[Child, dict, float]:
    """A sibling that launches `n` kernels back to back; what it left queued when its last
    launch returned (s), from the simulator's trace."""
    c = h.spawn("actor", ["k:1", "sync", f"kn:{n}:{KERNEL_US}", *extra, "line"], h.env(slot))
    kn = c.expect(lambda d: d["act"] == "kn", 60, "the launches")
    assert kn["rc"] == 0, kn
    ends = [o["end"] for o in h.ops(c.pid, life=False)]
    return c, kn, (max(ends) - kn["t1"]) / 1e9


def test_a_sibling_keeps_no_more_queued_than_the_cap(harness: Harness) -> None:
    h = harness
    _set_cap(h, 0)  # alone on the GPU: krexd publishes no cap
    free, _kn, left_free = _queue(h, h.claim(), 120)
    assert left_free >= 0.5, f"unpaced, 0.6 s of work should still be queued; {left_free:.3f} s was"
    p = h.proc(free.pid)
    assert p is not None and p.paced == 0, p

    _set_cap(h, CAP_MS)
    paced, kn, left = _queue(h, h.claim(), 120)
    assert left <= BOUND_S, f"paced: {left:.3f} s left queued, more than the {BOUND_S:.3f} s bound"
    assert (kn["t1"] - kn["t0"]) / 1e9 >= 0.45, "the launches did not wait for their queue"
    p = h.proc(paced.pid)
    assert p is not None and p.paced >= 1 and p.paced_ms >= 300, p
    assert "pace-off" not in p.flags, p


@pytest.mark.parametrize("cap_ms", [0, CAP_MS])
def test_the_drain_at_a_region_entry_is_short_when_siblings_are_paced(harness: Harness, cap_ms: int) -> None:
    h = harness
    _set_cap(h, cap_ms)
    owner, sib = h.claim(), h.claim()
    c = h.spawn("actor", ["k:1", "sync", f"kn:400:{KERNEL_US}", "line"], h.env(sib))  # 2 s of work
    c.expect(lambda d: d["act"] == "sync", 30, "registration")
    time.sleep(0.3)
    h.seg.set_daemon(os.getpid(), heartbeat_timeout_s=60)
    h.seg.close_gate(0, owner_slot=owner, holder=lib.KREX_HOLDER_REGION)
    t0 = time.monotonic()
    assert h.seg.wait_inflight(0, owner, timeout=10).ok
    res = h.seg.drain(0, owner, timeout=10)
    drain_s = time.monotonic() - t0
    assert res.ok and res.count == 1, res
    if cap_ms:
        assert drain_s <= BOUND_S, f"the drain took {drain_s:.3f} s with the sibling paced"
    else:
        assert drain_s >= 1.0, f"unpaced, the drain should wait for ~1.7 s of queued work: {drain_s:.3f} s"
    h.seg.open_gate(0)
    c.expect(lambda d: d["act"] == "kn", 60, "the rest of the launches")


def test_a_region_owner_is_never_paced(harness: Harness) -> None:
    """Inside its own command's region the gate is closed by its slot: a timed loop queues
    as it likes (pacing it would change what is measured)."""
    h = harness
    _set_cap(h, CAP_MS)
    h.claim()  # a sibling command exists: the cap applies
    mine = h.claim()
    h.seg.set_daemon(os.getpid(), heartbeat_timeout_s=60)
    h.seg.close_gate(0, owner_slot=mine, holder=lib.KREX_HOLDER_REGION)
    c, _kn, left = _queue(h, mine, 120)
    assert left >= 0.5, f"the owner's timed work was paced: only {left:.3f} s left queued"
    p = h.proc(c.pid)
    assert p is not None and p.paced == 0, p
    h.seg.open_gate(0)


def test_no_pacing_while_a_graph_capture_runs(harness: Harness) -> None:
    """An event recorded on a capturing stream would join the graph: a process with a capture
    under way records none."""
    h = harness
    _set_cap(h, CAP_MS)
    c = h.spawn("actor", ["k:1", "sync", "capbegin:77", f"kn:120:{KERNEL_US}", "line"], h.env(h.claim()))
    kn = c.expect(lambda d: d["act"] == "kn", 60, "the launches")
    ends = [o["end"] for o in h.ops(c.pid, life=False)]
    assert (max(ends) - kn["t1"]) / 1e9 >= 0.5, "launches were paced during a capture"
    p = h.proc(c.pid)
    assert p is not None and p.paced == 0, p


def test_pacing_gives_up_on_work_that_does_not_finish_and_never_hangs(harness: Harness) -> None:
    """Queued work that does not finish within KREX_PACE_GIVEUP_MS (here a 4 s kernel; on a
    GPU, a stream waiting for a flag this thread sets later) ends the wait and turns pacing
    off in that process, flagged: the process is slowed once, never stuck."""
    h = harness
    _set_cap(h, CAP_MS)
    c = h.spawn(
        "actor",
        # One check lands among the first EVERY short launches (an event behind the long
        # kernel), one among the next EVERY, 50 ms later: that event is past the cap.
        ["k:1", "sync", "kn:1:4000000", f"kn:{lib.KREX_PACE_EVERY}:100", "sleep:50",
         f"kn:{lib.KREX_PACE_EVERY}:100", f"kn:{4 * lib.KREX_PACE_EVERY}:100", "line"],
        h.env(h.claim()),
    )
    waited = c.expect(lambda d: d["act"] == "kn" and d["t1"] - d["t0"] > 1e9, 30, "the paced wait")
    giveup_s = lib.KREX_PACE_GIVEUP_MS / 1e3
    assert giveup_s - 0.05 <= (waited["t1"] - waited["t0"]) / 1e9 <= giveup_s + 1.0, waited
    after = c.expect(lambda d: d["act"] == "kn", 10, "the launches after it")
    assert (after["t1"] - after["t0"]) / 1e9 < 0.5, f"pacing still waited after giving up: {after}"
    p = h.proc(c.pid)
    assert p is not None and "pace-off" in p.flags and p.paced == 1, p


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: krexd's cgroups")
def test_krexd_caps_queues_only_while_commands_share_a_gpu(kx: Krex) -> None:
    """krexd publishes its queue_cap_ms (KREX_QUEUE_CAP_MS) on a GPU while two or more
    commands hold slots on it, and 0 (no pacing) while one does."""
    kx.start_daemon(slots=4)

    def cap() -> int:
        with Segment.attach(kx.shm) as s:
            return int(s.raw.gpus[0].queue_cap_us)

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    a = kx.run_argv("a", sleeper)
    kx.wait(lambda: len(kx.status()["slots"]) == 1, 30, "the first command's slot")
    assert cap() == 0, "one command alone was paced"
    b = kx.run_argv("b", sleeper)
    kx.wait(lambda: len(kx.status()["slots"]) == 2, 30, "the second command's slot")
    assert cap() == lib.KREX_QUEUE_CAP_MS * 1000
    b.send_signal(signal.SIGTERM)
    b.wait(timeout=30)
    kx.wait(lambda: cap() == 0, 30, "the cap lifted once one command is left")
    a.send_signal(signal.SIGTERM)
    a.wait(timeout=30)


def test_a_free_stamp_ahead_of_the_clock_counts_once_not_for_good(harness: Harness) -> None:
    """The segment is writable by every process of the user: random bytes over the free stamps
    (the chaos test's `overwrite`) left stamps in the future, which read as a free just now at
    every grant (a wait and a `recent-free` flag on every region, for good: 7817 of 10044 chaos
    regions). Such a stamp counts as one free now, once, then ages out."""
    h = harness
    from krex.native import ffi

    raw = h.seg.raw
    now = int(lib.krex_now_ns())
    raw.gpus[0].slot_free_ns[5] = now + 10**12  # 1000 s ahead
    raw.gpus[0].slot_free_gen[5] = 1
    slots, ago = ffi.new("int32_t[64]"), ffi.new("uint64_t[64]")
    n = lib.krex_recent_frees(raw, 0, 9, 0, now - 10**8, slots, ago, 64)
    assert n == 1 and slots[0] == 5 and ago[0] < 10**8, (n, slots[0], ago[0])
    assert int(raw.gpus[0].slot_free_ns[5]) <= int(lib.krex_now_ns())
    time.sleep(0.15)
    later = int(lib.krex_now_ns())
    assert lib.krex_recent_frees(raw, 0, 9, 0, later - lib.KREX_FREE_SETTLE_NS, slots, ago, 64) == 0
