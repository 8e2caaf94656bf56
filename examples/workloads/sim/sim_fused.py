#!/usr/bin/env python3
"""A fused-chain command on the SIMULATED GPU (logic demo, never performance evidence).

The simulated form of gpu/fused.py, phase for phase:

  import   -- CPU sleep (--import-s): `import torch`
  inputs   -- a CPU busy loop (--inputs-cpu-s: the seeded inputs made on the CPU), then a
              simulated host-to-device copy (--inputs-us, 1 ns per byte)
  compile  -- CPU sleep (--compile-s; torch.compile's Inductor run for --compile)
  check    -- the chain once plus reference kernels (--check-ms), then a synchronise
  timed    -- the harness's own timing function, `_timing.time_execution_with_cuda_event`
              (KernelBench style: 3 warm-ups, 100 trials, an L2 flush before each), on
              simulated events; KREX_AUTO_REGION makes its trial loop an automatic region
              (the command never calls krex.region())

One call of the chain is a few simulated kernels whose lengths add up to exactly --us
microseconds: the convolution or GEMM, then the normalisation, activation and reduction
kernels (eager: one kernel per operator; --compile: Inductor's one fused kernel after the
convolution or GEMM). ``ms`` is the mean over the trials, as KernelBench reports.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _timing  # noqa: E402
import _wl  # noqa: E402
from sim_cmd import Cudart, busy  # noqa: E402

# Share of the chain's time per kernel: the convolution or GEMM first, then its epilogue.
EAGER = {
    "conv-gn": (0.62, 0.08, 0.08, 0.07, 0.05, 0.10),  # conv, mean, var, normalise, silu+add, logsumexp
    "gemm-ln": (0.78, 0.06, 0.06, 0.05, 0.05),  # addmm, mean, var, normalise, gelu+sum
    "convt3d-gn": (0.70, 0.05, 0.07, 0.07, 0.06, 0.05),  # conv_transpose3d, relu, mean, var, norm, mean
}
COMPILED = {"conv-gn": (0.70, 0.30), "gemm-ln": (0.84, 0.16), "convt3d-gn": (0.76, 0.24)}


def kernels_of(chain: str, compiled: bool, us: int) -> list[int]:
    """The chain's kernel lengths (us), adding up to exactly ``us``."""
    shares = (COMPILED if compiled else EAGER)[chain]
    out = [max(1, round(us * s)) for s in shares[1:]]
    return [max(1, us - sum(out)), *out]


class _Event:
    def __init__(self, rt: Cudart) -> None:
        self.rt, self.e = rt, rt.event()

    def record(self) -> None:
        self.rt.check("cudaEventRecord", self.e, None)

    def elapsed_time(self, end: Any) -> float:
        return self.rt.elapsed_ms(self.e, end.e)


class SimBackend:
    """The simulated GPU's events for _timing (the calls torch.cuda makes on a real one)."""

    def __init__(self, rt: Cudart, flush_us: int) -> None:
        self.rt, self.flush_us = rt, flush_us

    def synchronize(self) -> None:
        self.rt.check("cudaDeviceSynchronize")

    def event(self) -> _Event:
        return _Event(self.rt)

    def clear_l2(self) -> None:
        self.rt.kernel(self.flush_us)


def main() -> int:
    p = _wl.parser(__doc__.splitlines()[0])
    p.add_argument("--chain", choices=sorted(EAGER), required=True)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--us", type=int, required=True, help="simulated length of one call of the chain")
    p.add_argument("--import-s", type=float, default=0.6)
    p.add_argument("--inputs-cpu-s", type=float, default=0.15, help="CPU time making the inputs")
    p.add_argument("--inputs-us", type=int, default=20000, help="simulated host-to-device copy")
    p.add_argument("--compile-s", type=float, default=0.1)
    p.add_argument("--check-ms", type=float, default=10.0)
    p.add_argument("--flush-us", type=int, default=50, help="the L2 flush before each trial")
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    cmd = _wl.Command(a.name, a.family, a.param)
    ks = kernels_of(a.chain, a.compile, a.us)

    with cmd.phase("import"):
        time.sleep(a.import_s)
        rt = Cudart()
        rt.check("cudaSetDevice", 0)
        dptr = ctypes.c_void_p()
        rt.check("cudaMalloc", ctypes.byref(dptr), 1 << 20)
    with cmd.phase("inputs"):
        busy(a.inputs_cpu_s)
        src, dst = ctypes.create_string_buffer(16), ctypes.create_string_buffer(16)
        rt.check("cudaMemcpyAsync", dst, src, max(1, a.inputs_us * 1000), 0, None)
        rt.check("cudaDeviceSynchronize")

    def chain() -> None:
        for us in ks:
            rt.kernel(us)

    with cmd.phase("compile"):
        time.sleep(a.compile_s)
        chain()
        rt.check("cudaDeviceSynchronize")
    be = SimBackend(rt, a.flush_us)
    with cmd.phase("check"):
        start, stop = be.event(), be.event()
        start.record()
        chain()
        stop.record()
        one = start.elapsed_time(stop)
        for _ in range(max(0, round(a.check_ms * 1000 / 500))):
            rt.kernel(500)
        rt.check("cudaDeviceSynchronize")
        correct = one >= 0.999 * a.us / 1000.0

    t0 = time.perf_counter()
    times = _timing.time_execution_with_cuda_event(
        chain, [], num_warmup=a.warmup, num_trials=a.trials, backend=be
    )
    t1 = time.perf_counter()
    rt.check("cudaFree", dptr)
    stats = _timing.timing_stats(times)
    cmd.t_region_s = t1 - t0  # the whole timing call (its warm-up calls included)
    cmd.region_entry_s = None  # the command cannot see its automatic region's entry
    cmd.phases["timed"] = t1 - t0
    cmd.emit(
        stats["mean"],
        correct,
        chain=a.chain,
        compiled=a.compile,
        kernels_us=ks,
        ms_median=stats["median"],
        ms_std=stats["std"],
        trials=len(times),
        us=a.us,
        device="sim",
        simulated=True,
        region="auto (KernelBench-style cuda-event timing)",
        sim_shm=os.environ.get("KREX_SIM_SHM"),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
