"""Green contexts (CUDA 12.4+, driver only) and the drain: a sibling's work queued on a green
context's stream is waited for by a region's drain, or the region is flagged.

On the simulated GPU a green context is a context of its own (docs/simulated-gpu.md): a sync
of its CUcontext waits for its work only, and a sync of the primary context does not wait for
it (KREX_SIM_PRIMARY_SYNCS_GREEN=1 models CUDA 13's cuCtxSynchronize, which does). So a
drain that synchronises only the primary context returns with the green context's kernel
still running; the drain helper synchronises the CUcontext each green context converts to
(interpose/drain.c, krex_green_add)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest
from helpers import Child, Harness, victims
from helpers.krex_world import Krex

from krex.native import lib

LONG_US = 600_000  # a 0.6 s kernel (gridDim.x microseconds)

root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: krexd's cgroups")


def _close(h: Harness, owner: int) -> None:
    h.seg.set_daemon(os.getpid(), heartbeat_timeout_s=60)
    h.seg.close_gate(0, owner_slot=owner, holder=lib.KREX_HOLDER_REGION)
    r = h.seg.wait_inflight(0, owner, timeout=10)
    assert r.ok, r


def _green_kernel(h: Harness, child: Child) -> dict[str, Any]:
    """The sibling's kernel on its green context's stream, still running now."""
    for act in ("green", "gk"):
        d = child.expect(lambda d, act=act: d["act"] == act, 30, act)
        assert d["rc"] == 0, d
    (op,) = [o for o in h.ops(child.pid, life=False) if o["api"] == "cuLaunchKernel"]
    assert time.monotonic_ns() < op["end"], (
        "the green kernel ended before the drain: the test would prove nothing"
    )
    return op


def _partial_or_waited(h: Harness, owner: int, pid: int, op: dict[str, Any], what: str) -> None:
    """Drain once: a process whose green kernel `op` no drain synchronised must ack as
    partial, or the drain must return after that kernel ended, never whole before it."""
    _close(h, owner)
    res = h.seg.drain(0, owner, timeout=10)
    t_ret = time.monotonic_ns()
    assert res.ok and res.count == 1, res
    assert res.partial == [pid] or op["end"] <= t_ret, (
        f"the drain acked whole {(op['end'] - t_ret) / 1e6:.0f} ms before {what} ended: {res}"
    )


def test_the_simulated_primary_sync_does_not_wait_for_a_green_contexts_work(harness: Harness) -> None:
    """The model the other tests rely on: without KREX, a device synchronise returns while the
    green context's kernel runs (so the drain's primary sync alone would too)."""
    h = harness
    env = h.env(None, krex=False, preload=False)
    child = h.spawn("actor", ["green", f"gk:{LONG_US}", "sync", "line"], env)
    op = _green_kernel(h, child)
    d = child.expect(lambda d: d["act"] == "sync", 30, "the device synchronise")
    assert d["t1"] < op["end"], "the primary context's sync waited for the green context's kernel"


@pytest.mark.parametrize("no_sync_by_handle", ["0", "1"])
@pytest.mark.parametrize("primary_syncs_green", ["0", "1"])
def test_a_drain_waits_for_a_siblings_green_context_work(
    harness: Harness, primary_syncs_green: str, no_sync_by_handle: str
) -> None:
    """A sibling queues a 0.6 s kernel on a green context's stream; a drain that returns ok
    returns after that kernel ended, by a sync of the green context on the helper thread
    (cuCtxSynchronize_v2 by handle, or a push and cuCtxSynchronize on a driver without it).
    With the primary sync covering green contexts (CUDA 13) it holds as well."""
    h = harness
    owner, sib = h.claim(), h.claim()
    env = h.env(
        sib, KREX_SIM_PRIMARY_SYNCS_GREEN=primary_syncs_green, KREX_SIM_NO_CTX_SYNC_V2=no_sync_by_handle
    )
    child = h.spawn("actor", ["green", f"gk:{LONG_US}", "line"], env)
    op = _green_kernel(h, child)

    _close(h, owner)
    res = h.seg.drain(0, owner, timeout=10)
    t_ret = time.monotonic_ns()

    assert res.ok and res.count == 1 and res.stragglers == [], res
    assert res.partial == [], res
    assert op["end"] <= t_ret, (
        f"the drain returned {(op['end'] - t_ret) / 1e6:.1f} ms before the sibling's green kernel ended"
    )
    syncs = [e for e in h.events() if e.get("ev") == "sync" and e["pid"] == child.pid]
    assert any(e["until"] >= op["end"] and e["t"] <= t_ret for e in syncs), (
        f"no synchronisation by the sibling's helper covering its green kernel: {syncs}"
    )
    assert all(e["tid"] != op["tid"] for e in syncs), "the drain ran on the app thread, not the helper"
    green = {e["api"] for e in syncs if e["green"]}
    want = "cuCtxSynchronize" if no_sync_by_handle == "1" else "cuCtxSynchronize_v2"
    assert primary_syncs_green == "1" or green == {want}, f"the green context was synced by {green}"


def test_a_green_context_the_helper_cannot_make_current_makes_the_drain_partial(harness: Harness) -> None:
    """On a driver without cuCtxSynchronize_v2 the helper pushes each green context to
    synchronise it; a live one current on another thread cannot be pushed (cuda.h: current to
    one thread at a time). Its kernel may still run: the drain acks as partial, never whole."""
    h = harness
    owner, sib = h.claim(), h.claim()
    env = h.env(sib, KREX_SIM_NO_CTX_SYNC_V2="1", KREX_SIM_GREEN_PUSH_FAILS="1")
    child = h.spawn("actor", ["green", f"gk:{LONG_US}", "line"], env)
    op = _green_kernel(h, child)
    _partial_or_waited(h, owner, child.pid, op, "the green kernel it could not synchronise")


def test_a_destroyed_green_context_is_no_longer_synchronised(harness: Harness) -> None:
    """Once destroyed, its CUcontext leaves the helper's contexts: later drains push no
    context that is gone (a failed push would leave the process never drained again)."""
    h = harness
    owner, sib = h.claim(), h.claim()
    child = h.spawn("actor", ["green", "gk:5", "greendel", "k:5", "line"], h.env(sib))
    for act in ("green", "gk", "greendel", "k"):
        d = child.expect(lambda d, act=act: d["act"] == act, 30, act)
        assert d["rc"] == 0, d
    _close(h, owner)
    res = h.seg.drain(0, owner, timeout=10)
    assert res.ok and res.count == 1 and res.partial == [], res
    green_syncs = [
        e for e in h.events() if e.get("ev") == "sync" and e["pid"] == child.pid and e.get("green")
    ]
    assert green_syncs == [], green_syncs
    rec = h.proc(child.pid)
    assert rec is not None and rec.quiet, (
        f"the drain did not count as full (a context it could not push?): {rec}"
    )


def test_green_contexts_beyond_the_table_flag_the_drain_as_partial(harness: Harness) -> None:
    """One more green context than the helper can hold: its work would go unsynchronised, so
    the drain acks as partial (krexd marks the region contaminated), never as clean."""
    h = harness
    owner, sib = h.claim(), h.claim()
    child = h.spawn("actor", ["green:33", f"gk:{LONG_US}", "line"], h.env(sib))
    op = _green_kernel(h, child)
    _close(h, owner)
    res = h.seg.drain(0, owner, timeout=10)
    assert res.ok and res.count == 1, res
    assert res.partial == [child.pid], (
        f"a drain that could not synchronise a green context was not flagged: {res} "
        f"(kernel ends {(op['end'] - time.monotonic_ns()) / 1e6:.0f} ms from now)"
    )
    rec = h.proc(child.pid)
    assert rec is not None and "drain-partial" in rec.flags and not rec.quiet, rec


@root
def test_no_sibling_green_context_work_runs_inside_a_clean_region(kx: Krex) -> None:
    """End to end, under krexd: a sibling command's 3 s kernel on a green context's stream is
    running as another command enters a region; on the simulated GPU's timeline no op of the
    sibling overlaps the region, unless the region is marked contaminated."""
    kx.start_daemon(slots=3, env_extra={"KREX_DRAIN_TIMEOUT": "30"})
    actor = str(victims()["actor"])
    kx.run_argv("sib", [actor, "green", "gk:3000000", "sleep:8000"])
    (gk,) = kx.wait(
        lambda: [o for o in kx.ops(life=False) if o["api"] == "cuLaunchKernel"], 60, "the green kernel"
    )
    # No GPU work before its region: it would queue behind the kernel (one op at a time).
    kx.run_argv("owner", [actor, "begin", "k:1", "sync", "end"])
    assert kx.cmds["owner"].popen.wait(60) == 0, kx.cmds["owner"].output()[-1500:]
    lines = [ln for ln in kx.cmds["owner"].output().splitlines() if ln.startswith("{")]
    begin = next(d for d in map(json.loads, lines) if d["act"] == "begin")
    assert begin["t0"] < gk["end"], "the green kernel ended before the region's entry: it would prove nothing"
    (rec,) = [r for r in kx.journal() if "t_grant_ns" in r]
    inside = gk["start"] < rec["t_end_ns"] and gk["end"] > rec["t_grant_ns"]
    assert not inside or rec["contaminated"], (
        f"the sibling's green-context kernel [{gk['start']}, {gk['end']}] ran inside the clean region "
        f"[{rec['t_grant_ns']}, {rec['t_end_ns']}]"
    )
    assert not rec["contaminated"], rec["reasons"]  # waited for, not merely flagged
    assert gk["end"] <= rec["t_grant_ns"], rec


# The count of contexts no table holds (g_ctx_overflow): once a context did not fit, the
# process's drains ack as partial for good. No destroy call takes it down: a destroy cannot
# tell which context it ends (a handle no green context has, a double destroy, one that
# fails), and one taken off wrongly would leave a live context's work read as drained.


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
    _partial_or_waited(h, owner, child.pid, op, "the kernel of a green context it never synchronised")


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
