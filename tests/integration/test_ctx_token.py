"""One context creation at a time into the driver (interpose/ctx_gate.c, ctx_token.c,
krex_abi.h KREX_CTX_TOKEN_LEASE_MS), on the simulated GPU with the driver's creation lock
modelled (KREX_SIM_CTX_MS: creations run one at a time, node-wide, in order, and the drain
helper's context query waits in the same queue, as on a real driver).

Siblings that make contexts while a region's gate closes: with the token, the drain waits for
the one creation inside the driver; without it (KREX_CTX_TOKEN=0), for every one queued.
A holder killed inside its creation, or stopped there, holds the others back briefly (its
death is noticed at once; a stop, until the lease ends). A region's owner makes its own
contexts straight through while siblings are parked or frozen."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import pytest
from helpers import read_jsonl, victims
from helpers.krex_world import Krex, frozen_reason

from krex.native import lib
from krex.node.shm import Segment

root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: krexd's cgroups")

LEASE_S = lib.KREX_CTX_TOKEN_LEASE_MS / 1000


def _lines(kx: Krex, name: str) -> list[dict[str, Any]]:
    """The actor's JSON lines so far (krex run's own output is not JSON)."""
    path = kx.out / f"{name}.log"
    if not path.exists():
        return []
    return [json.loads(s) for s in path.read_text().splitlines() if s.startswith("{")]


def _act(kx: Krex, name: str, act: str) -> dict[str, Any] | None:
    return next((x for x in _lines(kx, name) if x["act"] == act), None)


def _holder(kx: Krex) -> int:
    with Segment.attach(kx.shm) as s:
        return s.ctx_token_holder()


def _ctx_done(kx: Krex) -> list[dict[str, Any]]:
    """The simulator's finished first context creations, in order."""
    return sorted((e for e in read_jsonl(kx.trace) if e.get("ev") == "ctx"), key=lambda e: e["t"])


def _siblings(kx: Krex, n: int, actions: list[str], env: dict[str, str]) -> list[int]:
    """n commands running the actor's ACTIONS; their actors' pids once all have started."""
    actor = str(victims()["actor"])
    for i in range(n):
        kx.run_argv(f"sib{i}", [actor, *actions], env_extra=env)
    kx.wait(lambda: all(_lines(kx, f"sib{i}") for i in range(n)), 60, "the siblings' start")
    return [_lines(kx, f"sib{i}")[0]["pid"] for i in range(n)]


def _wait_all(kx: Krex, names: list[str], timeout: float) -> None:
    for name in names:
        rc = kx.cmds[name].popen.wait(timeout)
        assert rc == 0, f"{name}: {kx.cmds[name].output()[-1500:]}"


def _entry_with_creations(
    kx: Krex, how: str, token: str, n: int = 6, ctx_ms: int = 300, extra: dict[str, str] | None = None
) -> dict[str, Any]:
    """A command that made its context waits; n siblings start making theirs (`how`: the
    driver's retain, or the runtime's cudaMalloc, which retains inside it); once the first has
    finished, the command enters a region. Returns the region's record."""
    env = {"KREX_SIM_CTX_MS": str(ctx_ms), "KREX_CTX_TOKEN": token, **(extra or {})}
    kx.start_daemon(slots=n + 2, env_extra=env)
    actor = str(victims()["actor"])
    kx.run_argv("owner", [actor, "k:1", "sync", "sigwait", "begin", "k:1", "sync", "end"], env_extra=env)
    kx.wait(lambda: _act(kx, "owner", "sync"), 60, "the owner's context")
    _siblings(kx, n, [how, "k:1", "sync"], env)
    kx.wait(lambda: len(_ctx_done(kx)) >= 2, 60, "a sibling's first creation")  # (the owner's is first)
    os.kill(_lines(kx, "owner")[0]["pid"], signal.SIGUSR1)
    _wait_all(kx, ["owner", *(f"sib{i}" for i in range(n))], 120)
    recs = [r for r in kx.journal() if "drain_s" in r]
    assert len(recs) == 1, recs
    return recs[0]


@root
@pytest.mark.parametrize("how", ["ctx", "malloc"])
def test_a_drain_waits_for_one_creation_with_the_token_and_for_all_queued_without(how: str) -> None:
    """Six siblings make contexts (300 ms each, one at a time in the driver) as a region
    begins. With the token its drain waits for at most the one creation inside the driver;
    without, for the ones queued in the driver before its helpers' queries (four or so)."""
    ctx_s = 0.3
    drains = {}
    for token in ("1", "0"):
        kx = Krex()
        try:
            drains[token] = _entry_with_creations(kx, how, token)["drain_s"]
        finally:
            kx.cleanup()
    assert drains["1"] < ctx_s + 0.25, drains
    assert drains["0"] > 2 * ctx_s, drains


@root
def test_a_holder_killed_inside_its_creation_holds_no_one_back(kx: Krex) -> None:
    """The token's holder is SIGKILLed inside its creation: another sibling takes the token at
    once (its holder is dead), and every other sibling makes its context."""
    env = {"KREX_SIM_CTX_MS": "800"}
    kx.start_daemon(slots=6, env_extra=env)
    pids = _siblings(kx, 3, ["ctx", "k:1", "sync"], env)
    holder = kx.wait(lambda: (h := _holder(kx)) in pids and h, 60, "a sibling holding the token")
    time.sleep(0.1)  # inside the creation
    os.kill(holder, signal.SIGKILL)
    t_kill = time.monotonic()
    nxt = kx.wait(lambda: (h := _holder(kx)) in pids and h != holder and h, 10, "another holder")
    assert time.monotonic() - t_kill < 0.5
    others = [f"sib{i}" for i, p in enumerate(pids) if p != holder]
    _wait_all(kx, others, 30)
    assert nxt in pids and _holder(kx) == -1


