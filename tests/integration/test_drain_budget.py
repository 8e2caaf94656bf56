"""The drain budget and early shrinking (interpose/pace.c, shim.c, krex/node/pending.py):
what siblings leave queued when a region's gate closes, measured in simulated-GPU time from
the simulator's trace (the work they had submitted before the close that was still to run
after it), never by wall-clock deadlines. Each test runs the case without the mechanism
beside the one with it, so the bound it asserts is the mechanism's, not the simulator's."""

from __future__ import annotations

import collections
import os
import signal
import statistics
import sys
import time
from typing import Any

import pytest
from helpers import Harness, read_jsonl, victims
from helpers.krex_world import Krex

from krex.native import ffi, lib

root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: krexd's cgroups")

KERNEL_US = 300
BUDGET_MS = lib.KREX_DRAIN_BUDGET_MS


def _close_ns(rec: dict[str, Any]) -> int:
    """When a region's gate closed: its grant less the entry steps after the gate's CAS."""
    return int(rec["t_grant_ns"] - (rec["entry_s"] - rec["block_s"]) * 1e9)


def _left_at_close(kx: Krex, recs: list[dict[str, Any]]) -> list[float]:
    """For each region, the ms of other commands' kernels submitted before its gate closed
    that still ran after it (0: none): what its drain had to wait for."""
    ops = [e for e in read_jsonl(kx.trace) if e.get("ev") == "op" and e["cls"] == lib.KREX_CLS_KERNEL]
    out = []
    for r in recs:
        c = _close_ns(r)
        ends = [o["end"] for o in ops if o["submit"] < c and o["slot"] != r["owner_slot"]]
        out.append(max(0.0, (max(ends, default=c) - c) / 1e6))
    return out


def _hammers(kx: Krex, n: int, us: int = KERNEL_US, hold_ms: int = 0) -> None:
    """n siblings launching `us` kernels back to back; with `hold_ms`, each waits that long
    after its first kernel, so that none starts its stream while alone on the GPU (a command
    alone is not paced: it could queue all its kernels before the next one arrives)."""
    actor = str(victims()["actor"])
    hold = [f"sleep:{hold_ms}"] if hold_ms else []
    for i in range(n):
        kx.run_argv(f"hammer{i}", [actor, "k:1", "sync", *hold, f"kn:1000000:{us}"])
    kx.wait(lambda: len(kx.status()["slots"]) == n, 60, "the hammers' slots")
    kx.wait(lambda: sum(1 for p in kx.snapshot().procs if p.has_ctx) >= n, 60, "the hammers' first kernels")
    time.sleep(0.5)  # past their first pacing checks


def _regions(kx: Krex, owners: dict[str, list[str]], timeout: float = 120) -> list[dict[str, Any]]:
    """Run each owner (actor ACTIONS under krex run), wait for them, return their regions."""
    actor = str(victims()["actor"])
    for name, actions in owners.items():
        kx.run_argv(name, [actor, "k:1", "sync", *actions])
    for name in owners:
        rc = kx.cmds[name].popen.wait(timeout)
        assert rc == 0, kx.cmds[name].output()[-1500:]
    slots = {int(r["owner_slot"]) for r in kx.journal()}
    assert slots, "no region was journalled"
    return [r for r in kx.journal() if "t_grant_ns" in r]


