"""Where a slow drain waits: N copies of the corpus's CPU-heavy command (examples/workloads/gpu/
agent_like.py, under `krex run` with its automatic do_bench region) started at once beside one
command that enters `krex.region()` every few ms, while a sampler (gpu_entry_copies.Sampler)
records where the siblings' main and drain-helper threads block, from /proc.

    python benchmarks/gpu_drain_stall.py --siblings 12 --seconds 70      # the H200

Prints the region entries over 30 ms with their steps, then the blocked stacks by count."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from _siblings import World, measure_code, percentile, stop_all
from gpu_entry_copies import _GPU_PRELUDE, Sampler

AGENT = Path(__file__).resolve().parents[1] / "examples" / "workloads" / "gpu" / "agent_like.py"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--siblings", type=int, default=12)
    ap.add_argument("--seconds", type=float, default=70.0, help="how long the measuring command runs")
    ap.add_argument(
        "--helper-nice", default="0,-10", help="krexd's helper_nice per case, comma-separated (a world each)"
    )
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/krex-drain-stall")
    a = ap.parse_args()
    root = Path(a.out)
    root.mkdir(parents=True, exist_ok=True)
    for nice in a.helper_nice.split(","):
        case(a, root, int(nice))


def case(a: argparse.Namespace, root: Path, nice: int) -> None:
    w = World(f"nice{nice}", sys.executable, "gpu", root, a.siblings + 1, "ds")
    w.env["KREX_HELPER_NICE"] = str(nice)
    sibs = []
    rows: list[dict[str, Any]] = []
    smp = Sampler([])
    try:
        regions = int(a.seconds / 0.02)
        meas = w.run(_GPU_PRELUDE + measure_code("short_op(); sync()", 0.01), str(regions), log="measure.log")
        time.sleep(3)
        for i in range(a.siblings):
            argv = [str(AGENT), "--name", f"s{i}", "--n", str(1 << 26), "--iters", "10", "--input-gb", "2"]
            code = f"import runpy, sys; sys.argv = {argv!r}; runpy.run_path(sys.argv[0], run_name='__main__')"
            sibs.append(w.run(code, log=f"sibling-{i}.log", env={"KREX_AUTO_REGION": "do_bench"}))
        smp = Sampler([s.pid for s in sibs])
        smp.start()
        out, _ = meas.communicate(timeout=a.seconds * 4 + 120)
        smp.stop.set()
        rows = json.loads(out.strip().splitlines()[-1]) if meas.returncode == 0 else []
    finally:
        stop_all(sibs)
        w.stop_daemon()
    slow = [r for r in rows if r["client_s"] > 0.03]
    (w.dir / "drain_stall.json").write_text(json.dumps({"rows": rows, "blocked": smp.counts}, indent=1))
    ms = [r["client_s"] * 1e3 for r in rows] or [float("nan")]
    print(
        f"helper_nice {nice}: {len(rows)} regions beside {a.siblings} CPU-heavy commands; entry p50/p90/p99/max "
        f"{percentile(ms, 50):.1f}/{percentile(ms, 90):.1f}/{percentile(ms, 99):.1f}/{max(ms):.1f} ms; "
        f"{len(slow)} over 30 ms; {sum(1 for r in rows if r.get('lent_priority'))} lent priority to a "
        f"sibling's LIFE thread ({sum(1 for r in slow if r.get('lent_priority'))} of the slow ones)"
    )
    where: dict[str, int] = {}
    for r in slow:
        for line in r.get("drain_waited_on") or []:
            for part in ("helper", "main"):
                tail = line.split(f"{part} ", 1)[-1].split(";")[0].split(" stack=")
                key = (
                    f"{part}: "
                    + " ".join(tail[0].split()[2:])
                    + " "
                    + (tail[1].split("<")[0] if len(tail) > 1 else "")
                )
                where[key] = where.get(key, 0) + 1
    for r in slow[:6]:
        steps = " ".join(
            f"{k}={v * 1e3:.1f}"
            for k, v in r.items()
            if k.endswith("_s") and isinstance(v, float) and v > 0.002
        )
        print(f"  {steps}  {(r.get('drain_waited_on') or [''])[0][:300]}")
    print("  where slow drains' siblings were (state wchan top-of-stack: count):")
    for key, n in sorted(where.items(), key=lambda kv: -kv[1])[:12]:
        print(f"    {n:4d}  {key}")
    print(f"  blocked threads ({smp.samples} samples), top:")
    for key, n in sorted(smp.counts.items(), key=lambda kv: -kv[1])[:8]:
        print(f"    {n:6d}  {key}")


if __name__ == "__main__":
    main()
