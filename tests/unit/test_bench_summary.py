"""krex bench's summary on constructed results: figures with no data read n/a (never 0.0%),
the headline has every krex cell, tau and flips fall back to the native-serial passes, region
entry quantiles come from the journal's region records, and the flags are scored against
native (precision and recall per reason)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from krex import bench
from krex.bench import fidelity


def _cell(key: str, makespan: float = 60.0) -> dict[str, Any]:
    c = bench.Cell.from_key(key)
    return {
        "cell": key,
        "mode": c.mode,
        "c": c.c,
        "run": key,
        "n_runs": 1,
        "failures": 0,
        "started_at": 0.0,
        "ended_at": makespan,
        "makespan_s": makespan,
        "last_start_s": makespan / 2,
    }


def _rec(
    cell: str,
    name: str,
    ms: float,
    family: str | None = None,
    rep: int = 0,
    regions: list[dict[str, Any]] | None = None,
    **result: Any,
) -> dict[str, Any]:
    c = bench.Cell.from_key(cell)
    res = {"ms": ms, "correct": True, "t_total_s": 1.0, **result}
    return {
        "run": cell,
        "cell": cell,
        "mode": c.mode,
        "c": c.c,
        "rep": rep,
        "name": name,
        "family": family,
        "ok": True,
        "wall_s": 1.0,
        "started_at": 0.0,
        "ended_at": 1.0,
        "result": res,
        "krex": {"regions": regions if regions is not None else [{"entry_s": 0.01, "queue_wait_s": 0.0}]}
        if c.mode == "krex"
        else None,
    }


def _ws(tmp_path: Path, names: dict[str, float], family: str | None = None) -> list[bench.Workload]:
    script = tmp_path / "x.py"
    script.write_text("")
    return [
        bench.Workload(
            n,
            "sim",
            script,
            (),
            family=family,
            param=i,
            truth="param" if family else None,
            work=(100 + 10 * i) if family else None,
            expect_ms=ms,
        )
        for i, (n, ms) in enumerate(names.items())
    ]


META = {"device": "sim", "quick": False, "seed": 0, "repeat": 1, "versions": {}}


def test_figures_without_data_read_na_never_zero(tmp_path: Path) -> None:
    """Commands that print no t_region_s nor region_entry_s (an automatic region the command
    cannot see): the critical fraction and the client entry have no data, and say n/a."""
    ws = _ws(tmp_path, {"a": 2.0, "b": 3.0})
    recs = [_rec(cell, n, ms) for cell in ("native-serial", "krex-2") for n, ms in (("a", 2.0), ("b", 3.0))]
    s = bench.compute_summary(META, [_cell("native-serial"), _cell("krex-2")], recs, ws)
    assert s["critical"]["n"] == 0
    assert math.isnan(s["critical"]["p50"]) and math.isnan(s["critical"]["aggregate"])
    assert s["regions"]["krex-2"]["client_entry_s"]["n"] == 0
    md = bench.render_summary_md(s)
    crit = md.split("## Critical-region fraction")[1].split("##")[0]
    assert "0.0%" not in crit and "100%" not in crit
    assert "| 0 | n/a | n/a | n/a |" in crit
    # a band with no kernel in it (nothing above 10 ms) reads n/a, not 0.00% or "-"
    infl = md.split("## Timing inflation against native-serial")[1].split("###")[0]
    assert "| krex-2 | >10ms | 0 | n/a | n/a | n/a |" in infl
    head = md.split("## Headline")[1].split("## Throughput")[0]
    assert "p95 timing inflation, kernels >10ms | <= 0.30% | 0.30% | n/a | n/a |" in head


def test_headline_has_every_krex_cell(tmp_path: Path) -> None:
    ws = _ws(tmp_path, {"a": 2.0, "b": 20.0})
    ref = {"a": 2.0, "b": 20.0}
    recs = [_rec("native-serial", n, v) for n, v in ref.items()]
    recs += [_rec("krex-4", n, v * 1.001) for n, v in ref.items()]
    recs += [_rec("krex-8", n, v * 1.01) for n, v in ref.items()]
    recs += [_rec("unprotected-8", n, v * 1.05) for n, v in ref.items()]
    cells = [
        _cell("native-serial", 60.0),
        _cell("krex-4", 20.0),
        _cell("krex-8", 10.0),
        _cell("unprotected-8", 11.0),
    ]
    s = bench.compute_summary(META, cells, recs, ws)
    h = s["headline"]
    assert h["krex_cells"] == ["krex-4", "krex-8"]
    by = {(g["cell"], g["metric"]): g for g in h["goals"]}
    for k in ("krex-4", "krex-8"):
        assert (k, "throughput vs native serial") in by
        assert (k, "p95 timing inflation, kernels >10ms") in by
    assert by[("krex-4", "p95 timing inflation, kernels >10ms")]["met"] == "yes"
    assert by[("krex-8", "p95 timing inflation, kernels >10ms")]["met"] == "NO"
    # krex-8 against unprotected-8: 10 s against 11 s of makespan
    vs = by[("krex-8", "throughput vs unprotected (same C)")]
    assert vs["met"] == "yes" and "1.10x" in vs["ours"]
    assert by[("krex-4", "throughput vs unprotected (same C)")]["met"] == "n/a"
    md = bench.render_summary_md(s)
    head = md.split("## Headline")[1].split("## Throughput")[0]
    assert "| krex-4 | p95 timing inflation, kernels >10ms |" in head
    assert "| krex-8 | p95 timing inflation, kernels >10ms |" in head


def test_tau_and_flips_fall_back_to_native_serial_passes(tmp_path: Path) -> None:
    """No native-repeat cell, two native-serial passes: the krex cell's tau and flips are
    compared with the native-serial passes' (one of which swaps f-1 and f-2)."""
    ws = _ws(tmp_path, {"f-0": 1.0, "f-1": 1.1, "f-2": 1.2, "f-3": 1.3}, family="f")
    true = {"f-0": 1.0, "f-1": 1.1, "f-2": 1.2, "f-3": 1.3}
    swapped = {**true, "f-1": 1.25}
    recs = [_rec("native-serial", n, v, "f", rep=0) for n, v in true.items()]
    recs += [_rec("native-serial", n, v, "f", rep=1) for n, v in swapped.items()]
    recs += [_rec("krex-4", n, v, "f", rep=r) for r in (0, 1) for n, v in true.items()]
    s = bench.compute_summary({**META, "repeat": 2}, [_cell("native-serial"), _cell("krex-4")], recs, ws)
    h = s["headline"]
    assert h["tau_baseline"] == "native-serial"
    assert h["tau"]["native-serial"] == pytest.approx((1.0 + 4 / 6) / 2)
    by = {(g["cell"], g["metric"]): g for g in h["goals"]}
    tau = by[("krex-4", "Kendall tau (median per family and pass)")]
    assert tau["goal"] == ">= native serial passes" and tau["met"] == "yes"
    flips = [g for (c, m), g in by.items() if c == "krex-4" and m.startswith("pairwise flip rate")]
    assert flips and all(g["met"] == "yes" for g in flips)
    assert all("native serial passes" in g["ours"] for g in flips)


