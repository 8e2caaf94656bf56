"""The chaos test, CI length (about a minute): commands on the simulated GPU with
faults injected at random; zero false "clean" regions (see tests/helpers/chaos.py;
the long variant is scripts/chaos.py)."""

from __future__ import annotations

import os

import pytest
from helpers.chaos import ESCAPES, POLICIES, ChaosConfig, run_chaos, summary_table

pytestmark = [
    pytest.mark.cgroup,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: real cgroups and freezers"),
]


@pytest.mark.timeout(600)
def test_chaos_no_region_is_ever_falsely_clean() -> None:
    seed = int(os.environ.get("KREX_CHAOS_SEED", "7"))
    res = run_chaos(ChaosConfig(seconds=35, seed=seed, fault_every=0.8))
    print(summary_table(res))
    assert res.false_clean == [], res.false_clean[:5]
    assert res.journal_false_clean == [], res.journal_false_clean[:5]
    assert res.long_not_flagged == [], res.long_not_flagged[:5]
    assert res.daemon_tracebacks == 0
    # Not vacuous: many regions, faults of most kinds, and both outcomes.
    assert res.regions >= 200 and res.clean > 0 and res.flagged > 0, res.to_json()
    assert len(res.faults) >= 4, res.faults
    assert res.long_regions > 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", ESCAPES)
def test_chaos_escaping_sibling_never_runs_inside_a_clean_region(kind: str, policy: str) -> None:
    """Owners take regions beside a sibling command with a process the gate cannot hold
    (helpers/chaos.py, ESCAPES), under each freeze policy; no faults. Every region the
    owners saw clean, and every journal record that says clean, has no operation of
    that sibling inside it."""
    res = run_chaos(
        ChaosConfig(
            seconds=8,
            seed=int(os.environ.get("KREX_CHAOS_SEED", "11")),
            owners=2,
            hammers=0,
            faults=(),
            cut_p=0.0,
            leftover_p=0.0,
            escapes=(kind,),
            freeze=policy,
        )
    )
    print(summary_table(res))
    assert res.false_clean == [], (len(res.false_clean), res.false_clean[:3])
    assert res.journal_false_clean == [], (len(res.journal_false_clean), res.journal_false_clean[:3])
    assert res.daemon_tracebacks == 0
    # Not vacuous: the owners took regions while the sibling ran its kernels.
    assert res.regions >= 20, res.to_json()
    assert res.escape_ops[kind] > 100, res.to_json()


@pytest.mark.timeout(300)
def test_chaos_life_freeze_never_lets_a_frozen_call_run_inside_a_clean_region() -> None:
    """krexd's life_freeze under `gpu`, with every context creation a chain of slow driver
    calls (the simulator's KREX_SIM_CTX_MS in KREX_SIM_CTX_STEP_MS steps): commands start all
    the time, so regions begin while siblings are inside their creations and freeze them
    there. Every region the owners saw clean, and every journal record that says clean,
    has no operation of another command inside it; some entries did freeze a sibling
    inside its creation (not vacuous)."""
    res = run_chaos(
        ChaosConfig(
            seconds=10,
            seed=int(os.environ.get("KREX_CHAOS_SEED", "5")),
            owners=2,
            hammers=2,
            faults=(),
            cut_p=0.0,
            leftover_p=0.3,
            freeze="gpu",
            env=(
                ("KREX_LIFE_FREEZE", "1"),
                ("KREX_SIM_CTX_MS", "150"),
                ("KREX_SIM_CTX_STEP_MS", "15"),
                ("CP_WORKER_MALLOC_FIRST", "1"),
            ),
        )
    )
    print(summary_table(res))
    assert res.false_clean == [], (len(res.false_clean), res.false_clean[:3])
    assert res.journal_false_clean == [], (len(res.journal_false_clean), res.journal_false_clean[:3])
    assert res.daemon_tracebacks == 0
    assert res.regions >= 20, res.to_json()
    assert res.life_frozen >= 1, res.to_json()
