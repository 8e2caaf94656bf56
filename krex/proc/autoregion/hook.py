"""Automatic regions for unmodified harnesses: ``KREX_AUTO_REGION``.

    eval "$(krex env --export)"
    KREX_AUTO_REGION=do_bench python bench.py

``krex/proc/_hook/sitecustomize.py`` (on PYTHONPATH) calls :func:`install` at
interpreter start when the variable is set. :func:`install` puts an import hook
(a ``sys.meta_path`` finder) in front of the import system; right after a target
module has been executed the hook replaces the target function or method with a
wrapper. A target whose module is already imported is wrapped at once.

Built-in targets and what their wrapper puts inside the region:

- ``do_bench`` (``triton.testing.do_bench``): the timed repetitions, from the
  first L2 flush of the timed loop through the final synchronize and the event
  reads. The compile call, the runtime estimate and the warm-up run outside.
- ``do_bench_cudagraph``: the graph replays (and their synchronizes) after the
  benchmark graph has been captured; warm-up, estimate and capture run outside.
- ``torch_timer`` (``torch.utils.benchmark.Timer``): ``timeit(number)``: the timed
  ``number``-iteration call (its small warm-up call runs outside);
  ``blocked_autorange`` / ``adaptive_autorange``: the measurement loop after the
  block-size estimate; ``repeat``: from its first timed call.
- ``kernelbench`` (KernelBench's ``time_execution_with_cuda_event``,
  ``..._host_time``, ``..._do_bench_impl`` and ``..._nsight_python`` in
  ``kernelbench.timing``, ``kernelbench.eval``, ``src.timing``, ``src.eval``): the
  per-trial loop (for nsight_python_time: the profiled runs) after the last warm-up
  call. Also wraps ``do_bench``, which KernelBench's "do_bench" timing method calls.
- ``inductor`` (Inductor's autotuning benchmarker): every GPU benchmark call, through
  torch's own hook ``torch._inductor.runtime.benchmarking.set_gpu_benchmark_lock_context``
  (a context factory; nested entry on one thread is a no-op). A factory registered
  before keeps running, outside the region. A torch without the hook gets its
  ``TritonBenchmarker`` / ``InductorBenchmarker.benchmark_gpu`` wrapped whole.
- ``pytest_benchmark`` (pytest-benchmark's fixture): ``BenchmarkFixture._raw`` and
  ``_raw_pedantic``, calibration, warm-up and rounds. krex's pytest plugin
  (``krex.proc.pytest_plugin``) turns this on by itself under KREX.
- ``module:function`` / ``module:Class.method``: the whole call; with a suffix
  ``@do_bench``, ``@do_bench_cudagraph`` or ``@kernelbench`` the function is treated
  like that built-in (for forks of those harnesses, docs/inhouse-do-bench.md).

How the boundary is found: every wrapper calls the *original* function, so the
values it returns, its arguments and its statistics are exactly those of the
installed version. The wrapper only watches for the event that starts the timed
part (a call of the benchmarked ``fn``, Triton's ``clear_cache``, a CUDA graph's
``capture_end``, the Timer's ``_timeit``) and enters ``krex.region()`` there; the
region ends when the original returns. Where the installed version lacks the
hook point, or a call ends without the boundary having been seen, the target
falls back to putting the whole call in the region, and :func:`status` says so.

Outside KREX ``krex.region()`` does nothing (it warns once), so the wrappers then
behave like the originals. Wrapping never breaks the harness: a target that is
missing or cannot be wrapped keeps its original, and :func:`status` says why.
The library never prints."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType, TracebackType
from typing import Any

import krex
from krex.errors import UsageError

ENV_VAR = "KREX_AUTO_REGION"
MARK = "__krex_autoregion__"  # attribute set on every wrapper and hook (value: the target's name)

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


_TIMER = "torch.utils.benchmark.utils.timer"  # defines Timer; torch.utils.benchmark re-exports it
_KB_MODULES = ("kernelbench.timing", "kernelbench.eval", "src.timing", "src.eval")
_KB_FUNCS = (
    ("time_execution_with_cuda_event", 0),
    ("time_execution_with_host_time", 0),
    ("time_execution_with_do_bench_impl", 1),  # it calls kernel_fn once (compile) before warm-up
    ("time_execution_with_nsight_python", 0),  # warm-up, then profile_with_nsight runs the trials
)
_INDUCTOR_MODULE = "torch._inductor.runtime.benchmarking"
_INDUCTOR_FALLBACK = ("TritonBenchmarker", "InductorBenchmarker", "TorchProfilerBenchmarker")
_PYTEST_BENCHMARK = "pytest_benchmark.fixture"
_DO_BENCH = Target("triton.testing", "do_bench", DO_BENCH, source="do_bench")

BUILTINS: dict[str, tuple[Target, ...]] = {
    "do_bench": (_DO_BENCH,),
    "do_bench_cudagraph": (
        Target("triton.testing", "do_bench_cudagraph", CUDAGRAPH, source="do_bench_cudagraph"),
    ),
    "torch_timer": (
        Target(_TIMER, "Timer.timeit", TIMER_TIMEIT, source="torch_timer"),
        Target(_TIMER, "Timer.blocked_autorange", TIMER_LOOP, source="torch_timer"),
        Target(_TIMER, "Timer.adaptive_autorange", TIMER_LOOP, source="torch_timer"),
        Target(_TIMER, "Timer.repeat", TIMER_FIRST, source="torch_timer"),
    ),
    "kernelbench": tuple(
        Target(m, f, KERNELBENCH, untimed, optional=True, source="kernelbench")
        for m in _KB_MODULES
        for f, untimed in _KB_FUNCS
    )
    + (Target("triton.testing", "do_bench", DO_BENCH, source="kernelbench"),),
    "inductor": (Target(_INDUCTOR_MODULE, "set_gpu_benchmark_lock_context", INDUCTOR, source="inductor"),),
    "pytest_benchmark": (
        Target(_PYTEST_BENCHMARK, "BenchmarkFixture._raw", WHOLE, source="pytest_benchmark"),
        Target(_PYTEST_BENCHMARK, "BenchmarkFixture._raw_pedantic", WHOLE, source="pytest_benchmark"),
    ),
}
_ALL_WORDS = ("all", "1")
_DETAILS = {
    WHOLE: "the whole call is the region",
    DO_BENCH: "region: the timed loop, from its first clear_cache after warm-up to the final synchronize",
    CUDAGRAPH: "region: the graph replays after the benchmark graph was captured",
    TIMER_TIMEIT: "region: the timed _timeit(number) call (its warm-up call runs before)",
    TIMER_LOOP: "region: the measurement loop after the block-size estimate",
    TIMER_FIRST: "region: from the first timed _timeit call",
    KERNELBENCH: "region: the trial loop, from the return of the last warm-up call",
    INDUCTOR: "region: each Inductor GPU benchmark call (torch's set_gpu_benchmark_lock_context hook)",
}
_FIX = ("set KREX_AUTO_REGION to a comma list of " + ", ".join(BUILTINS)
        + ", all (or 1), and module:function or module:Class.method")


# ---------------------------------------------------------------- parsing


def parse(value: str) -> list[Target]:
    """Targets named by a KREX_AUTO_REGION value; [] for "" or "0".
    Raises UsageError for a malformed value."""
    raw = value.strip()
    if raw in ("", "0"):
        return []
    out: dict[str, Target] = {}
    for part in raw.split(","):
        item = part.strip()
        if not item:
            continue
        low = item.lower()
        if low in _ALL_WORDS:
            found = [t for group in BUILTINS.values() for t in group]
        elif ":" in item or "@" in item:
            found = [_parse_user(item)]
        elif low in BUILTINS:
            found = list(BUILTINS[low])
        else:
            raise _unknown(item)
        for t in found:
            out.setdefault(t.name, t)
    return list(out.values())


def _dotted(s: str) -> bool:
    return bool(s) and all(p.isidentifier() for p in s.split("."))


_USER_STRATEGIES = {"whole": WHOLE, "do_bench": DO_BENCH, "do_bench_cudagraph": CUDAGRAPH,
                    "kernelbench": KERNELBENCH}


def _parse_user(item: str) -> Target:
    item, at, how = item.partition("@")
    strategy = WHOLE
    if at:
        strategy = _USER_STRATEGIES.get(how.strip().lower(), "")
        if not strategy:
            raise UsageError(f"{ENV_VAR}: {item}@{how}: unknown strategy {how.strip()!r}",
                             "after @ write one of " + ", ".join(_USER_STRATEGIES)
                             + ", e.g. mylib.bench:do_bench@do_bench")
    module, _, qual = item.partition(":")
    module, qual = module.strip(), qual.strip()
    example = "e.g. mybench.timing:run_trials or mybench.timing:Runner.run"
    if ":" in qual:
        raise UsageError(f"{ENV_VAR}: {item!r} has more than one ':'",
                         f"write module:function or module:Class.method, {example}")
    if not module:
        raise UsageError(f"{ENV_VAR}: {item!r} names no module before ':'",
                         f"write module:function or module:Class.method, {example}")
    if not qual:
        raise UsageError(f"{ENV_VAR}: {item!r} names no function after ':'",
                         f"write module:function or module:Class.method, {example}")
    if not _dotted(module):
        raise UsageError(f"{ENV_VAR}: {module!r} (in {item!r}) is not a module name",
                         f"use the dotted name you would import, {example}")
    if not _dotted(qual):
        raise UsageError(f"{ENV_VAR}: {qual!r} (in {item!r}) is not a function or Class.method name",
                         f"use the name as written in the module, {example}")
    if module == "__main__":
        raise UsageError(f"{ENV_VAR}: {item!r}: functions of the __main__ script cannot be wrapped "
                         "(the script defines them after the hook ran)",
                         "move the function into a module and name it as module:function")
    return Target(module, qual, strategy)


def _unknown(item: str) -> UsageError:
    import difflib

    close = difflib.get_close_matches(item.lower(), [*BUILTINS, "all"], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    fix = _FIX
    if "." in item and _dotted(item):
        mod, _, fn = item.rpartition(".")
        fix = f"to wrap a function of your own, separate module and function with ':', e.g. {mod}:{fn}"
    return UsageError(f"{ENV_VAR}: unknown built-in {item!r}{hint}", fix)


# ---------------------------------------------------------------- state

_lock = threading.RLock()
_targets: dict[str, Target] = {}
_by_module: dict[str, list[Target]] = {}
_status: dict[str, dict[str, str]] = {}
_whole: set[str] = set()  # targets degraded to whole-call regions
_patches: list[tuple[Any, str, Any, bool]] = []  # (owner, attribute, previous value, owner had it itself)
_undo: list[Callable[[], None]] = []  # other ways of putting things back (a hook's previous factory)
_finder: _Finder | None = None
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


def installed() -> bool:
    return _finder is not None and _finder in sys.meta_path


# ---------------------------------------------------------------- install


def install(value: str | None = None) -> None:
    """Wrap the targets named by ``value`` (default: $KREX_AUTO_REGION). Does
    nothing for "" or "0". Raises UsageError for a malformed value; never for a
    target that is missing or cannot be wrapped (see status())."""
    global _finder
    targets = parse(os.environ.get(ENV_VAR, "") if value is None else value)
    if not targets:
        return
    with _lock:
        new = [t for t in targets if t.name not in _targets]
        for t in new:
            _targets[t.name] = t
            _by_module.setdefault(t.module, []).append(t)
            _set(t, "pending", f"wrapped when {t.module} is imported")
        if not installed():
            _finder = _Finder()
            sys.meta_path.insert(0, _finder)
            if os.environ.get(STATUS_DIR_ENV):
                import atexit

                atexit.register(_dump_locked)
        for name in dict.fromkeys(t.module for t in new):
            mod = sys.modules.get(name)
            if mod is not None:
                _patch_module(mod, [t for t in new if t.module == name])


def uninstall() -> None:
    """Remove the import hook and put every original back (mostly for tests)."""
    global _finder
    with _lock:
        if _finder is not None and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
        _finder = None
        for owner, attr, prev, owned in reversed(_patches):
            try:
                if owned or not isinstance(owner, type):
                    setattr(owner, attr, prev)
                else:
                    delattr(owner, attr)
            except (AttributeError, TypeError):
                pass
        _patches.clear()
        for undo in reversed(_undo):
            with contextlib.suppress(Exception):  # putting back is best effort
                undo()
        _undo.clear()
        _targets.clear()
        _by_module.clear()
        _status.clear()
        _whole.clear()
        _regions.clear()


class _Finder:
    """sys.meta_path finder: for a target module, let the other finders find it,
    then hand out a loader that patches the module right after executing it."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname not in _by_module:
            return None
        try:
            finders = sys.meta_path[sys.meta_path.index(self) + 1:]
        except ValueError:
            return None
        for finder in finders:
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is None:
                continue
            loader = getattr(spec, "loader", None)
            if loader is not None and hasattr(loader, "exec_module"):
                spec.loader = _Loader(loader)
            return spec
        return None

    def invalidate_caches(self) -> None:
        pass


