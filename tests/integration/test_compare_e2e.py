"""`krex compare` end to end on the simulated GPU: candidates of known true ratio
(examples/compare/sim_candidate.c, lognormal run-to-run noise) run interleaved under
KREX; the verdict, the interval and the pyperf export are checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import sim_candidate

KREX = [sys.executable, "-m", "krex.cli.main"]


def _compare(env: dict[str, str], *args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KREX, "compare", "--device", "sim", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_a_faster_candidate_is_found_with_an_interval_around_its_true_ratio(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    cand = sim_candidate()
    a = f"{cand} --us 400 --noise 0.02 --region"
    b = f"{cand} --us 400 --ratio 0.9 --noise 0.02 --region"
    p = _compare(krex_env, "--figure", "json:mean_us", "--unit", "us", "--max-runs", "12", "--seed", "5",
                 "--pyperf", str(tmp_path / "pyperf"), "--json", a, b)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    (r,) = out["ratios"]
    assert r["verdict"] == "faster" and out["settled"]
    # (that the interval covers 0.9 at its stated rate is the coverage study's to show:
    # docs/results/compare-coverage/; one run can only be near it)
    assert abs(r["ratio"] - 0.9) < 0.03 and r["low"] <= r["ratio"] <= r["high"] < 1
    assert r["p_wrong"] < 0.025
    assert out["simulated"] and out["seed"] == 5
    runs = out["runs"]
    assert {x["candidate"] for x in runs} == {"A", "B"}
    assert all(x["regions"] == 1 and x["region_s"] > 0 for x in runs)
    # palindromic blocks: each block's order reversed in its second half
    for b_ in {x["block"] for x in runs}:
        seq = [x["candidate"] for x in sorted(runs, key=lambda x: x["position"]) if x["block"] == b_]
        assert seq == seq[::-1]
    pyperf = pytest.importorskip("pyperf")
    bench = pyperf.BenchmarkSuite.load(out["pyperf_files"][1]).get_benchmark("krex-compare")
    assert bench.get_nvalue() == r["runs"]
    assert bench.median() == pytest.approx(400e-6 * 0.9, rel=0.1)


def test_equal_candidates_are_not_ordered_and_a_margin_calls_them_equivalent(
    krex_env: dict[str, str],
) -> None:
    cand = sim_candidate()
    a = f"{cand} --us 300 --noise 0.01 --region"
    p = _compare(krex_env, "--figure", "do_bench", "--max-runs", "10", "--margin", "0.05", a, a)
    assert p.returncode == 0, p.stderr
    assert "are equivalent within 5.0%" in p.stdout
    assert "settled" in p.stdout and "SIMULATED GPU" in p.stdout


def test_unprotected_runs_and_failing_candidates_stop_with_a_fix(krex_env: dict[str, str]) -> None:
    cand = sim_candidate()
    p = _compare(krex_env, "--figure", "do_bench", f"{cand} --us 100", f"{cand} --us 100")
    assert p.returncode == 2 and "made no region" in p.stderr and "fix:" in p.stderr
    p = _compare(krex_env, "--figure", "do_bench", "--allow-unprotected", "--max-runs", "6",
                 f"{cand} --us 100", f"{cand} --us 100")
    assert p.returncode == 0, p.stderr
    p = _compare(krex_env, "--figure", "do_bench", f"{cand} --us 100 --region", "exit 7")
    assert p.returncode == 1 and "exited 7" in p.stderr
    p = _compare(krex_env, "--figure", "json:nope", f"{cand} --us 100 --region", f"{cand} --us 100 --region")
    assert p.returncode == 2 and "no JSON document" in p.stderr


def test_runs_at_once_and_flagged_regions_run_again(krex_env: dict[str, str]) -> None:
    """-j 2: two runs at once, each still in a region; a run whose region was flagged (on a
    small machine: a sibling on the region core) is left out and its slot run again."""
    cand = sim_candidate()
    a = f"{cand} --us 300 --noise 0.02 --region"
    p = _compare(krex_env, "--figure", "do_bench", "-j", "2", "--min-runs", "6", "--max-runs", "6",
                 "--retries", "3", "--json", a, a)
    assert p.returncode == 0, p.stderr
    runs = json.loads(p.stdout)["runs"]
    by_slot: dict[tuple[int, int], list[dict[str, object]]] = {}
    for r in runs:
        by_slot.setdefault((int(r["block"]), int(r["position"])), []).append(r)
    assert len(by_slot) == 3 * 4  # 3 blocks of ABBA/BAAB
    for tries in by_slot.values():
        assert all(t["left_out"] for t in tries[:-1])  # run again only after a flagged run
        assert tries[-1]["left_out"] is None or len(tries) == 4
        assert all(t["left_out"] is None or str(t["left_out"]).startswith("region flagged") for t in tries)
