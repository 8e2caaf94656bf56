#!/usr/bin/env python3
"""A kernel-optimising agent loop on KREX: propose candidates, run them, compare, keep the
faster one, using krex.Executor and Executor.compare.

Each round the "agent" (here a random local search over a kernel's block size and warp
count) proposes neighbours of the current best configuration, screens each with one run
(all at once: each run's timing is a KREX region, so running them side by side does not
spoil it), and then asks `compare` whether the most promising one is really faster than
the incumbent. It keeps the challenger only when the comparison settles that it is
faster at the stated confidence; a ratio the runs cannot separate from 1 keeps the
incumbent, so noise never walks the search downhill.

    python examples/agent_loop/agent_loop.py                   # the simulated GPU (builds its candidate)
    python examples/agent_loop/agent_loop.py --device gpu      # Triton candidates on a real GPU

On the simulated GPU a candidate is examples/compare/sim_candidate.c, whose speed is a
known function of its configuration (speed_model) plus 3% lognormal run-to-run noise:
the loop shows the method and never says anything about a real GPU. With --device gpu a
candidate is examples/agent_loop/triton_candidate.py (torch and triton needed), timed by
triton.testing.do_bench, which KREX_AUTO_REGION=do_bench makes the region. The last line
printed is the whole search as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import krex
from krex.compare import parse_figure

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BLOCKS = (128, 256, 512, 1024, 2048, 4096)
WARPS = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Config:
    block: int
    warps: int

    def __str__(self) -> str:
        return f"block{self.block}-warps{self.warps}"


def neighbours(c: Config, rng: random.Random, k: int) -> list[Config]:
    """Up to k configurations one step away (one knob moved by one notch)."""
    bi, wi = BLOCKS.index(c.block), WARPS.index(c.warps)
    steps = [(bi + d, wi) for d in (-1, 1)] + [(bi, wi + d) for d in (-1, 1)]
    cands = [Config(BLOCKS[b], WARPS[w]) for b, w in steps if 0 <= b < len(BLOCKS) and 0 <= w < len(WARPS)]
    rng.shuffle(cands)
    return cands[:k]


def speed_model(c: Config) -> float:
    """The simulated candidate's time relative to the best one (block 1024, 4 warps): a few
    percent per notch away, the regime where one noisy measurement often orders two
    candidates wrongly."""
    return 1 + 0.04 * abs(math.log2(c.block / 1024)) + 0.025 * abs(math.log2(c.warps / 4))


def sim_binary() -> str:
    out = Path("/tmp") / f"krex-sim-candidate-{Path(REPO).stat().st_ino}"
    src = REPO / "examples/compare/sim_candidate.c"
    if not out.exists() or out.stat().st_mtime < src.stat().st_mtime:
        from krex.native import LIB_DIR

        subprocess.run(["gcc", "-O2", f"-I{REPO / 'interpose'}", "-o", str(out), str(src), f"-L{LIB_DIR}",
                        f"-Wl,-rpath,{LIB_DIR}", "-lcudart", "-lm", "-ldl"], check=True)
    return str(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["sim", "gpu"], default="sim")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--proposals", type=int, default=3, help="candidates screened per round")
    ap.add_argument("--max-runs", type=int, default=16, help="compare's budget: runs per candidate")
    ap.add_argument("--jobs", type=int, default=None,
                    help="compare's runs at once (default: 1 on the simulated GPU, 4 on a real one)")
    ap.add_argument("--start", default="256,2", help="BLOCK,WARPS to start from")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    block, warps = (int(x) for x in a.start.split(","))
    incumbent = Config(block, warps)
    jobs = a.jobs or (1 if a.device == "sim" else 4)
    figure = parse_figure("do_bench")  # both candidates print "<ms> ms"
    sim = sim_binary() if a.device == "sim" else ""

    def command(c: Config) -> list[str]:
        if a.device == "sim":
            return [sim, "--us", "400", "--ratio", f"{speed_model(c):.6f}", "--noise", "0.03", "--region"]
        return [sys.executable, str(HERE / "triton_candidate.py"),
                "--block", str(c.block), "--warps", str(c.warps)]

    opts = {} if a.device == "sim" else {"auto_region": "do_bench"}
    history = []
    t0 = time.monotonic()
    with krex.Executor(device=a.device) as ex:
        print(f"agent loop on the {'SIMULATED' if a.device == 'sim' else 'real'} GPU, "
              f"{ex.max_workers} commands at a time; start {incumbent}")
        for rnd in range(1, a.rounds + 1):
            proposals = neighbours(incumbent, rng, a.proposals)
            screened = [ex.submit(command(c), name=str(c), **opts) for c in proposals]
            figures = {}
            for c, fut in zip(proposals, screened, strict=True):
                res = fut.result()
                if not res.ok or not res.regions:
                    print(f"  round {rnd}: {c} failed or made no region (exit {res.exit_status}): "
                          f"{res.stderr.strip()[-200:]}")
                    continue
                figures[c] = figure.read(res.stdout)
            if not figures:
                break
            challenger = min(figures, key=lambda c: figures[c])
            print(f"round {rnd}: screened {', '.join(f'{c} {v:.4f} ms' for c, v in figures.items())}; "
                  f"comparing {challenger} with {incumbent}")
            cmp = ex.compare([command(incumbent), command(challenger)], figure,
                             names=[str(incumbent), str(challenger)], max_runs=a.max_runs, jobs=jobs,
                             seed=rng.randrange(1 << 30), **opts)
            r = cmp.ratios[0]
            keep = r.verdict == "faster"
            print(f"  {challenger}/{incumbent} = {r.ratio:.4f} [{r.low:.4f}, {r.high:.4f}] "
                  f"({cmp.confidence:.0%}), P(order wrong) {r.p_wrong:.2g}, {r.runs + r.base_runs} runs: "
                  f"{r.verdict} -> {'keep ' + str(challenger) if keep else 'keep ' + str(incumbent)}")
            history.append({"round": rnd, "incumbent": asdict(incumbent), "challenger": asdict(challenger),
                            "ratio": r.ratio, "low": r.low, "high": r.high, "p_wrong": r.p_wrong,
                            "verdict": r.verdict, "runs": r.runs + r.base_runs, "kept": keep,
                            "true_ratio": speed_model(challenger) / speed_model(incumbent) if sim else None})
            if keep:
                incumbent = challenger
    print(f"best: {incumbent} after {len(history)} round(s), {time.monotonic() - t0:.0f} s")
    print(json.dumps({"device": a.device, "best": asdict(incumbent), "rounds": history}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
