"""The headline of a bench summary: one row per goal and krex cell (every krex cell, in
cell order), then the rows that hold for the whole run. Pure; `summary.compute_summary`
calls it with its tables.

Goals per krex cell (krex-C and krex-mps-C): throughput >= 4x native-serial and >= 0.95x
the unprotected cell of the same C (a krex-mps cell also >= 0.95x unprotected-mps of its C);
p95 inflation in each nested band at or below the paper's figure or the native noise of the
same run (native-repeat, else the native-serial passes), whichever is larger;
Kendall tau >= the native baseline's; flip rate <= the baseline's + 3 percentage points in
every gap class. The native baseline of tau and flips is the native-repeat cell, else the
native-serial passes (a run without native-repeat). A figure with no data reads n/a."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from krex.bench import metrics as bm
from krex.bench.records import GoalRow, ThroughputRow

NA = "n/a"
GOAL_VS_UNPROTECTED = 0.95


def pct(x: float) -> str:
    return NA if not math.isfinite(x) else f"{100 * x:.2f}%"


def f3(x: float) -> str:
    return NA if not math.isfinite(x) else f"{x:.3f}"


def met(ok: bool | None) -> str:
    return NA if ok is None else ("yes" if ok else "NO")


def _f(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) else math.nan


def tau_baseline(ranking: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The native cell that tau and flips are held against: native-repeat when it ran and
    has trajectories, else native-serial (its passes), else None."""
    for k in ("native-repeat", "native-serial"):
        if (ranking.get(k) or {}).get("tau_n") or any(
            (f or {}).get("pairs") for f in ((ranking.get(k) or {}).get("flip") or {}).values()
        ):
            return k
    return None


BASE_LABEL = {"native-repeat": "native repeat", "native-serial": "native serial passes"}


def headline(
    thr: list[ThroughputRow],
    infl: Mapping[str, Mapping[str, Any]],
    noise_p95: Mapping[str, float],
    ranking: Mapping[str, Mapping[str, Any]],
    critical: Mapping[str, Any],
    ns_cpm: float,
    paper: Mapping[str, Any],
    goal_throughput: float,
) -> dict[str, Any]:
    krex_cells = [t for t in thr if t["mode"] in ("krex", "krex-mps")]
    finite = [t for t in krex_cells if math.isfinite(t["cmds_per_min"])]
    best = max(finite, key=lambda t: t["cmds_per_min"]) if finite else None
    base = tau_baseline(ranking)
    base_label = BASE_LABEL.get(base or "", "native")
    h: dict[str, Any] = {
        "krex_cell": best["cell"] if best else None,
        "krex_cells": [t["cell"] for t in krex_cells],
        "native_cpm": ns_cpm,
        "tau_baseline": base,
    }
    if best:
        h.update(krex_cpm=best["cmds_per_min"], throughput_ratio=best["ratio"], krex_c=best["c"])
    goals: list[GoalRow] = []
    per_cell: dict[str, dict[str, Any]] = {}
    for t in krex_cells:
        rows, figures = _cell_goals(
            t, thr, infl, noise_p95, ranking, base, base_label, ns_cpm, paper, goal_throughput
        )
        goals += rows
        per_cell[t["cell"]] = figures
    h["cells"] = per_cell
    h["p95_inflation"] = per_cell[best["cell"]]["p95_inflation"] if best else {}
    goals += _run_goals(thr, critical, ranking, best, base, base_label, paper)
    tau_k = per_cell[best["cell"]]["tau"] if best else math.nan
    unp = next((u for u in thr if best and u["mode"] == "unprotected" and u["c"] == best["c"]), None)
    h["tau"] = {
        "krex": tau_k,
        "native-repeat": _f((ranking.get("native-repeat") or {}).get("tau_median")),
        "native-serial": _f((ranking.get("native-serial") or {}).get("tau_median")),
        "unprotected": _f((ranking.get(unp["cell"]) or {}).get("tau_median")) if unp else math.nan,
    }
    h["flips"] = per_cell[best["cell"]]["flips"] if best else {}
    h["goals"] = goals
    if mps := mps_throughput(thr):
        h["mps_throughput"] = mps
    return h


def _same_c(thr: list[ThroughputRow], mode: str, c: int) -> ThroughputRow | None:
    return next((u for u in thr if u["mode"] == mode and u["c"] == c), None)


def _ratio(a: ThroughputRow, b: ThroughputRow | None) -> float:
    return a["cmds_per_min"] / b["cmds_per_min"] if b and b["cmds_per_min"] > 0 else math.nan