def test_entry_quantiles_come_from_the_region_records(tmp_path: Path) -> None:
    ws = _ws(tmp_path, {"a": 2.0})
    regions = [
        {"entry_s": i / 1000, "queue_wait_s": 0.002, "drain_s": i / 2000, "settle_s": 0.001}
        for i in range(1, 101)
    ]
    recs = [_rec("native-serial", "a", 2.0)]
    recs += [_rec("krex-8", "a", 2.0, regions=[g]) for g in regions]
    s = bench.compute_summary(META, [_cell("native-serial"), _cell("krex-8")], recs, ws)
    e = s["entry"]["krex-8"]
    assert e["regions"] == 100
    # 1..100 ms, linear interpolation: p50 = 50.5, p95 = 95.05, p99 = 99.01
    assert e["entry_s"]["p50"] == pytest.approx(0.0505)
    assert e["entry_s"]["p95"] == pytest.approx(0.09505)
    assert e["entry_s"]["p99"] == pytest.approx(0.09901)
    assert e["request_to_grant_s"]["p99"] == pytest.approx(0.10101)
    assert e["drain_s"]["p95"] == pytest.approx(0.047525)
    assert "native-serial" not in s["entry"]
    md = bench.render_summary_md(s)
    assert "| krex-8 | 100 | 50.5 | 95.0 | 99.0 |" in md