class _Loader:
    """Delegates to the real loader, puts it back on the module before executing
    it (so get_source, reload and resource readers see the real one), then
    patches the targets of the freshly executed module."""

    def __init__(self, loader: Any) -> None:
        self._krex_loader = loader

    def create_module(self, spec: Any) -> Any:
        create = getattr(self._krex_loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: ModuleType) -> None:
        real = self._krex_loader
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = real
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = real
        real.exec_module(module)
        with _lock:
            targets = list(_by_module.get(module.__name__, ()))
        _patch_module(module, targets)

    def __getattr__(self, name: str) -> Any:
        if name == "_krex_loader":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self._krex_loader, name)


def _patch_module(module: ModuleType, targets: list[Target]) -> None:
    for t in targets:
        try:
            with _lock:
                _apply(t, module)
        except Exception as e:  # never break the import
            _set(t, "failed", f"{type(e).__name__}: {e}; the original is left in place")


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


def _apply(t: Target, module: ModuleType) -> None:
    if t.strategy == INDUCTOR:
        _apply_inductor(t, module)
        return
    *path, attr = t.qualname.split(".")
    owner: Any = module
    for i, p in enumerate(path):
        owner = getattr(owner, p, _MISSING)
        if owner is _MISSING:
            where = ".".join([module.__name__, *path[:i]])
            _set(t, "absent" if t.optional else "missing",
                 f"{where} has no attribute {p!r} in this version; nothing wrapped")
            return
    raw = _lookup(owner, attr)
    if raw is _MISSING:
        where = getattr(owner, "__name__", owner)
        _set(t, "absent" if t.optional else "missing",
             f"{where!r} has no attribute {attr!r} in this version; nothing wrapped")
        return
    if _is_ours(raw):
        _set(t, "wrapped", "already wrapped (the same function under another name)")
        return
    if isinstance(raw, type):
        _set(t, "unsupported", f"{t.name} is a class; name one of its methods (module:Class.method)")
        return
    rewrap: Callable[[Any], Any] | None = None
    func: Any = raw
    if isinstance(raw, (staticmethod, classmethod)):
        rewrap, func = type(raw), raw.__func__
    if not callable(func):
        _set(t, "unsupported", f"{t.name} is a {type(raw).__name__}, not a function; left in place")
        return
    detail = _DETAILS[t.strategy]
    if t.strategy in (TIMER_TIMEIT, TIMER_LOOP, TIMER_FIRST):
        missing = _hook_timer(owner, t.strategy)
        if missing:
            _whole.add(t.name)
            detail = f"Timer has no {missing} in this version; the whole call is the region"
    wrapper = _make_wrapper(t, func)
    _replace(owner, attr, rewrap(wrapper) if rewrap is not None else wrapper)
    _set(t, "whole" if t.name in _whole else "wrapped", detail)


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
            _replace(cls, "benchmark_gpu", _make_wrapper(sub, raw))
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
            stack.enter_context(krex.region())  # nested on one thread: a no-op
            yield

    setattr(context, MARK, t.name)
    previous = setter(context)
    if _is_ours(previous):  # installed twice (a reload): keep the first chain
        setter(previous)
        _set(t, "wrapped", "already registered")
        return
    holder[0] = previous
    _undo.append(lambda: setter(previous))
    detail = _DETAILS[INDUCTOR]
    if previous is not None:
        name = getattr(previous, "__qualname__", previous)
        detail += f"; the context registered before ({name}) runs first"
    _set(t, "wrapped", detail)


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


