"""krex.bench.metrics: every metric against hand-computed values (and Kendall tau
against scipy when it is installed), plus the pure planning/summary helpers of
krex.bench that need no processes."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from krex import bench
from krex.bench import metrics as bm
from krex.errors import UsageError

# ------------------------------------------------------------------------------ percentiles


def test_percentile_linear_interpolation() -> None:
    xs = [1.0, 2.0, 3.0, 4.0]
    assert bm.percentile(xs, 0) == 1.0
    assert bm.percentile(xs, 100) == 4.0
    assert bm.percentile(xs, 50) == pytest.approx(2.5)
    # (n-1) * q = 3 * 0.95 = 2.85 -> 3 + 0.85 * (4 - 3)
    assert bm.percentile(xs, 95) == pytest.approx(3.85)
    assert bm.percentile([5.0], 95) == 5.0
    assert math.isnan(bm.percentile([], 50))
    assert bm.percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input
    with pytest.raises(ValueError):
        bm.percentile(xs, 101)


def test_dist() -> None:
    d = bm.dist([0.01, 0.02, 0.03, 0.04, 0.10])
    assert d.n == 5
    assert d.p50 == pytest.approx(0.03)
    assert d.p95 == pytest.approx(0.04 + 0.8 * 0.06)  # 4 * 0.95 = 3.8
    assert d.max == pytest.approx(0.10)
    assert d.mean == pytest.approx(0.04)
    e = bm.dist([])
    assert e.n == 0 and math.isnan(e.p95)
    assert e.to_json()["p95"] is None


# -------------------------------------------------------------------------------- inflation


def test_inflation_signed() -> None:
    assert bm.inflation(1.0158, 1.0) == pytest.approx(0.0158)
    assert bm.inflation(0.99, 1.0) == pytest.approx(-0.01)
    with pytest.raises(ValueError):
        bm.inflation(1.0, 0.0)


def test_bands_are_nested() -> None:
    assert bm.bands_of(20.0) == [">10ms", ">1ms", ">0.1ms"]
    assert bm.bands_of(5.0) == [">1ms", ">0.1ms"]
    assert bm.bands_of(0.5) == [">0.1ms"]
    assert bm.bands_of(0.05) == []
    assert bm.bands_of(10.0) == [">1ms", ">0.1ms"]  # strictly above the bound


def test_inflation_by_band() -> None:
    pairs = [(20.0, 20.2), (2.0, 2.02), (0.5, 0.55), (0.05, 0.5), (1.0, math.nan)]
    got = bm.inflation_by_band(pairs)
    assert got[">10ms"] == pytest.approx([0.01])
    assert got[">1ms"] == pytest.approx([0.01, 0.01])
    assert got[">0.1ms"] == pytest.approx([0.01, 0.01, 0.1])
    assert set(got) == {b for b, _ in bm.BANDS}


# ------------------------------------------------------------------------------ Kendall tau


def test_kendall_tau_hand_values() -> None:
    assert bm.kendall_tau([1, 2, 3, 4, 5], [1, 2, 3, 4, 5]) == pytest.approx(1.0)
    assert bm.kendall_tau([1, 2, 3, 4, 5], [5, 4, 3, 2, 1]) == pytest.approx(-1.0)
    # One adjacent swap among 5: 9 concordant, 1 discordant -> 8/10.
    assert bm.kendall_tau([1, 2, 3, 4, 5], [1, 3, 2, 4, 5]) == pytest.approx(0.8)
    # Two swaps: 8 concordant, 2 discordant -> 0.6.
    assert bm.kendall_tau([1, 2, 3, 4, 5], [2, 1, 3, 5, 4]) == pytest.approx(0.6)
    # Ties (tau-b): x=[1,2,3], y=[1,1,2]: C=2, D=0, ties only in y: 1 -> 2/sqrt(3*2).
    assert bm.kendall_tau([1, 2, 3], [1, 1, 2]) == pytest.approx(2 / math.sqrt(6))
    assert math.isnan(bm.kendall_tau([1, 1, 1], [1, 2, 3]))
    assert math.isnan(bm.kendall_tau([1], [1]))
    with pytest.raises(ValueError):
        bm.kendall_tau([1, 2], [1])


def test_kendall_tau_matches_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(7)
    for _ in range(50):
        n = rng.randint(2, 9)
        x = [rng.randint(0, 5) for _ in range(n)]
        y = [rng.randint(0, 5) for _ in range(n)]
        ref = stats.kendalltau(x, y).statistic
        got = bm.kendall_tau(x, y)
        if math.isnan(ref):
            assert math.isnan(got)
        else:
            assert got == pytest.approx(ref)


# ---------------------------------------------------------------------------- flip rates


def test_pairwise_flips_and_gap_classes() -> None:
    truth = [1.00, 1.015, 1.03, 1.06, 1.20]
    measured = [1.00, 1.04, 1.02, 1.07, 1.19]  # pair (1, 2) swapped; (2, 3)... in order
    pairs = bm.pairwise_flips(truth, measured)
    assert len(pairs) == 10
    flipped = [(round(g, 4), f) for g, f in pairs if f]
    # Only candidates 1 and 2 are out of order: true gap 1.03/1.015 - 1.
    assert flipped == [(round(1.03 / 1.015 - 1, 4), True)]
    rates = bm.flip_rates(pairs)
    assert set(rates) == {"<2%", "2-5%", "5-10%", ">=10%"}
    # gaps: (0,1) 1.5%, (0,2) 3%, (0,3) 6%, (0,4) 20%, (1,2) 1.48%, (1,3) 4.43%, (1,4) 18.2%,
    #       (2,3) 2.91%, (2,4) 16.5%, (3,4) 13.2%
    assert (rates["<2%"].pairs, rates["<2%"].flips) == (2, 1)
    assert rates["<2%"].rate == pytest.approx(0.5)
    assert (rates["2-5%"].pairs, rates["2-5%"].flips) == (3, 0)
    assert (rates["5-10%"].pairs, rates["5-10%"].flips) == (1, 0)
    assert (rates[">=10%"].pairs, rates[">=10%"].flips) == (4, 0)


def test_flip_ties_and_equal_truth() -> None:
    # A measured tie counts as a flip; equal true values are not a comparable pair.
    assert bm.pairwise_flips([1.0, 2.0], [1.5, 1.5]) == [(1.0, True)]
    assert bm.pairwise_flips([1.0, 1.0], [1.0, 2.0]) == []
    # Reversed truth order: a measured order agreeing with it is no flip.
    assert bm.pairwise_flips([2.0, 1.0], [2.1, 0.9]) == [(1.0, False)]
    assert math.isnan(bm.flip_rates([])["<2%"].rate)
    assert bm.gap_class(0.0199) == "<2%" and bm.gap_class(0.02) == "2-5%" and bm.gap_class(0.1) == ">=10%"
    with pytest.raises(ValueError):
        bm.gap_class(-0.1)


# ------------------------------------------------------------------- throughput, Amdahl


def test_throughput_and_amdahl() -> None:
    assert bm.throughput_per_min(32, 120.0) == pytest.approx(16.0)
    assert math.isnan(bm.throughput_per_min(0, 10.0))
    assert bm.critical_fraction(0.22, 2.6) == pytest.approx(0.0846, abs=1e-4)
    assert bm.critical_fraction(3.0, 2.0) == 1.0  # clamped
    assert bm.amdahl_bound(0.12) == pytest.approx(8.333, abs=1e-3)
    assert bm.amdahl_bound(0.0) == math.inf
    # The paper's toy model: f = 12 %, C = 16 -> 5.7x; C = 1 -> 1x.
    assert bm.speedup_bound(0.12, 16) == pytest.approx(5.7, abs=0.05)
    assert bm.speedup_bound(0.12, 1) == pytest.approx(1.0)


# ------------------------------------------------------------------- bench.py pure helpers


def test_parse_modes_and_concurrency() -> None:
    assert bench.parse_modes("native-serial, krex,krex") == ["native-serial", "krex"]
    assert bench.parse_concurrency("2,4, 8,16,4") == [2, 4, 8, 16]
    for bad in ("fast", ""):
        with pytest.raises(UsageError):
            bench.parse_modes(bad)
    for bad_c in ("0", "x", "65", ""):
        with pytest.raises(UsageError):
            bench.parse_concurrency(bad_c)


def test_plan_cells_interleaves() -> None:
    cells = bench.plan_cells(bench.DEFAULT_MODES, [2, 4, 8, 16], seed=3)
    keys = [c.key for c in cells]
    assert keys[:2] == ["reference", "native-serial"]
    assert sorted(keys) == sorted(
        ["reference", "native-serial", "native-repeat"]
        + [f"{m}-{c}" for m in ("unprotected", "krex") for c in (2, 4, 8, 16)]
    )
    # unprotected-C and krex-C run back to back; native-repeat sits in the middle.
    rest = [k for k in keys[2:] if k != "native-repeat"]
    for i in range(0, len(rest), 2):
        assert {rest[i].split("-")[-1], rest[i + 1].split("-")[-1]} == {rest[i].split("-")[-1]}
    assert 2 <= keys.index("native-repeat") <= len(keys) - 2
    assert bench.plan_cells(bench.DEFAULT_MODES, [2, 4, 8, 16], seed=3) == cells  # deterministic
    modes = bench.DEFAULT_MODES
    orders = {tuple(c.key for c in bench.plan_cells(modes, [2, 4, 8, 16], seed=s)) for s in range(8)}
    assert len(orders) > 1  # the seed matters
    assert [c.key for c in bench.plan_cells(["krex"], [4], 0)] == ["krex-4"]
    assert bench.Cell.from_key("krex-16") == bench.Cell("krex", 16)
    assert bench.Cell.from_key("native-repeat").key == "native-repeat"


def test_corpus_shapes() -> None:
    gpu = bench.load_corpus(None, "gpu")
    sim = bench.load_corpus(None, "sim")
    assert len(gpu) >= 32 and len(sim) >= 32
    for corpus in (gpu, sim):
        bands = {">10": 0, "1-10": 0, "0.1-1": 0}
        for w in corpus:
            if w.expect_ms > 10:
                bands[">10"] += 1
            elif w.expect_ms > 1:
                bands["1-10"] += 1
            elif w.expect_ms > 0.1:
                bands["0.1-1"] += 1
        assert min(bands.values()) >= 8, bands
        fams: dict[str, list[bench.Workload]] = {}
        for w in corpus:
            if w.family:
                fams.setdefault(w.family, []).append(w)
        assert sum(1 for ws in fams.values() if len(ws) >= 5) >= 4
        for ws in fams.values():
            if ws[0].truth == "param":
                works = sorted(float(w.work or 0) for w in ws)
                gaps = [b / a - 1 for a, b in zip(works, works[1:], strict=False)]
                assert all(0.01 <= g <= 0.10 for g in gaps), gaps
    kinds = {Path(w.script).name for w in gpu}
    assert {"fma_chain.py", "matmul.py", "compiled_fused.py", "cuda_ext.py"} <= kinds
    assert any(w.truth == "measured" for w in gpu)
    # The CPU-heavy family is timed by the harness's own do_bench under an automatic region.
    heavy = [w for w in gpu if w.family == "cpu-heavy"]
    assert len(heavy) >= 3 and all(dict(w.env).get("KREX_AUTO_REGION") == "do_bench" for w in heavy)
    # The fused family: chains timed by a KernelBench-style harness under an automatic region,
    # eager and torch.compile'd, ~0.5 to ~11 ms a call; and its simulated form.
    for corpus, prefix in ((gpu, "fused-"), (sim, "sim-fused-")):
        fused = [w for w in corpus if w.name.startswith(prefix)]
        assert len(fused) >= 6, prefix
        assert {Path(w.script).name for w in fused} == {"fused.py" if prefix == "fused-" else "sim_fused.py"}
        assert all(dict(w.env)["KREX_AUTO_REGION"].endswith("@kernelbench") for w in fused)
        assert any("--compile" in w.args for w in fused) and any("--compile" not in w.args for w in fused)
        assert any(w.quick for w in fused)
    gpu_fused = [w.expect_ms for w in gpu if w.name.startswith("fused-")]
    assert min(gpu_fused) <= 0.5 and max(gpu_fused) > 10
    quick = bench.load_corpus(None, "sim", quick=True)
    assert 0 < len(quick) < len(sim)
    with pytest.raises(UsageError):
        bench.load_corpus(None, "sim", only=["no-such-command"])


def _rec(
    cell: str,
    name: str,
    ms: float,
    family: str | None = None,
    rep: int = 0,
    ok: bool = True,
    region: float = 0.1,
    total: float = 1.0,
) -> dict[str, object]:
    c = bench.Cell.from_key(cell)
    return {
        "run": cell,
        "cell": cell,
        "mode": c.mode,
        "c": c.c,
        "rep": rep,
        "name": name,
        "family": family,
        "ok": ok,
        "wall_s": total,
        "started_at": 0.0,
        "ended_at": total,
        "result": {
            "ms": ms,
            "correct": ok,
            "t_region_s": region,
            "t_total_s": total,
            "region_entry_s": 0.001,
        },
    }


def test_compute_summary_by_hand(tmp_path: Path) -> None:
    script = tmp_path / "x.py"
    script.write_text("")
    ws = [
        bench.Workload(
            f"f-{k}", "sim", script, (), family="f", param=k, truth="param", work=100 + 10 * k, expect_ms=2.0
        )
        for k in range(4)
    ]
    ws.append(bench.Workload("long", "sim", script, (), expect_ms=20.0))
    ref = {"f-0": 1.0, "f-1": 1.1, "f-2": 1.2, "f-3": 1.3, "long": 20.0}
    recs = [_rec("native-serial", n, v, "f" if n != "long" else None) for n, v in ref.items()]
    recs += [_rec("native-repeat", n, v * 1.01, "f" if n != "long" else None) for n, v in ref.items()]
    # krex-4: same order, long inflated by 0.2 %; unprotected-4: f-1 and f-2 swapped.
    kx = {"f-0": 1.0, "f-1": 1.1, "f-2": 1.2, "f-3": 1.3, "long": 20.04}
    un = {"f-0": 1.0, "f-1": 1.3, "f-2": 1.2, "f-3": 1.35, "long": 30.0}
    recs += [_rec("krex-4", n, v, "f" if n != "long" else None) for n, v in kx.items()]
    for r, path in zip(recs[-5:], ("hook", "hook", None, "hook", None), strict=True):  # Inductor's regions
        r["krex"] = {"regions": [{}], "inductor_regions": {path: 2} if path else {}}
    recs += [_rec("unprotected-4", n, v, "f" if n != "long" else None) for n, v in un.items()]
    cells = [
        {
            "cell": "native-serial",
            "mode": "native-serial",
            "c": 1,
            "run": "native-serial",
            "n_runs": 5,
            "failures": 0,
            "started_at": 0.0,
            "ended_at": 60.0,
            "makespan_s": 60.0,
            "last_start_s": 59.0,
        },
        {
            "cell": "native-repeat",
            "mode": "native-repeat",
            "c": 1,
            "run": "native-repeat",
            "n_runs": 5,
            "failures": 0,
            "started_at": 0.0,
            "ended_at": 60.0,
            "makespan_s": 60.0,
            "last_start_s": 59.0,
        },
        {
            "cell": "krex-4",
            "mode": "krex",
            "c": 4,
            "run": "krex-4",
            "n_runs": 5,
            "failures": 0,
            "started_at": 0.0,
            "ended_at": 15.0,
            "makespan_s": 15.0,
            "last_start_s": 2.0,
        },
        {
            "cell": "unprotected-4",
            "mode": "unprotected",
            "c": 4,
            "run": "unprotected-4",
            "n_runs": 5,
            "failures": 0,
            "started_at": 0.0,
            "ended_at": 20.0,
            "makespan_s": 20.0,
            "last_start_s": 2.0,
        },
    ]
    meta = {"device": "sim", "quick": True, "seed": 0, "repeat": 1, "versions": {}}
    s = bench.compute_summary(meta, cells, recs, ws)
    thr = {t["cell"]: t for t in s["throughput"]}
    assert s["native_cpm"] == pytest.approx(5.0)
    assert thr["krex-4"]["cmds_per_min"] == pytest.approx(20.0) and thr["krex-4"]["ratio"] == pytest.approx(
        4.0
    )
    assert thr["unprotected-4"]["ratio"] == pytest.approx(3.0)
    assert s["inflation"]["krex-4"][">10ms"]["p95"] == pytest.approx(0.002)
    assert s["inflation"]["native-repeat"][">1ms"]["p50"] == pytest.approx(0.01)
    assert s["ranking"]["krex-4"]["tau_median"] == pytest.approx(1.0)
    assert s["ranking"]["unprotected-4"]["tau_median"] == pytest.approx(4 / 6)
    assert s["critical"]["aggregate"] == pytest.approx(0.1) and s["critical"][
        "amdahl_bound"
    ] == pytest.approx(10.0)
    h = s["headline"]
    assert h["krex_cell"] == "krex-4" and h["throughput_ratio"] == pytest.approx(4.0)
    met = {g["metric"]: g["met"] for g in h["goals"] if g["cell"] == "krex-4"}
    assert met["throughput vs native serial"] == "yes"
    assert met["throughput vs unprotected (same C)"] == "yes"  # 20 against 15 cmds/min
    assert met["p95 timing inflation, kernels >10ms"] == "yes"
    assert met["Kendall tau (median per family and pass)"] == "yes"
    md = bench.render_summary_md(s)
    assert "SIMULATED GPU - logic demo, not performance evidence" in md
    for heading in (
        "## Headline",
        "## Throughput",
        "## Timing inflation",
        "## Ranking fidelity",
        "## Critical-region fraction",
        "## Region entry overhead",
    ):
        assert heading in md
    assert "| krex-4 | 4 | 5 | 0 |" in md
    # Which way Inductor's autotuning ran, per krex cell: in the summary and its table.
    assert s["regions"]["krex-4"]["inductor_regions"] == {"hook": 6}
    assert "torch's set_gpu_benchmark_lock_context hook 6" in md
    line = "Inductor autotuning regions: krex-4: torch's set_gpu_benchmark_lock_context hook 6"
    assert bench.inductor_line(s) == line


def test_split_bands_are_disjoint_and_cover_every_duration() -> None:
    pairs = [(0.05, 0.1), (0.1, 0.11), (0.5, 0.5), (1.0, 2.0), (5.0, 5.0), (20.0, 22.0)]
    got = bm.inflation_by_split_band(pairs)
    # (lo, hi]: a 0.1 ms kernel is in the first band, as the nested ">0.1ms" leaves it out
    assert got == {
        "<0.1ms": [1.0, pytest.approx(0.1)],
        "0.1-1ms": [0.0, 1.0],
        "1-10ms": [0.0],
        ">10ms": [pytest.approx(0.1)],
    }
    # nested bands put the 20 ms kernel in all three; the split ones only once
    assert sum(len(v) for v in got.values()) == 6


def test_lend_cells_have_keys_of_their_own() -> None:
    """--lend gives one krex cell per lend_cores value, keyed krex-C[@POLICY]+lend-X[+pwN];
    the key reads back into the same cell, and a value krexd does not know is refused."""
    cells = bench.plan_cells(["unprotected", "krex"], [8], 0, lends=["off", "all"])
    assert sorted(c.key for c in cells) == ["krex-8+lend-all", "krex-8+lend-off", "unprotected-8"]
    for key in ("krex-8+lend-all", "krex-16@gpu+lend-region", "krex-4@all+lend-off+pw2"):
        assert bench.Cell.from_key(key).key == key
    c = bench.Cell.from_key("krex-16@gpu+lend-region+pw2")
    assert (c.c, c.freeze, c.lend, c.prewarm) == (16, "gpu", "region", 2)
    for bad in ("krex-8+lend-some", "unprotected-8+lend-all"):
        with pytest.raises(UsageError):
            bench.Cell.from_key(bad)
