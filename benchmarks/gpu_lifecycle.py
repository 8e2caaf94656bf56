"""Does GPU work that passes through no gated call disturb a region? (the `gpu` policy)

Under `--freeze gpu` a sibling keeps running through a region and parks at the gate only
when it submits a kernel, copy or memset. Without LIFE-call gating, regions
read clean but 15-23% slow that way (docs/results/lifecycle-calls/). This experiment needs no KREX: one owner times
three kernels with CUDA events while 7 siblings do one thing each, with no kernel at all:

  idle      nothing (run first and last: the noise floor)
  cpu       burn CPU in Python
  ctx       create and destroy a primary context in a loop (retain, alloc 64 MB, reset)
  proc      start processes that create a context, allocate 1 GB and exit without cleanup
  alloc     allocate and free 4 GB of device memory in a loop
  module    load and unload a small PTX module in a loop (JIT + code upload)
  hostmem   allocate and free 512 MB of pinned host memory in a loop

Prints, per variant and kernel, the median and p90 of the owner's trials and their ratio to
the first idle run; writes everything to $OUT/lifecycle.json.

With --krex BIN [--freeze POLICY] the same runs under KREX: each sibling is its own
`krex run` command, and the owner (another one, `--freeze POLICY`) times every round of the
three kernels inside a `krex.region()`; the regions' flags are counted too. Output:
$OUT/lifecycle-krex-POLICY.json."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import statistics
import sys
import time
from typing import Any

VARIANTS = ("idle", "cpu", "ctx", "proc", "alloc", "module", "hostmem", "idle")
PTX = b"""
.version 7.0
.target sm_50
.address_size 64
.visible .entry k(.param .u64 p) {
  .reg .u64 %a; .reg .u32 %r;
  ld.param.u64 %a, [p]; mov.u32 %r, %tid.x; st.global.u32 [%a], %r; ret;
}
"""


def _cu() -> tuple[ctypes.CDLL, ctypes.c_int]:
    cu = ctypes.CDLL("libcuda.so.1")
    _ck(cu.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    _ck(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    return cu, dev


def _ck(rc: int, what: str) -> None:
    if rc:
        raise SystemExit(f"{what}: CUDA error {rc}")


def _retain(cu: ctypes.CDLL, dev: ctypes.c_int) -> ctypes.c_void_p:
    ctx = ctypes.c_void_p()
    _ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
    _ck(cu.cuCtxSetCurrent(ctx), "set current")
    return ctx


def sibling(kind: str, count: ctypes.c_long) -> None:
    """One sibling's loop; never submits a kernel, copy or memset."""
    n = 0
    if kind == "cpu":
        while True:
            sum(i * i for i in range(20000))
            n += 1
            count.value = n
    if kind == "proc":  # fork before any CUDA call: each child makes its own context
        while True:
            pid = os.fork()
            if pid == 0:
                cu, dev = _cu()
                _retain(cu, dev)
                p = ctypes.c_uint64()
                cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(1 << 30))
                os._exit(0)
            os.waitpid(pid, 0)
            n += 1
            count.value = n
    cu, dev = _cu()
    _retain(cu, dev)
    p = ctypes.c_uint64()
    while True:
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
        elif kind == "hostmem":
            h = ctypes.c_void_p()
            _ck(cu.cuMemHostAlloc(ctypes.byref(h), ctypes.c_size_t(512 << 20), 0), "host alloc")
            _ck(cu.cuMemFreeHost(h), "host free")
        else:
            raise SystemExit(f"unknown sibling kind {kind}")
        n += 1
        count.value = n


def _kernels() -> dict:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    a = torch.randn(5120, 5120, device=dev)
    big = torch.empty(1 << 28, device=dev)  # 1 GB fp32: a bandwidth-bound pass
    small = torch.empty(1 << 16, device=dev)
    kernels = {
        "sgemm": (lambda: torch.mm(a, a), 1),
        "bw-1GB": (lambda: big.mul_(1.0000001), 4),
        "short": (lambda: small.add_(1.0), 50),
    }
    for f, _reps in kernels.values():
        for _ in range(3):
            f()
    torch.cuda.synchronize()
    return kernels


def measure(kernels: dict, secs: float, region: Any = None) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Rounds of the three kernels for `secs`, each timed with CUDA events; with `region`
    (krex.region) every round runs inside one. Returns the trials and the regions' flags."""
    import contextlib

    import torch

    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    trials: dict[str, list[float]] = {k: [] for k in kernels}
    flags: dict[str, int] = {"regions": 0, "clean": 0}
    t_end = time.monotonic() + secs
    while time.monotonic() < t_end:
        with region() if region else contextlib.nullcontext() as r:
            for name, (f, reps) in kernels.items():
                ev[0].record()
                for _ in range(reps):
                    f()
                ev[1].record()
                ev[1].synchronize()
                trials[name].append(ev[0].elapsed_time(ev[1]) / reps)
        if r is not None:
            flags["regions"] += 1
            flags["clean"] += bool(r.clean)
            for fl in r.flags:
                flags[fl] = flags.get(fl, 0) + 1
    return trials, flags


def summarise(label: str, trials: dict[str, list[float]], base: dict[str, float], row: dict) -> None:
    for name, t in trials.items():
        t.sort()
        med, p90 = statistics.median(t), t[int(0.9 * (len(t) - 1))]
        base.setdefault(name, med)
        row[name] = {
            "n": len(t),
            "median_ms": med,
            "p90_ms": p90,
            "max_ms": t[-1],
            "median_vs_idle": med / base[name],
            "p90_vs_idle": p90 / base[name],
        }
    extra = (
        f"  regions {row['regions']['clean']}/{row['regions']['regions']} clean" if "regions" in row else ""
    )
    print(
        f"{label:10s} ops/s {row.get('ops_per_s', 0):8.1f}  "
        + "  ".join(
            f"{n} {row[n]['median_ms']:.4f} ({row[n]['median_vs_idle']:.3f}x, p90 {row[n]['p90_vs_idle']:.3f}x)"
            for n in trials
        )
        + extra,
        flush=True,
    )


