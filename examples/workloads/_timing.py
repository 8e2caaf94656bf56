"""A harness's own timing function, KernelBench style: what the `fused` commands time
their candidate with, and what `KREX_AUTO_REGION` wraps (the manifest sets
``KREX_AUTO_REGION=_timing:time_execution_with_cuda_event@kernelbench``): the commands
never call krex.region(). Under KREX the region is the trial loop, from the return of the
last warm-up call (krex/proc/autoregion/kernelbench.py).

`time_execution_with_cuda_event` follows KernelBench's ``src/kernelbench/timing.py``
call for call: ``num_warmup`` untimed calls of ``kernel_fn(*args)`` (each followed by a
synchronize), then ``num_trials + discard_first`` trials, each one a synchronize, an L2
flush, a start event, the call, an end event and a synchronize; the first
``discard_first`` trials are dropped. It returns the per-trial times in milliseconds.

``backend`` is where the events come from: None is torch.cuda (a real GPU);
sim/sim_fused.py passes its simulated-GPU events, with the same calls in the same order.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any, Protocol


class Event(Protocol):
    def record(self) -> None: ...

    def elapsed_time(self, end: Any) -> float: ...


class Backend(Protocol):
    def synchronize(self) -> None: ...

    def event(self) -> Event: ...

    def clear_l2(self) -> None: ...


class _Torch:
    """torch.cuda's events; the L2 flush writes a 256 MiB buffer (as KernelBench's)."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.flush = torch.empty(32 * 1024 * 1024, dtype=torch.int64, device="cuda")

    def synchronize(self) -> None:
        self.torch.cuda.synchronize()

    def event(self) -> Event:
        return self.torch.cuda.Event(enable_timing=True)  # type: ignore[no-any-return]

    def clear_l2(self) -> None:
        self.flush.zero_()


def time_execution_with_cuda_event(
    kernel_fn: Callable[..., Any],
    args: Sequence[Any] = (),
    num_warmup: int = 3,
    num_trials: int = 100,
    discard_first: int = 1,
    verbose: bool = False,
    device: Any = None,
    backend: Backend | None = None,
) -> list[float]:
    """Per-trial times (ms) of ``kernel_fn(*args)``."""
    be: Backend = backend if backend is not None else _Torch()
    for _ in range(num_warmup):
        kernel_fn(*args)
        be.synchronize()
    elapsed: list[float] = []
    for trial in range(num_trials + discard_first):
        be.synchronize()
        start, end = be.event(), be.event()
        be.clear_l2()
        start.record()
        kernel_fn(*args)
        end.record()
        be.synchronize()
        if trial >= discard_first:
            elapsed.append(float(start.elapsed_time(end)))
    return elapsed


def timing_stats(times: Sequence[float]) -> dict[str, float]:
    """KernelBench's summary of the trials: mean (what it reports), std, min, max, and the median."""
    return {
        "mean": statistics.fmean(times),
        "std": statistics.pstdev(times) if len(times) > 1 else 0.0,
        "min": min(times),
        "max": max(times),
        "median": statistics.median(times),
        "num_trials": float(len(times)),
    }
