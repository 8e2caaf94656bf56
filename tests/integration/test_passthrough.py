"""Outside KREX the shim is a pure pass-through: same results, no threads, no
output (DESIGN.md). Under KREX it adds exactly one thread, the drain helper,
and only once the process has submitted GPU work."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import ALL_PATHS, Harness, read_jsonl

SIM_RC = 7


def _driver(h: Harness, env: dict[str, str]) -> tuple[list[tuple[Any, ...]], dict[str, Any], Any]:
    c = h.run("table_driver", ["run", ",".join(ALL_PATHS)], env)
    assert c.popen.returncode == 0, c.stderr
    calls = [(d["name"], d["path"], d["rc"], d["hash"]) for d in c.lines if "name" in d]
    done = next(d for d in c.lines if "done" in d)
    return calls, done, c


def _variants(h: Harness, slot: int) -> dict[str, dict[str, str]]:
    """Environments in which the preloaded shim must stay out of the way."""
    return {
        "no-krex-env": h.env(None, krex=False, rc=SIM_RC, SIM_US="1"),
        "missing-segment": h.env(slot, rc=SIM_RC, SIM_US="1", KREX_SHM="/krex-no-such-segment-for-tests"),
        "slot-not-a-number": h.env(slot, rc=SIM_RC, SIM_US="1", KREX_SLOT="not-a-number"),
        "slot-out-of-range": h.env(slot, rc=SIM_RC, SIM_US="1", KREX_SLOT="4096"),
    }


@pytest.mark.parametrize(
    "variant", ["no-krex-env", "missing-segment", "slot-not-a-number", "slot-out-of-range"]
)
def test_preloaded_shim_outside_krex_changes_nothing(harness: Harness, variant: str) -> None:
    h = harness
    plain_calls, plain_done, plain = _driver(h, h.env(None, krex=False, preload=False, rc=SIM_RC, SIM_US="1"))
    calls, done, c = _driver(h, _variants(h, h.claim())[variant])

    assert len(calls) > 800 and {rc for *_, rc, _ in calls} == {SIM_RC}
    assert calls == plain_calls, "rc or argument hash differs with the shim preloaded: " + str(
        [(a, b) for a, b in zip(calls, plain_calls, strict=False) if a != b][:5]
    )
    # The simulated GPU saw the same calls with the same arguments, in the same order.
    seen = [(o["api"], o["args"]) for o in h.ops(c.pid)]
    assert seen == [(o["api"], o["args"]) for o in h.ops(plain.pid)]
    assert c.stderr == "" and plain.stderr == ""
    assert done["threads"] == 1 and plain_done["threads"] == 1, "the shim started a thread outside KREX"
    assert h.seg.snapshot().procs == [], "a process outside KREX registered with the segment"


def test_results_identical_under_krex(harness: Harness) -> None:
    """With an open gate, KREX changes no result either; it adds the helper."""
    h = harness
    plain_calls, _, _ = _driver(h, h.env(None, krex=False, preload=False, rc=SIM_RC, SIM_US="1"))
    calls, done, c = _driver(h, h.env(h.claim(), rc=SIM_RC, SIM_US="1"))
    assert calls == plain_calls
    assert c.stderr == ""
    assert done["threads"] == 2, "under KREX: the app thread plus exactly one drain helper"


@pytest.mark.parametrize("mode", ["plain", "preload", "krex"])
def test_helper_thread_appears_only_under_krex_after_first_gpu_call(harness: Harness, mode: str) -> None:
    h = harness
    env = {
        "plain": h.env(None, krex=False, preload=False),
        "preload": h.env(None, krex=False),
        "krex": h.env(h.claim()),
    }[mode]
    c = h.run("actor", ["threads", "malloc", "threads", "k:5", "threads"], env)
    assert c.popen.returncode == 0 and c.stderr == "", c.stderr
    before, after_malloc, after = (d for d in c.lines if d["act"] == "threads")
    assert before["threads"] == 1, "a thread before any GPU call"
    # A cudaMalloc is a LIFE call: under KREX it registers, so its drain helper starts then.
    assert after_malloc["threads"] == (2 if mode == "krex" else 1), after_malloc
    if mode == "krex":
        assert after["threads"] == 2 and after["helper"] == 1
        assert before["helper"] == 0
    else:
        assert after["threads"] == 1
        assert after["helper"] == (-1 if mode == "plain" else 0)


def test_krex_log_does_reach_stderr(harness: Harness) -> None:
    """Control for the empty-stderr checks above: asked to log, the shim does."""
    h = harness
    c = h.run("actor", ["k:5"], h.env(h.claim(), KREX_LOG="1"))
    assert "[krex" in c.stderr and "registered" in c.stderr, c.stderr


def test_sim_trace_stays_json_with_any_slot_value(harness: Harness) -> None:
    h = harness
    h.run("actor", ["k:5"], h.env(None, krex=False, KREX_SLOT="not-a-number"))
    ops = [e for e in read_jsonl(h.trace_path, strict=True) if e.get("ev") == "op"]
    assert len(ops) == 1
