#!/usr/bin/env python3
"""Coverage of `krex compare`'s intervals on the simulated GPU: candidates of known true
ratio (examples/compare/sim_candidate.c: lognormal run-to-run noise of a chosen sigma)
compared many times through krex.Executor, each run a real `krex run` on the simulated
GPU, its figure read from its output.

Each repetition runs the whole budget (--runs per candidate, in randomized palindromic
blocks) and is then scored two ways from the same data:
  fixed   one look after the whole budget, at the stated level;
  seq     krex compare's sequential plan (looks after 3, 6, 12, ... blocks and at the
          budget, alpha split by plan_looks), stopping at the first look whose interval
          excludes 1: exactly what `krex compare` would have done with this data,
          since its decisions depend only on the runs before each look.
Prints a Markdown table and writes every comparison's numbers as JSON (--json).
--in-process draws the same candidates' figures in this process instead (no KREX, no
processes: the method alone, with many more repetitions).

    python benchmarks/compare_coverage.py --reps 150 --runs 12 --json out.json
    python benchmarks/compare_coverage.py --in-process --reps 4000 --runs 12
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from krex.compare.run import compare  # noqa: E402
from krex.compare.stats import plan_looks, shift_estimate  # noqa: E402
from krex.executor import Executor  # noqa: E402
from krex.native import LIB_DIR  # noqa: E402

CONFIGS = "1.00:0.03,0.97:0.03,0.95:0.02,1.10:0.05"


def build(out: Path) -> Path:
    exe = out / "sim_candidate"
    subprocess.run(["gcc", "-O2", f"-I{REPO / 'interpose'}", "-o", str(exe),
                    str(REPO / "examples/compare/sim_candidate.c"), f"-L{LIB_DIR}", f"-Wl,-rpath,{LIB_DIR}",
                    "-lcudart", "-lm", "-ldl"], check=True)
    return exe


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (c - h, c + h)


def score(runs: list[tuple[int, int, float]], ratio: float, budget: int, alpha: float) -> dict[str, object]:
    """runs: (candidate, block, value) in run order."""
    truth = math.log(ratio)

    def logs(c: int, blocks: int) -> list[float]:
        return [math.log(v) for cand, b, v in runs if cand == c and b < blocks]

    blocks = budget // 2
    fixed = shift_estimate(logs(0, blocks), logs(1, blocks), alpha)
    seq = None
    for lk in plan_looks(3, blocks, alpha, 1):
        seq = shift_estimate(logs(0, lk.blocks), logs(1, lk.blocks), lk.alpha)
        used = 2 * lk.blocks
        if seq.excludes_zero or lk.last:
            break
    assert seq is not None

    def claim(e: object) -> str:
        assert hasattr(e, "low") and hasattr(e, "high")
        return "faster" if e.high < 0 else "slower" if e.low > 0 else "none"

    right = "none" if ratio == 1 else ("faster" if ratio < 1 else "slower")
    return {
        "fixed_cover": fixed.low <= truth <= fixed.high,
        "fixed_claim": claim(fixed),
        "fixed_ratio": math.exp(fixed.estimate),
        "fixed_p_wrong": fixed.p_wrong,
        "seq_cover": seq.low <= truth <= seq.high,
        "seq_claim": claim(seq),
        "seq_runs": used,
        "right": right,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=150, help="comparisons per configuration")
    ap.add_argument("--runs", type=int, default=12, help="runs per candidate per comparison (even)")
    ap.add_argument("--configs", default=CONFIGS, help="TRUE_RATIO:SIGMA,... (B's speed over A's, lognormal sigma)")
    ap.add_argument("--us", type=float, default=500, help="A's kernel length")
    ap.add_argument("--confidence", type=float, default=0.95)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--in-process", action="store_true",
                    help="draw the figures here (lognormal, same design) instead of running candidates")
    a = ap.parse_args()
    alpha = 1 - a.confidence
    work = Path(tempfile.mkdtemp(prefix="krex-coverage-"))
    os.environ.setdefault("KREX_STATE_DIR", str(work / "state"))
    os.environ.setdefault("KREX_SHM", f"/krex-cov-{os.getpid()}")
    os.environ.setdefault("KREX_SIM_SHM", f"/krex-covsim-{os.getpid()}")
    exe = "" if a.in_process else str(build(work))
    configs = [(float(r), float(s)) for r, s in (c.split(":") for c in a.configs.split(","))]
    rows, raw = [], []
    t0 = time.time()
    with contextlib.ExitStack() as stack:
        ex = None if a.in_process else stack.enter_context(Executor(device="sim", max_workers=1))
        for ratio, sigma in configs:
            scored, left_out = [], 0
            for rep in range(a.reps):
                if ex is None:
                    rng = random.Random(f"{ratio}:{sigma}:{rep}")
                    runs = [(c, b, a.us * (ratio if c else 1.0) * math.exp(rng.gauss(0, sigma)))
                            for b in range(a.runs // 2) for c in (0, 1, 1, 0)]
                else:
                    cand = [[exe, "--us", f"{a.us:g}", "--noise", f"{sigma:g}", "--region"],
                            [exe, "--us", f"{a.us:g}", "--ratio", f"{ratio:g}", "--noise", f"{sigma:g}",
                             "--region"]]
                    cmp = compare(ex, cand, "json:mean_us", min_runs=a.runs, max_runs=a.runs,
                                  confidence=a.confidence, seed=rep)
                    left_out += sum(1 for r in cmp.runs if r.value is None)
                    runs = [(r.candidate, r.block, r.value) for r in cmp.runs if r.value is not None]
                s = score(runs, ratio, a.runs, alpha)
                scored.append(s)
                raw.append({"ratio": ratio, "sigma": sigma, "rep": rep, **s})
                if ex is not None:
                    print(f"ratio {ratio} sigma {sigma}: {rep + 1}/{a.reps} ({time.time() - t0:.0f} s)",
                          file=sys.stderr, flush=True)
            n = len(scored)
            fc = sum(bool(s["fixed_cover"]) for s in scored)
            sc = sum(bool(s["seq_cover"]) for s in scored)
            wrong = sum(1 for s in scored if s["seq_claim"] not in ("none", s["right"]))
            claims = sum(1 for s in scored if s["seq_claim"] != "none")
            rows.append({
                "ratio": ratio, "sigma": sigma, "reps": n, "left_out_runs": left_out,
                "fixed_coverage": fc / n, "fixed_ci": wilson(fc, n),
                "seq_coverage": sc / n, "seq_ci": wilson(sc, n),
                "seq_claims": claims / n, "seq_wrong_claims": wrong / n,
                "seq_mean_runs": sum(int(s["seq_runs"]) for s in scored) / n,  # type: ignore[call-overload]
                "median_estimate": sorted(float(s["fixed_ratio"]) for s in scored)[n // 2],  # type: ignore[arg-type]
            })
    how = "in process, no KREX" if a.in_process else "each run a krex run on the simulated GPU"
    print(f"\n{a.reps} comparisons per row ({how}), {a.runs} runs per candidate, stated confidence "
          f"{a.confidence:.0%}; {time.time() - t0:.0f} s; {platform.node()} ({os.cpu_count()} CPUs)\n")
    print("| true ratio B/A | noise sigma | fixed-n coverage [95% CI] | sequential coverage [95% CI] "
          "| settled (seq) | wrong order claimed (seq) | mean runs per candidate (seq) | median estimate "
          "| runs left out |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fl, fh = r["fixed_ci"]  # type: ignore[misc]
        sl, sh = r["seq_ci"]  # type: ignore[misc]
        print(f"| {r['ratio']:.2f} | {r['sigma']:.2f} | {r['fixed_coverage']:.3f} [{fl:.3f}, {fh:.3f}] "
              f"| {r['seq_coverage']:.3f} [{sl:.3f}, {sh:.3f}] | {r['seq_claims']:.3f} | {r['seq_wrong_claims']:.3f} "
              f"| {r['seq_mean_runs']:.1f} | {r['median_estimate']:.4f} | {r['left_out_runs']} |")
    if a.json:
        a.json.write_text(json.dumps({"rows": rows, "comparisons": raw, "args": vars(a) | {"json": str(a.json)}},
                                     indent=1, default=str))
    if not a.in_process:
        subprocess.run([sys.executable, "-m", "krex.cli.main", "daemon", "stop"], capture_output=True)
    for n in (os.environ["KREX_SHM"], os.environ["KREX_SIM_SHM"]):
        Path("/dev/shm" + n).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
