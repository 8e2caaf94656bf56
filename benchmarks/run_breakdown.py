"""Where `krex run`'s time goes, step by step, for N commands started at once.

    python3 benchmarks/run_breakdown.py --device sim -n 1 -r 20
    python3 benchmarks/run_breakdown.py --device sim -n 16 -r 5 --krex-bin /tmp/old/bin/krex

Starts N `krex -q run --device DEVICE -- python -c pass` at once with KREX_RUN_TRACE=1 (the
guardian writes CLOCK_MONOTONIC stamps of its steps to stderr at exit, see
interpose/guardian.c mark), records each one's spawn and reap on the same clock, and prints
the median and p90 of every step: spawn -> main (exec), main -> resolved -> connected ->
admitted -> env -> spawned -> started (the command runs from spawned on) -> exited ->
released -> exit, exit -> reaped. A build without the stamps shows only its total. An isolated
daemon as in benchmarks/run_overhead.py (whose helpers this uses)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _siblings import percentile  # noqa: E402
from run_overhead import krex_argv  # noqa: E402


def wave(argv: list[str], n: int, env: dict[str, str]) -> list[dict[str, int]]:
    """N at once; per command its stamps, plus `spawn` and `reaped`."""
    procs = {}
    for _ in range(n):
        t = time.monotonic_ns()
        p = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
        procs[p.pid] = (p, t)
    out = []
    reaped: dict[int, int] = {}
    while len(reaped) < n:
        pid, _st, _ru = os.wait4(-1, 0)
        reaped[pid] = time.monotonic_ns()
    for pid, (p, t) in procs.items():
        p.returncode = 0
        assert p.stderr is not None
        err = p.stderr.read().decode(errors="replace")
        stamps = {"spawn": t}
        for line in err.splitlines():
            if line.startswith("krex-trace "):
                stamps.update({k: int(v) for k, v in (w.split("=") for w in line.split()[1:])})
        stamps["reaped"] = reaped[pid]
        out.append(stamps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["sim", "gpu"], default="sim")
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("-r", "--repeat", type=int, default=5)
    ap.add_argument("--krex-bin", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    world = Path(tempfile.mkdtemp(prefix="krex-breakdown-"))
    tag = str(os.getpid())
    env = {k: v for k, v in os.environ.items() if not k.startswith("KREX_") and k != "LD_PRELOAD"}
    env.update(KREX_STATE_DIR=str(world / "state"), KREX_SHM=f"/krex-bd-{tag}", KREX_SIM_SHM=f"/krex-bdsim-{tag}")
    krex = krex_argv("script", args.krex_bin)
    subprocess.run([*krex, "daemon", "start", "--device", args.device, "--slots-per-gpu", str(args.n)],
                   env=env, check=True, capture_output=True, timeout=60)
    under = [*krex, "-q", "run", "--device", args.device, "--", sys.executable, "-c", "pass"]
    runs: list[dict[str, int]] = []
    bare: list[float] = []
    try:
        wave(under, args.n, env)  # warm-up
        tenv = {**env, "KREX_RUN_TRACE": "1"}
        for _ in range(args.repeat):
            bare += [(s["reaped"] - s["spawn"]) / 1e6 for s in wave([sys.executable, "-c", "pass"], args.n, env)]
            runs += wave(under, args.n, tenv)
    finally:
        subprocess.run([*krex, "daemon", "stop"], env=env, capture_output=True, timeout=60)
        for n in (env["KREX_SHM"], env["KREX_SIM_SHM"]):
            Path("/dev/shm" + n).unlink(missing_ok=True)
        shutil.rmtree(world, ignore_errors=True)
    order = [k for k in runs[0] if k != "reaped"] + ["reaped"]
    steps: dict[str, list[float]] = {}
    for s in runs:
        for a, b in zip(order, order[1:], strict=False):
            if a in s and b in s:
                steps.setdefault(f"{a} -> {b}", []).append((s[b] - s[a]) / 1e6)
    total = [(s["reaped"] - s["spawn"]) / 1e6 for s in runs]
    print(f"krex run step by step: device {args.device}, {args.n} at once, {args.repeat} rounds, "
          f"{os.cpu_count()} CPUs, krex = {' '.join(krex)}")
    print(f"{'step':<26} {'p50 ms':>8} {'p90 ms':>8}")
    for k, xs in steps.items():
        print(f"{k:<26} {statistics.median(xs):8.1f} {percentile(xs, 90):8.1f}")
    print(f"{'total (spawn -> reaped)':<26} {statistics.median(total):8.1f} {percentile(total, 90):8.1f}")
    print(f"{'bare python -c pass':<26} {statistics.median(bare):8.1f} {percentile(bare, 90):8.1f}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "run_breakdown.json").write_text(json.dumps({"runs": runs, "bare_ms": bare, "krex": krex}))


if __name__ == "__main__":
    main()
