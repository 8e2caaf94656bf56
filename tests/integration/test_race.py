"""I1 under load: 3 processes x 4 threads launch 5-us simulated kernels through
three entry paths (cudaLaunchKernel via the PLT, cuLaunchKernel via dlsym,
cuLaunchKernelEx via cuGetProcAddress) while the test closes and opens the gate
thousands of times, as the daemon's region protocol does (close, wait for
in-flight, hold, open). From the trace: no non-owner op may be submitted inside
any [t_closed, t_open] window. A control run without the shim shows that the
same check does catch violations."""

from __future__ import annotations

import bisect
import time
from collections import Counter
from typing import Any

from helpers import Child, Harness

from krex.native import lib

PROCS = 3
THREADS = 4
KERNEL_US = 5
PAUSE_US = 200
CYCLES = 2000
HOLD_NS = 200_000
GAP_NS = 300_000
APIS = {"cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"}


def _spin_until(t: int) -> None:
    while time.monotonic_ns() < t:
        pass


def _start_hammers(h: Harness, shim: bool) -> list[Child]:
    kids = []
    for _ in range(PROCS):
        slot = h.claim()
        kids.append(
            h.spawn(
                "hammer",
                ["60", str(THREADS), str(KERNEL_US), str(PAUSE_US)],
                h.env(slot, krex=shim, preload=shim),
            )
        )
    for k in kids:
        k.expect(lambda d: "ready" in d, 30, "hammer ready")
    return kids


def _toggle(h: Harness, owner: int, cycles: int) -> list[tuple[int, int]]:
    seg = h.seg
    intervals = []
    for _ in range(cycles):
        seg.heartbeat()
        seg.close_gate(0, owner_slot=owner, holder=lib.KREX_HOLDER_REGION)
        r = seg.wait_inflight(0, owner, timeout=10)
        assert r.ok, f"in-flight never drained: {r}"
        t_closed = time.monotonic_ns()
        _spin_until(t_closed + HOLD_NS)
        t_open = time.monotonic_ns()
        seg.open_gate(0)
        intervals.append((t_closed, t_open))
        _spin_until(t_open + GAP_NS)
    return intervals


def _wait_for_ops_after(h: Harness, t: int, pids: set[int]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if pids <= {o["pid"] for o in h.ops(life=False) if o["submit"] > t}:
            return
        time.sleep(0.05)


def _stop(kids: list[Child]) -> list[dict[str, Any]]:
    for k in kids:
        k.close_stdin()
    out = []
    for k in kids:
        assert k.wait(30) == 0, k.stderr
        out.append(k.lines[-1])
    return out


def _violations(
    ops: list[dict[str, Any]], intervals: list[tuple[int, int]]
) -> list[tuple[dict[str, Any], int]]:
    starts = [a for a, _ in intervals]
    bad = []
    for o in ops:
        i = bisect.bisect_right(starts, o["submit"]) - 1
        if i >= 0 and o["submit"] <= intervals[i][1]:
            bad.append((o, i))
    return bad


def _run(h: Harness, shim: bool, cycles: int) -> dict[str, Any]:
    owner = h.claim()  # the region owner: this test, which submits nothing
    h.seg.set_daemon(0, heartbeat_timeout_s=60)
    kids = _start_hammers(h, shim)
    pids = {k.pid for k in kids}
    time.sleep(0.1)  # some ops before the first close
    intervals = _toggle(h, owner, cycles)
    _wait_for_ops_after(h, intervals[-1][1], pids)
    results = _stop(kids)
    ops = [o for o in h.ops(life=False) if o["pid"] in pids]
    return {
        "owner": owner,
        "kids": kids,
        "pids": pids,
        "intervals": intervals,
        "ops": ops,
        "results": results,
    }


def test_no_submission_inside_closed_windows(harness: Harness) -> None:
    r = _run(harness, shim=True, cycles=CYCLES)
    ops, intervals, pids = r["ops"], r["intervals"], r["pids"]
    assert all(o["slot"] != r["owner"] for o in ops)

    bad = _violations(ops, intervals)
    assert not bad, f"{len(bad)} ops submitted while the gate was closed, e.g. " + "; ".join(
        f"pid {o['pid']} {o['api']} submit {o['submit']} in window {i} {intervals[i]}" for o, i in bad[:5]
    )

    # The check must have had something to catch.
    assert len(intervals) == CYCLES
    first, last = intervals[0][0], intervals[-1][1]
    before = [o for o in ops if o["submit"] < first]
    after = [o for o in ops if o["submit"] > last]
    assert before and after, f"ops before the first close: {len(before)}, after the last open: {len(after)}"
    gap_starts = [b for _, b in intervals]
    busy_gaps = {
        bisect.bisect_right(gap_starts, o["submit"]) - 1 for o in ops if first <= o["submit"] <= last
    }
    assert len(busy_gaps) >= CYCLES // 10, f"only {len(busy_gaps)} of {CYCLES} open gaps saw a submission"

    # Every process was stopped by the gate at some point, and used all three paths.
    snap = {p.pid: p for p in harness.seg.snapshot().procs}
    for pid in pids:
        assert snap[pid].blocked > 0, f"pid {pid} never waited at the gate in {CYCLES} closures"
        assert snap[pid].fail_opens == 0 and "failed-open" not in snap[pid].flags
        assert {o["api"] for o in ops if o["pid"] == pid} == APIS
    # Each launch reached the device exactly once, with no error.
    per_pid = Counter(o["pid"] for o in ops)
    for res in r["results"]:
        assert res["errors"] == 0
        assert sum(res["launches"]) == per_pid[res["pid"]], res


def test_control_without_shim_is_caught(harness: Harness) -> None:
    """The same load and check without LD_PRELOAD: the checker must report
    violations, or the test above proves nothing."""
    r = _run(harness, shim=False, cycles=300)
    bad = _violations(r["ops"], r["intervals"])
    assert len(bad) > 10, f"only {len(bad)} violations without the shim: the race check is blind"
