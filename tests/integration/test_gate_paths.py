"""Every gated entry point, through every path that reaches it, against the
gate (invariant I1 for each hook), generated from `table_driver list` so that a
new table row cannot stay untested.

One driver process per scenario runs all (entry, path) calls; per-(entry, path)
tests then look at that one run:
  open   the call reaches the simulated GPU with its exact arguments and return code
  closed the gate is closed by another slot: every call (one thread each) blocks,
         nothing reaches the GPU, and all resume after the open
  owner  the gate is closed with the caller's slot as owner: nothing blocks
"""

from __future__ import annotations

import bisect
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import pytest
from helpers import ALL_PATHS, Harness, driver_list, wait_until

from krex.native import lib
from krex.node.shm import CLASS_NAMES

LIST = driver_list()
KEYS = [(d["name"], d["path"]) for d in LIST]
IDS = [f"{n}@{p}" for n, p in KEYS]
SIM_RC = 7
PATHS = ",".join(ALL_PATHS)


@dataclass
class Scenario:
    pid: int = 0
    calls: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    ops: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    problems: dict[tuple[str, str], list[str]] = field(default_factory=lambda: defaultdict(list))
    info: dict[str, Any] = field(default_factory=dict)

    def problem(self, key: tuple[str, str], msg: str) -> None:
        self.problems[key].append(msg)


def _collect(s: Scenario, h: Harness, lines: list[dict[str, Any]], by_tid: bool) -> None:
    """Pair every call the driver printed with the trace op it caused, and check
    what all scenarios share: return code, entry name, argument hash, slot."""
    calls = [d for d in lines if "name" in d]
    for c in calls:
        s.calls[(c["name"], c["path"])] = c
    ops = h.ops(s.pid)
    if by_tid:
        per_tid: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for o in ops:
            per_tid[o["tid"]].append(o)
        for key, c in s.calls.items():
            got = per_tid.get(c["tid"], [])
            if len(got) != 1:
                s.problem(key, f"{len(got)} trace ops from its thread (want 1)")
            elif got:
                s.ops[key] = got[0]
    else:
        seq = sorted(s.calls.items(), key=lambda kv: kv[1]["t0"])
        starts = [c["t0"] for _, c in seq]
        per_call: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        for o in ops:
            i = bisect.bisect_right(starts, o["submit"]) - 1
            if i >= 0 and o["submit"] <= seq[i][1]["t1"]:
                per_call[seq[i][0]].append(o)
            elif seq and o["submit"] > seq[-1][1]["t1"] and o["cls"] == lib.KREX_CLS_LIFE:
                # The shim's own last drain at exit (a retain, a device set): no call's.
                s.info.setdefault("exit_drain_ops", []).append(o)
            else:
                s.info.setdefault("stray_ops", []).append(o)
        for key in s.calls:
            got = per_call.get(key, [])
            if len(got) != 1:
                s.problem(key, f"{len(got)} trace ops during the call (want 1)")
            else:
                s.ops[key] = got[0]
    for key in KEYS:
        if key not in s.calls:
            s.problem(key, "the driver never reported this call")
    for key, c in s.calls.items():
        if c["rc"] != SIM_RC:
            s.problem(key, f"rc {c['rc']} != simulated {SIM_RC}")
        o = s.ops.get(key)
        if o is None:
            continue
        if o["api"] != key[0]:
            s.problem(key, f"reached simulated {o['api']} instead of {key[0]}")
        if o["args"] != c["hash"]:
            s.problem(key, f"argument hash {o['args']} at the GPU != {c['hash']} at the caller")
        if o["slot"] != s.info["slot"]:
            s.problem(key, f"trace says slot {o['slot']}, want {s.info['slot']}")


def _start(h: Harness, slot: int, threads: bool) -> Any:
    args = ["run", PATHS] + (["threads"] if threads else [])
    return h.spawn("table_driver", args, h.env(slot, rc=SIM_RC, SIM_US="1"))


def scenario_open(h: Harness) -> Scenario:
    s = Scenario()
    s.info["slot"] = slot = h.claim()
    child = _start(h, slot, threads=False)
    s.pid = child.pid
    rc = child.wait(60)
    assert rc == 0, child.stderr
    _collect(s, h, child.lines, by_tid=False)
    rec = h.proc(child.pid)
    assert rec is not None, "the driver never registered with the segment"
    s.info["record"] = rec
    want = Counter(CLASS_NAMES[d["cls"]] for d in LIST)
    s.info["submits"] = (dict(rec.submits), dict(want))
    return s


