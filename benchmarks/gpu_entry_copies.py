"""Region entry while siblings move GB-scale inputs: large copies split into gated chunks
(KREX_COPY_CHUNK_BYTES, interpose/krex_abi.h) against the same run with splitting off.

    python benchmarks/gpu_entry_copies.py --device gpu          # the H200: 8 siblings, 2 GiB each
    python benchmarks/gpu_entry_copies.py --device sim --siblings 2 --regions 20 --sim-mib 256 \\
        --chunk-bytes 4194304                                # the simulated GPU (tests)

Per case ("chunked": the shim's default chunk or --chunk-bytes; "unchunked":
KREX_COPY_CHUNK_BYTES=0 in the siblings) a world of its own (state directory, segment,
simulated device), N siblings under `krex run --device D`, each copying a large pageable
host buffer to the GPU and back in a loop (synchronous copies), and one measuring command
that enters `krex.region()` R times around a short GPU operation. It records the client's
entry time (from `with krex.region()` to the first line inside) and the grant's steps
(inflight_s: the gate closed, waiting for siblings to leave their gated call; drain_s;
freeze_s). Uses only `krex run`, `krex.region()` and torch (gpu) or ctypes (sim).

Raw rows go to $OUT/entry_copies.json (default /tmp/krex-entry-copies); the table is
printed last. Simulated numbers (1 ns per byte) show logic, never GPU performance."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from _siblings import SIM_RUNTIME, World, fresh, measure_code, percentile, stop_all, wait_ready

_SIM_PRELUDE = (
    SIM_RUNTIME
    + r"""
FRESH = False
rt.cudaMemcpy.argtypes = [vp, vp, ctypes.c_size_t, ctypes.c_int]
def short_op():
    kernel(100)
def setup(nbytes):
    global H, D, N
    N = nbytes
    H, D = vp(), vp()
    rt.cudaMalloc(ctypes.byref(H), 16); rt.cudaMalloc(ctypes.byref(D), 16)  # the sim moves no bytes
def round_trip():
    assert rt.cudaMemcpy(D, H, N, 1) == 0  # host to device, synchronous: N ns on the simulated GPU
    assert rt.cudaMemcpy(H, D, N, 2) == 0
"""
)

_GPU_PRELUDE = r"""
import torch
x = torch.randn(1 << 20, device="cuda")
def sync():
    torch.cuda.synchronize()
def short_op():
    x.mul_(1.0)
