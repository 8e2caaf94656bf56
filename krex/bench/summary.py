"""Every metric of a bench results directory (`compute_summary`, pure) and its Markdown
(`render_summary_md`): the goal, the paper's figures and ours side by side."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from krex.bench import fidelity as fd
from krex.bench import metrics as bm
from krex.bench.corpus import Workload
from krex.bench.headline import headline
from krex.bench.plan import CONCURRENT, KREX_MODES, MODES, Cell
from krex.bench.records import (
    CellRanking,
    CellRegions,
    CellRow,
    Critical,
    DistJson,
    Failure,
    RunRecord,
    Summary,
    ThroughputRow,
    Truth,
)
from krex.node.optin import INDUCTOR_PATHS

__all__ = ["GOAL_THROUGHPUT", "PAPER", "SIM_LABEL", "compute_summary", "json_safe", "render_summary_md"]

SIM_LABEL = "SIMULATED GPU - logic demo, not performance evidence"

# The paper's figures (arXiv:2609.30057, NVIDIA H20) and our goals for them.
PAPER: dict[str, Any] = {
    "throughput_ratio": 3.4,
    "native_cpm": 16.0,
    "krex_cpm": 54.8,
    "unprotected_cpm": 41.9,
    "p95_inflation": {">10ms": 0.0030, ">1ms": 0.0158, ">0.1ms": 0.0390},
    "tau": {"krex": 0.857, "native-repeat": 0.820, "unprotected": 0.432},
    "flip_pp": 0.03,
    "critical_fraction_median": 0.12,
}
GOAL_THROUGHPUT = 4.0


def json_safe(v: Any) -> Any:
    if isinstance(v, float):
        return None if not math.isfinite(v) else v
    if isinstance(v, dict):
        return {str(k): json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return v


def _ms(r: RunRecord) -> float | None:
    res = r.get("result")
    if not r.get("ok") or not isinstance(res, dict):
        return None
    v = res.get("ms")
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else None


def _cell_sort_key(key: str) -> tuple[int, int, str, int, str]:
    c = Cell.from_key(key)
    return MODES.index(c.mode), c.c, c.freeze, c.prewarm, c.lend


@dataclass
class _Runs:
    """A results directory's records by cell and its cells in report order; `notes`
    collects what the sections could not compute, in the order they ran."""

    by_cell: dict[str, list[RunRecord]]
    cell_rows: dict[str, CellRow]
    keys: list[str]
    notes: list[str]

    def of(self, key: str) -> list[RunRecord]:
        return self.by_cell.get(key, [])


def compute_summary(
    meta: dict[str, Any],
    cells: Sequence[CellRow],
    recs: Sequence[RunRecord],
    workloads: Sequence[Workload],
) -> Summary:
    """Every metric of a results directory, as one JSON-able dict (see docs/bench.md)."""
    by_cell: dict[str, list[RunRecord]] = defaultdict(list)
    for r in recs:
        by_cell[str(r.get("cell"))].append(r)
    cell_rows = {str(c["cell"]): c for c in cells}
    rs = _Runs(by_cell, cell_rows, sorted(cell_rows, key=_cell_sort_key), list(meta.get("notes", [])))
    wl = {w.name: w for w in workloads}

    ref_ms, ref_wall = _reference(rs)
    ns_cpm, thr = _throughput(rs)
    infl, split = _inflation(rs, ref_ms)
    noise_pairs, noise_src = _noise_pairs(rs, ref_ms, split)
    noise_p95 = {b: bm.percentile(v, 95) for b, v in bm.inflation_by_band(noise_pairs).items()}
    per_gpu = _inflation_per_gpu(meta, rs, ref_ms)
    truth = _truth(rs, workloads)
    ranking = _ranking(rs, truth)
    critical = _critical(rs.of("native-serial") or rs.of("native-repeat"))
    regions = _regions(rs)
    failures: list[Failure] = [
        {
            "cell": r.get("cell"),
            "name": r.get("name"),
            "rep": r.get("rep"),
            "exit_status": r.get("exit_status"),
            "error": r.get("error"),
            "stderr_tail": (r.get("stderr_tail") or "")[-400:],
        }
        for r in recs
        if not r.get("ok")
    ]

    head = headline(thr, infl, noise_p95, ranking, critical, ns_cpm, PAPER, GOAL_THROUGHPUT)
    if head.get("tau_baseline") == "native-serial":
        rs.notes.append(
            "no native-repeat cell: tau and flip rates are held against the native-serial passes"
        )
    stated = meta.get("inflated_above")
    thresholds = fd.noise_thresholds(noise_pairs, float(stated) if stated is not None else None)
    entry, flag_scores, nvml = _fidelity(rs, ref_ms, thresholds)
    sim = meta.get("device") == "sim"
    return {
        "device": meta.get("device"),
        "simulated": sim,
        "label": SIM_LABEL if sim else "",
        "quick": meta.get("quick"),
        "seed": meta.get("seed"),
        "repeat": meta.get("repeat"),
        "commands": len(workloads),
        "cold_cache": meta.get("cold_cache"),
        "versions": meta.get("versions", {}),
        "workload_versions": _workload_versions(recs),
        "invocations": meta.get("invocations", []),
        "cells_done": rs.keys,
        "throughput": thr,
        "native_cpm": ns_cpm,
        "reference": {"ms": ref_ms, "wall_s": ref_wall, "expect_ms": {n: w.expect_ms for n, w in wl.items()}},
        "inflation": infl,
        "inflation_split": split,
        "inflation_per_gpu": per_gpu,
        "truth": truth,
        "ranking": ranking,
        "critical": critical,
        "regions": regions,
        "headline": head,
        "entry": entry,
        "flags": flag_scores,
        "flag_thresholds": thresholds,
        "flag_threshold_source": f"stated: {100 * float(stated):.2f}%" if stated is not None else noise_src,
        "nvml": nvml,
        "failures": failures,
        "notes": list(dict.fromkeys(rs.notes)),
        "paper": PAPER,
    }


def _reference(rs: _Runs) -> tuple[dict[str, float], dict[str, float]]:
    """Reference per command: median ms and wall over the native-serial cell."""
    ref_ms: dict[str, float] = {}
    ref_wall: dict[str, float] = {}
    ns = rs.of("native-serial")
    for name in {r["name"] for r in ns}:
        xs = [m for r in ns if r["name"] == name and (m := _ms(r)) is not None]
        walls_n = [float(w) for r in ns if r["name"] == name and r.get("ok") and (w := r.get("wall_s"))]
        if xs:
            ref_ms[name] = bm.median(xs)
        if walls_n:
            ref_wall[name] = bm.median(walls_n)
    if not ref_ms:
        rs.notes.append("no native-serial results: inflation and the throughput ratio are not available")
    return ref_ms, ref_wall


def _throughput(rs: _Runs) -> tuple[float, list[ThroughputRow]]:
    """native-serial's commands per minute, and one throughput row per non-reference cell."""
    ns_cpm = math.nan
    if "native-serial" in rs.cell_rows:
        row = rs.cell_rows["native-serial"]
        n_ok = sum(1 for r in rs.of("native-serial") if r.get("ok"))
        ns_cpm = bm.throughput_per_min(n_ok, float(row["makespan_s"]))
    thr: list[ThroughputRow] = []
    for k in rs.keys:
        row = rs.cell_rows[k]
        if row["mode"] == "reference":
            continue
        runs = rs.of(k)
        n_ok = sum(1 for r in runs if r.get("ok"))
        cpm = bm.throughput_per_min(n_ok, float(row["makespan_s"]))
        walls = [float(w) for r in runs if (w := r.get("wall_s"))]
        last = float(row.get("last_start_s") or 0.0)
        t0 = float(row["started_at"])
        steady = math.nan
        if last > 0 and row["mode"] in CONCURRENT:
            n_in = sum(
                1 for r in runs if r.get("ok") and (e := r.get("ended_at")) and float(e) - t0 <= last
            )
            if n_in >= int(row["c"]):
                steady = 60.0 * n_in / last
        thr.append(
            {
                "cell": k,
                "mode": row["mode"],
                "c": int(row["c"]),
                "n_runs": int(row["n_runs"]),
                "failures": int(row["failures"]),
                "makespan_s": float(row["makespan_s"]),
                "cmds_per_min": cpm,
                "ratio": cpm / ns_cpm if ns_cpm and math.isfinite(ns_cpm) else math.nan,
                "steady_cmds_per_min": steady,
                "mean_wall_s": sum(walls) / len(walls) if walls else math.nan,
            }
        )
    return ns_cpm, thr