def mps_throughput(thr: list[ThroughputRow]) -> list[dict[str, Any]]:
    """Each krex-mps cell's throughput against unprotected-C and unprotected-mps-C of its C."""
    out = []
    for t in thr:
        if t["mode"] != "krex-mps":
            continue
        unp, ump = _same_c(thr, "unprotected", t["c"]), _same_c(thr, "unprotected-mps", t["c"])
        out.append({
            "cell": t["cell"], "c": t["c"], "cmds_per_min": t["cmds_per_min"],
            "unprotected_cell": unp["cell"] if unp else None,
            "unprotected_cpm": unp["cmds_per_min"] if unp else math.nan,
            "vs_unprotected": _ratio(t, unp),
            "unprotected_mps_cell": ump["cell"] if ump else None,
            "unprotected_mps_cpm": ump["cmds_per_min"] if ump else math.nan,
            "vs_unprotected_mps": _ratio(t, ump),
        })
    return out


def _vs_unprotected_mps(t: ThroughputRow, thr: list[ThroughputRow]) -> list[GoalRow]:
    """A krex-mps cell's goal row against unprotected-mps of the same C (none for krex cells)."""
    if t["mode"] != "krex-mps":
        return []
    ump = _same_c(thr, "unprotected-mps", t["c"])
    vs = _ratio(t, ump)
    ours = NA if not (ump and math.isfinite(vs)) else (
        f"{vs:.2f}x ({ump['cmds_per_min']:.1f} -> {t['cmds_per_min']:.1f} cmds/min, {ump['cell']})"
    )
    return [{"cell": t["cell"], "metric": "throughput vs unprotected-mps (same C)",
             "goal": f">= {GOAL_VS_UNPROTECTED:.2f}x", "paper": "-", "ours": ours,
             "met": met(None if not math.isfinite(vs) else vs >= GOAL_VS_UNPROTECTED - 1e-12)}]


def _cell_goals(
    t: ThroughputRow,
    thr: list[ThroughputRow],
    infl: Mapping[str, Mapping[str, Any]],
    noise_p95: Mapping[str, float],
    ranking: Mapping[str, Mapping[str, Any]],
    base: str | None,
    base_label: str,
    ns_cpm: float,
    paper: Mapping[str, Any],
    goal_throughput: float,
) -> tuple[list[GoalRow], dict[str, Any]]:
    k = t["cell"]
    rows: list[GoalRow] = []

    def row(metric: str, goal: str, pap: str, ours: str, ok: str) -> None:
        rows.append({"cell": k, "metric": metric, "goal": goal, "paper": pap, "ours": ours, "met": ok})

    ratio = _f(t["ratio"])
    row(
        "throughput vs native serial",
        f">= {goal_throughput:.1f}x",
        f"{paper['throughput_ratio']}x ({paper['native_cpm']} -> {paper['krex_cpm']} cmds/min)",
        NA
        if not math.isfinite(ratio)
        else f"{ratio:.2f}x ({ns_cpm:.1f} -> {t['cmds_per_min']:.1f} cmds/min)",
        met(None if not math.isfinite(ratio) else ratio >= goal_throughput),
    )
    unp = next((u for u in thr if u["mode"] == "unprotected" and u["c"] == t["c"]), None)
    vs = t["cmds_per_min"] / unp["cmds_per_min"] if unp and unp["cmds_per_min"] > 0 else math.nan
    row(
        "throughput vs unprotected (same C)",
        f">= {GOAL_VS_UNPROTECTED:.2f}x",
        f"{paper['krex_cpm'] / paper['unprotected_cpm']:.2f}x",
        NA
        if not (unp and math.isfinite(vs))
        else f"{vs:.2f}x ({unp['cmds_per_min']:.1f} -> {t['cmds_per_min']:.1f} cmds/min, {unp['cell']})",
        met(None if not math.isfinite(vs) else vs >= GOAL_VS_UNPROTECTED - 1e-12),
    )
    rows += _vs_unprotected_mps(t, thr)
    p95: dict[str, float] = {}
    for band, paper_v in paper["p95_inflation"].items():
        d = (infl.get(k) or {}).get(band) or {}
        v = _f(d.get("p95"))
        p95[band] = v
        noise = _f(noise_p95.get(band))
        goal_v = max(paper_v, noise) if math.isfinite(noise) else paper_v
        goal = f"<= {pct(goal_v)}" + (" (native noise)" if goal_v > paper_v else "")
        ours = NA if not math.isfinite(v) else f"{pct(v)} (n={d.get('n', 0)}; native noise {pct(noise)})"
        row(
            f"p95 timing inflation, kernels {band}",
            goal,
            pct(paper_v),
            ours,
            met(None if not math.isfinite(v) else v <= goal_v),
        )
    tau = _f((ranking.get(k) or {}).get("tau_median"))
    tau_b = _f((ranking.get(base) or {}).get("tau_median")) if base else math.nan
    row(
        "Kendall tau (median per family and pass)",
        f">= {base_label}",
        f"{paper['tau']['krex']:.3f}",
        f3(tau) + (f" ({base_label} {f3(tau_b)})" if base else ""),
        met(None if not (math.isfinite(tau) and math.isfinite(tau_b)) else tau >= tau_b - 1e-12),
    )
    unp_tau = _f((ranking.get(unp["cell"]) or {}).get("tau_median")) if unp else math.nan
    if unp:
        row(
            f"Kendall tau, {unp['cell']} (same C)",
            "-",
            f"{paper['tau']['unprotected']:.3f}",
            f3(unp_tau),
            "-",
        )
    flips: dict[str, dict[str, float]] = {}
    kr = (ranking.get(k) or {}).get("flip") or {}
    nb = (ranking.get(base) or {}).get("flip") or {} if base else {}
    un = (ranking.get(unp["cell"]) or {}).get("flip") or {} if unp else {}
    for label, _, _ in bm.GAP_CLASSES:
        fa = _f((kr.get(label) or {}).get("rate"))
        fb = _f((nb.get(label) or {}).get("rate"))
        fu = _f((un.get(label) or {}).get("rate"))
        flips[label] = {"krex": fa, "native": fb, "unprotected": fu}
        if not (kr.get(label) or {}).get("pairs") and not (nb.get(label) or {}).get("pairs"):
            continue
        ok = None if not (math.isfinite(fa) and math.isfinite(fb)) else fa <= fb + paper["flip_pp"] + 1e-12
        row(
            f"pairwise flip rate, true gap {label}",
            f"<= {base_label} + 3 pp",
            "within 3 pp of native repeat",
            f"{pct(fa)} ({base_label} {pct(fb)}, unprotected {pct(fu)})",
            met(ok),
        )
    return rows, {"p95_inflation": p95, "tau": tau, "flips": flips, "vs_unprotected": vs}


