"""Triton's ``triton.testing.do_bench_cudagraph``: the region is the graph replays after
the benchmark graph was captured; warm-up, estimate and capture run outside."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from krex.proc.autoregion.core import (
    _MISSING,
    CUDAGRAPH,
    MARK,
    Args,
    Fn,
    Kwargs,
    Target,
    _class_raw,
    _is_ours,
    _lock,
    _Probe,
    _probed_fn,
    _replace,
    _top,
    _unhooked,
)

TARGETS = {
    "do_bench_cudagraph": (
        Target("triton.testing", "do_bench_cudagraph", CUDAGRAPH, source="do_bench_cudagraph"),
    ),
}
DETAILS = {CUDAGRAPH: "region: the graph replays after the benchmark graph was captured"}


def _body_cudagraph(t: Target, func: Fn, args: Args, kwargs: Kwargs) -> Any:
    """Triton 3.x do_bench_cudagraph: fn() warm-up, estimate (5 x fn), capture a
    graph of n x fn, sync, 10 x (record, replay, record, sync). The region starts
    when the first capture outside fn ends (fn's own captures, e.g. torch.compile
    cudagraphs during warm-up, do not count)."""
    why = _hook_capture_end()
    if why:
        return _unhooked(t, why, func, args, kwargs)
    probe = _Probe(CUDAGRAPH)

    def wrap_fn(fn: Any) -> Any:
        def fn_(*a: Any, **k: Any) -> Any:
            probe.depth += 1
            try:
                return fn(*a, **k)
            finally:
                probe.depth -= 1

        return fn_

    missed = "a call ended without a CUDA graph capture being seen"
    return _probed_fn(t, probe, func, args, kwargs, wrap_fn, missed)


def _hook_capture_end() -> str:
    try:
        import torch

        cls = torch.cuda.CUDAGraph
    except Exception as e:
        return f"torch.cuda.CUDAGraph unavailable ({type(e).__name__}: {e}); that call ran whole"
    with _lock:
        raw = _class_raw(cls, "capture_end")
        if raw is _MISSING:
            return "torch.cuda.CUDAGraph has no capture_end; that call ran whole"
        if _is_ours(raw):
            return ""
        orig: Callable[..., Any] = raw

        def capture_end(self: Any, *a: Any, **k: Any) -> Any:
            r = orig(self, *a, **k)
            p = _top()
            if p is not None and p.kind == CUDAGRAPH and p.depth == 0:
                p.enter()
            return r

        functools.update_wrapper(capture_end, orig)
        setattr(capture_end, MARK, "torch.cuda.CUDAGraph.capture_end")
        _replace(cls, "capture_end", capture_end)
    return ""


BODIES = {CUDAGRAPH: _body_cudagraph}