def _pairs(runs: Iterable[RunRecord], ref_ms: dict[str, float]) -> list[tuple[float, float]]:
    """(native-serial ms, measured ms) of each run with both."""
    return [(ref_ms[r["name"]], m) for r in runs if r["name"] in ref_ms and (m := _ms(r)) is not None]


def _inflation(
    rs: _Runs, ref_ms: dict[str, float]
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, DistJson]]]:
    """Inflation vs native-serial per cell: nested bands (with the values) and disjoint bands."""
    infl: dict[str, dict[str, Any]] = {}
    split: dict[str, dict[str, DistJson]] = {}
    for k in rs.keys:
        if k in ("native-serial", "reference"):
            continue
        pairs = _pairs(rs.of(k), ref_ms)
        bands = bm.inflation_by_band(pairs)
        infl[k] = {b: {**bm.dist(v).to_json(), "values": v} for b, v in bands.items()}
        split[k] = {b: bm.dist(v).to_json() for b, v in bm.inflation_by_split_band(pairs).items()}
    return infl, split


def _noise_pairs(
    rs: _Runs, ref_ms: dict[str, float], split: dict[str, dict[str, DistJson]]
) -> tuple[list[tuple[float, float]], str]:
    """The native noise floor's pairs and where they come from. When no native-repeat cell
    ran but native-serial made several passes: each native run against its command's
    native median (then also a "native-serial passes" row of `split`)."""
    ns_runs = [r for r in rs.of("native-serial") if r["name"] in ref_ms and _ms(r) is not None]
    if "native-repeat" in rs.cell_rows:
        return _pairs(rs.of("native-repeat"), ref_ms), "p95 |inflation| of native-repeat"
    if len({r.get("rep", 0) for r in ns_runs}) > 1:
        noise_pairs = [(ref_ms[r["name"]], float(_ms(r) or 0.0)) for r in ns_runs]
        split["native-serial passes"] = {
            b: bm.dist(v).to_json() for b, v in bm.inflation_by_split_band(noise_pairs).items()
        }
        return noise_pairs, "p95 |inflation| of the native-serial passes against their median"
    return [], "none (no native-repeat cell, one native-serial pass)"


