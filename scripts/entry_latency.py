"""Region entry latency with N sibling commands, idle or hammering, for one or more builds.

    python scripts/entry_latency.py --device sim                   # this checkout
    python scripts/entry_latency.py --device gpu \\
        --build old=/path/old/.venv/bin/python --build new=/path/new/.venv/bin/python

Each build gets a world of its own (state directory, segment, simulated device), so a
daemon already running on the machine is never touched. Per build and sibling kind it
starts N siblings under `krex run --device D`, then one measuring command under `krex run`
that enters `krex.region()` R times around a short GPU operation, and records the
client-side entry time (from `with krex.region()` to the first line inside) and the
grant's step timings. Builds are interleaved round by round, so a drift of the machine
hits all of them alike. The script uses only `krex run` and `krex.region()`, so it drives
an older build unchanged.

On `--device sim` the siblings drive the simulated GPU through ctypes (a hammer queues
four 500-us kernels and synchronises, in a loop); on `--device gpu` they use torch (a
hammer multiplies 8192x8192 bf16 matrices, as scripts/gpu_fidelity.py does). Simulated
numbers show logic and relative cost only, never GPU performance.

Logs and per-region rows go to $OUT (default /tmp/krex-entry-latency); the summary table
is printed last."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _siblings import SIM_RUNTIME, World, fresh, measure_code, percentile, stop_all, wait_ready

# ------------------------------------------------------------------ the commands
# Each runs under `krex run`, with the build's own interpreter. argv: SECONDS READY_FILE [BURN]

_SIM_PRELUDE = SIM_RUNTIME + r"""
def warm():
    p = vp(); rt.cudaMalloc(ctypes.byref(p), 16); kernel(10); sync()
"""

_GPU_PRELUDE = r"""
import torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
c = torch.randn(1 << 24, device="cuda")
x = torch.randn(1 << 20, device="cuda")
def hammer_step():
    a @ a
    c.mul_(1.0001)
def short_op():
    x.mul_(1.0)
def sync():
    torch.cuda.synchronize()
def warm():
    sync()
"""

_SIM_OPS = r"""
def hammer_step():
    kernel(500)
def short_op():
    kernel(100)
