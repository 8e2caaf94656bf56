"""On a real GPU: timing fidelity of concurrent commands, with and without KREX,
and region-entry latency with idle and busy siblings. Prints JSON; the summary table last."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from _siblings import fresh, percentile, stop_all, wait_ready

PY = sys.executable
KREX = [PY, "-m", "krex.cli.main"]

BENCH = r"""
import json, os, sys, time, torch, triton
import krex
reps = int(sys.argv[1])
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
fn = lambda: a @ b
fn(); torch.cuda.synchronize()
out = []
for _ in range(reps):
    if krex.under_krex():
        with krex.region() as r:
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        out.append({"ms": ms, "contaminated": (r.grant or {}).get("contaminated"), "entry_s": (r.grant or {}).get("entry_s")})
    else:
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        out.append({"ms": ms})
print(json.dumps({"pid": os.getpid(), "runs": out}))
"""

HAMMER = r"""
import sys, threading, time, torch
stop = time.time() + float(sys.argv[1])
def burn():
    x = 0
    while time.time() < stop:
        x += 1
threading.Thread(target=burn, daemon=True).start()
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
c = torch.randn(1 << 24, device="cuda")
open(sys.argv[2], "w").write("ready")
while time.time() < stop:
    for _ in range(4):
        a @ a
        c.mul_(1.0001)
    torch.cuda.synchronize()
"""

IDLE = r"""
import sys, time, torch
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
open(sys.argv[2], "w").write("ready")
time.sleep(float(sys.argv[1]))
"""

LATENCY = r"""
import json, sys, time, torch, krex
n = int(sys.argv[1])
x = torch.randn(1 << 20, device="cuda"); torch.cuda.synchronize()
rows = []
for _ in range(n):
    t0 = time.perf_counter()
    with krex.region() as r:
        t1 = time.perf_counter()
        x.mul_(1.0); torch.cuda.synchronize()
    g = r.grant or {}
    rows.append({"client_s": t1 - t0, **{k: g.get(k) for k in ("entry_s", "block_s", "inflight_s", "drain_s", "freeze_s", "pin_s", "queue_wait_s", "contaminated", "drained")}})
print(json.dumps(rows))
"""


def start(cmd: list[str], under: bool) -> subprocess.Popen[str]:
    full = [*KREX, "run", "--device", "gpu", "--", *cmd] if under else cmd
    return subprocess.Popen(full, stdout=subprocess.PIPE, text=True)


def cotenants(kind: str, k: int, under: bool, secs: float, tag: str) -> list[subprocess.Popen[str]]:
    src = HAMMER if kind == "hammer" else IDLE
    files = [f"/tmp/krex_{tag}_{i}" for i in range(k)]
    fresh(files)
    ps = [start([PY, "-c", src, str(secs), f], under) for f in files]
    wait_ready(files)  # not ready after 120 s: measured all the same
    return ps


def bench(n_cmds: int, reps: int, under: bool) -> list[dict[str, object]]:
    ps = [start([PY, "-c", BENCH, str(reps)], under) for _ in range(n_cmds)]
    out = []
    for p in ps:
        stdout, _ = p.communicate(timeout=600)
        for line in stdout.splitlines():
            if line.startswith("{"):
                out.extend(json.loads(line)["runs"])
    return out


def latency(kind: str) -> list[dict[str, float]]:
    """100 regions of one command with 8 siblings (idle or hammer) under KREX."""
    cs = cotenants(kind, 8, True, 900, f"l{kind}")
    p = start([PY, "-c", LATENCY, "100"], True)
    stdout, _ = p.communicate(timeout=600)
    stop_all(cs)
    rows: list[dict[str, float]] = json.loads(stdout.strip().splitlines()[-1])
    return rows


def latency_line(kind: str, rows: list[dict[str, float]]) -> str:
    cl = [1e3 * r["client_s"] for r in rows]
    steps = {s: statistics.median([1e3 * (r[s] or 0) for r in rows])
             for s in ("block_s", "inflight_s", "drain_s", "freeze_s", "pin_s")}
    dom = max(steps, key=lambda s: steps[s])
    return (f"region entry, 8 {kind} siblings: p50 {percentile(cl, 50):.2f} ms p99 {percentile(cl, 99):.2f} ms; "
            "median steps (ms) " + ", ".join(f"{k[:-2]} {v:.2f}" for k, v in steps.items()) + f"; dominant: {dom[:-2]}")


def latency_only() -> None:
    for kind in ("idle", "hammer"):
        rows = latency(kind)
        with open(os.path.join(os.environ.get("OUT", "/tmp"), f"latency_{kind}.json"), "w") as f:
            json.dump(rows, f)
        print(latency_line(kind, rows) + f"; contaminated {sum(1 for r in rows if r.get('contaminated'))}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--latency-only", action="store_true", help="only the region-entry latency (idle, hammer)")
    if ap.parse_args().latency_only:
        latency_only()
        return
    res: dict[str, object] = {}
    ref1 = bench(1, 10, under=False)
    res["alone_before"] = [r["ms"] for r in ref1]
    for k in (2, 4, 7):
        hs = cotenants("hammer", k, False, 600, f"h{k}")
        res[f"nokrex_{k}"] = [r["ms"] for r in bench(1, 5, under=False)]
        stop_all(hs)
    hs = cotenants("hammer", 4, True, 900, "kh")
    runs = bench(8, 5, under=True)
    stop_all(hs)
    res["krex_8x_with_4_hammers"] = runs
    ref2 = bench(1, 10, under=False)
    res["alone_after"] = [r["ms"] for r in ref2]
    lat = {kind: latency(kind) for kind in ("idle", "hammer")}
    res["latency"] = lat
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "fidelity.json"), "w") as f:
        json.dump(res, f, indent=1)

    ref = statistics.median(res["alone_before"] + res["alone_after"])  # type: ignore[operator]
    print(
        f"alone median {ref:.4f} ms (before {statistics.median(res['alone_before']):.4f}, "  # type: ignore[arg-type]
        f"after {statistics.median(res['alone_after']):.4f})"
    )  # type: ignore[arg-type]
    for k in (2, 4, 7):
        xs = res[f"nokrex_{k}"]
        print(f"no KREX, {k} co-tenants: median inflation {100 * (statistics.median(xs) / ref - 1):+.1f}%")  # type: ignore[arg-type]
    infl = [100 * (r["ms"] / ref - 1) for r in runs]  # type: ignore[operator]
    print(
        f"KREX, 8 concurrent benches + 4 hammers: n={len(infl)} inflation p50 {percentile(infl, 50):+.2f}% "
        f"p95 {percentile(infl, 95):+.2f}% max {max(infl):+.2f}% contaminated {sum(1 for r in runs if r.get('contaminated'))}"
    )
    for kind, rows in lat.items():
        print(latency_line(kind, rows))


if __name__ == "__main__":
    main()
