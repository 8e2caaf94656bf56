#!/usr/bin/env python3
"""Drive the simulated GPU from Python with ctypes, and watch time-slicing.

The simulated ``libcudart.so.13`` (``krex.native.sim_dir()``) exports the CUDA
runtime entry points. This script launches N-microsecond kernels through
``cudaLaunchKernel`` (``dim3`` passed by value as a ctypes Structure) and N-byte
copies through ``cudaMemcpyAsync``, times both with simulated events and
prints one JSON line.

    python examples/sim/sim_example.py --us 200 --iters 20 --reps 5
    python examples/sim/sim_example.py --contend     # alone vs. next to a hammer
    python examples/sim/sim_example.py --hammer --seconds 5

``--contend`` measures alone, then starts a hammering copy of itself (same
simulated GPU: same ``KREX_SIM_SHM``), measures again and prints both. The
simulated device runs one operation at a time node-wide, so the hammer's
kernels land between our start and stop events and the contended mean grows.
That is a property of the model, not evidence about any real GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CUDA_MEMCPY_HOST_TO_HOST = 0


class Dim3(ctypes.Structure):
    """``dim3`` from the CUDA headers: three unsigned ints, passed by value."""

    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


def sim_cudart_path() -> Path:
    """``libcudart.so.13`` of the simulated GPU, next to the KREX installation."""
    try:
        from krex.native import sim_dir
    except ImportError:  # krex not importable: fall back to the source tree layout
        return Path(__file__).resolve().parents[2] / "krex" / "_lib" / "libcudart.so.13"
    return sim_dir() / "libcudart.so.13"


class Cudart:
    """The handful of runtime calls this example needs, with checked return codes."""

    def __init__(self, path: Path) -> None:
        self.lib = lib = ctypes.CDLL(str(path))
        vp, i = ctypes.c_void_p, ctypes.c_int
        sigs: dict[str, list[object]] = {
            "cudaSetDevice": [i],
            "cudaLaunchKernel": [vp, Dim3, Dim3, ctypes.POINTER(vp), ctypes.c_size_t, vp],
            "cudaMemcpyAsync": [vp, vp, ctypes.c_size_t, i, vp],
            "cudaEventCreate": [ctypes.POINTER(vp)],
            "cudaEventRecord": [vp, vp],
            "cudaEventSynchronize": [vp],
            "cudaEventElapsedTime": [ctypes.POINTER(ctypes.c_float), vp, vp],
            "cudaEventDestroy": [vp],
            "cudaDeviceSynchronize": [],
        }
        for name, argtypes in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        # A kernel "function": the simulated GPU never calls it.
        self.func = ctypes.cast(lib.cudaDeviceSynchronize, ctypes.c_void_p)
        self.stream = None  # the default stream

    def check(self, name: str, *args: object) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} returned {rc}")

    def event(self) -> ctypes.c_void_p:
        e = ctypes.c_void_p()
        self.check("cudaEventCreate", ctypes.byref(e))
        return e

    def kernel(self, us: int) -> None:
        """One kernel of ``us`` microseconds: the simulator charges gridDim.x us."""
        self.check("cudaLaunchKernel", self.func, Dim3(us, 1, 1), Dim3(1, 1, 1), None, 0, self.stream)

    def copy(self, dst: ctypes.Array[ctypes.c_char], src: ctypes.Array[ctypes.c_char], n: int) -> None:
        """An ``n``-byte copy: the simulator charges 1 ns per byte (and moves nothing)."""
        self.check("cudaMemcpyAsync", dst, src, n, CUDA_MEMCPY_HOST_TO_HOST, self.stream)

    def elapsed_ms(self, start: ctypes.c_void_p, stop: ctypes.c_void_p) -> float:
        ms = ctypes.c_float()
        self.check("cudaEventSynchronize", stop)
        self.check("cudaEventElapsedTime", ctypes.byref(ms), start, stop)
        return ms.value


def measure(rt: Cudart, us: int, iters: int, reps: int, nbytes: int) -> dict[str, float]:
    """Mean event-timed kernel length over ``reps`` batches of ``iters`` kernels,
    and the mean event-timed length of ``iters`` back-to-back ``nbytes`` copies."""
    start, stop = rt.event(), rt.event()
    rt.kernel(us)  # warm-up
    rt.check("cudaDeviceSynchronize")
    total_ms = 0.0
    for _ in range(reps):
        rt.check("cudaEventRecord", start, rt.stream)
        for _ in range(iters):
            rt.kernel(us)
        rt.check("cudaEventRecord", stop, rt.stream)
        total_ms += rt.elapsed_ms(start, stop)
    buf_a, buf_b = ctypes.create_string_buffer(nbytes), ctypes.create_string_buffer(nbytes)
    rt.check("cudaEventRecord", start, rt.stream)
    for _ in range(iters):
        rt.copy(buf_a, buf_b, nbytes)
    rt.check("cudaEventRecord", stop, rt.stream)
    copy_ms = rt.elapsed_ms(start, stop) / iters
    rt.check("cudaEventDestroy", start)
    rt.check("cudaEventDestroy", stop)
    return {"kernel_mean_us": total_ms * 1000.0 / (iters * reps), "copy_mean_us": copy_ms * 1000.0}


def hammer(rt: Cudart, us: int, iters: int, seconds: float) -> dict[str, float]:
    """Keep the simulated device busy for ``seconds``: batches of ``iters``
    kernels, the next one queued before the previous one is waited for, so at
    most two batches are ever ahead of the wall clock."""
    events = [(rt.event(), rt.event()) for _ in range(2)]
    deadline = time.monotonic() + seconds
    batches, total_ms, pending = 0, 0.0, None
    while True:
        start, stop = events[batches % 2]
        rt.check("cudaEventRecord", start, rt.stream)
        for _ in range(iters):
            rt.kernel(us)
        rt.check("cudaEventRecord", stop, rt.stream)
        if batches == 0:  # the device now has work queued: tell whoever started us
            print(json.dumps({"hammer": "ready", "pid": os.getpid()}), flush=True)
        batches += 1
        if pending is not None:
            total_ms += rt.elapsed_ms(*pending)
        pending = (start, stop)
        if time.monotonic() >= deadline:
            break
    total_ms += rt.elapsed_ms(*pending)
    return {"kernel_mean_us": total_ms * 1000.0 / (iters * batches), "batches": batches}


def contend(args: argparse.Namespace, rt: Cudart) -> dict[str, object]:
    """Measure alone, then next to a hammering copy of this script."""
    alone = measure(rt, args.us, args.iters, args.reps, args.bytes)
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--hammer",
        "--us",
        str(args.us),
        "--iters",
        str(args.iters),
        "--seconds",
        str(args.hammer_seconds),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline() or "{}")
        if ready.get("hammer") != "ready":
            raise RuntimeError(f"hammer did not start (exit status {proc.poll()})")
        contended = measure(rt, args.us, args.iters, args.reps, args.bytes)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()
    return {
        "us": args.us,
        "iters": args.iters,
        "reps": args.reps,
        "bytes": args.bytes,
        "alone_mean_us": alone["kernel_mean_us"],
        "contended_mean_us": contended["kernel_mean_us"],
        "inflation": contended["kernel_mean_us"] / alone["kernel_mean_us"],
        "alone_copy_mean_us": alone["copy_mean_us"],
        "contended_copy_mean_us": contended["copy_mean_us"],
        "pid": os.getpid(),
        "hammer_pid": proc.pid,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--us", type=int, default=200, help="kernel length in microseconds (default 200)")
    p.add_argument("--iters", type=int, default=20, help="kernels per timed batch (default 20)")
    p.add_argument("--reps", type=int, default=5, help="timed batches (default 5)")
    p.add_argument("--bytes", type=int, default=100_000, help="size of the timed copy (default 100000)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--contend", action="store_true", help="measure alone, then next to a hammer")
    mode.add_argument("--hammer", action="store_true", help="keep the device busy for --seconds")
    p.add_argument("--seconds", type=float, default=5.0, help="hammer duration (default 5)")
    p.add_argument(
        "--hammer-seconds",
        type=float,
        default=60.0,
        help="upper bound on the --contend hammer's life (it is stopped when done)",
    )
    args = p.parse_args(argv)

    rt = Cudart(sim_cudart_path())
    rt.check("cudaSetDevice", 0)
    if args.hammer:
        out: dict[str, object] = {"us": args.us, "iters": args.iters, "pid": os.getpid()}
        out.update(hammer(rt, args.us, args.iters, args.seconds))
    elif args.contend:
        out = contend(args, rt)
    else:
        out = {"us": args.us, "iters": args.iters, "reps": args.reps, "bytes": args.bytes, "pid": os.getpid()}
        out.update(measure(rt, args.us, args.iters, args.reps, args.bytes))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
