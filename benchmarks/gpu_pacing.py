"""Region entry while siblings queue GPU work without waiting for it: bounded queues
(krexd's queue_cap_ms, interpose/pace.c) against the same run with pacing off
(KREX_QUEUE_CAP_MS=0), side by side.

    python benchmarks/gpu_pacing.py --device gpu             # the H200: 6 siblings
    python benchmarks/gpu_pacing.py --device sim --siblings 2 --regions 10 --seconds 4   # logic only

Per case, a world of its own (state directory, segment, daemon started on demand with the
case's KREX_QUEUE_CAP_MS), N siblings under `krex run`, each launching kernels in bursts
of --burst with one synchronise per burst (a queue of up to burst x kernel time), and one
measuring command that enters `krex.region()` R times around a short operation. Per region:
the client's entry time and the grant's steps (drain_s: siblings' queued work). Per
sibling: kernels completed per second (what pacing costs them) and its `paced` waits.

Raw rows go to $OUT/pacing.json (default /tmp/krex-pacing); the table is printed last.
Simulated numbers show logic, never GPU performance."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _siblings import SIM_RUNTIME, World, fresh, measure_code, percentile, stop_all, wait_ready

_SIM_PRELUDE = SIM_RUNTIME + r"""
def short_op():
    kernel(100)
def work():
    kernel(KERNEL_US)
"""

_GPU_PRELUDE = r"""
import torch
x = torch.randn(1 << 20, device="cuda")
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
def sync():
    torch.cuda.synchronize()
def short_op():
    x.mul_(1.0)
def work():
    torch.mm(a, a)  # ~0.15 ms on an H200 alone
"""

_SIBLING = r"""
import sys, time
burst, ready, stats, seconds = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
work(); sync()
open(ready, "w").write("ready")
n, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < seconds:
    for _ in range(burst):
        work()
    sync()
    n += burst
    open(stats, "w").write(f"{n} {time.perf_counter() - t0}")
"""

STEPS = ("inflight_s", "drain_s", "freeze_s", "settle_s", "entry_s")


def run_case(w: World, a: argparse.Namespace, kernel_us: int) -> dict[str, Any]:
    ready = [w.dir / f"ready-{i}" for i in range(a.siblings)]
    stats = [w.dir / f"stats-{i}" for i in range(a.siblings)]
    reports = [w.dir / f"report-{i}.json" for i in range(a.siblings)]
    fresh([*ready, *stats, *reports])
    pre = (_GPU_PRELUDE if w.device == "gpu" else _SIM_PRELUDE.replace("KERNEL_US", str(kernel_us)))
    sibs = [
        w.run(pre + _SIBLING, str(a.burst), str(r), str(s), str(a.seconds), log=f"sibling-{i}.log",
              opts=("--report", str(rep)))
        for i, (r, s, rep) in enumerate(zip(ready, stats, reports, strict=True))
    ]
    try:
        if wait_ready(ready, sibs, 180):
            raise SystemExit(f"{w.name}: siblings not ready; see {w.dir}")
        time.sleep(0.5)
        p = w.run(pre + measure_code("short_op(); sync()", a.pause), str(a.regions), log="measure.log")
        out, _ = p.communicate(timeout=300)
        if p.returncode != 0:
            raise SystemExit(f"{w.name}: measuring command failed; see {w.dir}/measure.log")
        rows: list[dict[str, Any]] = json.loads(out.strip().splitlines()[-1])
        for s in sibs:  # each runs --seconds, then exits and writes its report
            s.wait(timeout=a.seconds + 120)
    finally:
        stop_all(sibs)
    rates, paced, paced_ms = [], 0, 0.0
    for s, rep in zip(stats, reports, strict=True):
        with open(s) as f:
            n, t = f.read().split()
        rates.append(int(n) / float(t))
        with open(rep) as f:
            r = json.load(f)
        paced += int(r.get("paced") or 0)
        paced_ms += float(r.get("paced_ms") or 0.0)
    return {"rows": rows, "rates": rates, "paced": paced, "paced_ms": paced_ms}


def summary(c: dict[str, Any]) -> dict[str, float]:
    rows = c["rows"]
    ms = [r["client_s"] * 1e3 for r in rows]
    s = {"p50_ms": percentile(ms, 50), "p95_ms": percentile(ms, 95), "p99_ms": percentile(ms, 99), "max_ms": max(ms)}
    for step in STEPS:
        vals = [r[step] * 1e3 for r in rows if isinstance(r.get(step), (int, float))]
        s[f"{step[:-2]}_p50_ms"] = statistics.median(vals) if vals else float("nan")
        s[f"{step[:-2]}_max_ms"] = max(vals) if vals else float("nan")
    s["contaminated"] = float(sum(1 for r in rows if r.get("contaminated")))
    s["kernels_per_s"] = sum(c["rates"])
    s["paced"] = float(c["paced"])
    s["paced_s"] = c["paced_ms"] / 1e3
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("sim", "gpu"), default="gpu")
    ap.add_argument("--siblings", type=int, default=6)
    ap.add_argument("--regions", type=int, default=60)
    ap.add_argument("--burst", type=int, default=2000, help="kernels a sibling queues between synchronises")
    ap.add_argument("--seconds", type=float, default=25.0, help="how long each sibling runs")
    ap.add_argument("--pause", type=float, default=0.1, help="seconds between two regions")
    ap.add_argument("--sim-kernel-us", type=int, default=500)
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/krex-pacing")
    a = ap.parse_args()
    root = Path(a.out)
    root.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"device": a.device, "siblings": a.siblings, "burst": a.burst, "cases": {}}
    for name, cap in (("paced", None), ("unpaced", "0")):
        w = World(name, sys.executable, a.device, root, a.siblings + 1, "pc")
        if cap is not None:
            w.env["KREX_QUEUE_CAP_MS"] = cap  # the on-demand daemon reads it
        try:
            t0 = time.time()
            c = run_case(w, a, a.sim_kernel_us)
            c["summary"] = summary(c)
            c["wall_s"] = time.time() - t0
            result["cases"][name] = c
            print(f"{name}: {len(c['rows'])} regions in {c['wall_s']:.0f} s", file=sys.stderr, flush=True)
        finally:
            w.stop_daemon()
    (root / "pacing.json").write_text(json.dumps(result, indent=1))
    cols = ("p50_ms", "p95_ms", "p99_ms", "max_ms", "drain_p50_ms", "drain_max_ms", "settle_max_ms",
            "contaminated", "kernels_per_s", "paced", "paced_s")
    print(f"region entry with {a.siblings} siblings queueing bursts of {a.burst} kernels ({a.device}), "
          f"{a.regions} regions per case; raw rows in {root / 'pacing.json'}")
    print(f"{'case':<9} " + " ".join(f"{c:>14}" for c in cols))
    for name, c in result["cases"].items():
        print(f"{name:<9} " + " ".join(f"{c['summary'][k]:>14.2f}" for k in cols))


if __name__ == "__main__":
    main()
