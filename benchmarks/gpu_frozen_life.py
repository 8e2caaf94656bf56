"""Can a region's entry freeze a sibling in the middle of a context, module or memory call
instead of waiting for the call to end? (no KREX needed)

A region's drain waits for a sibling inside a LIFE call: its drain helper's sync waits
behind the driver lock the call holds, and a context creation takes 100-250 ms on a loaded
GPU (docs/results/entry-latency/). A cgroup freeze takes effect at the thread's next return
to user space, between two of the call's ioctls, with no kernel lock held. This experiment
measures, on a real GPU, the two things that decide whether the entry may freeze instead:

  1. how long the freeze takes when it lands inside such a call (against the call's length);
  2. whether the owner's kernels, timed right after the freeze and while the sibling stays
     frozen mid-call, run as on an idle GPU: nothing the half-done call queued disturbs them.

One owner (torch, this process) times three kernels with CUDA events in back-to-back
rounds. SIBLINGS processes, each in a cgroup v2 directory of its own, do one LIFE call kind
in a loop (gpu_lifecycle.py's kinds: ctx, proc, module, alloc). A controller process
freezes all of them for FROZEN_MS every RUN_MS, writing cgroup.freeze and polling
cgroup.events; each sibling says in shared memory whether it is inside its call, read once
all are frozen. Every owner round is classed by where it fell:

  idle      no siblings at all (the noise floor, first and last)
  running   the siblings run (no freeze window overlaps the round)
  first     the first round begun after a freeze completed with a sibling frozen mid-call
  frozen    every other round inside such a window

Prints a table; writes $OUT/frozen-life.json. Needs root and cgroup v2 at /sys/fs/cgroup.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import statistics
import sys
import time
from typing import Any

CG = "/sys/fs/cgroup/krex-frozen-life"
KINDS = ("idle", "ctx", "proc", "module", "alloc", "idle")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _cg_write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _frozen(d: str) -> bool:
    with open(os.path.join(d, "cgroup.events")) as f:
        return "frozen 1" in f.read()


def sibling(kind: str, in_op: Any, ops: Any, op_ns: Any, cg: str) -> None:
    """One sibling in its own cgroup: gpu_lifecycle's loop, with in_op set around each call."""
    _cg_write(os.path.join(cg, "cgroup.procs"), str(os.getpid()))
    from gpu_lifecycle import PTX, _ck, _cu, _retain

    if kind == "proc":
        while True:
            pid = os.fork()
            if pid == 0:
                t0 = time.monotonic_ns()
                in_op.value = 1
                cu, dev = _cu()
                _retain(cu, dev)
                p = ctypes.c_uint64()
                cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(1 << 30))
                in_op.value = 0
                op_ns.value += time.monotonic_ns() - t0
                os._exit(0)
            os.waitpid(pid, 0)
            ops.value += 1
    cu, dev = _cu()
    _retain(cu, dev)
    p = ctypes.c_uint64()
    while True:
        t0 = time.monotonic_ns()
        in_op.value = 1
        if kind == "ctx":
            _ck(cu.cuDevicePrimaryCtxReset_v2(dev), "reset")
            _retain(cu, dev)
            _ck(cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(64 << 20)), "alloc")
        elif kind == "alloc":
            _ck(cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(4 << 30)), "alloc")
            _ck(cu.cuMemFree_v2(ctypes.c_uint64(p.value)), "free")
        elif kind == "module":
            m = ctypes.c_void_p()
            _ck(cu.cuModuleLoadData(ctypes.byref(m), ctypes.c_char_p(PTX + b"\0")), "module load")
            _ck(cu.cuModuleUnload(m), "module unload")
        in_op.value = 0
        op_ns.value += time.monotonic_ns() - t0
        ops.value += 1
        time.sleep(0.002)  # a gap between calls, as a real program has


