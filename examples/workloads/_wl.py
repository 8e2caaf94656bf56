"""What every corpus command shares: phase timing, the timed region, the JSON line.

A corpus command is shaped like an agent's benchmarking command:

    import (torch/triton) -> build the candidate -> seeded inputs -> correctness check
        -> timed loop inside `with krex.region():` -> one JSON line on stdout

`krex.region()` is a no-op outside KREX (native modes run exactly this code), and
under `krex run` it makes the timed loop exclusive on the GPU.

The JSON line holds at least: name, family, param, ms (the timed kernel's duration),
correct, t_total_s (process start to the line), t_region_s (time inside the region),
region_entry_s (time to get into it: queue wait + the daemon's protocol), the
per-phase times and, under KREX, the daemon's grant (queue_wait_s, entry_s,
contaminated).

Knobs (environment; `krex bench --reference-rep-ms` sets them for its reference pass):
  KREX_WL_REP_MS     timed-loop budget in ms (default 100, like do_bench's rep)
  KREX_WL_WARMUP_MS  warm-up budget in ms (default 25)
  KREX_WL_REGION     "0": run the timed loop outside any region, even under KREX (what
                     benchmarks/lone_region.py compares a region against; with
                     KREX_AUTO_REGION=0 for the commands timed through automatic regions)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

warnings.filterwarnings(
    "ignore", message=r"krex\.region\(\): not running under KREX", category=RuntimeWarning
)


def _process_start_epoch() -> float:
    """When this process started (so that interpreter start-up counts too): its
    start time in clock ticks since boot (/proc/self/stat) against CLOCK_BOOTTIME.
    (psutil's create_time adds the whole-second boot time, off by up to a second.)"""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - max(0.0, age)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


def rep_ms(default: float = 100.0) -> float:
    return float(os.environ.get("KREX_WL_REP_MS") or default)


def warmup_ms(default: float = 25.0) -> float:
    return float(os.environ.get("KREX_WL_WARMUP_MS") or default)


class Command:
    """Times the phases of one benchmarking command and prints its JSON line."""

    def __init__(self, name: str, family: str | None, param: float) -> None:
        self.t_start = _process_start_epoch()
        self.name, self.family, self.param = name, family, param
        self.phases: dict[str, float] = {}
        self.t_region_s = 0.0
        # None: not seen by the command (an automatic region's entry); the JSON line says null
        self.region_entry_s: float | None = 0.0
        self.grant: dict[str, Any] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t

    def timed(self, measure: Callable[[], float]) -> float:
        """Run ``measure`` (the timed loop; returns ms) inside a KREX region."""
        import krex

        t0 = time.perf_counter()
        region = krex.region() if os.environ.get("KREX_WL_REGION", "").strip() != "0" else None
        with region if region is not None else contextlib.nullcontext() as r:
            t1 = time.perf_counter()
            ms = measure()
            t2 = time.perf_counter()
        self.region_entry_s = (self.region_entry_s or 0.0) + (t1 - t0)
        self.t_region_s += t2 - t1
        g = (r.grant if r is not None else None) or {}
        self.grant = {
            k: g.get(k)
            for k in ("queue_wait_s", "entry_s", "drain_s", "freeze_s", "contaminated", "partition_degraded")
            if k in g
        }
        self.phases["timed"] = self.phases.get("timed", 0.0) + (t2 - t0)
        return ms

    def emit(self, ms: float, correct: bool, **extra: Any) -> None:
        out: dict[str, Any] = {
            "name": self.name,
            "family": self.family,
            "param": self.param,
            "ms": ms,
            "correct": bool(correct),
            "t_total_s": time.time() - self.t_start,
            "t_region_s": self.t_region_s,
            "region_entry_s": self.region_entry_s,
            "phases": {k: round(v, 6) for k, v in self.phases.items()},
            "under_krex": bool(os.environ.get("KREX_SHM") or os.environ.get("KREX_SOCKET")),
            "pid": os.getpid(),
        }
        if self.grant:
            out["grant"] = self.grant
        out.update(extra)
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


def parser(description: str) -> argparse.ArgumentParser:
    """The arguments every corpus command takes (what its JSON line reports)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--name", required=True, help="the command's name in the corpus")
    p.add_argument("--family", default=None, help="ranking family (candidates compared with each other)")
    p.add_argument("--param", type=float, default=0.0, help="the candidate's parameter within its family")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs")
    return p


def do_bench_ms(fn: Callable[[], Any]) -> float:
    """triton.testing.do_bench with the corpus's budgets, median of the timed runs."""
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup_ms(), rep=rep_ms(), return_mode="median"))
