"""What the measuring scripts share: an isolated KREX world to run commands in, sibling
commands started and waited for (each writes a ready file) and stopped, and the
library's one percentile.

Standard library only, and krex is not imported: a script may run under an interpreter
without krex, or with another build's (benchmarks/entry_latency.py drives older builds
side by side, each with a bare python3). The percentile is therefore read from
this checkout's krex/bench/metrics.py (itself standard library only) by path."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _library_metrics() -> Any:
    name = "_krex_checkout_bench_metrics"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "krex" / "bench" / "metrics.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # dataclasses look their module up while the class is made
        spec.loader.exec_module(mod)
    return sys.modules[name]


# The start of a sibling command on the simulated GPU: its runtime through ctypes, kernel(us)
# and sync(). The scripts append their own operations.
SIM_RUNTIME = r"""
import ctypes, os
class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]
rt = ctypes.CDLL("libcudart.so.13")  # the simulated runtime: krex run --device sim puts it on the path
vp = ctypes.c_void_p
rt.cudaLaunchKernel.argtypes = [vp, Dim3, Dim3, ctypes.POINTER(vp), ctypes.c_size_t, vp]
rt.cudaMalloc.argtypes = [ctypes.POINTER(vp), ctypes.c_size_t]
FN = ctypes.cast(rt.cudaDeviceSynchronize, vp)
def kernel(us):
    assert rt.cudaLaunchKernel(FN, Dim3(us, 1, 1), Dim3(1, 1, 1), None, 0, None) == 0
def sync():
    rt.cudaDeviceSynchronize()
"""


def measure_code(warm: str, pause_s: float, before: str = "pass") -> str:
    """The measuring command's loop (after a prelude defining short_op and sync): argv[1]
    regions around short_op, each row the client's entry time and the grant's steps, as one
    JSON list on stdout. `warm` runs once first; `pause_s` lets the siblings run between;
    `before` (one statement) runs before each region, outside it (a benchmark's warm-up)."""
    return MEASURE.replace("WARM", warm).replace("PAUSE", repr(pause_s)).replace("BEFORE", before)


MEASURE = r"""
import json, sys, time, krex
n = int(sys.argv[1])
WARM
rows = []
for _ in range(n):
    BEFORE
    t0 = time.perf_counter()
    with krex.region() as r:
        t1 = time.perf_counter()
        short_op(); sync()
    g = r.grant or {}
    rows.append({"client_s": t1 - t0, **{k: v for k, v in g.items() if k.endswith("_s") or k.startswith("wait_")
                                          or k in ("contaminated", "drained", "flags", "drain_slow", "drain_waited_on", "lent_priority",
                                                   "freeze_why")}})
    time.sleep(PAUSE)
print(json.dumps(rows))
"""


def percentile(xs: Iterable[float], q: float) -> float:
    """krex.bench.metrics.percentile: q in 0..100, linear interpolation, NaN when empty."""
    return float(_library_metrics().percentile(xs, q))


class World:
    """One isolated KREX world: its own state directory, segment and simulated GPU (so a
    daemon already running on the machine is never touched), driven by ``python``'s krex."""

    def __init__(self, name: str, python: str, device: str, root: Path, slots: int, prefix: str) -> None:
        self.name, self.python, self.device = name, python, device
        tag = f"{os.getpid()}-{name}"
        self.dir = root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KREX_") and k != "LD_PRELOAD"}
        self.env.update(
            KREX_STATE_DIR=str(self.dir / "state"),
            KREX_SHM=f"/krex-{prefix}-{tag}",
            KREX_SIM_SHM=f"/krex-{prefix}sim-{tag}",
            KREX_SLOTS_PER_GPU=str(slots),  # every sibling and the measurer admitted at once
            PYTHONUNBUFFERED="1",
        )

    def krex(self, *args: str) -> list[str]:
        return [self.python, "-m", "krex.cli.main", *args]

    def run(
        self, code: str, *argv: str, log: str, opts: Sequence[str] = (), env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        """``python -c code argv...`` under `krex run --device D opts`; stderr to ``log``."""
        out = open(self.dir / log, "a")  # noqa: SIM115 - closed with the process by the OS
        return subprocess.Popen(
            self.krex("run", "--device", self.device, *opts, "--", self.python, "-c", code, *argv),
            env={**self.env, **(env or {})},
            cwd=self.dir,  # never the checkout: `-m krex...` would import the krex found there
            stdout=subprocess.PIPE,
            stderr=out,
            text=True,
        )

    def stop_daemon(self) -> None:
        subprocess.run(self.krex("daemon", "stop"), env=self.env, cwd=self.dir, capture_output=True, timeout=60)
        for n in (self.env["KREX_SHM"], self.env["KREX_SIM_SHM"]):
            Path("/dev/shm" + n).unlink(missing_ok=True)


def fresh(files: Iterable[str | Path]) -> None:
    """Remove ready files left from an earlier run."""
    for f in files:
        Path(f).unlink(missing_ok=True)


def wait_ready(
    files: Sequence[str | Path], ps: Sequence[subprocess.Popen[str]] = (), timeout_s: float = 120
) -> str | None:
    """Wait until every ready file exists: None then, else why not ("exited": one of ``ps``
    ended first, or "timeout")."""
    deadline = time.time() + timeout_s
    while not all(os.path.exists(f) for f in files):
        if any(p.poll() is not None for p in ps):
            return "exited"
        if time.time() > deadline:
            return "timeout"
        time.sleep(0.2)
    return None


def stop_all(ps: Iterable[subprocess.Popen[str]]) -> None:
    """Terminate the commands, then kill any still there after 30 s."""
    ps = list(ps)
    for p in ps:
        p.terminate()
    for p in ps:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
