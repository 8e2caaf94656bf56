"""Region entry latency with N sibling commands, idle or hammering, for one or more builds
or krexd configurations, side by side in one run.

    python benchmarks/entry_latency.py --device sim                   # this checkout
    python benchmarks/entry_latency.py --device gpu \\
        --build old=/path/old/.venv/bin/python --build new=/path/new/.venv/bin/python
    python benchmarks/entry_latency.py --device gpu --siblings 7,15 --kinds hammer --regions 80 \\
        --config cap=KREX_DRAIN_BUDGET_MS=0,KREX_EARLY_SHRINK=off --config budget=

Each build or configuration gets a world of its own (state directory, segment, simulated
device, krexd), so a daemon already running on the machine is never touched. `--config
NAME=VAR=VALUE,...` is one build (`--python`, default this interpreter) with krexd started
under those variables (`budget=` with none: the defaults). Per world, sibling count (`--siblings 7,15`: C=8 and
C=16 with the measuring command) and sibling kind it starts N siblings under `krex run
--device D`, then one measuring command under `krex run` that enters `krex.region()` R
times around a short GPU operation, each after `--warmup` operations outside it (as a
benchmark's warm-up runs before its timed loop; before them it says a region comes soon,
as an automatic region's target does, where the build knows how), and records the
client-side entry time (from `with krex.region()` to the first line inside) and the
grant's step timings. Worlds are interleaved round by round, so a drift of the machine
hits all of them alike. The script uses only `krex run` and `krex.region()`, so it drives
an older build unchanged.

Context creations (`--kinds ctxchurn`, `ctxchurn_rt`): each sibling starts one short-lived
process after another that makes a context and runs a little (see _CHURN_DRIVER). The A/B of
the shim's context-creation token (krex_abi.h, KREX_CTX_TOKEN_LEASE_MS) is two worlds, the
token on and off in every process (the variable reaches the commands through `krex run`):

    python3 benchmarks/entry_latency.py --device gpu --siblings 8 --kinds ctxchurn,ctxchurn_rt \
        --regions 20 --rounds 3 --config token= --config notoken=KREX_CTX_TOKEN=0

On `--device sim`, add KREX_SIM_CTX_MS=300 to both worlds (the simulator's model of the
driver's creation lock; off by default).

On `--device sim` the siblings drive the simulated GPU through ctypes (a hammer queues
four 500-us kernels and synchronises, in a loop; a `life` sibling also allocates and frees
device memory each time round; a `long` sibling queues four 3-ms kernels); on `--device gpu`
they use torch (a `long` sibling multiplies 16384x16384 bf16 matrices, about 12 ms each on
an H200; a hammer multiplies
8192x8192 bf16 matrices, as benchmarks/gpu_fidelity.py does; a `life` sibling also allocates
a tensor of a new size and empties torch's cache, i.e. cudaMalloc and cudaFree). Simulated
numbers show logic and relative cost only, never GPU performance. `life_frz` counts the
regions whose entry froze a sibling inside a context, module or memory call.

Logs and per-region rows go to $OUT (default /tmp/krex-entry-latency); the summary table
is printed last."""

from __future__ import annotations

import argparse
import json
import math
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
big = None
def long_step():
    global big
    if big is None:
        big = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16)
    big @ big
def short_op():
    x.mul_(1.0)
def warm_op():
    a @ a
def life_step():
    t = torch.empty(int(torch.randint(1 << 20, 1 << 26, ())), device="cuda")
    t.fill_(1.0)
    del t
    torch.cuda.empty_cache()
def sync():
    torch.cuda.synchronize()
def warm():
    sync()
"""

_SIM_OPS = r"""
rt.cudaFree.argtypes = [vp]
def hammer_step():
    kernel(500)
def long_step():
    kernel(3000)
def short_op():
    kernel(100)
def warm_op():
    kernel(500)