def _inflation_per_gpu(
    meta: dict[str, Any], rs: _Runs, ref_ms: dict[str, float]
) -> dict[str, dict[str, dict[str, Any]]]:
    """Fidelity per GPU, when the concurrent cells were spread over several (--gpus)."""
    per_gpu: dict[str, dict[str, dict[str, Any]]] = {}
    if len(meta.get("gpus") or []) <= 1:
        return per_gpu
    for k in rs.keys:
        if rs.cell_rows[k]["mode"] not in CONCURRENT:
            continue
        by_gpu: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for r in rs.of(k):
            if r["name"] in ref_ms and (m := _ms(r)) is not None and r.get("gpu") is not None:
                by_gpu[str(r["gpu"])].append((ref_ms[r["name"]], m))
        per_gpu[k] = {
            g: {"n": len(p), **{b: bm.dist(v).to_json() for b, v in bm.inflation_by_band(p).items()}}
            for g, p in sorted(by_gpu.items())
        }
    return per_gpu


def _truth(rs: _Runs, workloads: Sequence[Workload]) -> dict[str, Truth]:
    """The true order per family: its parameter, else the reference cell's (or the native
    passes') median ms per candidate."""
    fams: dict[str, list[Workload]] = defaultdict(list)
    for w in workloads:
        if w.family:
            fams[w.family].append(w)
    truth: dict[str, Truth] = {}
    refc = rs.of("reference")
    for fam, ws in sorted(fams.items()):
        kind = ws[0].truth
        if kind == "param":
            truth[fam] = {"kind": "param", "values": {w.name: float(w.work or 0.0) for w in ws}}
            continue
        src = [r for r in refc if r.get("family") == fam]
        how = "reference"
        if not src:
            src = [r for r in rs.of("native-serial") + rs.of("native-repeat") if r.get("family") == fam]
            how = "native passes"
            if src:
                rs.notes.append(
                    f"family {fam}: no reference pass; true order taken from the native passes "
                    "(native ranking figures for it are then not independent)"
                )
        vals: dict[str, float] = {}
        for w in ws:
            xs = [m for r in src if r["name"] == w.name and (m := _ms(r)) is not None]
            if xs:
                vals[w.name] = bm.median(xs)
        if len(vals) >= 2:
            truth[fam] = {"kind": f"measured ({how})", "values": vals}
        else:
            rs.notes.append(f"family {fam}: no true order (no measurements); left out of the ranking metrics")
    return truth