def controller(
    dirs: list[str], in_ops: list[Any], secs: float, run_ms: float, frozen_ms: float, out: Any, seed: int
) -> None:
    """Freeze every sibling's cgroup for frozen_ms every ~run_ms; `out` gets one JSON list of
    windows: [t_request, t_frozen, t_thaw, siblings mid-call]."""
    rng = random.Random(seed)
    wins = []
    t_end = time.monotonic() + secs
    while time.monotonic() < t_end:
        time.sleep(rng.uniform(0.5, 1.5) * run_ms / 1e3)
        t_req = time.monotonic_ns()
        for d in dirs:
            _cg_write(os.path.join(d, "cgroup.freeze"), "1")
        while not all(_frozen(d) for d in dirs):
            time.sleep(0.0002)
        t_frozen = time.monotonic_ns()
        mid = sum(int(v.value) for v in in_ops)
        time.sleep(frozen_ms / 1e3)
        t_thaw = time.monotonic_ns()
        for d in dirs:
            _cg_write(os.path.join(d, "cgroup.freeze"), "0")
        wins.append([t_req, t_frozen, t_thaw, mid])
    out.send(json.dumps(wins))


def _kernels() -> dict:
    from gpu_lifecycle import _kernels as k

    return k()


def measure(kernels: dict, secs: float) -> list[tuple[int, int, str, float]]:
    """Back-to-back rounds for `secs`: (t_start_ns, t_end_ns, kernel, ms) per trial."""
    import torch

    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    rows = []
    t_end = time.monotonic() + secs
    while time.monotonic() < t_end:
        for name, (f, reps) in kernels.items():
            t0 = time.monotonic_ns()
            ev[0].record()
            for _ in range(reps):
                f()
            ev[1].record()
            ev[1].synchronize()
            rows.append((t0, time.monotonic_ns(), name, ev[0].elapsed_time(ev[1]) / reps))
    return rows


def classify(
    rows: list[tuple[int, int, str, float]], wins: list[list[int]]
) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {"running": {}, "first": {}, "frozen": {}, "frozen-idle": {}}
    firsts: set[int] = set()
    for _req, t_fz, _th, mid in wins:
        k = next((i for i, r in enumerate(rows) if r[0] >= t_fz), None)
        if k is not None and mid:
            firsts.add(k)
    for i, (t0, t1, name, ms) in enumerate(rows):
        w = next((w for w in wins if t0 < w[2] and t1 > w[0]), None)
        if w is None:
            cls = "running"
        elif t0 >= w[1] and t1 <= w[2]:
            cls = ("first" if i in firsts else "frozen") if w[3] else "frozen-idle"
        else:
            continue  # straddles a freeze or a thaw
        out[cls].setdefault(name, []).append(ms)
    return out


def _stats(t: list[float], base: float) -> dict[str, float]:
    t = sorted(t)
    med, p90 = statistics.median(t), t[int(0.9 * (len(t) - 1))]
    return {
        "n": len(t),
        "median_ms": med,
        "p90_ms": p90,
        "max_ms": t[-1],
        "median_vs_idle": med / base,
        "p90_vs_idle": p90 / base,
        "max_vs_idle": t[-1] / base,
    }


