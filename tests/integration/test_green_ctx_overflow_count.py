"""The drain helper's count of contexts no table holds (g_ctx_overflow, interpose/drain.c):
once a context did not fit, the process's drains ack as partial for good. The count follows
no destroy call: a destroy cannot tell which context it ends (a handle no green context has,
a double destroy, a destroy that fails), and one taken off wrongly would leave a live
context's work read as drained. Conservative by design: a process past the tables (more than
32 live contexts) flags the regions it overlaps until it exits.

On the simulated GPU a sync of the primary context does not wait for a green context's
work (docs/simulated-gpu.md), so a green context no drain synchronises leaves its kernel
running past a drain that acked whole."""

from __future__ import annotations

import time

from helpers import Harness
from test_green_ctx_drain import LONG_US, _close


def test_a_failed_green_context_destroy_does_not_uncount_one_the_drain_cannot_synchronise(
    harness: Harness,
) -> None:
    """33 green contexts (one more than the table holds), a cuGreenCtxDestroy of a handle no
    green context has (it fails), then a 0.6 s kernel on the 33rd's stream. The 33rd
    still lives and no drain synchronises it: the drain must still ack as partial, or return
    after its kernel ended."""
    h = harness
    owner, sib = h.claim(), h.claim()
    child = h.spawn("actor", ["green:33", "greenbad", f"gk:{LONG_US}", "line"], h.env(sib))
    for act in ("green", "greenbad", "gk"):
        d = child.expect(lambda d, act=act: d["act"] == act, 30, act)
        assert (d["rc"] != 0) == (act == "greenbad"), d  # the bad destroy fails, the rest succeed
    (op,) = [o for o in h.ops(child.pid, life=False) if o["api"] == "cuLaunchKernel"]
    assert time.monotonic_ns() < op["end"], "the green kernel ended before the drain: it would prove nothing"
    _close(h, owner)
    res = h.seg.drain(0, owner, timeout=10)
    t_ret = time.monotonic_ns()
    assert res.ok and res.count == 1, res
    assert res.partial == [child.pid] or op["end"] <= t_ret, (
        f"the drain acked whole {(op['end'] - t_ret) / 1e6:.0f} ms before the kernel of a green context "
        f"it never synchronised ended: {res}"
    )


def test_a_process_past_the_context_tables_drains_partial_for_good(harness: Harness) -> None:
    """33 green contexts (the 33rd counted: no slot), the first destroyed (a slot frees), the
    application converts the 33rd (cuCtxFromGreenCtx: it takes the freed slot), then destroys
    it. Its drains stay partial: the count is never taken down by a destroy call, so no
    sequence of destroys can make a live context no drain synchronises read as drained."""
    h = harness
    owner, sib = h.claim(), h.claim()
    acts = ["green:33", "greendel1", "greenconv", "greendel", "k:5", "line"]
    child = h.spawn("actor", acts, h.env(sib))
    for act in acts[:-1]:
        d = child.expect(lambda d, act=act: d["act"] == act.split(":")[0], 30, act)
        assert d["rc"] == 0, d
    _close(h, owner)
    res = h.seg.drain(0, owner, timeout=10)
    assert res.ok and res.count == 1, res
    assert res.partial == [child.pid], res
    rec = h.proc(child.pid)
    assert rec is not None and "drain-partial" in rec.flags and not rec.quiet, rec
