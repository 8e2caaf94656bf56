"""Per-cell table of a krex bench results directory: throughput against
the unprotected cell of the same C, region entry (all regions and one family), flagged
regions and why, and how long pre-warmed commands waited for their slot.

    python3 benchmarks/bench_cells.py RESULTS_DIR [RESULTS_DIR ...] [--family cpu-heavy] [--slow MS]

Several directories (replicates of the same cells, e.g. other seeds): each one's tables, then
the pooled ones: a cell's runs over its summed makespans, the Little ratio over all its runs,
entry quantiles over all its regions (node busy and krexd CPU weighted by makespan).

Reads cells.jsonl and raw.jsonl only (the bench's own files); prints markdown tables.
Entry is krexd's `entry_s` of each region (request to grant), quantiles by nearest rank.

A second throughput view, less sensitive to a cell's ramp and tail than runs/makespan (with
few runs at a high C a cell is one wave and a tail): by Little's law a pool that keeps C
commands running completes 60 * C / mean wall commands a minute. Its ratio to the
unprotected cell of the same C is paired by command (summed per-command mean walls, over the
commands both ran) and comes with a 90% bootstrap interval (2000 seeded resamples of the
commands, then of each one's runs): a ratio whose interval holds 0.95 is not told apart from
0.95 by the run.

--slow MS: after the pooled tables, every region whose entry took MS or more, with the
grant's slowest step and the first of krexd's reasons for freezing a sibling, then a count
of regions by slowest step (where the entry tail comes from)."""

from __future__ import annotations

import argparse
import collections
import json
import math
import random
from pathlib import Path
from typing import Any


def jsonl(p: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()]


def q(xs: list[float], p: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(p * len(s)) - 1))]


def ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1e3:.0f}"


def little_ratio(
    krex: dict[str, list[float]], unp: dict[str, list[float]], n: int = 2000
) -> tuple[float, float, float]:
    """(ratio, 5th, 95th percentile) of (C / mean krex wall) / (C / mean unprotected wall),
    paired by command: the ratio of the summed per-command mean walls, over the commands both
    cells ran; the bootstrap resamples the commands, then each one's runs in each cell."""
    names = sorted(set(krex) & set(unp))
    if not names:
        return math.nan, math.nan, math.nan
    rng = random.Random(11)

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    def ratio(pick: list[str], draw: bool) -> float:
        res = (lambda xs: rng.choices(xs, k=len(xs))) if draw else (lambda xs: xs)
        return sum(mean(res(unp[m])) for m in pick) / sum(mean(res(krex[m])) for m in pick)

    boot = sorted(ratio(rng.choices(names, k=len(names)), True) for _ in range(n))
    return ratio(names, False), boot[int(0.05 * n)], boot[int(0.95 * n) - 1]


Cells = dict[str, dict[str, Any]]
Runs = dict[str, list[dict[str, Any]]]


def load(out: Path) -> tuple[Cells, Runs]:
    cells = {c["cell"]: c for c in jsonl(out / "cells.jsonl")}
    runs: Runs = collections.defaultdict(list)
    for r in jsonl(out / "raw.jsonl"):
        if r.get("cell") in cells and r.get("run") == cells[r["cell"]]["run"]:
            runs[r["cell"]].append(r)
    return cells, runs


def pool(loaded: list[tuple[Cells, Runs]]) -> tuple[Cells, Runs]:
    """The cells of several directories as one: runs and makespans summed, runs joined."""
    cells: Cells = {}
    runs: Runs = collections.defaultdict(list)
    for cs, rs in loaded:
        for k, c in cs.items():
            m = cells.setdefault(
                k, {"cell": k, "mode": c["mode"], "c": c["c"], "n_runs": 0, "failures": 0, "makespan_s": 0.0, "w": {}}
            )
            m["n_runs"] += c["n_runs"]
            m["failures"] += c["failures"]
            m["makespan_s"] += c["makespan_s"]
            for f in ("node_busy", "krexd_cpu_s"):
                if c.get(f) is not None:
                    m["w"].setdefault(f, []).append((c[f], c["makespan_s"]))
            runs[k].extend(rs.get(k, []))
    for m in cells.values():
        for f, vs in m.pop("w").items():
            if len(vs) == sum(1 for cs, _ in loaded if m["cell"] in cs):  # every replicate had it
                m[f] = (sum(v * w for v, w in vs) / sum(w for _, w in vs)) if f == "node_busy" else sum(v for v, _ in vs)
    return cells, runs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path, nargs="+")
    ap.add_argument("--family", default="cpu-heavy")
    ap.add_argument("--slow", type=float, default=None, metavar="MS")
    a = ap.parse_args()
    loaded = [load(d) for d in a.out]
    for d, (cells, runs) in zip(a.out, loaded, strict=True):
        if len(a.out) > 1:
            print(f"## {d}\n")
        tables(cells, runs, a.family)
    if len(a.out) > 1:
        print(f"## pooled: {len(a.out)} directories\n")
        tables(*pool(loaded), a.family)
    if a.slow is not None:
        slow_entries(a.out, loaded, a.slow / 1e3)
    return 0


# The grant's steps (krexd's region record), in the order they happen.
STEPS = ("queue_wait_s", "block_s", "inflight_s", "drain_s", "freeze_s", "exit_wait_s", "teardown_wait_s",
         "settle_s", "pin_s")


