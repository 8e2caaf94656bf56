#!/usr/bin/env python3
"""Does a lone command time the same inside a region as outside it?

For each command of the `krex bench` corpus (or those --only names), alone on the GPU, N
times in a rotating order (so that drift cannot favour one mode):

  region     under `krex run` as the bench runs it: its region (explicit, or automatic
             through the manifest's KREX_AUTO_REGION) is taken
  no-region  under `krex run`, with KREX_AUTO_REGION=0 and KREX_WL_REGION=0 (the corpus's
             knob that runs the timed loop outside krex.region()): no region at all
  native     no KREX at all (the bench's native environment): the noise floor

and prints per command the mean ms of each mode, region / no-region, the native spread
((max - min) / mean of the native runs; --noise-floor sets a least one) and whether the
region's difference is within it.
A no-region run that still took a region, or a region run that took none, is counted and
shown (the comparison is then void). Every run is appended to --out (JSON lines); running
again with the same --out continues where it stopped (finished runs are kept), so a long
list can be split over several calls, each bounded by --budget-s.

    python3 benchmarks/lone_region.py --device sim --only sim-fused -n 3
    python3 benchmarks/lone_region.py --device gpu --corpus examples/workloads/manifest.py \\
        --only fused- -n 3 --budget-s 500 --out /tmp/lone.jsonl
    python3 benchmarks/lone_region.py --device gpu --only fused- -n 3 --plan   # estimate only

Compiler caches are shared between the runs (a candidate compiles once; compiling runs
outside the region anyway); --cold-cache gives every run fresh ones, as the bench does.
Exit status: 0 when every command was compared, 1 when a run failed or a comparison is void.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from krex.bench import load_corpus
from krex.bench.corpus import Workload
from krex.bench.run import (
    _daemon_status,
    _drop_shim,
    _parse_result,
    _start_daemon,
    _stop_daemon,
    _strip_krex,
)
from krex.runner import Spec, guardian_argv, run_one

MODES = ("region", "no-region", "native")


def _env(mode: str, w: Workload, cache: Path | None, tmp: Path) -> dict[str, str]:
    if mode == "native":
        env = _strip_krex(dict(os.environ))
    else:  # as the bench's krex cells: the guardian sets the slot, the GPU and the shim
        env = {k: v for k, v in os.environ.items() if k not in ("KREX_SLOT", "KREX_GPU")}
        _drop_shim(env)
    env.update(dict(w.env))
    if mode == "no-region":
        env["KREX_AUTO_REGION"] = "0"
        env["KREX_WL_REGION"] = "0"
    if mode == "native":
        env.pop("KREX_AUTO_REGION", None)  # outside KREX it is a no-op; keep the process bare
    root = cache if cache is not None else tmp
    env["TRITON_CACHE_DIR"] = str(root / "triton")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    env["TORCH_EXTENSIONS_DIR"] = str(root / "extensions")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run(w: Workload, mode: str, dev: str, timeout_s: float, cache: Path | None) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="krexlone-"))
    try:
        cmd = w.argv(sys.executable)
        report = tmp / "report.json" if mode != "native" else None
        if report is not None:
            cmd = guardian_argv(cmd, report, dev)
        spec = Spec(
            cmd, tmp / "out", tmp / "err", _env(mode, w, cache, tmp), str(w.script.parent), timeout_s, report
        )
        got = run_one(spec)
        out, err = got.read()
        res = _parse_result(out)
        regions = (got.report or {}).get("regions") or []
        ok = got.exit_status == 0 and res is not None and bool(res.get("correct"))
        return {
            "name": w.name,
            "mode": mode,
            "ok": ok,
            "ms": res.get("ms") if res else None,
            "wall_s": round(got.wall_s, 3),
            "regions": len(regions) if report is not None else None,
            "flags": sorted({f for g in regions for f in g.get("flags") or []}),
            "error": None if ok else (got.error or f"exit {got.exit_status}: {err.strip()[-300:]}"),
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def summarise(rows: list[dict[str, Any]], names: list[str], floor: float = 0.0) -> tuple[list[str], bool]:
    """The table's lines, and whether every command was compared cleanly."""
    out = [
        f"{'command':44} {'n':>5} {'region ms':>11} {'no-region':>11} {'ratio':>8} {'native ms':>11} "
        f"{'spread':>7}  verdict"
    ]
    clean = True
    for name in names:
        mine = [r for r in rows if r["name"] == name]
        ms = {m: [float(r["ms"]) for r in mine if r["mode"] == m and r["ok"]] for m in MODES}
        void = sum(1 for r in mine if r["mode"] == "no-region" and r["ok"] and r["regions"]) + sum(
            1 for r in mine if r["mode"] == "region" and r["ok"] and not r["regions"]
        )
        failed = sum(1 for r in mine if not r["ok"])
        mean = {m: statistics.fmean(v) if v else math.nan for m, v in ms.items()}
        ratio = mean["region"] / mean["no-region"] if mean["no-region"] > 0 else math.nan
        nat = ms["native"]
        spread = (max(nat) - min(nat)) / mean["native"] if len(nat) >= 2 and mean["native"] > 0 else math.nan
        spread = max(spread, floor) if math.isfinite(spread) else spread
        if void:
            verdict = f"VOID ({void} run(s) with the wrong region count)"
        elif not (math.isfinite(ratio) and math.isfinite(spread)):
            verdict = "n/a (too few runs)"
        else:
            verdict = "within native noise" if abs(ratio - 1) <= spread else "OUTSIDE native noise"
        if failed:
            verdict += f"; {failed} failed"
        clean = clean and not void and not failed and "n/a" not in verdict
        n = "/".join(str(len(ms[m])) for m in MODES)

        def f(x: float, fmt: str) -> str:
            return "n/a" if not math.isfinite(x) else fmt.format(x)

        out.append(
            f"{name:44} {n:>5} {f(mean['region'], '{:.4f}'):>11} {f(mean['no-region'], '{:.4f}'):>11} "
            f"{f(ratio, '{:.4f}'):>8} {f(mean['native'], '{:.4f}'):>11} {f(100 * spread, '{:.2f}%'):>7}  {verdict}"
        )
    return out, clean


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("sim", "gpu"), default="sim")
    p.add_argument("--corpus", type=Path, default=None, help="manifest.py (default: the shipped corpus)")
    p.add_argument("--only", default="", help="comma list: commands whose name contains one of these")
    p.add_argument("--quick", action="store_true", help="the corpus's quick subset")
    p.add_argument("-n", type=int, default=3, help="runs per mode and command")
    p.add_argument("--out", type=Path, default=Path("lone-region.jsonl"))
    p.add_argument(
        "--budget-s", type=float, default=0.0, help="start no run after this many seconds (0: none)"
    )
    p.add_argument(
        "--timeout", type=float, default=None, help="per run (default 600 on a GPU, 120 simulated)"
    )
    p.add_argument("--cold-cache", action="store_true", help="fresh compiler caches per run")
    p.add_argument(
        "--noise-floor",
        type=float,
        default=0.0,
        metavar="PCT",
        help="the least native spread counted (percent)",
    )
    p.add_argument("--plan", action="store_true", help="print the runs and their estimated time, run nothing")
    a = p.parse_args()
    only = [s.strip() for s in a.only.split(",") if s.strip()]
    ws = load_corpus(a.corpus, a.device, a.quick, only)
    est = sum(w.est_wall_s for w in ws) * len(MODES) * a.n
    print(
        f"{len(ws)} commands x {len(MODES)} modes x {a.n}: {len(ws) * len(MODES) * a.n} runs, ~{est:.0f} s "
        "by the manifest's estimates (compiling once with shared caches is faster)",
        flush=True,
    )
    if a.plan:
        for w in ws:
            print(f"  {w.name:44} ~{w.est_wall_s * len(MODES) * a.n:6.0f} s")
        return 0
    done = load(a.out)
    have = {(r["name"], r["mode"], r["i"]) for r in done}
    timeout = a.timeout or (120.0 if a.device == "sim" else 600.0)
    cache = None if a.cold_cache else Path(tempfile.mkdtemp(prefix="krexlone-cache-"))
    started = False
    if _daemon_status() is None:
        started = _start_daemon(a.device, 1)
    t0 = time.monotonic()
    stopped = False
    try:
        for w in ws:
            for i in range(a.n):
                order = MODES[i % 3 :] + MODES[: i % 3]  # rotate: R N X, N X R, X R N
                for mode in order:
                    if (w.name, mode, i) in have:
                        continue
                    if a.budget_s and time.monotonic() - t0 > a.budget_s:
                        stopped = True
                        break
                    rec = {**run(w, mode, a.device, timeout, cache), "i": i}
                    with a.out.open("a") as f:
                        f.write(json.dumps(rec) + "\n")
                    done.append(rec)
                    ms = "n/a" if rec["ms"] is None else f"{rec['ms']:.4f} ms"
                    print(
                        f"  {w.name} {mode} #{i}: {ms} (wall {rec['wall_s']:.1f} s)"
                        + ("" if rec["ok"] else f" FAILED: {rec['error']}"),
                        flush=True,
                    )
    finally:
        if started:
            _stop_daemon()
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
    lines, clean = summarise(done, [w.name for w in ws], a.noise_floor / 100.0)
    print("\n".join(lines))
    if stopped:
        print(f"stopped after --budget-s {a.budget_s:g}: run again with the same --out to continue")
        return 0
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