def test_flag_precision_and_recall_against_native(tmp_path: Path) -> None:
    """Ten commands of 2 ms; native repeat moves them by at most 0.5 % (the noise). In krex-8
    four runs are inflated by 3 %; throttle flags two of them and one clean run; recent-free
    flags one clean run only."""
    names = {f"c{i}": 2.0 for i in range(10)}
    ws = _ws(tmp_path, names)
    recs = [_rec("native-serial", n, 2.0) for n in names]
    recs += [_rec("native-repeat", n, 2.0 * (1 + 0.005 * (i % 2))) for i, n in enumerate(names)]

    def reg(*flags: str) -> list[dict[str, Any]]:
        return [{"entry_s": 0.01, "queue_wait_s": 0.0, "flags": list(flags), "contaminated": bool(flags)}]

    plan = {
        "c0": (1.03, reg("throttle")),
        "c1": (1.03, reg("throttle")),
        "c2": (1.03, reg()),
        "c3": (1.03, reg()),
        "c4": (1.001, reg("throttle")),
        "c5": (1.001, reg("recent-free")),
    }
    for n in names:
        f, regs = plan.get(n, (1.0, reg()))
        recs.append(_rec("krex-8", n, 2.0 * f, regions=regs))
    cells = [_cell("native-serial"), _cell("native-repeat"), _cell("krex-8")]
    s = bench.compute_summary(META, cells, recs, ws)
    assert s["flag_thresholds"]["1-10ms"] == pytest.approx(0.005)
    f = s["flags"]["krex-8"]
    assert f["judged"] == 10 and f["inflated"] == 4
    thr = f["by_reason"]["throttle"]
    assert (thr["flagged"], thr["flagged_and_inflated"]) == (3, 2)
    assert thr["precision"] == pytest.approx(2 / 3) and thr["recall"] == pytest.approx(0.5)
    rf = f["by_reason"]["recent-free"]
    assert rf["precision"] == 0.0 and rf["recall"] == 0.0
    anyf = f["by_reason"][fidelity.ANY]
    assert anyf["flagged"] == 4 and anyf["precision"] == pytest.approx(0.5)
    md = bench.render_summary_md(s)
    assert "| krex-8 | 10 | 4 | throttle | 3 | 2 | 67% | 50% |" in md
    # a stated threshold replaces the native noise: above 5 % nothing is inflated, recall n/a
    s2 = bench.compute_summary({**META, "inflated_above": 0.05}, cells, recs, ws)
    f2 = s2["flags"]["krex-8"]
    assert f2["inflated"] == 0 and f2["by_reason"]["throttle"]["recall"] is None
    assert "| krex-8 | 10 | 0 | throttle | 3 | 0 | 0% | n/a |" in bench.render_summary_md(s2)


def test_flags_without_native_noise_are_not_judged(tmp_path: Path) -> None:
    ws = _ws(tmp_path, {"a": 2.0})
    recs = [_rec("native-serial", "a", 2.0), _rec("krex-8", "a", 2.2)]
    s = bench.compute_summary(META, [_cell("native-serial"), _cell("krex-8")], recs, ws)
    f = s["flags"]["krex-8"]
    assert f["runs"] == 1 and f["judged"] == 0
    assert f["by_reason"][fidelity.ANY]["precision"] is None


def test_nvml_figures_split_by_inflation(tmp_path: Path) -> None:
    names = {f"c{i}": 20.0 for i in range(4)}
    ws = _ws(tmp_path, names)
    recs = [_rec("native-serial", n, 20.0) for n in names]
    for i, n in enumerate(names):
        slow = i < 2
        g = {
            "entry_s": 0.01,
            "queue_wait_s": 0.0,
            "attest": {"sm_clock_mhz": [1500 if slow else 1980, 1980]},
            "nvml": {
                "entry": {"sm_mhz": 1500 if slow else 1980, "power_w": 600.0, "temp_c": 70},
                "inside": {"n": 5, "sm_min": 1400 if slow else 1950, "power_max_w": 700.0, "temp_max_c": 72},
            },
        }
        recs.append(_rec("krex-16", n, 20.0 * (1.05 if slow else 1.0), regions=[g]))
    s = bench.compute_summary(
        {**META, "inflated_above": 0.01}, [_cell("native-serial"), _cell("krex-16")], recs, ws
    )
    nv = s["nvml"]["krex-16"]
    assert nv["inflated"]["regions"] == 2 and nv["not inflated"]["regions"] == 2
    assert nv["inflated"]["sm_mhz_at_grant"]["p50"] == 1500
    assert nv["not inflated"]["sm_mhz_min_inside"]["p50"] == 1950
    assert nv["inflated"]["krexd_sm_mhz_at_grant"]["p50"] == 1500
    md = bench.render_summary_md(s)
    assert "| krex-16 | inflated | 2 | 1500 | 1400 | 1500 | 600 | 700 | 70 | 72 |" in md