@root
@pytest.mark.parametrize("budget_ms", [str(BUDGET_MS), "0"])
def test_the_budget_bounds_what_all_hammering_siblings_leave_for_a_drain(kx: Krex, budget_ms: str) -> None:
    """Six siblings launch 0.3 ms kernels back to back. With krexd's drain budget (default),
    what they leave queued at a region's gate close stays near the budget plus at most a
    kernel each (their floor); with a cap per command instead (budget 0, the 15 ms
    KREX_QUEUE_CAP_MS), each keeps up to a cap's worth and more, and the drain grows with
    their number."""
    n = 6
    kx.start_daemon(slots=n + 2, env_extra={"KREX_DRAIN_BUDGET_MS": budget_ms, "KREX_EARLY_SHRINK": "off"})
    _hammers(kx, n)
    recs = _regions(kx, {"owner": ["sleep:100", "begin", "end"] * 14})
    left = _left_at_close(kx, recs)[2:]  # the first two: the hammers may still be cold
    med = statistics.median(left)
    # Slack: the simulated device and the siblings share this machine's CPUs; on a loaded
    # machine (a whole test run on 2 cores) the medians reached 9.8 ms. A cap per command
    # leaves several times that (40 ms here), which the bound stays well below.
    bound = BUDGET_MS + n * KERNEL_US / 1e3 + 8.0
    if budget_ms == "0":
        assert med > bound, f"a cap per command left only {med:.1f} ms at the close: the test proves nothing"
    else:
        assert med <= bound, (
            f"with a {budget_ms} ms budget, {n} siblings left a median {med:.1f} ms of work at the gate's "
            f"close (bound {bound:.1f} ms): {[round(x, 1) for x in left]}"
        )
    assert not any("drain-timeout" in r.get("flags", []) for r in recs)


LONG_US = 3000  # each kernel longer than a sibling's share of the budget: they are on the floor


@root
@pytest.mark.parametrize("tokens", [str(lib.KREX_PACE_TOKENS), "0"])
def test_long_work_takes_turns_so_a_drain_does_not_grow_with_the_siblings(kx: Krex, tokens: str) -> None:
    """Six siblings launch 3 ms kernels, each longer than its share of the 4 ms budget, so
    each keeps one at a time in flight (the floor). Taking turns (default), at most
    `pace_tokens` of those are queued on the GPU at once, and a region's gate closes on about
    that many kernels; without turns (0) it closes on about one per sibling, six."""
    n, k = 6, int(tokens)
    kx.start_daemon(slots=n + 2, env_extra={"KREX_PACE_TOKENS": tokens, "KREX_EARLY_SHRINK": "off"})
    _hammers(kx, n, LONG_US, hold_ms=2000)
    time.sleep(2.5)  # past their hold: all of them launching
    recs = _regions(kx, {"owner": ["sleep:100", "begin", "end"] * 12})
    left = _left_at_close(kx, recs)[2:]
    med = statistics.median(left)
    # The turns' bound: `k` kernels, plus slack for leases lapsing on a loaded machine (a
    # holder's renewal comes from a CPU the simulator shares).
    bound = k * LONG_US / 1e3 + LONG_US / 1e3 + 1.0
    if k == 0:
        assert med > (n - 1) * LONG_US / 1e3 - 2.0, (
            f"without turns only {med:.1f} ms were left at the close: the test proves nothing ({left})"
        )
    else:
        assert med <= bound, (
            f"with {k} turns, {n} siblings of {LONG_US} us kernels left a median {med:.1f} ms at the "
            f"gate's close (bound {bound:.1f} ms): {[round(x, 1) for x in left]}"
        )
        assert not any("drain-timeout" in r.get("flags", []) for r in recs)
    print(f"turns {k}: left at close median {med:.1f} ms, {[round(x, 1) for x in left]}; "
          f"flags {[r.get('flags') for r in recs if r.get('flags')]}")
    # Taking turns starves no sibling and leaves the GPU no idler: between the first and the
    # last region, every sibling ran kernels, the fewest at least a fifth of the most, and
    # siblings' kernels kept the simulated GPU busy (regions and their entries aside).
    ops = [e for e in read_jsonl(kx.trace) if e.get("ev") == "op" and e["cls"] == lib.KREX_CLS_KERNEL]
    t0, t1 = _close_ns(recs[2]), _close_ns(recs[-1])
    mine = [o for o in ops if t0 <= o["end"] <= t1 and o["slot"] != recs[0]["owner_slot"]]
    per = collections.Counter(o["slot"] for o in mine)
    busy = len(mine) * LONG_US * 1e3 / (t1 - t0)
    print(f"turns {k}: kernels per sibling {sorted(per.values())}, siblings' kernels {busy:.0%} of the time")
    fair = len(per) == n and min(per.values()) * 5 >= max(per.values())
    assert fair, f"kernels per sibling slot: {dict(per)}"
    assert busy >= 0.6, f"siblings' kernels ran only {busy:.0%} of the time between the regions"


