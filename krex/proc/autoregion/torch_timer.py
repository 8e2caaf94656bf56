"""``torch.utils.benchmark.Timer``: ``timeit(number)`` from its timed call (the warm-up
call runs outside), ``blocked_autorange`` / ``adaptive_autorange`` from the measurement
loop after the block-size estimate, ``repeat`` from its first timed call."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from krex.proc.autoregion.core import (
    _MISSING,
    MARK,
    TIMER_FIRST,
    TIMER_LOOP,
    TIMER_TIMEIT,
    Args,
    Fn,
    Kwargs,
    Target,
    _class_raw,
    _is_ours,
    _Probe,
    _probed,
    _replace,
    _top,
)

_TIMER = "torch.utils.benchmark.utils.timer"  # defines Timer; torch.utils.benchmark re-exports it
TARGETS = {
    "torch_timer": (
        Target(_TIMER, "Timer.timeit", TIMER_TIMEIT, source="torch_timer"),
        Target(_TIMER, "Timer.blocked_autorange", TIMER_LOOP, source="torch_timer"),
        Target(_TIMER, "Timer.adaptive_autorange", TIMER_LOOP, source="torch_timer"),
        Target(_TIMER, "Timer.repeat", TIMER_FIRST, source="torch_timer"),
    ),
}
DETAILS = {
    TIMER_TIMEIT: "region: the timed _timeit(number) call (its warm-up call runs before)",
    TIMER_LOOP: "region: the measurement loop after the block-size estimate",
    TIMER_FIRST: "region: from the first timed _timeit call",
}


def prepare(t: Target, owner: Any) -> str:
    """Hook the Timer's helper for this strategy before its method is wrapped; "" when
    hooked, else the detail saying why the whole call is the region."""
    missing = _hook_timer(owner, t.strategy)
    return f"Timer has no {missing} in this version; the whole call is the region" if missing else ""


def _hook_timer(cls: Any, strategy: str) -> str:
    """Hook Timer._timeit / Timer._threaded_measurement_loop (class level,
    pass-through unless a probe for that very Timer is innermost on this
    thread). Returns the name of a missing helper, or ""."""
    if not isinstance(cls, type):
        return "class"
    helper = "_threaded_measurement_loop" if strategy == TIMER_LOOP else "_timeit"
    raw = _class_raw(cls, helper)
    if raw is _MISSING or not inspect.isfunction(raw):
        return helper
    if _is_ours(raw):
        return ""
    orig: Callable[..., Any] = raw
    if helper == "_timeit":

        def hook(self: Any, *a: Any, **k: Any) -> Any:
            p = _top()
            if p is not None and p.owner is self and p.kind in (TIMER_TIMEIT, TIMER_FIRST):
                if p.count >= p.threshold:
                    p.enter()
                p.count += 1
            return orig(self, *a, **k)
    else:

        def hook(self: Any, *a: Any, **k: Any) -> Any:
            p = _top()
            if p is not None and p.owner is self and p.kind == TIMER_LOOP:
                p.enter()
            return orig(self, *a, **k)

    functools.update_wrapper(hook, orig)
    setattr(hook, MARK, f"Timer.{helper}")
    _replace(cls, helper, hook)
    return ""


def _body_timer(t: Target, func: Fn, args: Args, kwargs: Kwargs) -> Any:
    if not args:
        return func(*args, **kwargs)  # unbound misuse: let the original complain
    probe = _Probe(t.strategy, owner=args[0], threshold=1 if t.strategy == TIMER_TIMEIT else 0)
    missed = "a call ended without its timed part being recognised"
    return _probed(t, probe, lambda: func(*args, **kwargs), missed)


BODIES = {TIMER_TIMEIT: _body_timer, TIMER_LOOP: _body_timer, TIMER_FIRST: _body_timer}
