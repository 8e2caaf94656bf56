"""Inductor's autotuning benchmarker: every GPU benchmark call is a region, through
torch's own hook ``set_gpu_benchmark_lock_context`` (a factory registered before keeps
running, outside the region). A torch without the hook gets ``benchmark_gpu`` wrapped whole."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import krex
from krex.proc.autoregion.core import (
    INDUCTOR,
    MARK,
    WHOLE,
    Target,
    _body_whole,
    _is_ours,
    _make_wrapper,
    _replace,
    _set,
    _undo,
    _whole,
)

_INDUCTOR_MODULE = "torch._inductor.runtime.benchmarking"
_INDUCTOR_FALLBACK = ("TritonBenchmarker", "InductorBenchmarker", "TorchProfilerBenchmarker")
TARGETS = {
    "inductor": (Target(_INDUCTOR_MODULE, "set_gpu_benchmark_lock_context", INDUCTOR, source="inductor"),),
}
DETAIL = "region: each Inductor GPU benchmark call (torch's set_gpu_benchmark_lock_context hook)"
DETAILS = {INDUCTOR: DETAIL}


# Set by hook.install(implicit=True): the target KREX turned on by itself (sitecustomize.py)
# takes soft regions (krex.region(soft=True)), which never wait for the command's own region.
soft = False


def _apply_inductor(t: Target, module: ModuleType) -> None:
    """Register a krex region as Inductor's GPU benchmark lock context; the factory
    registered before (a harness's own lock) is entered first and kept."""
    setter = getattr(module, "set_gpu_benchmark_lock_context", None)
    if not callable(setter):
        wrapped = []
        for cls_name in _INDUCTOR_FALLBACK:
            cls = getattr(module, cls_name, None)
            raw = cls.__dict__.get("benchmark_gpu") if isinstance(cls, type) else None
            if raw is None or _is_ours(raw) or not callable(raw):
                continue
            sub = Target(t.module, f"{cls_name}.benchmark_gpu", WHOLE, source=t.source)
            _replace(cls, "benchmark_gpu", _make_wrapper(sub, raw, _body_whole))
            wrapped.append(f"{cls_name}.benchmark_gpu")
        if wrapped:
            _whole.add(t.name)
            _set(t, "whole", "this torch has no set_gpu_benchmark_lock_context; "
                 f"{', '.join(wrapped)} wrapped, the whole call is the region")
        else:
            _set(t, "missing", f"{module.__name__} has neither set_gpu_benchmark_lock_context nor "
                 "benchmark_gpu methods in this version; nothing wrapped")
        return
    holder: list[Any] = [None]

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if holder[0] is not None:
                stack.enter_context(holder[0]())
            # Labelled as every target's regions (the journal, krex run's per-target counts).
            stack.enter_context(krex.region(f"auto:{t.name}", soft=soft))  # nested: a no-op
            yield

    setattr(context, MARK, t.name)
    previous = setter(context)
    if _is_ours(previous):  # installed twice (a reload): keep the first chain
        setter(previous)
        _set(t, "wrapped", "already registered")
        return
    holder[0] = previous
    _undo.append(lambda: setter(previous))
    detail = DETAIL
    if previous is not None:
        name = getattr(previous, "__qualname__", previous)
        detail += f"; the context registered before ({name}) runs first"
    _set(t, "wrapped", detail)