@root
@pytest.mark.parametrize("early", ["on", "off"])
def test_a_region_queued_behind_another_closes_on_empty_sibling_queues(kx: Krex, early: str) -> None:
    """Two commands take regions in turn, so each often waits behind the other's. Siblings
    parked at the first gate are held through its hand-over to the queued one (early
    shrinking on), so the queued region's drain waits for nothing; without it they submit
    while krexd passes from one region to the next, and the next region drains that."""
    # `gpu`: no gateable sibling is frozen, so each owner's BEGIN arrives during the other's region.
    env = {"KREX_DRAIN_BUDGET_MS": "0", "KREX_EARLY_SHRINK": early, "KREX_FREEZE_POLICY": "gpu"}
    kx.start_daemon(slots=8, env_extra=env)
    _hammers(kx, 3)
    loop = ["begin", "sleep:40", "end", "sleep:3"] * 12
    recs = _regions(kx, {"a": loop, "b": loop})
    queued = [r for r in recs if r["queue_wait_s"] >= 0.005]
    assert len(queued) >= 5, f"too few regions queued behind another: {[r['queue_wait_s'] for r in recs]}"
    left = _left_at_close(kx, queued)
    if early == "off":
        med = statistics.median(left)
        assert med > 2.0, f"without early shrinking a median {med:.2f} ms was left: the test proves nothing"
    else:
        assert max(left) <= KERNEL_US / 1e3, (
            f"queued regions' gates closed on up to {max(left):.2f} ms of siblings' work: {left}"
        )
        held = sum(p.held for p in kx.snapshot().procs)
        assert held > 0, "no sibling call was held for a queued region"


def _kernels_per_s(h: Harness, pid: int, secs: float) -> float:
    """Kernels process `pid` submitted per second over the next `secs` (the trace)."""
    t0 = time.monotonic_ns()
    time.sleep(secs)
    t1 = time.monotonic_ns()
    ops = [e for e in read_jsonl(h.trace_path) if e.get("ev") == "op" and e["cls"] == lib.KREX_CLS_KERNEL]
    return sum(1 for o in ops if o["pid"] == pid and t0 <= o["submit"] <= t1) / secs


@root
@pytest.mark.parametrize("tokens", [str(lib.KREX_PACE_TOKENS), "0"])
def test_long_work_parked_at_a_gate_takes_turns_when_it_opens(kx: Krex, tokens: str) -> None:
    """Regions of 30 ms follow each other 5 ms apart, so the six long-kernel siblings spend
    most of their time parked at a closed gate. When it opens, a sibling on the floor takes
    a turn before its parked kernel goes on, so the next region, 5 ms later, closes on about
    the turns' worth of kernels; without turns every parked sibling submits at once and the
    next region drains one kernel of each."""
    n, k = 6, int(tokens)
    kx.start_daemon(slots=n + 2, env_extra={"KREX_PACE_TOKENS": tokens, "KREX_EARLY_SHRINK": "off"})
    _hammers(kx, n, LONG_US, hold_ms=2000)
    time.sleep(2.5)
    recs = _regions(kx, {"owner": ["sleep:5", "begin", "sleep:30", "end"] * 16})
    left = _left_at_close(kx, recs)[3:]
    med = statistics.median(left)
    shown = [round(x, 1) for x in left]
    print(f"turns {k}, regions back to back: left at close median {med:.1f} ms, {shown}")
    if k == 0:
        assert med > (n - 2) * LONG_US / 1e3, f"without turns only {med:.1f} ms were left: proves nothing"
    else:
        bound = (k + 1) * LONG_US / 1e3 + 1.0
        assert med <= bound, f"{k} turns: a median {med:.1f} ms left at a close (bound {bound:.1f}): {shown}"