"""

_SIBLING = r"""
import sys, threading, time
secs, ready, burn = float(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
stop = time.time() + secs
def burner():
    x = 0
    while time.time() < stop:
        x += 1
warm()
if KIND == "hammer" and burn:
    threading.Thread(target=burner, daemon=True).start()
open(ready, "w").write("ready")
while time.time() < stop:
    if KIND == "hammer":
        for _ in range(4):
            hammer_step()
        sync()
    else:
        time.sleep(0.5)
"""

_MEASURE = measure_code("warm()", 0.002)  # let the siblings run between regions, as a benchmark's untimed work would

STEPS = ("queue_wait_s", "block_s", "inflight_s", "drain_s", "freeze_s", "pin_s", "entry_s")


def source(device: str, body: str, kind: str = "") -> str:
    prelude = _GPU_PRELUDE if device == "gpu" else _SIM_PRELUDE + _SIM_OPS
    return f"KIND = {kind!r}\n" + prelude + body


def siblings(w: World, kind: str, k: int, secs: float, burn: bool) -> list[subprocess.Popen[str]]:
    files = [w.dir / f"ready-{kind}-{i}" for i in range(k)]
    fresh(files)
    code = source(w.device, _SIBLING, kind)
    ps = [w.run(code, str(secs), str(f), "1" if burn else "0", log=f"sibling-{kind}-{i}.log") for i, f in enumerate(files)]
    why = wait_ready(files, ps, 180)
    if why == "exited":
        raise SystemExit(f"{w.name}: a {kind} sibling exited early; see {w.dir}")
    if why:
        raise SystemExit(f"{w.name}: {kind} siblings not ready after 180 s; see {w.dir}")
    return ps


def measure(w: World, kind: str, k: int, n: int, burn: bool, freeze: str | None) -> list[dict[str, Any]]:
    sibs = siblings(w, kind, k, 900, burn)
    try:
        opts = ("--freeze", freeze) if freeze else ()
        p = w.run(source(w.device, _MEASURE), str(n), log=f"measure-{kind}.log", opts=opts)
        stdout, _ = p.communicate(timeout=540)
    finally:
        stop_all(sibs)
    lines = [x for x in stdout.splitlines() if x.startswith("[")]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"{w.name}: the measuring command failed (rc {p.returncode}); see {w.dir}")
    rows: list[dict[str, Any]] = json.loads(lines[-1])
    return rows


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    cl = [1e3 * r["client_s"] for r in rows]
    out: dict[str, Any] = {
        "n": len(rows),
        "p50_ms": percentile(cl, 50),
        "p90_ms": percentile(cl, 90),
        "p99_ms": percentile(cl, 99),
        "max_ms": max(cl) if cl else float("nan"),
        "contaminated": sum(1 for r in rows if r.get("contaminated")),
    }
    for s in STEPS:
        xs = [1e3 * (r.get(s) or 0.0) for r in rows]
        out[f"{s[:-2]}_p50"] = statistics.median(xs) if xs else float("nan")
        out[f"{s[:-2]}_p99"] = percentile(xs, 99)
    for key in ("wait_inflight", "wait_drain"):  # builds with wake-ups report their wait loops
        vals = [r[key] for r in rows if isinstance(r.get(key), dict)]
        if vals:
            out[f"{key}_timeouts"] = sum(int(v.get("timeouts", 0)) for v in vals)
            out[f"{key}_wakeups"] = sum(int(v.get("wakeups", 0)) for v in vals)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("sim", "gpu"), default="sim")
    ap.add_argument("--build", action="append", default=[], metavar="NAME=PYTHON",
                    help="a build to measure (its interpreter); default: this one")
    ap.add_argument("--siblings", type=int, default=8)
    ap.add_argument("--regions", type=int, default=100, help="regions per measurement")
    ap.add_argument("--kinds", default="idle,hammer")
    ap.add_argument("--rounds", type=int, default=1, help="rounds, each measuring every build once")
    ap.add_argument("--burn", choices=("auto", "on", "off"), default="auto",
                    help="hammers also burn a CPU thread (auto: on for gpu, off for sim)")
    ap.add_argument("--freeze", default=None, metavar="POLICY",
                    help="the measuring command's freeze policy (krex run --freeze; default: krexd's)")
    a = ap.parse_args()
    builds = [b.split("=", 1) for b in a.build] or [["this", sys.executable]]
    burn = a.burn == "on" or (a.burn == "auto" and a.device == "gpu")
    out = Path(os.environ.get("OUT") or tempfile.gettempdir() + "/krex-entry-latency")
    out.mkdir(parents=True, exist_ok=True)
    worlds = [World(name, py, a.device, out, a.siblings + 1, "lat") for name, py in builds]
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    try:
        for rnd in range(a.rounds):
            for kind in a.kinds.split(","):
                for w in worlds if rnd % 2 == 0 else worlds[::-1]:
                    t0 = time.monotonic()
                    got = measure(w, kind, a.siblings, a.regions, burn, a.freeze)
                    rows.setdefault((w.name, kind), []).extend(got)
                    print(f"# round {rnd} {w.name} {kind}: {len(got)} regions in {time.monotonic() - t0:.0f}s",
                          flush=True)
    finally:
        for w in worlds:
            w.stop_daemon()
    summary = {f"{b}/{k}": summarise(r) for (b, k), r in rows.items()}
    (out / "entry_latency.json").write_text(
        json.dumps({"device": a.device, "siblings": a.siblings, "burn": burn, "freeze": a.freeze, "summary": summary,
                    "rows": {f"{b}/{k}": r for (b, k), r in rows.items()}}, indent=1)
    )
    print(f"\nregion entry latency, {a.siblings} siblings, device {a.device}, burn {'on' if burn else 'off'}, "
          f"freeze {a.freeze or 'default'} "
          f"(client ms; steps: median ms / p99 ms); rows in {out}/entry_latency.json")
    hdr = f"{'build/kind':<18}{'n':>5}{'p50':>8}{'p90':>8}{'p99':>8}{'max':>8}  " + "  ".join(
        f"{s[:-2]:>13}" for s in STEPS) + "  contam  waits(to/wk)"
    print(hdr)
    for key, s in summary.items():
        steps = "  ".join(f"{s[f'{x[:-2]}_p50']:>6.2f}/{s[f'{x[:-2]}_p99']:<6.2f}" for x in STEPS)
        waits = "/".join(
            f"{s.get(f'{k}_timeouts', '-')}:{s.get(f'{k}_wakeups', '-')}" for k in ("wait_inflight", "wait_drain"))
        print(f"{key:<18}{s['n']:>5}{s['p50_ms']:>8.2f}{s['p90_ms']:>8.2f}{s['p99_ms']:>8.2f}{s['max_ms']:>8.2f}  "
              f"{steps}  {s['contaminated']:>6}  {waits}")


if __name__ == "__main__":
    main()