def life_step():
    p = vp(); rt.cudaMalloc(ctypes.byref(p), 1 << 20); rt.cudaFree(p)
"""

# A `ctxchurn` sibling starts one short-lived process after another, each making a context on
# the GPU and running a little (as commands that start, set up and exit do), so contexts are
# being made while regions begin: through the driver's retain (`ctxchurn`: ctypes on libcuda,
# a process starts in ~50 ms, so creations queue in the driver) or inside the CUDA runtime's
# first call (`ctxchurn_rt`: torch on a GPU, the simulated runtime on --device sim).
_CHURN_DRIVER = r"""
import ctypes
cu = ctypes.CDLL("libcuda.so.1")
vp, sz = ctypes.c_void_p, ctypes.c_size_t
assert cu.cuInit(0) == 0
dev, ctx, ptr = ctypes.c_int(), vp(), ctypes.c_uint64()
assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
if hasattr(cu, "cuCtxSetCurrent"):
    cu.cuCtxSetCurrent(ctx)
assert cu.cuMemAlloc_v2(ctypes.byref(ptr), sz(64 << 20)) == 0
cu.cuMemsetD8_v2(ptr, ctypes.c_ubyte(1), sz(64 << 20))
cu.cuCtxSynchronize()
cu.cuMemFree_v2(ptr)
cu.cuDevicePrimaryCtxRelease_v2(dev)
"""
_CHURN_RT = {
    "gpu": r"""
import torch
x = torch.ones(1 << 24, device="cuda")
x.mul_(2.0)
torch.cuda.synchronize()
""",
    "sim": SIM_RUNTIME + r"""