def main() -> int:
    import multiprocessing as mp

    kernels = _kernels()
    # spawn, not fork: a forked child of a process with a CUDA context must not touch CUDA
    spawn = mp.get_context("spawn")
    results: dict[str, dict] = {}
    base: dict[str, float] = {}
    secs = float(os.environ.get("LIFE_SECS", "6"))
    nsib = int(os.environ.get("LIFE_SIBLINGS", "7"))
    for i, kind in enumerate(VARIANTS):
        label = kind if i == 0 or kind != "idle" else "idle-again"
        counts = [spawn.Value(ctypes.c_long, 0, lock=False) for _ in range(nsib if kind != "idle" else 0)]
        procs = [spawn.Process(target=sibling, args=(kind, c), daemon=True) for c in counts]
        for p in procs:
            p.start()
        t_wait = time.monotonic() + 20
        while procs and min(c.value for c in counts) == 0 and time.monotonic() < t_wait:
            time.sleep(0.05)
        c0 = [c.value for c in counts]
        trials, _ = measure(kernels, secs)
        ops = sum(c.value for c in counts) - sum(c0)
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
            p.join()
        row: dict[str, Any] = {"sibling_ops": ops, "ops_per_s": ops / secs}
        summarise(label, trials, base, row)
        results[label] = row
    write_results("lifecycle.json", siblings=nsib, secs=secs, results=results)
    return 0


def write_results(name: str, **data: Any) -> None:
    """$OUT/NAME (default: here): `data`, with the torch and GPU it ran on."""
    import torch

    meta = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    with open(os.path.join(os.environ.get("OUT", "."), name), "w") as f:
        json.dump({**data, **meta}, f, indent=1)


def _sibling_cmd(count_file: str, kind: str) -> None:
    """`--sibling KIND FILE`: sibling() under `krex run`, its count written to FILE."""
    c = ctypes.c_long(0)
    import threading

    def dump() -> None:
        while True:
            with open(count_file + ".tmp", "w") as f:
                f.write(str(c.value))
            os.replace(count_file + ".tmp", count_file)
            time.sleep(0.2)

    threading.Thread(target=dump, daemon=True).start()
    sibling(kind, c)


def _owner_cmd(secs: float, out: str) -> None:
    """`--owner SECS OUT`: measure() with a region around every round (under `krex run`)."""
    import krex

    kernels = _kernels()
    measure(kernels, 1.0, krex.region)  # warm: first regions, allocator
    trials, flags = measure(kernels, secs, krex.region)
    with open(out, "w") as f:
        json.dump({"trials": trials, "regions": flags}, f)


def main_krex(krex_bin: str, policy: str) -> int:
    import subprocess
    import tempfile

    secs = float(os.environ.get("LIFE_SECS", "6"))
    nsib = int(os.environ.get("LIFE_SIBLINGS", "7"))
    tmp = tempfile.mkdtemp(prefix="lifecycle-")
    run = [krex_bin, "run", "--device", "gpu", "--"]
    me = [sys.executable, os.path.abspath(__file__)]
    results: dict[str, dict] = {}
    base: dict[str, float] = {}
    for i, kind in enumerate(VARIANTS):
        label = kind if i == 0 or kind != "idle" else "idle-again"
        files = [os.path.join(tmp, f"{label}-{k}.count") for k in range(nsib if kind != "idle" else 0)]
        sibs = [subprocess.Popen([*run, *me, "--sibling", kind, f]) for f in files]

        def count(f: str) -> int:
            try:
                with open(f) as fh:
                    return int(fh.read() or 0)
            except (OSError, ValueError):
                return 0

        t_wait = time.monotonic() + 60
        while sibs and min(count(f) for f in files) == 0 and time.monotonic() < t_wait:
            time.sleep(0.1)
        c0 = sum(count(f) for f in files)
        out = os.path.join(tmp, f"{label}.json")
        t0 = time.monotonic()
        rc = subprocess.call(
            [krex_bin, "run", "--device", "gpu", "--freeze", policy, "--", *me, "--owner", str(secs), out]
        )
        span = time.monotonic() - t0
        ops = sum(count(f) for f in files) - c0
        for p in sibs:
            p.terminate()
        for p in sibs:
            p.wait(30)
        if rc != 0:
            print(f"{label}: owner exited {rc}", flush=True)
            continue
        with open(out) as f:
            got = json.load(f)
        row: dict[str, Any] = {"sibling_ops": ops, "ops_per_s": ops / span, "regions": got["regions"]}
        summarise(label, got["trials"], base, row)
        results[label] = row
    dest = os.path.join(os.environ.get("OUT", "."), f"lifecycle-krex-{policy}.json")
    with open(dest, "w") as f:
        json.dump({"siblings": nsib, "secs": secs, "policy": policy, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--sibling":
        _sibling_cmd(sys.argv[3], sys.argv[2])
    elif len(sys.argv) > 1 and sys.argv[1] == "--owner":
        _owner_cmd(float(sys.argv[2]), sys.argv[3])
    elif len(sys.argv) > 2 and sys.argv[1] == "--krex":
        pol = sys.argv[sys.argv.index("--freeze") + 1] if "--freeze" in sys.argv else "gpu"
        sys.exit(main_krex(sys.argv[2], pol))
    else:
        sys.exit(main())