def _make_wrapper(t: Target, func: Callable[..., Any]) -> Callable[..., Any]:
    body = _BODIES[t.strategy]

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        stack = getattr(_tls, "targets", None)
        if stack is None:
            stack = _tls.targets = []
        stack.append(t)  # the region this call opens is labelled with its target
        try:
            if t.name in _whole:
                return _call_whole(func, args, kwargs)
            return body(t, func, args, kwargs)
        finally:
            stack.pop()

    setattr(wrapper, MARK, t.name)
    return wrapper


# ---------------------------------------------------------------- strategies


def _body_whole(t: Target, func: Fn, args: Args, kwargs: Kwargs) -> Any:
    return _call_whole(func, args, kwargs)


def _body_do_bench(t: Target, func: Fn, args: Args, kwargs: Kwargs) -> Any:
    """Triton 3.x do_bench: fn(); sync; estimate 5 x (clear_cache, fn); warm-up
    n x fn; timed n x (clear_cache, record, fn, record); sync; read events.
    The timed loop starts at the first clear_cache that follows two fn calls in
    a row (the last warm-up calls); that holds with and without the estimate."""
    why = _hook_clear_cache(func)
    if why:
        if why.startswith("!"):
            _degrade(t, why[1:])
        else:
            _note(t, why)
        return _call_whole(func, args, kwargs)
    probe = _Probe(DO_BENCH)

    def wrap_fn(fn: Any) -> Any:
        def fn_(*a: Any, **k: Any) -> Any:
            probe.saw("F")
            return fn(*a, **k)

        return fn_

    swapped = _swap_fn(args, kwargs, "fn", wrap_fn)
    if swapped is None:
        return func(*args, **kwargs)  # no fn: the original raises its own TypeError
    a, k = swapped
    result = _run(probe, lambda: func(*a, **k))
    if not probe.entered:
        _degrade(t, "a call ended without the timed loop being recognised "
                    "(no clear_cache right after warm-up calls)")
    return result


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


