#!/usr/bin/env python3
"""A benchmarking command on the SIMULATED GPU (logic demo, never performance evidence).

Shaped like the GPU corpus's commands, with each phase simulated:

  import   -- CPU sleep (--import-s): what `import torch, triton` costs
  compile  -- CPU sleep plus a short busy loop (--compile-s, --busy-s): JIT compilation
  inputs   -- a GPU copy outside the region (--inputs-us): input generation
  check    -- the candidate once plus reference kernels (--check-ms of GPU work), then a
              synchronise, outside the region: the correctness check
  timed    -- inside `with krex.region():` a do_bench-like loop of --us-microsecond
              kernels (cudaLaunchKernel through ctypes on the simulated libcudart,
              exactly as examples/sim/sim_example.py), timed with simulated events;
              ms = median over 5 repetitions of (elapsed / kernels per repetition)

The simulated kernel lasts exactly --us microseconds on the shared simulated device,
so the true order of a family whose --us scales with its parameter is known exactly.
Prints one JSON line (see examples/workloads/_wl.py).
"""

from __future__ import annotations

import ctypes
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _wl  # noqa: E402

REPS = 5


class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


def _cudart_path() -> Path:
    try:
        from krex.native import sim_dir

        return sim_dir() / "libcudart.so.13"
    except ImportError:
        return Path(__file__).resolve().parents[3] / "krex" / "_lib" / "libcudart.so.13"


class Cudart:
    def __init__(self) -> None:
        self.lib = lib = ctypes.CDLL(str(_cudart_path()))
        vp, i = ctypes.c_void_p, ctypes.c_int
        sigs: dict[str, list[object]] = {
            "cudaSetDevice": [i],
            "cudaMalloc": [ctypes.POINTER(vp), ctypes.c_size_t],
            "cudaFree": [vp],
            "cudaLaunchKernel": [vp, Dim3, Dim3, ctypes.POINTER(vp), ctypes.c_size_t, vp],
            "cudaMemcpyAsync": [vp, vp, ctypes.c_size_t, i, vp],
            "cudaEventCreate": [ctypes.POINTER(vp)],
            "cudaEventRecord": [vp, vp],
            "cudaEventSynchronize": [vp],
            "cudaEventElapsedTime": [ctypes.POINTER(ctypes.c_float), vp, vp],
            "cudaDeviceSynchronize": [],
        }
        for name, argtypes in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        self.func = ctypes.cast(lib.cudaDeviceSynchronize, ctypes.c_void_p)
        self._launch = lib.cudaLaunchKernel
        self._one = Dim3(1, 1, 1)

    def check(self, name: str, *args: object) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} returned {rc}")

    def kernel(self, us: int) -> None:
        rc = self._launch(self.func, Dim3(us, 1, 1), self._one, None, 0, None)
        if rc != 0:
            raise RuntimeError(f"cudaLaunchKernel returned {rc}")

    def event(self) -> ctypes.c_void_p:
        e = ctypes.c_void_p()
        self.check("cudaEventCreate", ctypes.byref(e))
        return e

    def elapsed_ms(self, a: ctypes.c_void_p, b: ctypes.c_void_p) -> float:
        ms = ctypes.c_float()
        self.check("cudaEventSynchronize", b)
        self.check("cudaEventElapsedTime", ctypes.byref(ms), a, b)
        return float(ms.value)


def busy(seconds: float) -> int:
    """Burn CPU like a compiler would (returns a checksum so nothing is optimised out)."""
    end, acc = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        for i in range(1000):
            acc = (acc * 31 + i) & 0xFFFFFFFF
    return acc


def main() -> int:
    p = _wl.parser(__doc__.splitlines()[0])
    p.add_argument("--us", type=int, required=True, help="simulated kernel length in microseconds")
    p.add_argument("--import-s", type=float, default=0.5)
    p.add_argument("--compile-s", type=float, default=0.3)
    p.add_argument("--busy-s", type=float, default=0.03, help="CPU-bound part of the compile phase")
    p.add_argument("--inputs-us", type=int, default=5000, help="GPU copy outside the region (1 ns per byte)")
    p.add_argument(
        "--check-ms",
        type=float,
        default=20.0,
        help="GPU work of the correctness check outside the region (reference kernels)",
    )
    a = p.parse_args()
    cmd = _wl.Command(a.name, a.family, a.param)

    with cmd.phase("import"):
        time.sleep(a.import_s)
        rt = Cudart()
        rt.check("cudaSetDevice", 0)
        dptr = ctypes.c_void_p()
        rt.check("cudaMalloc", ctypes.byref(dptr), 1 << 20)  # makes the simulated context active
    with cmd.phase("compile"):
        time.sleep(max(0.0, a.compile_s - a.busy_s))
        busy(a.busy_s)
    with cmd.phase("inputs"):
        n = max(1, a.inputs_us * 1000)
        src, dst = ctypes.create_string_buffer(16), ctypes.create_string_buffer(16)
        rt.check("cudaMemcpyAsync", dst, src, n, 0, None)  # the simulator moves no bytes; it charges n ns
        rt.check("cudaDeviceSynchronize")
    with cmd.phase("check"):
        # The candidate once (timed with events: the device must have run all of it),
        # then "reference" kernels worth --check-ms, queued at once like a real check.
        start, stop = rt.event(), rt.event()
        rt.check("cudaEventRecord", start, None)
        rt.kernel(a.us)
        rt.check("cudaEventRecord", stop, None)
        one = rt.elapsed_ms(start, stop)
        ref_us = min(1000, max(1, a.us))
        for _ in range(max(0, round(a.check_ms * 1000 / ref_us))):
            rt.kernel(ref_us)
        rt.check("cudaDeviceSynchronize")
        correct = one >= 0.999 * a.us / 1000.0

    rep_us = _wl.rep_ms(default=50.0) * 1000.0
    iters = max(1, math.ceil(rep_us / (REPS * a.us)))
    warm = max(1, min(iters, math.ceil(_wl.warmup_ms(default=5.0) * 1000.0 / a.us)))

    def measure() -> float:
        for _ in range(warm):
            rt.kernel(a.us)
        rt.check("cudaDeviceSynchronize")
        per: list[float] = []
        for _ in range(REPS):
            rt.check("cudaEventRecord", start, None)
            for _ in range(iters):
                rt.kernel(a.us)
            rt.check("cudaEventRecord", stop, None)
            per.append(rt.elapsed_ms(start, stop) / iters)
        return statistics.median(per)

    ms = cmd.timed(measure)
    rt.check("cudaFree", dptr)
    cmd.emit(
        ms,
        correct,
        us=a.us,
        iters=iters,
        reps=REPS,
        device="sim",
        simulated=True,
        sim_shm=os.environ.get("KREX_SIM_SHM"),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