def _host_gap_run(h: Harness, tokens: int, kernel_us: int, host_ms: int) -> tuple[int, float]:
    """Three siblings that launch a `kernel_us` kernel, then do `host_ms` of host work, in a
    loop, for 1.5 s under `tokens` turns: (their long kernels, the share launched while
    KREX_PACE_TOKENS other siblings' were queued: more long kernels at once than turns allow)."""
    g = h.seg.raw.gpus[0]
    g.budget_us, g.pace_tokens = BUDGET_MS * 1000, tokens
    kids = []
    for _ in range(3):
        steps = [f"k:{kernel_us}", f"sleep:{host_ms}"] * 400
        c = h.spawn("actor", ["k:1", "sync", *steps, "line"], h.env(h.claim()))
        c.expect(lambda d: d["act"] == "sync", 30, "registration")
        kids.append(c)
    time.sleep(0.5)
    t0 = time.monotonic_ns()
    time.sleep(1.5)
    t1 = time.monotonic_ns()
    for c in kids:
        c.kill_group()
    pids = {c.pid for c in kids}
    ops = [e for e in read_jsonl(h.trace_path) if e.get("ev") == "op" and e["cls"] == lib.KREX_CLS_KERNEL
           and e["pid"] in pids and e["end"] - e["submit"] > 1_000_000 and t0 <= e["submit"] <= t1]
    queued = [
        sum(1 for p in ops if p["pid"] != o["pid"] and p["submit"] < o["submit"] < p["end"]) for o in ops
    ]
    crowded = sum(1 for q in queued if q >= lib.KREX_PACE_TOKENS)
    return len(ops), crowded / max(1, len(ops))


@pytest.mark.parametrize(("kernel_us", "host_ms"), [(2 * LONG_US, 3), (LONG_US, 4)])
def test_turns_bound_siblings_with_host_work_between_launches_at_little_cost(
    harness: Harness, kernel_us: int, host_ms: int
) -> None:
    """A turn's lease covers its holder's next interval, so a holder doing host work before
    it launches keeps its turn through host work shorter than its kernel and lets it lapse
    through longer. Three siblings alternating 6 ms kernels and 3 ms of host work thus have at
    most two long kernels queued at a time with the default two turns, where without turns
    nearly every launch finds both other siblings' queued (a fixed 2 ms lease lapsed during
    the host work: two thirds of the launches were crowded with turns too); with 3 ms kernels
    and 4 ms of host work (never three queued, turns or not) nobody keeps a turn idle through
    the host work (a fixed 10 ms lease cost them 18% of their kernels). Either way the
    siblings get through about as many kernels as without turns."""
    h = harness
    h.seg.set_daemon(os.getpid(), heartbeat_timeout_s=60)
    n0, crowded0 = _host_gap_run(h, 0, kernel_us, host_ms)
    n2, crowded2 = _host_gap_run(h, int(lib.KREX_PACE_TOKENS), kernel_us, host_ms)
    print(f"{kernel_us} us kernels, {host_ms} ms host work between launches: {n0} kernels without turns "
          f"({crowded0:.0%} crowded), {n2} with {lib.KREX_PACE_TOKENS} turns ({crowded2:.0%} crowded)")
    # The simulated GPU runs 1.5 s of them (250 or 500); the two CPUs the siblings share slow them.
    assert n0 >= 0.6 * 1.5e6 / kernel_us, f"only {n0} long kernels in 1.5 s without turns"
    assert n2 >= 0.9 * n0, f"with turns the siblings ran {n2} kernels against {n0} without"
    if kernel_us > host_ms * 1000:
        assert crowded0 >= 0.6, f"without turns only {crowded0:.0%} of launches were crowded: proves nothing"
        assert crowded2 <= 0.2, f"with turns {crowded2:.0%} of launches were crowded (without {crowded0:.0%})"