def _body_cudagraph(t: Target, func: Fn, args: Args, kwargs: Kwargs) -> Any:
    """Triton 3.x do_bench_cudagraph: fn() warm-up, estimate (5 x fn), capture a
    graph of n x fn, sync, 10 x (record, replay, record, sync). The region starts
    when the first capture outside fn ends (fn's own captures, e.g. torch.compile
    cudagraphs during warm-up, do not count)."""
    why = _hook_capture_end()
    if why:
        _note(t, why)
        return _call_whole(func, args, kwargs)
    probe = _Probe(CUDAGRAPH)

    def wrap_fn(fn: Any) -> Any:
        def fn_(*a: Any, **k: Any) -> Any:
            probe.depth += 1
            try:
                return fn(*a, **k)
            finally:
                probe.depth -= 1

        return fn_

    swapped = _swap_fn(args, kwargs, "fn", wrap_fn)
    if swapped is None:
        return func(*args, **kwargs)
    a, k = swapped
    result = _run(probe, lambda: func(*a, **k))
    if not probe.entered:
        _degrade(t, "a call ended without a CUDA graph capture being seen")
    return result


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
    result = _run(probe, lambda: func(*args, **kwargs))
    if not probe.entered:
        _degrade(t, "a call ended without its timed part being recognised")
    return result


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

    result = _run(probe, call)
    if not probe.entered:
        _degrade(t, f"a call made fewer than {probe.threshold} untimed calls of kernel_fn")
    return result


_BODIES: dict[str, Callable[[Target, Fn, Args, Kwargs], Any]] = {
    WHOLE: _body_whole,
    DO_BENCH: _body_do_bench,
    CUDAGRAPH: _body_cudagraph,
    TIMER_TIMEIT: _body_timer,
    TIMER_LOOP: _body_timer,
    TIMER_FIRST: _body_timer,
    KERNELBENCH: _body_kernelbench,
}