def _run_goals(
    thr: list[ThroughputRow],
    critical: Mapping[str, Any],
    ranking: Mapping[str, Mapping[str, Any]],
    best: ThroughputRow | None,
    base: str | None,
    base_label: str,
    paper: Mapping[str, Any],
) -> list[GoalRow]:
    rows: list[GoalRow] = []

    def row(metric: str, pap: str, ours: str) -> None:
        rows.append({"cell": "-", "metric": metric, "goal": "-", "paper": pap, "ours": ours, "met": "-"})

    amd = _f(critical.get("amdahl_bound"))
    ratio = _f(best["ratio"]) if best else math.nan
    amd_txt = NA
    if math.isfinite(amd):
        amd_txt = f"{amd:.1f}x (aggregate critical fraction {pct(_f(critical.get('aggregate')))})"
        if math.isfinite(ratio):
            amd_txt += (
                f"; the fastest krex cell ({best['cell'] if best else ''}) reaches {ratio / amd:.0%} of it"
            )
    row(
        "Amdahl bound 1/(critical fraction)",
        f"{1 / paper['critical_fraction_median']:.1f}x (median fraction 12%)",
        amd_txt,
    )
    unp_best = max(
        (t for t in thr if t["mode"] == "unprotected" and math.isfinite(t["cmds_per_min"])),
        key=lambda t: t["cmds_per_min"],
        default=None,
    )
    unp_txt = NA
    if unp_best:
        r = _f(unp_best["ratio"])
        rtxt = NA if not math.isfinite(r) else f"{r:.2f}x"
        unp_txt = f"{unp_best['cmds_per_min']:.1f} cmds/min ({rtxt}, {unp_best['cell']})"
    row(
        "unprotected sharing throughput",
        f"{paper['unprotected_cpm']} cmds/min "
        f"({paper['unprotected_cpm'] / paper['native_cpm']:.1f}x), below KREX",
        unp_txt,
    )
    ump = max((t for t in thr if t["mode"] == "unprotected-mps" and math.isfinite(t["cmds_per_min"])),
              key=lambda t: t["cmds_per_min"], default=None)
    if ump:
        r = _f(ump["ratio"])
        rtxt = NA if not math.isfinite(r) else f"{r:.2f}x"
        row("unprotected sharing throughput under MPS", "-",
            f"{ump['cmds_per_min']:.1f} cmds/min ({rtxt}, {ump['cell']})")
    tau_b = _f((ranking.get(base) or {}).get("tau_median")) if base else math.nan
    row(f"Kendall tau, {base_label}", f"{paper['tau']['native-repeat']:.3f} (native repeat)", f3(tau_b))
    return rows