@pytest.mark.parametrize("holder", ["stopped", "stray"])
def test_a_turn_nobody_renews_never_holds_long_work_back(harness: Harness, holder: str) -> None:
    """Long work takes one turn here (pace_tokens 1). A holder stopped with SIGSTOP (as a
    frozen or dead one) stops renewing its lease, and a word no holder could have written
    (a lease days ahead) is not a lease: either way the other command keeps launching its
    3 ms kernels at the simulated GPU's pace, instead of waiting KREX_TURN_WAIT_MS each."""
    h = harness
    h.seg.set_daemon(os.getpid(), heartbeat_timeout_s=60)
    g = h.seg.raw.gpus[0]
    g.budget_us, g.pace_tokens = BUDGET_MS * 1000, 1
    a, b = h.claim(), h.claim()
    kn = f"kn:100000:{LONG_US}"
    cb = h.spawn("actor", ["k:1", "sync", kn, "line"], h.env(b))
    cb.expect(lambda d: d["act"] == "sync", 30, "registration")
    if holder == "stopped":
        ca = h.spawn("actor", ["k:1", "sync", kn, "line"], h.env(a))
        ca.expect(lambda d: d["act"] == "sync", 30, "registration")
        time.sleep(0.5)
        shared = _kernels_per_s(h, cb.pid, 1.0)
        os.kill(ca.pid, signal.SIGSTOP)
    else:
        shared = float("nan")
        now_us = time.monotonic_ns() // 1000
        g.turns[0] = (1 << 40) | ((now_us + 10**10) & ((1 << 40) - 1))
    try:
        time.sleep(0.1)
        rate = _kernels_per_s(h, cb.pid, 1.0)
    finally:
        if holder == "stopped":
            os.kill(ca.pid, signal.SIGCONT)
    # Waiting out KREX_TURN_WAIT_MS per kernel would allow 5 a second; the device allows 333.
    assert rate >= 100, f"{rate:.0f} kernels/s with the {holder} turn (sharing the turn: {shared:.0f}/s)"


def _pending(h: Harness, word: str, slot: int) -> None:
    setattr(h.seg.raw.gpus[0], word, 1 << slot)


@pytest.mark.parametrize("word", ["pending_slots", "soon_slots"])
def test_a_life_call_waits_while_another_commands_region_is_about_to_begin(
    harness: Harness, word: str
) -> None:
    """A sibling's cudaMalloc begun while another command's region is queued (or announced)
    waits, as at a closed gate: when that gate closes it parks there, and it reaches the
    GPU only after the region. Without the word it runs at once."""
    h = harness
    h.seg.set_daemon(os.getpid(), heartbeat_timeout_s=60)
    owner, sib = h.claim(), h.claim()
    c = h.spawn("actor", ["k:1", "sync", "line", "malloc", "line", "malloc", "line"], h.env(sib))
    c.expect(lambda d: d["act"] == "sync", 30, "registration")

    c.send()  # no region about to begin: at once
    m = c.expect(lambda d: d["act"] == "malloc", 10, "the first malloc")
    assert m["rc"] == 0 and (m["t1"] - m["t0"]) / 1e9 < 0.04, m

    _pending(h, word, owner)
    c.send()
    time.sleep(0.02)  # the malloc is waiting now
    h.seg.close_gate(0, owner_slot=owner, holder=lib.KREX_HOLDER_REGION)  # the region's gate
    h.seg.raw.gpus[0].pending_slots = h.seg.raw.gpus[0].soon_slots = 0  # as krexd does once it closed
    assert h.seg.wait_inflight(0, owner, timeout=5).ok
    time.sleep(0.2)
    t_open = time.monotonic_ns()
    h.seg.open_gate(0)
    m = c.expect(lambda d: d["act"] == "malloc", 10, "the second malloc")
    assert m["rc"] == 0, m
    mallocs = [o for o in h.ops(c.pid) if o["api"] == "cudaMalloc"]
    assert mallocs[-1]["submit"] >= t_open, (
        f"the malloc reached the GPU {(t_open - mallocs[-1]['submit']) / 1e6:.1f} ms before the region's "
        "gate opened"
    )
    p = h.proc(c.pid)
    assert p is not None and p.held >= 1, p


