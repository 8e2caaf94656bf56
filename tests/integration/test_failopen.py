"""I5: a shim stops waiting on a gate whose holder is gone and fails open,
counting the event; it keeps waiting while the holder is alive."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from helpers import Child, Harness, wait_until

from krex.native import lib

HB_TIMEOUT_S = 0.5


def _blocked(h: Harness, c: Child) -> None:
    wait_until(lambda: (r := h.proc(c.pid)) and r.blocked >= 1, 10, f"pid {c.pid} to block at the gate")


@contextmanager
def _beating(h: Harness, every: float = 0.05) -> Iterator[None]:
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            h.seg.heartbeat()
            stop.wait(every)

    t = threading.Thread(target=beat, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def _check_failed_open(h: Harness, c: Child, not_before_ns: int) -> None:
    assert c.wait(10) == 0, c.stderr
    ks = [d for d in c.lines if d["act"] == "k"]
    assert [d["rc"] for d in ks] == [0] * len(ks) and ks
    rec = h.proc(c.pid)
    assert rec is not None
    assert rec.fail_opens >= 1 and "failed-open" in rec.flags, rec
    assert rec.blocked == 1, "after failing open on a gate word, later calls must not wait on it again"
    gate = h.seg.snapshot().gates[0]
    assert gate.fail_opens >= 1 and gate.closed, gate
    ops = h.ops(c.pid, life=False)
    assert len(ops) == len(ks)
    assert min(o["submit"] for o in ops) >= not_before_ns, "failed open before the holder was gone"


def test_region_with_stale_heartbeat_fails_open(harness: Harness) -> None:
    h = harness
    owner, sib = h.claim(), h.claim()
    h.seg.set_daemon(os.getpid(), heartbeat_timeout_s=HB_TIMEOUT_S)
    h.seg.close_gate(0, owner_slot=owner, holder=lib.KREX_HOLDER_REGION)
    hb = int(h.seg.raw.hdr.heartbeat_ns)
    c = h.spawn("actor", ["k:5", "k:5"], h.env(sib))
    _check_failed_open(h, c, hb + int(HB_TIMEOUT_S * 1e9))


def test_region_with_fresh_heartbeat_keeps_blocking(harness: Harness) -> None:
    h = harness
    owner, sib = h.claim(), h.claim()
    h.seg.set_daemon(os.getpid(), heartbeat_timeout_s=HB_TIMEOUT_S)
    h.seg.close_gate(0, owner_slot=owner, holder=lib.KREX_HOLDER_REGION)
    c = h.spawn("actor", ["k:5"], h.env(sib))
    with _beating(h):
        _blocked(h, c)
        time.sleep(3 * HB_TIMEOUT_S)
        assert c.alive() and h.ops(c.pid, life=False) == [], "gave up on a gate whose holder is alive"
        rec = h.proc(c.pid)
        assert rec.fail_opens == 0 and "failed-open" not in rec.flags
    # The daemon "dies" (beats stop): now it fails open.
    t_stop = time.monotonic_ns()
    _check_failed_open(h, c, t_stop)


def test_pause_with_expired_lease_fails_open(harness: Harness) -> None:
    h = harness
    sib = h.claim()
    h.seg.close_gate(0, None, holder=lib.KREX_HOLDER_PAUSE, lease_s=0.3)
    deadline = int(h.seg.raw.gpus[0].lease_deadline_ns)
    assert deadline > 0
    c = h.spawn("actor", ["k:5", "k:5"], h.env(sib))
    _check_failed_open(h, c, deadline)


def test_pause_without_lease_ignores_heartbeat(harness: Harness) -> None:
    """A pause holds the gate on its own terms: no lease means no lapse, even
    with a stale daemon heartbeat."""
    h = harness
    sib = h.claim()
    h.seg.set_daemon(os.getpid(), heartbeat_timeout_s=HB_TIMEOUT_S)  # and never beat again
    h.seg.close_gate(0, None, holder=lib.KREX_HOLDER_PAUSE)
    c = h.spawn("actor", ["k:5"], h.env(sib))
    _blocked(h, c)
    time.sleep(2 * HB_TIMEOUT_S)
    assert c.alive() and h.ops(c.pid, life=False) == []
    assert h.proc(c.pid).fail_opens == 0
    t_open = time.monotonic_ns()
    h.seg.open_gate(0)
    assert c.wait(10) == 0
    assert [o["submit"] > t_open for o in h.ops(c.pid, life=False)] == [True]