p = vp(); rt.cudaMalloc(ctypes.byref(p), 1 << 20); kernel(200); sync()
""",
}

_SIBLING = r"""
import subprocess, sys, threading, time
secs, ready, burn = float(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
stop = time.time() + secs
def burner():
    x = 0
    while time.time() < stop:
        x += 1
if not KIND.startswith("ctxchurn"):  # a churner makes no context of its own
    warm()
if KIND in ("hammer", "life", "long") and burn:
    threading.Thread(target=burner, daemon=True).start()
open(ready, "w").write("ready")
rate, steps, t_log = open(ready + ".rate", "w"), 0, 0.0
while time.time() < stop:
    if time.time() >= t_log:  # (wall time, steps so far): the siblings' throughput meanwhile
        rate.write(f"{time.time()} {steps}\n"); rate.flush(); t_log = time.time() + 0.5
    steps += 1
    if KIND in ("hammer", "life"):
        for _ in range(4):
            hammer_step()
        if KIND == "life":
            life_step()
        sync()
    elif KIND == "long":
        for _ in range(4):
            long_step()
        sync()
    elif KIND.startswith("ctxchurn"):
        subprocess.run([sys.executable, "-c", CHURN], check=False, timeout=300)
    else:
        time.sleep(0.5)
"""

# Before each region: the hint an automatic region's target gives (builds without it: none),
# then WARMUP operations outside the region, as a benchmark's warm-up; between regions the
# siblings run, as they would during a benchmark's untimed work.
_SOON = """
try:
    from krex.proc.region import soon
except ImportError:
    soon = lambda: False
def before(n):
    soon()
    for _ in range(n):
        warm_op()
    sync()
"""


def measure_source(device: str, warmup: int) -> str:
    return source(device, _SOON + measure_code("warm()", 0.002, f"before({warmup})"))


STEPS = ("queue_wait_s", "block_s", "inflight_s", "drain_s", "freeze_s", "settle_s", "pin_s", "entry_s")


def source(device: str, body: str, kind: str = "") -> str:
    if kind.startswith("ctxchurn"):  # no GPU work of its own: not even torch's import
        churn = _CHURN_RT[device] if kind == "ctxchurn_rt" else _CHURN_DRIVER
        return f"KIND = {kind!r}\nCHURN = {churn!r}\n" + body
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


def measure(
    w: World, kind: str, k: int, n: int, burn: bool, freeze: str | None, warmup: int
) -> list[dict[str, Any]]:
    sibs = siblings(w, kind, k, 900, burn)
    try:
        opts = ("--freeze", freeze) if freeze else ()
        t0 = time.time()
        p = w.run(measure_source(w.device, warmup), str(n), log=f"measure-{kind}-{k}.log", opts=opts)
        stdout, _ = p.communicate(timeout=540)
        t1 = time.time()
    finally:
        stop_all(sibs)
    lines = [x for x in stdout.splitlines() if x.startswith("[")]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"{w.name}: the measuring command failed (rc {p.returncode}); see {w.dir}")
    rows: list[dict[str, Any]] = json.loads(lines[-1])
    rate = sibling_rate([w.dir / f"ready-{kind}-{i}.rate" for i in range(k)], t0, t1)
    for r in rows:
        r["sibling_steps_s"] = rate
    return rows


def sibling_rate(files: list[Path], t0: float, t1: float) -> float:
    """The siblings' steps per second together while the measuring command ran (each
    logs its count every 0.5 s): what the regions and pacing left them."""
    total = 0.0
    for f in files:
        try:
            pts = [tuple(map(float, ln.split())) for ln in f.read_text().splitlines() if ln.strip()]
        except (OSError, ValueError):
            continue
        # The samples that bracket the window (the last at or before its start, the first at
        # or after its end): a window shorter than the 0.5 s between samples still counts.
        before = [p for p in pts if p[0] <= t0]
        after = [p for p in pts if p[0] >= t1]
        a = before[-1] if before else (pts[0] if pts else None)
        b = after[0] if after else (pts[-1] if pts else None)
        if a is not None and b is not None and b[0] > a[0]:
            total += (b[1] - a[1]) / (b[0] - a[0])
    return total


LIFE_WHY = "inside a context, module or device memory call"


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    cl = [1e3 * r["client_s"] for r in rows]
    out: dict[str, Any] = {
        "n": len(rows),
        "p50_ms": percentile(cl, 50),
        "p95_ms": percentile(cl, 95),
        "p99_ms": percentile(cl, 99),
        "max_ms": max(cl) if cl else float("nan"),
        "contaminated": sum(1 for r in rows if r.get("contaminated")),
        "life_frz": sum(1 for r in rows if any(LIFE_WHY in w for w in r.get("freeze_why") or [])),
        "sib_steps_s": statistics.median([r.get("sibling_steps_s", math.nan) for r in rows]) if rows else math.nan,
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


def worlds_for(a: argparse.Namespace, out: Path, slots: int) -> list[World]:
    """One world per --build (its interpreter) and per --config (--python, krexd's
    environment as given); this interpreter's defaults when neither is given."""
    worlds = [World(name, py, a.device, out, slots, "lat") for name, py in (b.split("=", 1) for b in a.build)]
    for c in a.config:
        name, _, spec = c.partition("=")
        w = World(name, a.python, a.device, out, slots, "lat")
        for kv in filter(None, spec.split(",")):
            k, eq, v = kv.partition("=")
            if not eq or not k.startswith("KREX_"):
                raise SystemExit(f"--config {c!r}: {kv!r} is not KREX_VAR=VALUE")
            w.env[k] = v
        worlds.append(w)
    return worlds or [World("this", sys.executable, a.device, out, slots, "lat")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("sim", "gpu"), default="sim")
    ap.add_argument("--build", action="append", default=[], metavar="NAME=PYTHON",
                    help="a build to measure (its interpreter); default: this one")
    ap.add_argument("--config", action="append", default=[], metavar="NAME=KREX_VAR=VALUE,...",
                    help="this build with krexd under these variables (NAME= alone: its defaults)")
    ap.add_argument("--python", default=sys.executable, metavar="PYTHON",
                    help="the interpreter (build) the --config worlds run; default: this one")
    ap.add_argument("--siblings", default="8", help="sibling counts, e.g. 7,15 (C = siblings + 1)")
    ap.add_argument("--regions", type=int, default=100, help="regions per measurement")
    ap.add_argument("--kinds", default="idle,hammer",
                    help="idle, hammer, life, long, ctxchurn, ctxchurn_rt (comma-separated)")
    ap.add_argument("--warmup", type=int, default=3, help="operations before each region, outside it")
    ap.add_argument("--rounds", type=int, default=1, help="rounds, each measuring every world once")
    ap.add_argument("--burn", choices=("auto", "on", "off"), default="auto",
                    help="hammers also burn a CPU thread (auto: on for gpu, off for sim)")
    ap.add_argument("--freeze", default=None, metavar="POLICY",
                    help="the measuring command's freeze policy (krex run --freeze; default: krexd's)")
    a = ap.parse_args()
    counts = [int(x) for x in a.siblings.split(",")]
    burn = a.burn == "on" or (a.burn == "auto" and a.device == "gpu")
    out = Path(os.environ.get("OUT") or tempfile.gettempdir() + "/krex-entry-latency")
    out.mkdir(parents=True, exist_ok=True)
    worlds = worlds_for(a, out, max(counts) + 1)
    rows: dict[str, list[dict[str, Any]]] = {}
    try:
        for rnd in range(a.rounds):
            for k in counts:
                for kind in a.kinds.split(","):
                    for w in worlds if rnd % 2 == 0 else worlds[::-1]:
                        t0 = time.monotonic()
                        got = measure(w, kind, k, a.regions, burn, a.freeze, a.warmup)
                        rows.setdefault(f"{w.name}/{kind}/C{k + 1}", []).extend(got)
                        print(f"# round {rnd} {w.name} {kind} C={k + 1}: {len(got)} regions in "
                              f"{time.monotonic() - t0:.0f}s", flush=True)
    finally:
        for w in worlds:
            w.stop_daemon()
    summary = {key: summarise(r) for key, r in rows.items()}
    (out / "entry_latency.json").write_text(
        json.dumps({"device": a.device, "siblings": counts, "burn": burn, "freeze": a.freeze, "warmup": a.warmup,
                    "worlds": {w.name: {k: v for k, v in w.env.items() if k.startswith("KREX_")} for w in worlds},
                    "summary": summary, "rows": rows}, indent=1)
    )
    print(f"\nregion entry latency, siblings {a.siblings}, device {a.device}, burn {'on' if burn else 'off'}, "
          f"freeze {a.freeze or 'default'}, warm-up {a.warmup} "
          f"(client ms; steps: median ms / p99 ms); rows in {out}/entry_latency.json")
    hdr = f"{'world/kind/C':<24}{'n':>5}{'p50':>8}{'p95':>8}{'p99':>8}{'max':>8}  " + "  ".join(
        f"{s[:-2]:>13}" for s in STEPS) + "  contam  life_frz  waits(to/wk)  sib_steps/s"
    print(hdr)
    for key, s in summary.items():
        steps = "  ".join(f"{s[f'{x[:-2]}_p50']:>6.2f}/{s[f'{x[:-2]}_p99']:<6.2f}" for x in STEPS)
        waits = "/".join(
            f"{s.get(f'{k}_timeouts', '-')}:{s.get(f'{k}_wakeups', '-')}" for k in ("wait_inflight", "wait_drain"))
        print(f"{key:<24}{s['n']:>5}{s['p50_ms']:>8.2f}{s['p95_ms']:>8.2f}{s['p99_ms']:>8.2f}{s['max_ms']:>8.2f}  "
              f"{steps}  {s['contaminated']:>6}  {s['life_frz']:>8}  {waits:>12}  {s['sib_steps_s']:>10.1f}")


if __name__ == "__main__":
    main()