def main() -> int:
    import multiprocessing as mp

    secs = float(os.environ.get("FL_SECS", "8"))
    nsib = int(os.environ.get("FL_SIBLINGS", "4"))
    run_ms = float(os.environ.get("FL_RUN_MS", "250"))
    frozen_ms = float(os.environ.get("FL_FROZEN_MS", "150"))
    kernels = _kernels()
    spawn = mp.get_context("spawn")
    os.makedirs(CG, exist_ok=True)
    base: dict[str, float] = {}
    results: dict[str, Any] = {}
    for i, kind in enumerate(KINDS):
        label = kind if i == 0 or kind != "idle" else "idle-again"
        if kind == "idle":
            rows = measure(kernels, secs / 2)
            by: dict[str, list[float]] = {}
            for _a, _b, n, ms in rows:
                by.setdefault(n, []).append(ms)
            for n, t in by.items():
                base.setdefault(n, statistics.median(t))
            results[label] = {"idle": {n: _stats(t, base[n]) for n, t in by.items()}}
            print(
                f"{label:10s} " + "  ".join(f"{n} {statistics.median(t):.4f} ms" for n, t in by.items()),
                flush=True,
            )
            continue
        dirs, in_ops, ops, op_ns, procs = [], [], [], [], []
        for k in range(nsib):
            d = os.path.join(CG, f"{kind}{k}")
            os.makedirs(d, exist_ok=True)
            dirs.append(d)
            v, c, t = (spawn.Value(ctypes.c_long, 0, lock=False) for _ in range(3))
            in_ops.append(v), ops.append(c), op_ns.append(t)
            p = spawn.Process(target=sibling, args=(kind, v, c, t, d), daemon=True)
            p.start()
            procs.append(p)
        t_wait = time.monotonic() + 30
        while min(c.value for c in ops) == 0 and time.monotonic() < t_wait:
            time.sleep(0.05)
        o0 = sum(c.value for c in ops)
        n0 = sum(t.value for t in op_ns)
        rx, tx = spawn.Pipe(duplex=False)
        ctl = spawn.Process(target=controller, args=(dirs, in_ops, secs, run_ms, frozen_ms, tx, 7 + i))
        ctl.start()
        rows = measure(kernels, secs + 0.3)
        wins = json.loads(rx.recv())
        ctl.join()
        n_ops = sum(c.value for c in ops) - o0
        mean_op_ms = (sum(t.value for t in op_ns) - n0) / max(n_ops, 1) / 1e6
        for d in dirs:
            _cg_write(os.path.join(d, "cgroup.freeze"), "0")
        for p in procs:
            p.kill()
            p.join()
        for d in dirs:  # the forked children of `proc` may linger a moment
            for _ in range(100):
                try:
                    os.rmdir(d)
                    break
                except OSError:
                    time.sleep(0.05)
        cls = classify(rows, wins)
        fz_mid = [(w[1] - w[0]) / 1e6 for w in wins if w[3]]
        fz_none = [(w[1] - w[0]) / 1e6 for w in wins if not w[3]]
        row: dict[str, Any] = {
            "ops_per_s": n_ops / secs,
            "mean_op_ms": mean_op_ms,
            "windows": len(wins),
            "windows_mid_call": len(fz_mid),
            "freeze_ms_mid_call": sorted(fz_mid),
            "freeze_ms_between_calls": sorted(fz_none),
        }
        for c, by in cls.items():
            row[c] = {n: _stats(t, base[n]) for n, t in by.items() if t}
        results[label] = row

        def q(v: list[float], f: float) -> float:
            return sorted(v)[int(f * (len(v) - 1))] if v else float("nan")

        print(
            f"{label:10s} call (frozen time included) {mean_op_ms:7.1f} ms, {n_ops / secs:6.1f}/s; windows {len(wins)} "
            f"({len(fz_mid)} mid-call); freeze mid-call p50/p95/max {q(fz_mid, 0.5):.1f}/{q(fz_mid, 0.95):.1f}/"
            f"{max(fz_mid, default=float('nan')):.1f} ms, between calls p50 {q(fz_none, 0.5):.1f} ms",
            flush=True,
        )
        for c in ("running", "first", "frozen", "frozen-idle"):
            if c in row and row[c]:
                print(
                    f"{'':10s} {c:11s} "
                    + "  ".join(
                        f"{n} {s['median_vs_idle']:.3f}x p90 {s['p90_vs_idle']:.3f}x max {s['max_vs_idle']:.2f}x (n {s['n']})"
                        for n, s in row[c].items()
                    ),
                    flush=True,
                )
    with contextlib.suppress(OSError):
        os.rmdir(CG)
    from gpu_lifecycle import write_results

    write_results(
        "frozen-life.json", siblings=nsib, secs=secs, run_ms=run_ms, frozen_ms=frozen_ms, results=results
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
