"""KernelBench's ``time_execution_with_*`` timing functions: the region is the trial
loop, from the return of the last untimed call of ``kernel_fn``. KernelBench's
"do_bench" timing method calls Triton's do_bench, which is wrapped as well."""

from __future__ import annotations

import inspect
from typing import Any

from krex.proc.autoregion import do_bench
from krex.proc.autoregion.core import (
    DO_BENCH,
    KERNELBENCH,
    Args,
    Fn,
    Kwargs,
    Target,
    _call_whole,
    _degrade,
    _Probe,
    _probed,
)

_KB_MODULES = ("kernelbench.timing", "kernelbench.eval", "src.timing", "src.eval")
_KB_FUNCS = (
    ("time_execution_with_cuda_event", 0),
    ("time_execution_with_host_time", 0),
    ("time_execution_with_do_bench_impl", 1),  # it calls kernel_fn once (compile) before warm-up
    ("time_execution_with_nsight_python", 0),  # warm-up, then profile_with_nsight runs the trials
)
TARGETS = {
    "kernelbench": tuple(
        Target(m, f, KERNELBENCH, untimed, optional=True, source="kernelbench")
        for m in _KB_MODULES
        for f, untimed in _KB_FUNCS
    )
    + (Target(do_bench.TARGET.module, do_bench.TARGET.qualname, DO_BENCH, source="kernelbench"),),
}
DETAILS = {KERNELBENCH: "region: the trial loop, from the return of the last warm-up call"}


def _body_kernelbench(t: Target, func: Fn, args: Args, kwargs: Kwargs) -> Any:
    """KernelBench: kernel_fn is the first parameter; num_warmup (or
    num_warmups) counts its warm-up calls. The region starts when the last
    untimed call returns, so the trial loop, its synchronizes, L2 flushes and
    event reads are all inside."""
    try:
        sig = inspect.signature(func)
        bound = sig.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return _call_whole(func, args, kwargs)
    params = list(sig.parameters.values())
    warm = next((p for p in params if p.name in ("num_warmup", "num_warmups")), None)
    if not params or warm is None:
        _degrade(t, "this version has no num_warmup parameter")
        return _call_whole(func, args, kwargs)
    n_warm = bound.arguments.get(warm.name, warm.default)
    if not isinstance(n_warm, int) or isinstance(n_warm, bool) or n_warm < 0:
        return _call_whole(func, args, kwargs)
    first = params[0].name
    if first not in bound.arguments:
        return _call_whole(func, args, kwargs)
    probe = _Probe(KERNELBENCH, threshold=t.untimed_before_warmup + n_warm)
    kernel_fn = bound.arguments[first]

    def fn_(*a: Any, **k: Any) -> Any:
        r = kernel_fn(*a, **k)
        probe.count += 1
        if probe.count == probe.threshold:
            probe.enter()
        return r

    bound.arguments[first] = fn_

    def call() -> Any:
        if probe.threshold == 0:
            probe.enter()
        return func(*bound.args, **bound.kwargs)

    return _probed(t, probe, call, f"a call made fewer than {probe.threshold} untimed calls of kernel_fn")


BODIES = {KERNELBENCH: _body_kernelbench}
