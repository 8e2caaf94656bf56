"""The machinery every harness shares: a Target, the strategy names, the state of
this process's wrapped targets and their status file, the helpers that patch and
un-patch attributes, and the probes: a per-thread stack of wrapped calls in which a
harness's hook points (clear_cache, capture_end, Timer._timeit, ...) find the call
they belong to and enter `krex.region()` there."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import krex
from krex.proc.region import soon

ENV_VAR = "KREX_AUTO_REGION"


MARK = "__krex_autoregion__"  # attribute set on every wrapper and hook (value: the target's name)

# strategies: where the region starts
# strategies: where the region starts
WHOLE = "whole"

DO_BENCH = "do_bench"

CUDAGRAPH = "do_bench_cudagraph"

TIMER_TIMEIT = "timer_timeit"  # before the second Timer._timeit call (the first is warm-up)

TIMER_LOOP = "timer_loop"  # at Timer._threaded_measurement_loop (after the block-size estimate)

TIMER_FIRST = "timer_first"  # before the first Timer._timeit call

KERNELBENCH = "kernelbench"  # after the last untimed call of kernel_fn

INDUCTOR = "inductor"  # torch's set_gpu_benchmark_lock_context hook: each benchmark_gpu call

_MISSING: Any = object()

Fn = Callable[..., Any]

Args = tuple[Any, ...]

Kwargs = dict[str, Any]


@dataclass(frozen=True)
class Target:
    """One function or method to wrap."""

    module: str
    qualname: str  # "do_bench" or "Timer.timeit"
    strategy: str = WHOLE
    untimed_before_warmup: int = 0  # KernelBench: calls of kernel_fn before its warm-up loop
    optional: bool = False  # absent in the imported module is normal (KernelBench layouts)
    source: str = "user"  # the built-in name it came from, or "user"

    @property
    def name(self) -> str:
        return f"{self.module}:{self.qualname}"


# ---------------------------------------------------------------- state

_lock = threading.RLock()

_targets: dict[str, Target] = {}

_by_module: dict[str, list[Target]] = {}

_status: dict[str, dict[str, str]] = {}

_whole: set[str] = set()  # targets degraded to whole-call regions

_patches: list[tuple[Any, str, Any, bool]] = []  # (owner, attribute, previous value, owner had it itself)

_undo: list[Callable[[], None]] = []  # other ways of putting things back (a hook's previous factory)

_tls = threading.local()
_regions: dict[str, int] = {}  # target name -> regions its wrapper entered in this process

STATUS_DIR_ENV = "KREX_AUTO_STATUS_DIR"  # set by `krex run`: where each process leaves its status


def _set(t: Target, state: str, detail: str) -> None:
    _status[t.name] = {"target": t.name, "builtin": t.source, "state": state, "detail": detail}
    _dump()


def _dump_locked() -> None:
    with _lock:
        _dump()


def _dump() -> None:
    """Leave this process's target states and region counts where `krex run` reads them
    after the command (one small file per process, replaced atomically)."""
    d = os.environ.get(STATUS_DIR_ENV)
    if not d:
        return
    import json

    data = {
        "pid": os.getpid(),
        "value": os.environ.get(ENV_VAR, ""),
        "targets": [dict(e, regions=_regions.get(e["target"], 0)) for e in _status.values()],
    }
    path = os.path.join(d, f"{os.getpid()}.json")
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(data, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # reporting must never break the harness


def status() -> list[dict[str, str]]:
    """One entry per target: target ("module:qualname"), builtin (the built-in
    name it came from, or "user"), state and detail. States:
    pending (module not imported yet), wrapped (the region covers the timed
    part), whole (degraded: the region covers the whole call; detail says why),
    missing / absent (no such attribute; absent = expected for some layouts),
    unsupported / failed (the original was left in place; detail says why)."""
    with _lock:
        return [dict(e) for e in _status.values()]


# ---------------------------------------------------------------- patching


def _class_raw(cls: type, attr: str) -> Any:
    for k in cls.__mro__:
        if attr in k.__dict__:
            return k.__dict__[attr]
    return _MISSING


def _lookup(owner: Any, attr: str) -> Any:
    return _class_raw(owner, attr) if isinstance(owner, type) else getattr(owner, attr, _MISSING)


def _is_ours(obj: Any) -> bool:
    inner = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    return getattr(inner, MARK, None) is not None


def _replace(owner: Any, attr: str, new: Any) -> None:
    owned = not isinstance(owner, type) or attr in owner.__dict__
    prev = owner.__dict__[attr] if isinstance(owner, type) and owned else getattr(owner, attr, None)
    setattr(owner, attr, new)
    _patches.append((owner, attr, prev, owned))


# ---------------------------------------------------------------- probes


class _Probe:
    """What one wrapped call has seen so far; lives on a per-thread stack so the
    hooks (clear_cache, capture_end, Timer._timeit) can find the innermost one."""

    __slots__ = ("kind", "owner", "entered", "_region", "prev1", "prev2", "count", "threshold", "depth")

    def __init__(self, kind: str, owner: Any = None, threshold: int = 0) -> None:
        self.kind = kind
        self.owner = owner
        self.entered = False
        self._region: Any = None
        self.prev1 = ""
        self.prev2 = ""
        self.count = 0
        self.threshold = threshold
        self.depth = 0  # > 0 while the benchmarked fn runs (CUDA-graph strategy)

    def enter(self) -> None:
        if self.entered:
            return
        self.entered = True  # first: a failed entry must not be left again
        tgt: Target | None = (getattr(_tls, "targets", None) or [None])[-1]
        name = tgt.name if tgt is not None else "?"
        r = krex.region()
        r.label = f"auto:{name}" + (":whole" if self.kind == WHOLE else "")  # journal: who opened it
        r.__enter__()
        self._region = r
        if getattr(r, "grant", None) is not None:
            _regions[name] = _regions.get(name, 0) + 1

    def leave(self, et: type[BaseException] | None, ev: BaseException | None,
              tb: TracebackType | None) -> None:
        r, self._region = self._region, None
        if r is not None:
            try:
                r.__exit__(et, ev, tb)
            finally:
                with _lock:
                    _dump()

    def saw(self, event: str) -> None:
        self.prev2, self.prev1 = self.prev1, event


def _stack() -> list[_Probe]:
    st: list[_Probe] | None = getattr(_tls, "stack", None)
    if st is None:
        st = _tls.stack = []
    return st


def _top() -> _Probe | None:
    st: list[_Probe] | None = getattr(_tls, "stack", None)
    return st[-1] if st else None


def _run(probe: _Probe, call: Callable[[], Any]) -> Any:
    st = _stack()
    st.append(probe)
    try:
        result = call()
    except BaseException as e:
        _pop(st, probe)
        probe.leave(type(e), e, e.__traceback__)
        raise
    _pop(st, probe)
    probe.leave(None, None, None)
    return result


def _pop(st: list[_Probe], probe: _Probe) -> None:
    if st and st[-1] is probe:
        st.pop()
    else:
        for i in range(len(st) - 1, -1, -1):
            if st[i] is probe:
                del st[i]
                break


def _degrade(t: Target, why: str) -> None:
    with _lock:
        if t.name in _whole:
            return
        _whole.add(t.name)
        _set(t, "whole", f"{why}; from now on the whole call is the region")


def _note(t: Target, why: str) -> None:
    with _lock:
        e = _status.get(t.name)
        if e is not None and why not in e["detail"]:
            e["detail"] += f"; {why}"


def _call_whole(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    probe = _Probe(WHOLE)

    def call() -> Any:
        probe.enter()
        return func(*args, **kwargs)

    return _run(probe, call)


def _swap_fn(args: tuple[Any, ...], kwargs: dict[str, Any], name: str,
             make: Callable[[Any], Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Replace the benchmarked callable (keyword `name` or first positional)."""
    if name in kwargs:
        kw = dict(kwargs)
        kw[name] = make(kw[name])
        return args, kw
    if args:
        return (make(args[0]), *args[1:]), kwargs
    return None