def _ranking(rs: _Runs, truth: dict[str, Truth]) -> dict[str, CellRanking]:
    """Per cell: Kendall tau per family and pass against the true order, and flip rates."""
    ranking: dict[str, CellRanking] = {}
    for k in rs.keys:
        if k == "reference":
            continue
        runs = rs.of(k)
        taus: dict[str, list[float]] = {}
        flip_pairs: list[tuple[float, bool]] = []
        for fam, t in truth.items():
            per_rep: dict[int, dict[str, float]] = defaultdict(dict)
            for r in runs:
                if r.get("family") == fam and r["name"] in t["values"] and (m := _ms(r)) is not None:
                    per_rep[int(r.get("rep", 0))][r["name"]] = m
            taus[fam] = []
            for _rep, got in sorted(per_rep.items()):
                names = [n for n in t["values"] if n in got]
                if len(names) < 3:
                    continue
                tv = [t["values"][n] for n in names]
                mv = [got[n] for n in names]
                tau = bm.kendall_tau(tv, mv)
                if math.isfinite(tau):
                    taus[fam].append(tau)
                flip_pairs.extend(bm.pairwise_flips(tv, mv))
        all_t = [x for v in taus.values() for x in v]
        ranking[k] = {
            "tau": taus,
            "tau_median": bm.median(all_t) if all_t else math.nan,
            "tau_n": len(all_t),
            "flip": {c: fr.to_json() for c, fr in bm.flip_rates(flip_pairs).items()},
        }
    return ranking


def _critical(src: Sequence[RunRecord]) -> Critical:
    """Critical fraction over `src` (native-serial, else any native pass)."""
    fr_list: list[float] = []
    reg_sum = tot_sum = 0.0
    for r in src:
        res = r.get("result")
        if not r.get("ok") or not isinstance(res, dict):
            continue
        # A command that prints no t_region_s (or null) has no fraction: never a 0 %.
        if not isinstance(res.get("t_region_s"), (int, float)):
            continue
        tr, tt = float(res["t_region_s"]), float(res.get("t_total_s") or 0.0)
        if tt > 0:
            fr_list.append(bm.critical_fraction(tr, tt))
            reg_sum += tr
            tot_sum += tt
    agg = reg_sum / tot_sum if tot_sum > 0 else math.nan

    def pct(q: float) -> float:
        return bm.percentile(fr_list, q) if fr_list else math.nan

    return {
        "n": len(fr_list),
        "fractions": fr_list,
        "p10": pct(10), "p25": pct(25), "p50": pct(50), "p75": pct(75), "p90": pct(90),
        "share_below_25": (sum(1 for f in fr_list if f < 0.25) / len(fr_list)) if fr_list else math.nan,
        "aggregate": agg,
        "amdahl_bound": bm.amdahl_bound(agg) if math.isfinite(agg) else math.nan,
        "median_bound": bm.amdahl_bound(bm.median(fr_list)) if fr_list else math.nan,
        "paper_median": PAPER["critical_fraction_median"],
    }


def _regions(rs: _Runs) -> dict[str, CellRegions]:
    """Region entry overhead, queue wait and what KREX could not vouch for, per cell."""
    regions: dict[str, CellRegions] = {}
    for k in rs.keys:
        runs = [r for r in rs.of(k) if isinstance(r.get("result"), dict)]
        if runs:
            regions[k] = _cell_regions(runs)
    return regions


def _cell_regions(runs: Sequence[RunRecord]) -> CellRegions:
    client = [  # commands timed by an automatic region cannot see its entry: null, no data
        float(v) for r in runs if isinstance(v := (r["result"] or {}).get("region_entry_s"), (int, float))
    ]
    qw: list[float] = []
    proto: list[float] = []
    adm: list[float] = []
    contaminated = nreg = cut = no_region = 0
    flags: dict[str, int] = {}
    wrapped: set[str] = set()
    inductor: dict[str, int] = {}  # Inductor's autotuning regions per path (optin.region_tally)
    for r in runs:
        kr = r.get("krex") or {}
        if r.get("krex") is not None and not kr.get("regions"):
            no_region += 1
        for w in (kr.get("auto_region") or {}).get("wrapped") or []:
            wrapped.add(str(w))
        for path, n in (kr.get("inductor_regions") or {}).items():
            inductor[str(path)] = inductor.get(str(path), 0) + int(n or 0)
        for g in kr.get("regions") or []:
            nreg += 1
            contaminated += int(bool(g.get("contaminated")))
            cut += int(bool(g.get("cut")))
            for f in g.get("flags") or []:
                flags[str(f)] = flags.get(str(f), 0) + 1
            if g.get("queue_wait_s") is not None:
                qw.append(float(g["queue_wait_s"]))
            if g.get("entry_s") is not None:
                proto.append(float(g["entry_s"]))
        if kr.get("admission_wait_s") is not None:
            adm.append(float(kr["admission_wait_s"]))
    return {
        "client_entry_s": bm.dist(client).to_json(),
        "queue_wait_s": bm.dist(qw).to_json(),
        "protocol_entry_s": bm.dist(proto).to_json(),
        "admission_wait_s": bm.dist(adm).to_json(),
        "regions": nreg,
        "contaminated": contaminated,
        # Trust: what KREX could not vouch for (attestation flags included).
        "cut": cut,
        "flags": flags,
        "runs_without_region": no_region,
        "auto_wrapped": sorted(wrapped),
        "inductor_regions": dict(sorted(inductor.items())),
    }