def setup(nbytes):
    global H, D
    H = torch.ones(nbytes // 4, dtype=torch.float32)  # pageable: staged through the driver
    D = torch.empty_like(H, device="cuda")
def round_trip():
    global H
    if FRESH:  # a new host buffer each time, as an agent's command generates its input
        H = torch.randn(H.numel())
    D.copy_(H)  # cudaMemcpyAsync + a stream synchronise: a synchronous copy
    H.copy_(D)
"""

_SIBLING = r"""
import sys, time
nbytes, ready = int(sys.argv[1]), sys.argv[2]
FRESH = len(sys.argv) > 3 and sys.argv[3] == "fresh"
setup(nbytes)
round_trip(); sync()
open(ready, "w").write("ready")
while True:
    round_trip()
"""

_MEASURE = measure_code("short_op(); sync()", 0.005)  # let the siblings run between regions

STEPS = ("inflight_s", "drain_s", "freeze_s", "entry_s")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


class Sampler(threading.Thread):
    """--sample: where the siblings' threads wait, every ~2 ms, from /proc (root). Counts, per
    thread kind (the drain helper, the main thread, others), each blocked kernel stack top
    and, for a thread inside a system call, the call with its arguments: which call of the
    sibling holds the memory map lock a drain helper waits for."""

    def __init__(self, roots: list[int]) -> None:
        super().__init__(daemon=True)
        self.roots, self.stop = set(roots), threading.Event()
        self.counts: dict[str, int] = {}
        self.samples = 0

    def _pids(self) -> list[int]:
        kids: dict[int, list[int]] = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                st = _read(f"/proc/{d}/stat")
                if st:
                    kids.setdefault(int(st.rsplit(")", 1)[1].split()[1]), []).append(int(d))
        out, todo = [], list(self.roots)
        while todo:
            p = todo.pop()
            out.append(p)
            todo.extend(kids.get(p, []))
        return [p for p in out if "python" in _read(f"/proc/{p}/comm")]

    def run(self) -> None:
        pids: list[int] = []
        t_pids = 0.0
        while not self.stop.wait(0.002):
            if time.time() - t_pids > 1.0:
                pids, t_pids = self._pids(), time.time()
            self.samples += 1
            for pid in pids:
                try:
                    tids = os.listdir(f"/proc/{pid}/task")
                except OSError:
                    continue
                for tid in tids:
                    base = f"/proc/{pid}/task/{tid}"
                    comm = _read(f"{base}/comm")
                    kind = "helper" if comm == "krex-drain" else "main" if tid == str(pid) else "other"
                    if kind == "other":
                        continue
                    st = _read(f"{base}/stat")
                    state = st.rsplit(")", 1)[1].split()[0] if st else "?"
                    stack = [ln.split()[-1].split("+")[0] for ln in _read(f"{base}/stack").splitlines()[:6]]
                    if state != "D" and not any("pin_user_pages" in f or "gup" in f for f in stack):
                        continue
                    sc = _read(f"{base}/syscall").split()
                    call = sc[0] if sc else "?"
                    if call == "9" and len(sc) > 4:  # mmap: length and flags
                        call += (
                            f" len={int(sc[2], 16)} flags={sc[4]} fd={int(sc[5], 16) if len(sc) > 5 else '?'}"
                        )
                    elif call == "16" and len(sc) > 3:  # ioctl: the request
                        call += f" req={sc[2]}"
                    key = f"{kind} {state} {'<'.join(stack)} | syscall {call}"
                    self.counts[key] = self.counts.get(key, 0) + 1


def source(device: str, body: str) -> str:
    return (_GPU_PRELUDE if device == "gpu" else _SIM_PRELUDE) + body


def run_case(
    w: World,
    chunk: str | None,
    k: int,
    nbytes: int,
    regions: int,
    fresh_host: bool = False,
    sampler: list[Sampler] | None = None,
) -> list[dict[str, Any]]:
    """k siblings copying nbytes each way in a loop, then `regions` regions. chunk: the
    siblings' KREX_COPY_CHUNK_BYTES (None: the shim's default). fresh_host: each copy from a
    newly generated host buffer. sampler: a list to put a started Sampler in."""
    env = {} if chunk is None else {"KREX_COPY_CHUNK_BYTES": chunk}
    files = [w.dir / f"ready-{i}" for i in range(k)]
    fresh(files)
    code = source(w.device, _SIBLING)
    extra = ["fresh"] if fresh_host else []
    sibs = [
        w.run(code, str(nbytes), str(f), *extra, log=f"sibling-{i}.log", env=env) for i, f in enumerate(files)
    ]
    try:
        if wait_ready(files, sibs, 120):
            raise SystemExit(f"{w.name}: siblings not ready (exited or 120 s); see {w.dir}")
        time.sleep(0.5)  # every sibling inside its copy loop
        if sampler is not None:
            sampler.append(Sampler([s.pid for s in sibs]))
            sampler[-1].start()
        p = w.run(source(w.device, _MEASURE), str(regions), log="measure.log")
        stdout, _ = p.communicate(timeout=300)
        if p.returncode != 0:
            raise SystemExit(f"{w.name}: measuring command failed ({p.returncode}); see {w.dir}/measure.log")
        rows: list[dict[str, Any]] = json.loads(stdout.strip().splitlines()[-1])
        return rows
    finally:
        if sampler:
            sampler[-1].stop.set()
        stop_all(sibs)


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    ms = [r["client_s"] * 1e3 for r in rows]
    s = {
        "n": float(len(rows)),
        "p50_ms": percentile(ms, 50),
        "p90_ms": percentile(ms, 90),
        "p99_ms": percentile(ms, 99),
        "max_ms": max(ms),
    }
    for step in STEPS:
        vals = [r[step] * 1e3 for r in rows if isinstance(r.get(step), (int, float))]
        s[f"{step[:-2]}_p50_ms"] = statistics.median(vals) if vals else float("nan")
        s[f"{step[:-2]}_max_ms"] = max(vals) if vals else float("nan")
    s["contaminated"] = float(sum(1 for r in rows if r.get("contaminated")))
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("sim", "gpu"), default="gpu")
    ap.add_argument("--siblings", type=int, default=8)
    ap.add_argument("--regions", type=int, default=100)
    ap.add_argument("--gib", type=float, default=2.0, help="bytes each sibling copies each way (gpu)")
    ap.add_argument("--sim-mib", type=int, default=256, help="bytes each sibling copies each way (sim)")
    ap.add_argument(
        "--chunk-bytes", default=None, help="the chunked case's KREX_COPY_CHUNK_BYTES (default: the shim's)"
    )
    ap.add_argument("--cases", default="chunked,unchunked", help="which cases, comma-separated")
    ap.add_argument("--fresh-host", action="store_true", help="each copy from a newly generated host buffer")
    ap.add_argument("--sample", action="store_true", help="sample where the siblings' threads block (/proc)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/krex-entry-copies")
    a = ap.parse_args()
    root = Path(a.out)
    root.mkdir(parents=True, exist_ok=True)
    nbytes = int(a.gib * 2**30) if a.device == "gpu" else a.sim_mib * 2**20
    cases = [c for c in (("chunked", a.chunk_bytes), ("unchunked", "0")) if c[0] in a.cases.split(",")]
    result: dict[str, Any] = {"device": a.device, "siblings": a.siblings, "bytes": nbytes, "cases": {}}
    t_start = time.time()
    for name, chunk in cases:
        w = World(name, sys.executable, a.device, root, a.siblings + 1, "cp")
        try:
            t0 = time.time()
            smp: list[Sampler] = []
            rows = run_case(w, chunk, a.siblings, nbytes, a.regions, a.fresh_host, smp if a.sample else None)
            if smp:
                top = sorted(smp[0].counts.items(), key=lambda kv: -kv[1])
                print(f"{name}: where siblings' threads blocked ({smp[0].samples} samples):", file=sys.stderr)
                for key, n in top[:25]:
                    print(f"  {n:6d}  {key}", file=sys.stderr)
            result["cases"][name] = {
                "blocked": dict(smp[0].counts) if smp else {},
                "chunk": chunk,
                "rows": rows,
                "summary": summary(rows),
                "wall_s": time.time() - t0,
            }
            print(f"{name}: {len(rows)} regions in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        finally:
            w.stop_daemon()
    result["wall_s"] = time.time() - t_start
    (root / "entry_copies.json").write_text(json.dumps(result, indent=1))
    cols = (
        "p50_ms",
        "p90_ms",
        "p99_ms",
        "max_ms",
        "inflight_p50_ms",
        "inflight_max_ms",
        "drain_p50_ms",
        "freeze_p50_ms",
        "contaminated",
    )
    print(
        f"region entry with {a.siblings} siblings copying {nbytes / 2**30:.2f} GiB each way ({a.device}), "
        f"{a.regions} regions per case; raw rows in {root / 'entry_copies.json'}"
    )
    print(f"{'case':<10} " + " ".join(f"{c:>15}" for c in cols))
    for name, c in result["cases"].items():
        print(f"{name:<10} " + " ".join(f"{c['summary'][k]:>15.2f}" for k in cols))
    print(json.dumps({n: c["summary"] for n, c in result["cases"].items()}))


if __name__ == "__main__":
    main()
