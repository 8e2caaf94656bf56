"""Fair region access against first come, first served, side by side in one run.

Two experiments, each run once under `--region-queue fair` and once under `fifo`, each in a
private KREX world (its own daemon, segment and journal):

- greedy-vs-light: tenant `greedy` runs GREEDY commands that each take REGIONS regions of
  LONG ms back to back; tenant `light` runs one command that takes REGIONS regions of SHORT
  ms with a pause between them. What it shows: the light tenant's worst and p99 wait for
  a region (the journal's queue_wait_s).
- shares: tenants `a` (weight WA) and `b` (weight 1) keep regions of the same length queued,
  `a` with 3 commands and `b` with 1. What it shows: each tenant's share of the exclusive
  time while both were queuing, against its weight's share, and Jain's fairness index over
  share / weight (1.0: every tenant got exactly its weight's share).

Every experiment also prints its span, from the first grant to the last region's end (command
start-up left out): fairness must not cost total throughput.

    python benchmarks/fair_regions.py --device sim          # the simulated GPU (logic only)
    python benchmarks/fair_regions.py --device gpu          # a real GPU (torch)

Prints a markdown table; `--json FILE` keeps every region record."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KREX = [sys.executable, "-P", "-m", "krex.cli.main"]

WORKER = r"""
import os, sys, time
import krex
n, ms, gap_ms = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
if os.environ["FAIR_DEVICE"] == "gpu":
    import torch
    torch.cuda._sleep(1000); torch.cuda.synchronize()
    cycles = int(ms * 1.7e6)  # about ms at the H200's sustained SM clock
    def kernel():
        torch.cuda._sleep(cycles); torch.cuda.synchronize()
else:
    sys.path.insert(0, os.environ["FAIR_SIM_DIR"])
    from sim_cmd import Cudart
    rt = Cudart()
    def kernel():
        rt.kernel(int(ms * 1000)); rt.check("cudaDeviceSynchronize")
for _ in range(n):
    time.sleep(gap_ms / 1e3)
    with krex.region():
        kernel()
"""


def world(tmp: Path, device: str) -> dict[str, str]:
    tag = uuid.uuid4().hex[:8]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KREX_")}
    env.update(
        KREX_STATE_DIR=str(tmp / f"state-{tag}"),
        KREX_SHM=f"/krex-fair-{tag}",
        KREX_CONFIG="/dev/null",
        FAIR_DEVICE=device,
        FAIR_SIM_DIR=str(ROOT / "examples" / "workloads" / "sim"),
        PYTHONUNBUFFERED="1",
    )
    if device == "sim":
        env.update(KREX_SIM_SHM=f"/krex-fair-{tag}-sim", KREX_SIM_GPUS="1")
    return env


def run_world(
    device: str, queue: str, tenants: list[tuple[str, int, int, float, float]], weights: str, tmp: Path
) -> tuple[list[dict[str, Any]], float]:
    """tenants: (name, commands, regions each, region ms, gap ms). Returns (region records, makespan s)."""
    env = world(tmp, device)
    worker = tmp / "worker.py"
    worker.write_text(WORKER)
    start = [*KREX, "daemon", "start", "--device", device, "--slots-per-gpu", "8", "--region-queue", queue]
    if weights:
        start += ["--tenant-weights", weights]
    p = subprocess.run(start, env=env, capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise SystemExit(f"krex daemon start failed: {p.stderr}")
    t0 = time.monotonic()
    try:
        procs = []
        for name, commands, n, ms, gap in tenants:
            for _ in range(commands):
                argv = [
                    *KREX,
                    "run",
                    "--device",
                    device,
                    "--tenant",
                    name,
                    "--",
                    sys.executable,
                    str(worker),
                    str(n),
                    str(ms),
                    str(gap),
                ]
                procs.append(
                    subprocess.Popen(
                        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
                    )
                )
        failed = []
        for q in procs:
            _o, err = q.communicate(timeout=600)
            if q.returncode != 0:
                failed.append(f"exit {q.returncode}: {err[-500:]}")
        if failed:
            raise SystemExit(f"{len(failed)} command(s) failed; the first: {failed[0]}")
        makespan = time.monotonic() - t0
    finally:
        subprocess.run([*KREX, "daemon", "stop"], env=env, capture_output=True, timeout=120)
    journal = Path(env["KREX_STATE_DIR"]) / "journal.jsonl"
    recs = [json.loads(x) for x in journal.read_text().splitlines() if '"owner_slot"' in x]
    return recs, makespan


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def shares_while_both_queue(recs: list[dict[str, Any]]) -> dict[str, float]:
    """Each tenant's exclusive time (entry + region) over the window in which every tenant
    was running regions: from the latest first grant to the earliest last end."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for r in recs:
        t = r["tenant"]
        first[t] = min(first.get(t, r["t_grant_ns"]), r["t_grant_ns"])
        last[t] = max(last.get(t, 0), r["t_end_ns"])
    lo, hi = max(first.values()), min(last.values())
    used: dict[str, float] = {}
    for r in recs:
        if lo <= r["t_grant_ns"] and r["t_end_ns"] <= hi:
            used[r["tenant"]] = used.get(r["tenant"], 0.0) + r["entry_s"] + r["region_s"]
    total = sum(used.values()) or 1.0
    return {t: u / total for t, u in used.items()}