@root
def test_a_stopped_holder_holds_the_others_back_until_its_lease_ends(kx: Krex) -> None:
    """The token's holder is SIGSTOPped inside its creation: the others wait for it only until
    its lease ends, then make their contexts; it finishes its own once continued."""
    env = {"KREX_SIM_CTX_MS": "1500"}
    kx.start_daemon(slots=6, env_extra=env)
    pids = _siblings(kx, 3, ["ctx", "k:1", "sync"], env)
    holder = kx.wait(lambda: (h := _holder(kx)) in pids and h, 60, "a sibling holding the token")
    t_took = time.monotonic()
    os.kill(holder, signal.SIGSTOP)
    try:
        kx.wait(lambda: _holder(kx) != holder, LEASE_S + 2, "the lease's end")
        waited = time.monotonic() - t_took
        assert LEASE_S - 0.2 < waited < LEASE_S + 1.0, waited
        others = [f"sib{i}" for i, p in enumerate(pids) if p != holder]
        _wait_all(kx, others, 30)
    finally:
        os.kill(holder, signal.SIGCONT)
    _wait_all(kx, [f"sib{i}" for i, p in enumerate(pids) if p == holder], 30)


@root
def test_the_owner_makes_a_context_in_its_region_while_siblings_queue_for_the_token(kx: Krex) -> None:
    """Siblings queue for the token as a region begins; its owner makes a context inside the
    region. It waits for no token (the owner takes none; parked siblings gave theirs back, a
    frozen one's krexd dropped): about one creation at most (a frozen sibling's turn in the
    driver lapsing), never a lease. No sibling keeps the token through the region."""
    ctx_ms, n = 300, 4
    env = {"KREX_SIM_CTX_MS": str(ctx_ms)}
    kx.start_daemon(slots=n + 2, env_extra=env)
    actor = str(victims()["actor"])
    kx.run_argv("owner", [actor, "sigwait", "begin", "ctx", "end"], env_extra=env)
    kx.wait(lambda: _lines(kx, "owner"), 60, "the owner's start")
    pids = _siblings(kx, n, ["ctx", "k:1", "sync"], env)
    kx.wait(lambda: len(_ctx_done(kx)) >= 1, 60, "a sibling's first creation")
    os.kill(_lines(kx, "owner")[0]["pid"], signal.SIGUSR1)
    seen: list[tuple[int, int, str | None]] = []
    while kx.cmds["owner"].popen.poll() is None:
        h = _holder(kx)
        seen.append((time.monotonic_ns(), h, frozen_reason(h) if h > 0 else None))
        time.sleep(0.01)
    _wait_all(kx, ["owner", *(f"sib{i}" for i in range(n))], 60)
    made = _act(kx, "owner", "ctx")
    assert made and made["rc"] == 0
    assert (made["t1"] - made["t0"]) / 1e9 < 2 * ctx_ms / 1e3 + 0.4 < LEASE_S, made
    begun, ended = _act(kx, "owner", "begin"), _act(kx, "owner", "end")
    assert begun and ended
    inside = [(t, h, why) for t, h, why in seen if begun["t1"] + 0.1e9 < t < ended["t0"]]
    assert all(h not in pids or why is None for _t, h, why in inside), inside  # never a frozen holder
    held = {h for _t, h, _why in inside if h in pids}
    for h in held:  # a parked sibling gives it back: held in one sample at most, for a moment
        assert sum(1 for _t, x, _w in inside if x == h) <= 2, inside


@root
@pytest.mark.parametrize("how", ["ctx", "malloc"])
def test_life_freeze_freezes_a_sibling_inside_its_creation_rather_than_wait_for_it(
    kx: Krex, how: str
) -> None:
    """With life_freeze, a sibling inside its context creation (600 ms in the modelled driver)
    with nothing else queued is frozen inside it and its drain ack excused: the region's drain
    takes a fraction of one creation, the region is clean, and nothing of the frozen sibling
    ran inside it; once thawed, every sibling finishes its creation and its kernel."""
    rec = _entry_with_creations(
        kx,
        how,
        "1",
        n=4,
        ctx_ms=600,
        extra={"KREX_LIFE_FREEZE": "1", "KREX_SIM_CTX_STEP_MS": "20", "KREX_FREEZE_POLICY": "gpu"},
    )
    assert rec["drain_s"] < 0.3, json.dumps(rec)
    assert rec["life_frozen"], rec
    assert not rec["contaminated"], rec["reasons"]
    t0, t1 = rec["t_grant_ns"], rec["t_end_ns"]
    frozen = set(rec["life_frozen"])

    def during(e: dict[str, Any]) -> bool:
        if e.get("ev") == "op":
            return bool(e["start"] < t1 and e["end"] > t0)
        return bool(t0 <= e.get("t", 0) <= t1)

    trace = read_jsonl(kx.trace)
    assert [e for e in trace if e.get("pid") in frozen and during(e)] == []
    done = {e["pid"] for e in _ctx_done(kx)}
    assert frozen <= done, (frozen, done)  # thawed, each finished its creation