def test_a_wait_for_a_region_about_to_begin_is_bounded(harness: Harness) -> None:
    """A pending word nobody clears (krexd hung with a fresh heartbeat, or a bug) slows a
    sibling's LIFE call by KREX_PENDING_HOLD_MS, never stops it."""
    h = harness
    h.seg.set_daemon(os.getpid(), heartbeat_timeout_s=60)
    owner, sib = h.claim(), h.claim()
    _pending(h, "pending_slots", owner)
    c = h.spawn("actor", ["k:1", "sync", "malloc", "malloc", "line"], h.env(sib))
    ms = [c.expect(lambda d: d["act"] == "malloc", 10, "a malloc") for _ in range(2)]
    hold_s = lib.KREX_PENDING_HOLD_MS / 1e3
    for m in ms:
        assert hold_s * 0.9 <= (m["t1"] - m["t0"]) / 1e9 <= hold_s + 0.5, m


def test_a_pacing_check_waits_for_a_queued_regions_gate(harness: Harness) -> None:
    """A sibling that keeps launching while another command's region is queued stops at its
    next pacing check, with nothing of its own left queued, until that gate closes: the
    gate then closes on an empty queue."""
    h = harness
    h.seg.set_daemon(os.getpid(), heartbeat_timeout_s=60)
    h.seg.raw.gpus[0].budget_us = BUDGET_MS * 1000
    owner, sib = h.claim(), h.claim()
    c = h.spawn("actor", ["k:1", "sync", f"kn:100000:{KERNEL_US}", "line"], h.env(sib))
    c.expect(lambda d: d["act"] == "sync", 30, "registration")
    time.sleep(0.3)
    _pending(h, "pending_slots", owner)
    time.sleep(0.03)  # within the hold: the sibling waits at its check
    t_close = time.monotonic_ns()
    h.seg.close_gate(0, owner_slot=owner, holder=lib.KREX_HOLDER_REGION)
    h.seg.raw.gpus[0].pending_slots = 0
    assert h.seg.wait_inflight(0, owner, timeout=5).ok
    ends = [o["end"] for o in h.ops(c.pid, life=False) if o["submit"] < t_close]
    left_ms = max(0, max(ends) - t_close) / 1e6
    assert left_ms <= KERNEL_US / 1e3, f"{left_ms:.2f} ms of the sibling's work was queued at the close"
    h.seg.open_gate(0)


@root
def test_soon_marks_the_slot_until_the_hint_lapses(kx: Krex) -> None:
    """krex.proc.region.soon() (an automatic region's target entered) sets its command's bit
    in the GPU's soon_slots; krexd clears it KREX_SOON_MS later."""
    kx.start_daemon(slots=4)
    code = (
        "import os, sys, time, krex.proc.region as r\n"
        "from krex.node.shm import Segment\n"
        "slot = int(os.environ['KREX_SLOT'])\n"
        "with Segment.attach(os.environ['KREX_SHM']) as s:\n"
        "    ok = r.soon(); t0 = time.monotonic()\n"
        "    bit = lambda: int(s.raw.gpus[0].soon_slots) >> slot & 1\n"
        "    was = bit()\n"
        "    while bit() and time.monotonic() - t0 < 5: time.sleep(0.005)\n"
        "    print('SOON', ok, was, round(time.monotonic() - t0, 3), flush=True)\n"
    )
    kx.run_argv("hint", [sys.executable, "-c", code])
    assert kx.cmds["hint"].popen.wait(60) == 0, kx.cmds["hint"].output()
    words = kx.cmds["hint"].output().split("SOON ")[-1].split()
    assert words[:2] == ["True", "1"], kx.cmds["hint"].output()
    lapse_s = float(words[2])
    assert lib.KREX_SOON_MS / 1e3 * 0.9 <= lapse_s <= lib.KREX_SOON_MS / 1e3 + 0.5, lapse_s


