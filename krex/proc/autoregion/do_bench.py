"""Triton's ``triton.testing.do_bench``: the region is the timed loop, from the first
L2 flush after the warm-up calls through the final synchronize and the event reads."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from krex.proc.autoregion.core import (
    DO_BENCH,
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

TARGET = Target("triton.testing", "do_bench", DO_BENCH, source="do_bench")
TARGETS = {"do_bench": (TARGET,)}
DETAILS = {
    DO_BENCH: "region: the timed loop, from its first clear_cache after warm-up to the final synchronize",
}


def _body_do_bench(t: Target, func: Fn, args: Args, kwargs: Kwargs) -> Any:
    """Triton 3.x do_bench: fn(); sync; estimate 5 x (clear_cache, fn); warm-up
    n x fn; timed n x (clear_cache, record, fn, record); sync; read events.
    The timed loop starts at the first clear_cache that follows two fn calls in
    a row (the last warm-up calls); that holds with and without the estimate."""
    why = _hook_clear_cache(func)
    if why:
        return _unhooked(t, why, func, args, kwargs)
    probe = _Probe(DO_BENCH)

    def wrap_fn(fn: Any) -> Any:
        def fn_(*a: Any, **k: Any) -> Any:
            probe.saw("F")
            return fn(*a, **k)

        return fn_

    missed = "a call ended without the timed loop being recognised (no clear_cache right after warm-up calls)"
    return _probed_fn(t, probe, func, args, kwargs, wrap_fn, missed)


def _hook_clear_cache(func: Callable[..., Any]) -> str:
    """Hook the active Triton driver's clear_cache (class level, pass-through
    unless a do_bench probe is innermost on this thread). Returns "" when
    hooked, "!reason" when this version has no such hook point, "reason" when it
    failed for this call only."""
    rt = getattr(func, "__globals__", {}).get("runtime")
    if rt is None:
        return "!this triton.testing has no runtime.driver (older than Triton 3)"
    code = getattr(func, "__code__", None)
    if code is None or "clear_cache" not in code.co_names:
        return "!this do_bench does not flush the L2 cache through runtime.driver.active.clear_cache"
    try:
        bound = rt.driver.active.clear_cache
    except AttributeError as e:
        return f"!the Triton driver has no clear_cache ({e})"
    except Exception as e:  # e.g. no active driver on this machine: the original will say so
        return f"could not reach the Triton driver ({type(e).__name__}: {e}); that call ran whole"
    owner = getattr(bound, "__self__", None)
    if owner is None or isinstance(owner, type):
        return "!the Triton driver's clear_cache is not a method"
    cls = type(owner)
    with _lock:
        raw = _class_raw(cls, "clear_cache")
        if _is_ours(raw):
            return ""
        if not inspect.isfunction(raw):
            return "!the Triton driver's clear_cache is not a plain method"
        orig: Callable[..., Any] = raw

        @functools.wraps(orig)
        def clear_cache(self: Any, *a: Any, **k: Any) -> Any:
            p = _top()
            if p is not None and p.kind == DO_BENCH:
                if not p.entered and p.prev1 == "F" and p.prev2 == "F":
                    p.enter()
                p.saw("C")
            return orig(self, *a, **k)

        setattr(clear_cache, MARK, "triton driver clear_cache")
        _replace(cls, "clear_cache", clear_cache)
    return ""


BODIES = {DO_BENCH: _body_do_bench}