def _unhooked(t: Target, why: str, func: Callable[..., Any], args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> Any:
    """A harness's hook point could not be hooked: ``why`` ("!reason": never in this
    version, so the target is degraded; "reason": for this call only, noted). The call
    runs whole."""
    if why.startswith("!"):
        _degrade(t, why[1:])
    else:
        _note(t, why)
    return _call_whole(func, args, kwargs)


def _probed(t: Target, probe: _Probe, call: Callable[[], Any], missed: str) -> Any:
    """Run ``call`` under ``probe``; a call that ends without the probe having entered
    its region degrades the target (``missed`` says why)."""
    result = _run(probe, call)
    if not probe.entered:
        _degrade(t, missed)
    return result


def _probed_fn(t: Target, probe: _Probe, func: Callable[..., Any], args: tuple[Any, ...],
               kwargs: dict[str, Any], wrap_fn: Callable[[Any], Any], missed: str) -> Any:
    """_probed for harnesses that take the benchmarked callable as ``fn`` (Triton's
    do_bench and do_bench_cudagraph): ``fn`` wrapped by ``wrap_fn`` for the probe. Without
    one the original is called as given (it raises its own TypeError)."""
    swapped = _swap_fn(args, kwargs, "fn", wrap_fn)
    if swapped is None:
        return func(*args, **kwargs)
    a, k = swapped
    return _probed(t, probe, lambda: func(*a, **k), missed)


Body = Callable[[Target, Fn, Args, Kwargs], Any]


def _make_wrapper(t: Target, func: Callable[..., Any], body: Body) -> Callable[..., Any]:
    """A wrapper that calls `body` (the harness's strategy), or the whole call once
    the target has been degraded, and labels the regions it opens with `t`."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        stack = getattr(_tls, "targets", None)
        if stack is None:
            stack = _tls.targets = []
        if not stack:
            # Its warm-up runs before the region: siblings' queues start shrinking now, so
            # that the region's gate closes on short ones (a hint krexd lets lapse).
            soon()
        stack.append(t)  # the region this call opens is labelled with its target
        try:
            if t.name in _whole:
                return _call_whole(func, args, kwargs)
            return body(t, func, args, kwargs)
        finally:
            stack.pop()

    setattr(wrapper, MARK, t.name)
    return wrapper


def _body_whole(t: Target, func: Fn, args: Args, kwargs: Kwargs) -> Any:
    return _call_whole(func, args, kwargs)