def test_a_sized_free_settles_for_its_size_and_any_other_for_the_fixed_time(harness: Harness) -> None:
    """The driver clears freed memory on its own copy-engine channel after the free returns,
    at ~2.5 ms/GB on the H200 (docs/results/free-settle/). A cudaFree of an allocation's base
    is stamped with the time its size takes (KREX_SETTLE_NS_PER_GB, at least
    KREX_SETTLE_MIN_NS); a free the shim cannot size (stream-ordered) keeps
    KREX_FREE_SETTLE_NS."""
    h = harness
    owner = h.claim()
    gib = 1 << 30
    cases = {
        "free": (4 * gib, 4 * lib.KREX_SETTLE_NS_PER_GB),
        "freeasync": (4 * gib, lib.KREX_FREE_SETTLE_NS),
    }
    for act, (size, want_ns) in cases.items():
        sib = h.claim()
        c = h.spawn("actor", ["k:1", "sync", f"malloc:{size}", act, "line"], h.env(sib))
        d = c.expect(lambda d, act=act: d["act"] == act, 10, act)
        assert d["rc"] == 0, d
        latest = ffi.new("uint64_t *")
        gen = int(h.seg.raw.slots[owner].generation)
        until = int(lib.krex_settle_until(h.seg.raw, 0, owner, gen, 0, latest))
        got = until - int(latest[0])
        assert abs(got - want_ns) <= 2_000_000, (
            f"{act}: settles {got / 1e6:.1f} ms after its stamp, not {want_ns / 1e6:.1f}"
        )
        assert int(latest[0]) >= d["t0"], d
        h.seg.raw.gpus[0].slot_free_ns[sib] = 0  # the next case alone
        h.seg.raw.gpus[0].slot_free_until_ns[sib] = 0


@root
@pytest.mark.parametrize("act", ["free", "freeasync"])
def test_a_region_after_a_small_sized_free_waits_its_size_not_the_fixed_settle(kx: Krex, act: str) -> None:
    """A sibling frees 256 MiB just before a region's BEGIN: the grant waits the few ms that
    size takes to clear (cudaFree), or the fixed KREX_FREE_SETTLE_NS when the shim cannot
    size the free (cudaFreeAsync); flagged neither way."""
    kx.start_daemon(slots=4)
    actor = str(victims()["actor"])
    from helpers import Child

    env = kx.env()
    krex_run = [sys.executable, "-m", "krex.cli.main", "run", "--device", "sim", "--"]
    sib = Child([*krex_run, actor, "k:1", "sync", f"malloc:{256 << 20}", "line", act, "line"], env)
    own = Child([*krex_run, actor, "k:1", "sync", "line", "begin", "end", "line"], env)
    try:
        sib.expect(lambda d: d["act"] == "malloc", 60, "the sibling's malloc")
        own.expect(lambda d: d["act"] == "sync", 60, "the owner's start")
        sib.send()
        sib.expect(lambda d: d["act"] == act, 10, "the free")
        own.send()
        own.expect(lambda d: d["act"] == "end", 30, "the region")
        rec = kx.journal()[-1]
        if act == "free":
            assert rec["settle_s"] <= 0.03, f"a 256 MiB cudaFree made the grant wait {rec['settle_s']:.3f} s"
        else:
            assert rec["settle_s"] >= 0.03, f"an unsized free was waited out only {rec['settle_s']:.3f} s"
        assert "recent-free" not in rec["flags"], rec
    finally:
        for c in (sib, own):
            c.close_stdin()
            c.wait(30)