def test_nvml_figures_read_na_on_the_simulated_gpu(tmp_path: Path) -> None:
    ws = _ws(tmp_path, {"a": 2.0})
    recs = [_rec("native-serial", "a", 2.0), _rec("krex-2", "a", 2.0)]
    s = bench.compute_summary(
        {**META, "inflated_above": 0.01}, [_cell("native-serial"), _cell("krex-2")], recs, ws
    )
    md = bench.render_summary_md(s)
    assert "| krex-2 | not inflated | 1 | n/a | n/a | n/a | n/a | n/a | n/a | n/a |" in md


def test_nvml_window_at_grant_and_inside() -> None:
    from krex.bench.nvmlsample import window

    ms = 1_000_000
    samples = [(t * 25 * ms, 1980 - t, 400_000 + 1000 * t, 50 + t) for t in range(10)]  # every 25 ms
    got = window(samples, 60 * ms, 130 * ms, 75 * ms)
    assert got is not None
    assert got["entry"] == {"sm_mhz": 1978, "power_w": 402.0, "temp_c": 52, "age_ms": 10.0}
    # inside [60, 130] ms: the samples at 75, 100 and 125 ms
    assert got["inside"]["n"] == 3
    assert got["inside"]["sm_min"] == 1975 and got["inside"]["power_max_w"] == 405.0
    assert got["inside"]["temp_max_c"] == 55
    assert window(samples, 900 * ms, 901 * ms, 75 * ms) is None  # nothing near: no figures
    # a sample just after the grant stands for it when none came before
    first = window(samples, -5 * ms, -1 * ms, 75 * ms)
    assert first is not None and first["entry"]["age_ms"] == -5.0 and first["inside"]["n"] == 0


def test_nvml_sampler_annotates_regions_from_a_fake_nvml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json
    import time

    from krex.bench.nvmlsample import NVML_FILE, Sampler
    from krex.device.nvml import FakeNvml

    fake = tmp_path / "nvml.json"
    fake.write_text(json.dumps({"gpus": [{"sm_clock": 1755, "power_mw": 612000, "temp_c": 66}]}))
    s = Sampler(FakeNvml(str(fake)), [0], 0.01, tmp_path / NVML_FILE).start()
    try:
        t0 = time.monotonic_ns()
        time.sleep(0.08)
        t1 = time.monotonic_ns()
        time.sleep(0.02)
        rep: dict[str, Any] = {"gpu": 0, "regions": [{"t_grant_ns": t0, "t_end_ns": t1}, {"t_grant_ns": 0}]}
        s.annotate(rep)
    finally:
        s.stop()
    nv = rep["regions"][0]["nvml"]
    assert nv["entry"]["sm_mhz"] == 1755 and nv["entry"]["power_w"] == 612.0
    assert nv["inside"]["n"] >= 3 and nv["inside"]["temp_max_c"] == 66
    assert "nvml" not in rep["regions"][1]  # a region without its grant time gets no figures
    lines = (tmp_path / NVML_FILE).read_text().splitlines()
    assert len(lines) >= 5 and json.loads(lines[0])["sm_mhz"] == 1755


def test_flag_thresholds_without_noise_read_na(tmp_path: Path) -> None:
    """A band with no native noise has no threshold: summary.md says n/a (never nan%)."""
    ws = _ws(tmp_path, {"a": 2.0})
    recs = [_rec("native-serial", "a", 2.0, rep=0), _rec("native-serial", "a", 2.02, rep=1)]
    recs += [_rec("krex-2", "a", 2.0)]
    s = bench.compute_summary({**META, "repeat": 2}, [_cell("native-serial"), _cell("krex-2")], recs, ws)
    md = bench.render_summary_md(s)
    line = next(ln for ln in md.splitlines() if ln.startswith("A krex run is *inflated*"))
    assert "nan" not in line and "<0.1ms n/a" in line and ">10ms n/a" in line and "1-10ms 0.50%" in line