def gpu_span(recs: list[dict[str, Any]]) -> float:
    """Seconds from the first grant to the last region's end (command start-up left out)."""
    return (max(r["t_end_ns"] for r in recs) - min(r["t_grant_ns"] for r in recs)) / 1e9


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("sim", "gpu"), default="sim")
    ap.add_argument("--greedy", type=int, default=6, help="commands of the greedy tenant")
    ap.add_argument("--regions", type=int, default=8, help="regions per command")
    ap.add_argument("--long-ms", type=float, default=40.0)
    ap.add_argument("--short-ms", type=float, default=4.0)
    ap.add_argument("--wa", type=float, default=2.0, help="weight of tenant a in the shares experiment")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="krex-fair-"))
    rows, keep = [], {}
    for queue in ("fair", "fifo"):
        recs, _ = run_world(
            a.device,
            queue,
            [
                ("greedy", a.greedy, a.regions, a.long_ms, 0.0),
                ("light", 1, a.regions, a.short_ms, 3 * a.long_ms),
            ],
            "",
            tmp,
        )
        waits = [r["queue_wait_s"] for r in recs if r["tenant"] == "light"]
        span = gpu_span(recs)
        keep[f"greedy-vs-light/{queue}"] = recs
        recs2, _ = run_world(
            a.device,
            queue,
            [
                ("a", 3, 3 * a.regions, a.long_ms / 2, 0.0),
                ("b", 1, 3 * a.regions, a.long_ms / 2, 0.0),
            ],
            f"a={a.wa:g}",
            tmp,
        )
        keep[f"shares/{queue}"] = recs2
        sh = shares_while_both_queue(recs2)
        span2 = gpu_span(recs2)
        want = {"a": a.wa / (a.wa + 1), "b": 1 / (a.wa + 1)}
        rows.append(
            (
                queue,
                max(waits) * 1e3,
                pct(waits, 0.99) * 1e3,
                statistics.median(waits) * 1e3,
                span,
                sh.get("a", 0),
                sh.get("b", 0),
                want["a"],
                jain([sh.get(t, 0) / want[t] for t in want]),
                span2,
            )
        )
    print(
        f"device {a.device}: greedy {a.greedy} commands x {a.regions} regions of {a.long_ms:g} ms; "
        f"light 1 command x {a.regions} of {a.short_ms:g} ms; "
        f"shares: a (weight {a.wa:g}, 3 commands) and b (weight 1, 1 command)"
    )
    print(
        "| queue | light wait max ms | p99 ms | p50 ms | span s | share a | share b | a's weight share "
        "| Jain (share/weight) | span s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r[0]} | {r[1]:.1f} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.2f} | {r[5]:.3f} | {r[6]:.3f} "
            f"| {r[7]:.3f} | {r[8]:.3f} | {r[9]:.2f} |"
        )
    if a.json:
        a.json.write_text(json.dumps(keep, default=str))


if __name__ == "__main__":
    main()