def slow_entries(dirs: list[Path], loaded: list[tuple[Cells, Runs]], limit_s: float) -> None:
    print(f"## region entries of {limit_s * 1e3:.0f} ms or more\n")
    print("| dir | command | family | entry ms | slowest step, ms | siblings frozen | first freeze reason |")
    print("|---|---|---|---|---|---|---|")
    by_step: collections.Counter[str] = collections.Counter()
    total = 0
    for d, (cells, runs) in zip(dirs, loaded, strict=True):
        for k, c in cells.items():
            if c["mode"] != "krex":
                continue
            for r in runs[k]:
                for g in (r.get("krex") or {}).get("regions") or []:
                    total += 1
                    e = g.get("entry_s")
                    if e is None or float(e) < limit_s:
                        continue
                    step = max(STEPS, key=lambda s: float(g.get(s) or 0))
                    by_step[step[:-2]] += 1
                    why = str((g.get("freeze_why") or ["-"])[0])
                    print(f"| {d.name} | {r.get('name')} | {r.get('family')} | {float(e) * 1e3:.0f} "
                          f"| {step[:-2]} {float(g.get(step) or 0) * 1e3:.0f} | {g.get('siblings_frozen')} "
                          f"| {why[:110]} |")
    print(f"\n{sum(by_step.values())} of {total} regions; by slowest step: "
          + (", ".join(f"{s} {n}" for s, n in by_step.most_common()) or "-") + "\n")


def tables(cells: Cells, runs: Runs, family: str) -> None:
    cpm = {k: c["n_runs"] / c["makespan_s"] * 60 for k, c in cells.items() if c["makespan_s"] > 0}
    # node busy: the cores' busy share over the cell; krexd CPU: krexd's own CPU seconds (with
    # its watchdog) over the cell ("-" where cells.jsonl has no such field).
    print("| cell | runs | failed | makespan s | cmds/min | vs unprotected-C | node busy | krexd CPU s |")
    print("|---|---|---|---|---|---|---|---|")
    for k, c in cells.items():
        unp = f"unprotected-{c['c']}" if c["mode"] == "krex" else None
        ratio = f"{cpm[k] / cpm[unp]:.2f}x" if unp in cpm and k in cpm else ""
        busy = f"{c['node_busy']:.0%}" if c.get("node_busy") is not None else "-"
        kcpu = f"{c['krexd_cpu_s']:.1f}" if c.get("krexd_cpu_s") is not None else "-"
        print(
            f"| {k} | {c['n_runs']} | {c['failures']} | {c['makespan_s']:.1f} | {cpm.get(k, math.nan):.1f} "
            f"| {ratio} | {busy} | {kcpu} |"
        )
    print()
    print("| cell | mean wall s | Little cmds/min (60 C / mean wall) | vs unprotected-C, 90% interval |")
    print("|---|---|---|---|")
    walls: dict[str, dict[str, list[float]]] = {}
    for k, rs in runs.items():
        for r in rs:
            if r.get("ok") and r.get("wall_s"):
                walls.setdefault(k, {}).setdefault(str(r["name"]), []).append(float(r["wall_s"]))
    for k, c in cells.items():
        w = [x for xs in (walls.get(k) or {}).values() for x in xs]
        if not w:
            continue
        unp = f"unprotected-{c['c']}"
        iv = ""
        if c["mode"] == "krex" and walls.get(unp):
            lr, lo, hi = little_ratio(walls[k], walls[unp])
            iv = f"{lr:.2f}x [{lo:.2f}, {hi:.2f}]"
        print(f"| {k} | {sum(w) / len(w):.1f} | {60 * c['c'] * len(w) / sum(w):.1f} | {iv} |")
    print()
    print(f"| cell | regions | entry p50/p95/p99/max ms | {family}: n, p50/p99/max ms | flagged (why) | "
          "pre-warmed: n, wait p50/max s |")
    print("|---|---|---|---|---|---|")
    for k, c in cells.items():
        if c["mode"] != "krex":
            continue
        regs = [(r.get("family"), g) for r in runs[k] for g in ((r.get("krex") or {}).get("regions") or [])]
        ent = [float(g["entry_s"]) for _, g in regs if g.get("entry_s") is not None]
        fam = [float(g["entry_s"]) for f, g in regs if f == family and g.get("entry_s") is not None]
        why: collections.Counter[str] = collections.Counter()
        for _, g in regs:
            if g.get("contaminated"):
                for x in g.get("flags") or g.get("reasons") or ["?"]:
                    why[str(x).split(":")[0].split(" ")[0]] += 1
        flagged = sum(1 for _, g in regs if g.get("contaminated"))
        pw = [float(r["krex"]["prewarm_s"]) for r in runs[k] if (r.get("krex") or {}).get("prewarm_s") is not None]
        print(
            f"| {k} | {len(regs)} | {ms(q(ent, .5))}/{ms(q(ent, .95))}/{ms(q(ent, .99))}/{ms(max(ent, default=math.nan))} "
            f"| {len(fam)}, {ms(q(fam, .5))}/{ms(q(fam, .99))}/{ms(max(fam, default=math.nan))} "
            f"| {flagged} ({', '.join(f'{w} {n}' for w, n in why.most_common()) or '-'}) "
            f"| {len(pw)}, {q(pw, .5):.2f}/{max(pw, default=math.nan):.2f} |"
        )
    print()


if __name__ == "__main__":
    raise SystemExit(main())