def scenario_closed(h: Harness) -> Scenario:
    s = Scenario()
    s.info["slot"] = slot = h.claim()
    owner = h.claim()
    h.seg.close_gate(0, owner_slot=owner, holder=lib.KREX_HOLDER_PAUSE, lease_s=120)
    child = _start(h, slot, threads=True)
    s.pid = child.pid
    n = child.expect(lambda d: "jobs" in d, 30, "the job count")["jobs"]
    s.info["jobs"] = n

    def settled() -> bool:
        rec = h.proc(child.pid)
        passed = sum(1 for d in child.lines if "name" in d)
        return (rec.blocked if rec else 0) + passed >= n or not child.alive()

    wait_until(settled, 60, f"all {n} calls of pid {child.pid} to block (or pass)")
    time.sleep(0.2)  # a call that slipped through would show up in the trace now
    s.info["ops_while_closed"] = h.ops(child.pid)
    s.info["record_while_closed"] = h.proc(child.pid)
    s.info["inflight_while_closed"] = h.seg.inflight(0, owner)
    t_open = time.monotonic_ns()
    s.info["t_open"] = t_open
    h.seg.open_gate(0)
    rc = child.wait(60)
    assert rc == 0, child.stderr
    _collect(s, h, child.lines, by_tid=True)
    passed_early = {(o["api"], o["tid"]) for o in s.info["ops_while_closed"]}
    for key, c in s.calls.items():
        o = s.ops.get(key)
        if (key[0], c["tid"]) in passed_early or (o and o["submit"] <= t_open):
            s.problem(key, "reached the GPU while the gate was closed by another slot")
        if c["t0"] >= t_open:
            s.problem(key, "started only after the open (the test did not wait for it)")
    return s


def scenario_owner(h: Harness) -> Scenario:
    s = Scenario()
    s.info["slot"] = slot = h.claim()
    h.seg.close_gate(0, owner_slot=slot, holder=lib.KREX_HOLDER_PAUSE, lease_s=120)
    child = _start(h, slot, threads=True)
    s.pid = child.pid
    t_forced = None
    try:
        child.wait(30)
    except Exception:
        t_forced = time.monotonic_ns()  # something blocked: let it finish, then name it
        h.seg.open_gate(0)
        child.wait(60)
    s.info["record"] = h.proc(child.pid)
    _collect(s, h, child.lines, by_tid=True)
    if t_forced is not None:
        for key, o in s.ops.items():
            if o["submit"] >= t_forced:
                s.problem(key, "blocked although its own slot owns the gate")
    h.seg.open_gate(0)
    return s


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    h = Harness(tmp_path_factory.mktemp("gate_paths"))
    try:
        yield {"open": scenario_open(h), "closed": scenario_closed(h), "owner": scenario_owner(h)}
    finally:
        h.close()


def _summary(s: Scenario) -> str:
    bad = sorted(s.problems.items())
    return f"{len(bad)} of {len(KEYS)} (entry, path) pairs fail:\n" + "\n".join(
        f"  {n} via {p}: {'; '.join(m)}" for (n, p), m in bad[:60]
    )


# ---------------------------------------------------------------- whole-run checks


def test_list_covers_all_paths() -> None:
    assert {p for _, p in KEYS} == set(ALL_PATHS)
    assert len(KEYS) == len(set(KEYS))


def test_open_gate_all(runs: Any) -> None:
    s = runs["open"]
    assert not s.problems, _summary(s)
    rec = s.info["record"]
    assert rec.blocked == 0 and rec.fail_opens == 0 and not rec.flags, rec
    got, want = s.info["submits"]
    assert got == {c: want.get(c, 0) for c in CLASS_NAMES}, "per-class submit counters of the proc record"
    assert not s.info.get("stray_ops"), s.info.get("stray_ops")[:5]


def test_closed_gate_all(runs: Any) -> None:
    s = runs["closed"]
    assert s.info["jobs"] == len(KEYS)
    assert not s.info["ops_while_closed"], (
        "reached the GPU through a gate closed by another slot: "
        + ", ".join(sorted({o["api"] for o in s.info["ops_while_closed"]}))
    )
    rec = s.info["record_while_closed"]
    assert rec is not None, "the driver never registered with the segment"
    assert rec.blocked >= len(KEYS), f"only {rec.blocked} of {len(KEYS)} calls blocked"
    assert rec.inflight == 0 and s.info["inflight_while_closed"] == (0, []), (
        "blocked calls must not count in-flight"
    )
    assert not s.problems, _summary(s)


def test_owner_gate_all(runs: Any) -> None:
    s = runs["owner"]
    assert not s.problems, _summary(s)
    assert s.info["record"].blocked == 0, "the owner's own calls waited at the gate"


# ------------------------------------------------------------ per (entry, path)


@pytest.mark.parametrize("key", KEYS, ids=IDS)
def test_open_passes_through(key: tuple[str, str], runs: Any) -> None:
    assert not runs["open"].problems.get(key), runs["open"].problems.get(key)


@pytest.mark.parametrize("key", KEYS, ids=IDS)
def test_closed_blocks_then_resumes(key: tuple[str, str], runs: Any) -> None:
    assert not runs["closed"].problems.get(key), runs["closed"].problems.get(key)


@pytest.mark.parametrize("key", KEYS, ids=IDS)
def test_owner_goes_through(key: tuple[str, str], runs: Any) -> None:
    assert not runs["owner"].problems.get(key), runs["owner"].problems.get(key)
