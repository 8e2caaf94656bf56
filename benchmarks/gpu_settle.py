"""How long does a GPU stay slower after another process frees memory or exits?

krexd flags a region `recent-free` when it is granted within KREX_FREE_SETTLE_NS of another
command's free or exit (the driver scrubs freed memory on the GPU after the call returned),
and `sibling-context` when a sibling process ends during it. The 100 ms settle time was a
guess. This experiment measures it, with no KREX: one owner keeps a bandwidth-bound copy
(--mb MB each way) running back to back on its stream, every kernel between two CUDA events,
while a sibling process that holds SIZE GB (allocated and written) either frees it
(`free`: del + torch.cuda.empty_cache, i.e. cudaFree) or exits with it (`exit`).

Each kernel's GPU start is put on the host clock through a reference event that completed
while the stream was idle. Per trial: the baseline (median kernel time in the 0.4 s before
the sibling was told to go), then the median ratio to it in 5 ms bins after the call
returned (free) or after the process was reaped (exit), `settle_ms`: the end of the last
bin over --threshold (default 1.03) within --window-ms after the event, and `settle_run_ms`:
the end of the first stretch of such bins from the event on.

    python3 benchmarks/gpu_settle.py [--sizes 2,16,64] [--modes free,exit] [--reps 3]

Prints a table; writes $OUT/settle.json (every trial's bins)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

SIBLING = r"""
import os, sys, time, torch
gb, mode = float(sys.argv[1]), sys.argv[2]
t = torch.empty(int(gb * (1 << 30)) // 4, dtype=torch.float32, device="cuda")
t.fill_(1.0)
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.readline()
if mode == "free":
    t0 = time.monotonic()
    del t
    torch.cuda.empty_cache()
    t1 = time.monotonic()
    print(f"{t0} {t1}", flush=True)
    sys.stdin.readline()
else:
    print(f"{time.monotonic()} 0", flush=True)
    sys.exit(0)
"""


def trial(torch: Any, gb: float, mode: str, mb: int, window_ms: float, thr: float) -> dict[str, Any]:
    n = mb * (1 << 20) // 4
    x = torch.ones(n, device="cuda")
    y = torch.empty_like(x)
    sib = subprocess.Popen(
        [sys.executable, "-c", SIBLING, str(gb), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert sib.stdout is not None and sib.stdin is not None
    if sib.stdout.readline().strip() != "ready":
        raise RuntimeError("sibling did not get ready")
    for _ in range(20):
        y.copy_(x)
    torch.cuda.synchronize()
    ref = torch.cuda.Event(enable_timing=True)
    ref.record()
    ref.synchronize()
    t_ref = time.monotonic()
    evs: list[Any] = []
    times: dict[str, float] = {}

    def poke() -> None:
        """The sibling's side, off the launching thread: the stream never runs dry."""
        times["go"] = time.monotonic()
        sib.stdin.write("go\n")
        sib.stdin.flush()
        t_call_s, t_ev_s = sib.stdout.readline().split()
        times["call"] = float(t_call_s)
        if mode == "free":
            times["event"] = float(t_ev_s)
        else:
            sib.wait(60)
            times["event"] = time.monotonic()  # reaped: every fd closed, its contexts gone

    th = threading.Thread(target=poke)
    start = time.monotonic()
    while time.monotonic() - start < 0.4 or th.is_alive() or "event" not in times or (
        time.monotonic() < times["event"] + window_ms / 1e3 + 0.2
    ):
        for _ in range(40):
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            y.copy_(x)
            evs.append(e)
        if th.ident is None and time.monotonic() - start > 0.4:
            th.start()
        if len(evs) % 400 == 0:  # keep the queue close to the host clock
            evs[-1].synchronize()
        if time.monotonic() - start > 60:
            raise RuntimeError("the sibling never finished")
    th.join()
    t_go, t_call, t_event = times["go"], times["call"], times["event"]
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    torch.cuda.synchronize()
    if mode == "free":
        sib.stdin.write("bye\n")
        sib.stdin.flush()
        sib.wait(30)
    evs.append(end)
    starts = [t_ref + ref.elapsed_time(e) / 1e3 for e in evs]
    durs = [evs[i].elapsed_time(evs[i + 1]) for i in range(len(evs) - 1)]
    base = [d for s, d in zip(starts, durs, strict=False) if t_go - 0.4 <= s < t_go - 0.01]
    b = statistics.median(base) if base else float("nan")
    bins: list[dict[str, float]] = []
    step = 0.005
    settle = 0.0
    for k in range(int(window_ms / 1e3 / step)):
        lo = t_event + k * step
        ds = [d for s, d in zip(starts, durs, strict=False) if lo <= s < lo + step]
        if not ds:
            continue
        r = statistics.median(ds) / b
        bins.append({"t_ms": round(k * step * 1e3, 1), "n": len(ds), "ratio": round(r, 4), "max": round(max(ds) / b, 4)})
        if r > thr:
            settle = (k + 1) * step * 1e3
    run = 0.0  # the end of the first stretch of bins over the threshold, from the event on
    for bn in bins:
        if bn["ratio"] <= thr:
            break
        run = bn["t_ms"] + step * 1e3
    during = [d for s, d in zip(starts, durs, strict=False) if t_call <= s < t_event]
    return {
        "gb": gb,
        "mode": mode,
        "baseline_ms": b,
        "n_base": len(base),
        "call_ms": (t_event - t_call) * 1e3,
        "during_ratio": statistics.median(during) / b if during else None,
        "settle_ms": settle,
        "settle_run_ms": run,
        "first_bins": bins[:8],
        "bins": bins,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="2,16,64")
    ap.add_argument("--modes", default="free,exit")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--window-ms", type=float, default=500.0)
    ap.add_argument("--threshold", type=float, default=1.03)
    a = ap.parse_args()
    import torch

    out: list[dict[str, Any]] = []
    print(f"{'mode':>5} {'GB':>4} {'call ms':>8} {'base ms':>8} {'during':>7} {'0-5ms':>7} {'5-10':>6} "
          f"{'10-20':>6} {'settle ms':>9} {'first run ms':>12}")
    for rep in range(a.reps):
        for mode in a.modes.split(","):
            for gb in [float(s) for s in a.sizes.split(",")]:
                try:
                    r = trial(torch, gb, mode, a.mb, a.window_ms, a.threshold)
                except Exception as e:  # noqa: BLE001 - one failed trial must not lose the others
                    print(f"{mode} {gb}: {type(e).__name__}: {e}", file=sys.stderr)
                    continue
                r["rep"] = rep
                out.append(r)
                fb = {b["t_ms"]: b["ratio"] for b in r["bins"]}
                d = r["during_ratio"]
                print(
                    f"{mode:>5} {gb:>4g} {r['call_ms']:>8.1f} {r['baseline_ms']:>8.4f} "
                    f"{(f'{d:.3f}' if d else '-'):>7} {fb.get(0.0, float('nan')):>7.3f} "
                    f"{fb.get(5.0, float('nan')):>6.3f} {max(fb.get(10.0, 0), fb.get(15.0, 0)):>6.3f} "
                    f"{r['settle_ms']:>9.0f} {r['settle_run_ms']:>12.0f}",
                    flush=True,
                )
                path = os.path.join(os.environ.get("OUT", "/tmp"), "settle.json")
                with open(path, "w") as f:
                    json.dump(out, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