def _fidelity(
    rs: _Runs, ref_ms: dict[str, float], thresholds: dict[str, float]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Entry quantiles, the flags against native and NVML, per krex cell (fidelity.py)."""
    entry: dict[str, Any] = {}
    flag_scores: dict[str, Any] = {}
    nvml: dict[str, Any] = {}
    for k in rs.keys:
        if rs.cell_rows[k]["mode"] not in KREX_MODES:
            continue
        runs = rs.of(k)
        entry[k] = fd.entry_stats(runs)
        judged = fd.judge_runs(runs, ref_ms, thresholds)
        flag_scores[k] = fd.flag_scores(judged)
        nvml[k] = fd.nvml_stats(judged)
    return entry, flag_scores, nvml


def _workload_versions(recs: Iterable[RunRecord]) -> dict[str, list[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for r in recs:
        res = r.get("result")
        if isinstance(res, dict):
            for k in ("torch", "triton"):
                if res.get(k):
                    out[k].add(str(res[k]))
    return {k: sorted(v) for k, v in out.items()}


# ----------------------------------------------------------------------------------- summary.md


def _pct(x: Any, digits: int = 2) -> str:
    """A fraction as a percentage; n/a where there is no data (None, NaN): never 0.0%."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return "n/a"
    return "n/a" if not math.isfinite(v) else f"{100 * v:.{digits}f}%"


def _num(x: Any, fmt: str = "{:.2f}") -> str:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return "n/a"
    return "n/a" if not math.isfinite(v) else fmt.format(v)


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def render_summary_md(s: Summary, out_dir: Path | None = None) -> str:
    """summary.md: the goal, the paper's figures and ours side by side, then details."""
    return "\n".join(line for section in _MD_SECTIONS for line in section(s))


def _md_intro(s: Summary) -> list[str]:
    """The title, the simulated-GPU warning and the run's settings and versions."""
    L: list[str] = ["# krex bench results", ""]  # noqa: N806
    if s.get("simulated"):
        L += [
            f"> **{SIM_LABEL}.** The simulated GPU models time-slicing only; every number below shows "
            "whether the logic works, never how a real GPU performs.",
            "",
        ]
    v = s.get("versions", {})
    wv = s.get("workload_versions", {})
    L += [
        f"- device: **{s.get('device')}** ({', '.join(v.get('gpu_names') or []) or '-'}); "
        f"{v.get('cpus')} CPUs; {v.get('platform')}",
        f"- krex {v.get('krex')}, Python {v.get('python')}"
        + (f", torch {', '.join(wv['torch'])}" if wv.get("torch") else "")
        + (f", triton {', '.join(wv['triton'])}" if wv.get("triton") else ""),
        f"- corpus: {s.get('commands')} commands{' (--quick)' if s.get('quick') else ''}, "
        f"{s.get('repeat')} pass(es) per cell, seed {s.get('seed')}, "
        f"{'fresh compiler caches per run' if s.get('cold_cache') else 'shared compiler caches'}",
        f"- cells done: {', '.join(s.get('cells_done') or []) or '-'}",
    ]
    for inv in s.get("invocations", []):
        L.append(f"- run {inv.get('started')}: `{' '.join(inv.get('argv') or []) or 'krex bench'}`")
    L += [""]
    return L


def _md_headline(s: Summary) -> list[str]:
    """The goals, the paper's figures and ours, one block of rows per krex cell."""
    L: list[str] = []  # noqa: N806
    h = s.get("headline", {})
    L += ["## Headline: goal, paper (NVIDIA H20) and ours", ""]
    if h.get("krex_cells"):
        base = {"native-repeat": "the native-repeat cell", "native-serial": "the native-serial passes"}.get(
            str(h.get("tau_baseline")), "no native cell"
        )
        L += [
            f"One block of rows per krex cell ({', '.join(h['krex_cells'])}), each against the unprotected "
            f"cell of the same C; the native noise and the tau and flip baseline are {base}. Rows with cell "
            "`-` hold for the whole run. n/a: no data.",
            "",
        ]
    L += _table(
        ["cell", "metric", "goal", "paper", "ours", "goal met"],
        [
            [g.get("cell", "-"), g["metric"], g["goal"], g["paper"], g["ours"], g["met"]]
            for g in h.get("goals", [])
        ],
    )
    L += [""]
    return L


def _md_throughput(s: Summary) -> list[str]:
    """Commands per minute per cell."""
    L: list[str] = []  # noqa: N806
    L += [
        "## Throughput",
        "",
        "Commands per minute = runs / makespan of the cell (first start to last end). "
        "`steady` counts only the runs that ended while the cell still had commands waiting to start.",
        "",
    ]
    L += _table(
        [
            "cell",
            "C",
            "runs",
            "failed",
            "makespan s",
            "cmds/min",
            "vs native-serial",
            "steady cmds/min",
            "mean wall s",
        ],
        [
            [
                t["cell"],
                str(t["c"]),
                str(t["n_runs"]),
                str(t["failures"]),
                _num(t["makespan_s"], "{:.1f}"),
                _num(t["cmds_per_min"], "{:.1f}"),
                _num(t["ratio"], "{:.2f}x"),
                _num(t["steady_cmds_per_min"], "{:.1f}"),
                _num(t["mean_wall_s"], "{:.2f}"),
            ]
            for t in s.get("throughput", [])
        ],
    )
    L += [""] + _mps_throughput_md(s)
    return L


def _mps_throughput_md(s: Summary) -> list[str]:
    """The throughput of each krex-mps cell against both unprotected baselines of its C
    (the headline's ``mps_throughput``); nothing when no MPS cell ran."""
    rows = (s.get("headline") or {}).get("mps_throughput") or []
    if not rows:
        return []
    out = [
        "### Under NVIDIA MPS",
        "",
        "Each krex-mps cell against unprotected sharing of the same C, without and with MPS "
        "(cmds/min; the ratio is krex-mps over the baseline).",
        "",
    ]
    out += _table(
        ["cell", "cmds/min", "unprotected", "cmds/min", "ratio", "unprotected-mps", "cmds/min", "ratio"],
        [
            [
                r["cell"],
                _num(r["cmds_per_min"], "{:.1f}"),
                r.get("unprotected_cell") or "-",
                _num(r.get("unprotected_cpm"), "{:.1f}"),
                _num(r.get("vs_unprotected"), "{:.2f}x"),
                r.get("unprotected_mps_cell") or "-",
                _num(r.get("unprotected_mps_cpm"), "{:.1f}"),
                _num(r.get("vs_unprotected_mps"), "{:.2f}x"),
            ]
            for r in rows
        ],
    )
    return out + [""]


def _md_inflation(s: Summary) -> list[str]:
    """Timing inflation against native-serial: nested bands, disjoint bands, per GPU."""
    L: list[str] = []  # noqa: N806
    L += [
        "## Timing inflation against native-serial",
        "",
        "Inflation = measured ms / the same command's native-serial ms - 1, signed. Bands are nested, by "
        "native-serial duration (a 20 ms kernel counts in all three), as in the paper.",
        "",
    ]
    rows = []
    for k, bands in s.get("inflation", {}).items():
        for band, _ in bm.BANDS:
            d = bands.get(band) or {}
            rows.append(
                [
                    k,
                    band,
                    str(d.get("n", 0)),
                    _pct(d.get("p50")),
                    _pct(d.get("p95")),
                    _pct(d.get("max")),
                    _pct(PAPER["p95_inflation"][band]),
                ]
            )
    L += _table(["cell", "band", "n", "p50", "p95", "max", "paper p95 (krex)"], rows) + [""]
    if s.get("inflation_split"):
        L += [
            "### Disjoint bands",
            "",
            "The same inflation over disjoint duration bands, so that short kernels are not hidden among "
            "long ones. `native-serial passes` (when native-serial made several passes and no native-repeat "
            "cell ran): each native run against its command's native median, the noise floor.",
            "",
        ]
        rows = []
        for k, bands in s["inflation_split"].items():
            for band, _lo, _hi in bm.SPLIT_BANDS:
                d = bands.get(band) or {}
                if d.get("n"):
                    p = [_pct(d.get(q)) for q in ("p50", "p95", "max")]
                    rows.append([k, band, str(d["n"]), *p])
        L += _table(["cell", "band", "n", "p50", "p95", "max"], rows) + [""]
    if s.get("inflation_per_gpu"):
        L += ["### Per GPU (C commands on each GPU at once)", ""]
        rows = []
        for k, gs in s["inflation_per_gpu"].items():
            for g, bands in gs.items():
                for band, _ in bm.BANDS:
                    d = bands.get(band) or {}
                    if d.get("n"):
                        rows.append([k, g, band, str(d["n"]), _pct(d.get("p50")), _pct(d.get("p95"))])
        L += _table(["cell", "gpu", "band", "n", "p50", "p95"], rows) + [""]
    return L


def _md_ranking(s: Summary) -> list[str]:
    """The true orders, Kendall tau per family and flip rates per gap class."""
    L: list[str] = []  # noqa: N806
    L += ["## Ranking fidelity", ""]
    truth = s.get("truth", {})
    L += _table(
        ["family", "true order from", "candidates (fastest first)"],
        [
            [f, t["kind"], ", ".join(sorted(t["values"], key=lambda n: t["values"][n]))]
            for f, t in truth.items()
        ],
    ) + [""]
    fams = list(truth)
    L += ["### Kendall tau per family (mean over passes) and median over all (family, pass)", ""]
    rows = []
    for k, r in s.get("ranking", {}).items():
        cols = []
        for f in fams:
            xs = r["tau"].get(f) or []
            cols.append(_num(sum(xs) / len(xs), "{:.3f}") if xs else "-")
        rows.append([k, *cols, _num(r.get("tau_median"), "{:.3f}")])
    L += _table(["cell", *fams, "median"], rows) + [""]
    L += [
        "### Pairwise flip rate per true-gap class",
        "",
        "A flip: the measured order of two candidates of a family disagrees with the true order.",
        "",
    ]
    rows = []
    for k, r in s.get("ranking", {}).items():
        cols = []
        for label, _, _ in bm.GAP_CLASSES:
            fl = r["flip"].get(label) or {}
            cols.append(
                "-" if not fl.get("pairs") else f"{_pct(fl.get('rate'), 1)} ({fl['flips']}/{fl['pairs']})"
            )
        rows.append([k, *cols])
    L += _table(["cell", *[g[0] for g in bm.GAP_CLASSES]], rows) + [""]
    return L


def _md_critical(s: Summary) -> list[str]:
    """The critical-region fraction and its Amdahl bound."""
    L: list[str] = []  # noqa: N806
    c = s.get("critical", {})
    L += [
        "## Critical-region fraction (native-serial)",
        "",
        "fraction = t_region_s / t_total_s per command (time inside `krex.region()` over the process's "
        "whole life). Amdahl bound on the throughput gain = total command time / total region time.",
        "",
    ]
    L += _table(
        ["n", "p10", "p25", "p50", "p75", "p90", "share < 25%", "aggregate", "Amdahl bound", "paper median"],
        [
            [
                str(c.get("n", 0)),
                _pct(c.get("p10"), 1),
                _pct(c.get("p25"), 1),
                _pct(c.get("p50"), 1),
                _pct(c.get("p75"), 1),
                _pct(c.get("p90"), 1),
                _pct(c.get("share_below_25"), 0),
                _pct(c.get("aggregate"), 1),
                _num(c.get("amdahl_bound"), "{:.1f}x"),
                _pct(c.get("paper_median"), 0),
            ]
        ],
    ) + [""]
    return L


def _md_regions(s: Summary) -> list[str]:
    """Region entry overhead, queue wait and what KREX could not vouch for."""
    L: list[str] = []  # noqa: N806
    L += [
        "## Region entry overhead and queue wait",
        "",
        "client entry: time from `with krex.region()` to its body (queue wait + protocol), per command. "
        "queue wait and protocol entry (block, catch stragglers, drain, freeze, pin) come from the daemon's "
        "journal via `krex run --report`. Native and unprotected cells enter no-op regions.",
        "",
    ]
    rows = []
    for k, r in s.get("regions", {}).items():
        ce, qw, pe, ad = r["client_entry_s"], r["queue_wait_s"], r["protocol_entry_s"], r["admission_wait_s"]
        rows.append(
            [
                k,
                _num(ce.get("p50"), "{:.4f}"),
                _num(ce.get("p95"), "{:.4f}"),
                _num(qw.get("p50"), "{:.4f}"),
                _num(qw.get("p95"), "{:.4f}"),
                _num(pe.get("p50"), "{:.5f}"),
                _num(pe.get("p95"), "{:.5f}"),
                _num(ad.get("p95"), "{:.4f}"),
                str(r["regions"]),
                str(r["contaminated"]),
                str(r.get("cut", 0)),
                ", ".join(f"{f} {n}" for f, n in (r.get("flags") or {}).items()) or "-",
                str(r.get("runs_without_region", 0)),
                ", ".join(r.get("auto_wrapped") or []) or "-",
                inductor_text(r.get("inductor_regions")) or "-",
            ]
        )
    L += _table(
        [
            "cell",
            "client entry p50 s",
            "p95 s",
            "queue wait p50 s",
            "p95 s",
            "protocol entry p50 s",
            "p95 s",
            "admission wait p95 s",
            "regions",
            "contaminated",
            "cut",
            "flagged by reason",
            "runs without a region",
            "auto targets wrapped",
            "Inductor autotuning regions",
        ],
        rows,
    ) + [""]
    return L


def _md_failures(s: Summary) -> list[str]:
    """The failed runs (the first 50)."""
    L: list[str] = []  # noqa: N806
    fails = s.get("failures", [])
    L += ["## Failures", ""]
    if fails:
        L += _table(
            ["cell", "command", "pass", "exit", "error"],
            [
                [str(f["cell"]), str(f["name"]), str(f["rep"]), str(f["exit_status"]), str(f["error"])]
                for f in fails[:50]
            ],
        )
        if len(fails) > 50:
            L.append(f"... and {len(fails) - 50} more (raw.jsonl has them all)")
    else:
        L.append("None.")
    L += [""]
    return L


def _md_notes(s: Summary) -> list[str]:
    """What the summary could not compute."""
    L: list[str] = []  # noqa: N806
    if s.get("notes"):
        L += ["## Notes", ""] + [f"- {n}" for n in s["notes"]] + [""]
    return L


def _md_files(s: Summary) -> list[str]:
    """The results directory's files, and the simulated-GPU label again."""
    L: list[str] = []  # noqa: N806
    L += [
        "## Files",
        "",
        "- `raw.jsonl`: one line per command run (cell, mode, C, pass, wall times, the command's JSON line, "
        "the `krex run` report)",
        "- `cells.jsonl`: one line per finished cell (makespan); `meta.json`: configuration and versions",
        "- `summary.json`: every metric below in machine-readable form",
        "- `throughput.png`, `inflation_cdf.png`, `flip_rates.png`, `critical_fraction.png`",
        "",
    ]
    if s.get("simulated"):
        L += [f"**{SIM_LABEL}.**", ""]
    return L


# summary.md's sections, in order: each returns its lines (a section ends with a blank line)
_MD_SECTIONS: tuple[Callable[[Summary], list[str]], ...] = (
    _md_intro,
    _md_headline,
    _md_throughput,
    _md_inflation,
    _md_ranking,
    _md_critical,
    _md_regions,
    fd.render_md,
    _md_failures,
    _md_notes,
    _md_files,
)


_INDUCTOR_SHORT = {"hook": INDUCTOR_PATHS["hook"],
                   "fallback": "KREX's fallback wrapper (benchmark_gpu whole)"}


def inductor_text(per_path: object) -> str:
    """Inductor's autotuning regions of a cell by path: "torch's ... hook 6", "" for none."""
    if not isinstance(per_path, dict):
        return ""
    return "; ".join(f"{_INDUCTOR_SHORT.get(str(p), p)} {n}" for p, n in sorted(per_path.items()) if n)


def inductor_line(summary: Summary) -> str:
    """One line for the bench's closing summary: which way each krex cell's Inductor
    autotuning ran ("" when no cell's did)."""
    cells = [f"{k}: {txt}" for k, r in (summary.get("regions") or {}).items()
             if (txt := inductor_text(r.get("inductor_regions")))]
    return "Inductor autotuning regions: " + "; ".join(cells) if cells else ""
