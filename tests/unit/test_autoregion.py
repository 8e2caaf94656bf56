"""krex.proc.autoregion: automatic regions for unmodified harnesses (KREX_AUTO_REGION).

The fakes below are written into a temporary directory as real packages
(triton, torch, kernelbench, src) so the import hook is exercised for real.
They follow the control flow of the real sources (Triton 3.x
triton/testing.py do_bench and do_bench_cudagraph, torch's
torch/utils/benchmark/utils/timer.py Timer, KernelBench's
src/kernelbench/timing.py and the older src/eval.py) call for call; every
GPU-ish step appends to one log, and krex.region is replaced by a recorder
that appends "enter"/"exit" to the same log. The tests then check where the
region sits in that sequence."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import krex
from krex.errors import UsageError
from krex.proc import autoregion

FAKE_PREFIXES = ("triton", "torch", "kernelbench", "src", "userbench", "legacybench", "legacy30", "fakelog")

FAKES: dict[str, str] = {
    "fakelog.py": """
        LOG = []
        CLOCK = [0.0]
        CAPTURING = [None]   # the CUDAGraph being captured, if any
        CALLS = [0]

        def reset():
            LOG.clear(); CLOCK[0] = 0.0; CAPTURING[0] = None; CALLS[0] = 0

        def make_fn(name="fn"):
            # a "kernel" whose duration varies with the call number (1, 2 or 3 ms)
            def fn(*args):
                CALLS[0] += 1
                cost = 1.0 + CALLS[0] % 3
                LOG.append(name)
                if CAPTURING[0] is not None:
                    CAPTURING[0].costs.append(cost)
                else:
                    CLOCK[0] += cost
                return sum(args) if args else None
            return fn

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None
            def record(self, stream=None):
                LOG.append("record"); self.t = CLOCK[0]
            def elapsed_time(self, end):
                LOG.append("elapsed"); return end.t - self.t

        def synchronize(device=None):
            LOG.append("sync")
    """,
    # ---- Triton 3.x
    "triton/__init__.py": "from . import runtime\n",
    "triton/runtime/__init__.py": "from .driver import driver\n",
    "triton/runtime/driver.py": """
        import fakelog

        class _DeviceInterface:          # torch.cuda, as the CUDA driver hands it out
            Event = fakelog.Event
            @staticmethod
            def synchronize(device=None):
                fakelog.synchronize(device)

        class CudaDriver:
            def get_device_interface(self):
                return _DeviceInterface
            def get_empty_cache_for_benchmark(self):
                fakelog.LOG.append("alloc_cache"); return object()
            def clear_cache(self, cache):
                fakelog.LOG.append("clear")

        class DriverConfig:
            def __init__(self):
                self._active = None
            @property
            def active(self):
                if self._active is None:
                    self._active = CudaDriver()
                return self._active

        driver = DriverConfig()
    """,
    "triton/testing.py": """
        import statistics
        from . import runtime

        CLEAR_IN_WARMUP = False   # a hypothetical future layout the boundary rule does not know

        def _quantile(a, q):
            a = sorted(a); n = len(a); out = []
            for x in q:
                point = x * (n - 1); lo = int(point); hi = min(lo + 1, n - 1); t = point - lo
                out.append((1 - t) * a[lo] + t * a[hi])
            return out

        def _summarize_statistics(times, quantiles, return_mode):
            if quantiles is not None:
                ret = _quantile(times, quantiles)
                if len(ret) == 1:
                    ret = ret[0]
                return ret
            if return_mode == "all":
                return times
            return {"min": min, "max": max, "mean": statistics.mean,
                    "median": statistics.median}[return_mode](times)

        def do_bench_cudagraph(fn, rep=20, grad_to_none=None, quantiles=None, return_mode="mean"):
            import torch
            assert return_mode in ["min", "max", "mean", "median", "all"]
            with torch.cuda.stream(torch.cuda.Stream()):
                fn()
                if grad_to_none is not None:
                    for x in grad_to_none:
                        x.grad = None
                start_event = torch.cuda.Event(enable_timing=True)
                end_event = torch.cuda.Event(enable_timing=True)
                start_event.record()
                for _ in range(5):
                    fn()
                end_event.record()
                torch.cuda.synchronize()
                estimate_ms = start_event.elapsed_time(end_event) / 5
                n_repeat = 1000 if estimate_ms == 0 else max(1, int(rep / estimate_ms))
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(n_repeat):
                        fn()
                torch.cuda.synchronize()
                ret = []
                for _ in range(10):
                    start_event = torch.cuda.Event(enable_timing=True)
                    end_event = torch.cuda.Event(enable_timing=True)
                    start_event.record()
                    g.replay()
                    end_event.record()
                    torch.cuda.synchronize()
                    ret += [start_event.elapsed_time(end_event) / n_repeat]
                return _summarize_statistics(ret, quantiles, return_mode)

        def do_bench(fn, warmup=25, rep=100, grad_to_none=None, quantiles=None, return_mode="mean"):
            assert return_mode in ["min", "max", "mean", "median", "all"]
            di = runtime.driver.active.get_device_interface()
            fn()
            di.synchronize()
            cache = runtime.driver.active.get_empty_cache_for_benchmark()
            start_event = di.Event(enable_timing=True)
            end_event = di.Event(enable_timing=True)
            start_event.record()
            for _ in range(5):
                runtime.driver.active.clear_cache(cache)
                fn()
            end_event.record()
            di.synchronize()
            estimate_ms = start_event.elapsed_time(end_event) / 5
            n_warmup = max(1, int(warmup / estimate_ms))
            n_repeat = max(1, int(rep / estimate_ms))
            start_event = [di.Event(enable_timing=True) for i in range(n_repeat)]
            end_event = [di.Event(enable_timing=True) for i in range(n_repeat)]
            for _ in range(n_warmup):
                if CLEAR_IN_WARMUP:
                    runtime.driver.active.clear_cache(cache)
                fn()
            for i in range(n_repeat):
                if grad_to_none is not None:
                    for x in grad_to_none:
                        x.grad = None
                runtime.driver.active.clear_cache(cache)
                start_event[i].record()
                fn()
                end_event[i].record()
            di.synchronize()
            times = [s.elapsed_time(e) for s, e in zip(start_event, end_event)]
            return _summarize_statistics(times, quantiles, return_mode)
    """,
    # ---- a Triton 2.x-style do_bench (no runtime.driver): the wrapper falls back to the whole call
    "legacybench.py": """
        import fakelog

        def do_bench(fn, warmup=25, rep=100, grad_to_none=None, quantiles=None):
            fn(); fakelog.synchronize()
            for _ in range(3):
                fn()
            s, e = fakelog.Event(), fakelog.Event()
            s.record(); fn(); e.record(); fakelog.synchronize()
            return s.elapsed_time(e)
    """,
    # ---- a Triton 3.0-style do_bench: runtime is there, but the L2 flush is cache.zero_()
    "legacy30.py": """
        import fakelog
        from triton import runtime

        class _Cache:
            def zero_(self):
                fakelog.LOG.append("zero")

        def do_bench(fn, warmup=25, rep=100, grad_to_none=None, quantiles=None, fast_flush=True):
            di = runtime.driver.active.get_device_interface()
            fn(); di.synchronize()
            cache = _Cache()
            for _ in range(3):
                fn()
            s, e = di.Event(), di.Event()
            cache.zero_(); s.record(); fn(); e.record(); di.synchronize()
            return s.elapsed_time(e)
    """,
    # ---- torch (only what the fakes need)
    "torch/__init__.py": "from . import cuda\n",
    "torch/cuda/__init__.py": """
        import fakelog
        from fakelog import Event, synchronize

        class Stream:
            pass

        class stream:
            def __init__(self, s):
                self.s = s
            def __enter__(self):
                return self.s
            def __exit__(self, *exc):
                return None

        class CUDAGraph:
            def __init__(self):
                self.costs = []
            def capture_begin(self):
                fakelog.LOG.append("capture_begin"); fakelog.CAPTURING[0] = self
            def capture_end(self):
                fakelog.CAPTURING[0] = None; fakelog.LOG.append("capture_end")
            def replay(self):
                fakelog.LOG.append("replay"); fakelog.CLOCK[0] += sum(self.costs)

        class graph:                       # torch.cuda.graph: sync, capture_begin ... capture_end
            def __init__(self, cuda_graph):
                self.cuda_graph = cuda_graph
            def __enter__(self):
                synchronize()
                self.cuda_graph.capture_begin()
            def __exit__(self, *exc):
                self.cuda_graph.capture_end()
    """,
    "torch/utils/__init__.py": "",
    "torch/utils/benchmark/__init__.py": "from torch.utils.benchmark.utils.timer import *  # noqa\n",
    "torch/utils/benchmark/utils/__init__.py": "",
    "torch/utils/benchmark/utils/timer.py": """
        import statistics
        import timeit as _timeit_mod
        import fakelog

        __all__ = ["Timer", "timer"]

        def timer():
            fakelog.synchronize()
            return fakelog.CLOCK[0] / 1000.0

        class Measurement:
            def __init__(self, number_per_run, raw_times, task_spec=None):
                self.number_per_run = number_per_run
                self.raw_times = raw_times
            def meets_confidence(self, threshold):
                return len(self.raw_times) >= 5

        class Timer:
            def __init__(self, stmt="pass", setup="pass", timer=timer, globals=None):
                self._timer = _timeit_mod.Timer(stmt=stmt, setup=setup, timer=timer,
                                                globals=dict(globals or {}))

            def _timeit(self, number):
                return max(self._timer.timeit(number), 1e-9)

            def timeit(self, number=1000000):
                self._timeit(number=max(int(number // 100), 2))
                return Measurement(number_per_run=number, raw_times=[self._timeit(number=number)])

            def repeat(self, repeat=-1, number=-1):
                raise NotImplementedError("See `Timer.blocked_autorange.`")

            def _threaded_measurement_loop(self, number, time_hook, stop_hook, min_run_time,
                                           max_run_time=None, callback=None):
                total_time = 0.0
                can_stop = False
                times = []
                while (total_time < min_run_time) or (not can_stop):
                    time_spent = time_hook()
                    times.append(time_spent)
                    total_time += time_spent
                    if callback:
                        callback(number, time_spent)
                    can_stop = stop_hook(times)
                    if max_run_time and total_time > max_run_time:
                        break
                return times

            def _estimate_block_size(self, min_run_time):
                overhead = statistics.median([self._timeit(0) for _ in range(5)])
                number = 1
                while True:
                    time_taken = self._timeit(number)
                    relative_overhead = overhead / time_taken
                    if relative_overhead <= 1e-4 and time_taken >= min_run_time / 1000:
                        break
                    if time_taken > min_run_time:
                        break
                    number *= 10
                return number

            def blocked_autorange(self, callback=None, min_run_time=0.2):
                number = self._estimate_block_size(min_run_time)
                def time_hook():
                    return self._timeit(number)
                def stop_hook(times):
                    return True
                times = self._threaded_measurement_loop(number, time_hook, stop_hook,
                                                        min_run_time=min_run_time, callback=callback)
                return Measurement(number_per_run=number, raw_times=times)

            def adaptive_autorange(self, threshold=0.1, *, min_run_time=0.01, max_run_time=10.0,
                                   callback=None):
                number = self._estimate_block_size(min_run_time=0.05)
                def time_hook():
                    return self._timeit(number)
                def stop_hook(times):
                    if len(times) > 3:
                        return Measurement(number, times).meets_confidence(threshold=threshold)
                    return False
                times = self._threaded_measurement_loop(number, time_hook, stop_hook, min_run_time,
                                                        max_run_time, callback=callback)
                return Measurement(number_per_run=number, raw_times=times)
    """,
    # ---- KernelBench, current layout (src/kernelbench/timing.py)
    "kernelbench/__init__.py": "",
    "kernelbench/timing.py": """
        import fakelog
        import torch
        from triton import runtime as triton_runtime
        from triton import testing as triton_testing

        def clear_l2_cache(device="cuda"):
            fakelog.LOG.append("l2")

        def get_timing_function(method="cuda_event"):
            return {"cuda_event": time_execution_with_cuda_event,
                    "do_bench": time_execution_with_do_bench_interface,
                    "do_bench_impl": time_execution_with_do_bench_impl}[method]

        def time_execution_with_cuda_event(kernel_fn, args, num_warmup=3, num_trials=10, discard_first=1,
                                           verbose=True, device=None):
            if device is None:
                device = 0
            for _ in range(num_warmup):
                kernel_fn(*args)
                torch.cuda.synchronize(device=device)
            fakelog.LOG.append("empty_cache")
            elapsed_times = []
            for trial in range(num_trials + discard_first):
                torch.cuda.synchronize(device=device)
                start_event = torch.cuda.Event(enable_timing=True)
                end_event = torch.cuda.Event(enable_timing=True)
                clear_l2_cache(device=device)
                start_event.record()
                _ = kernel_fn(*args)
                end_event.record()
                torch.cuda.synchronize(device=device)
                elapsed_time_ms = start_event.elapsed_time(end_event)
                if trial >= discard_first:
                    elapsed_times.append(elapsed_time_ms)
            return elapsed_times

        def time_execution_with_do_bench_interface(kernel_fn, args, num_warmup=3, num_trials=10,
                                                   discard_first=1, verbose=True, device=None):
            do_bench_fn = lambda: kernel_fn(*args)  # noqa: E731
            return triton_testing.do_bench(fn=do_bench_fn, warmup=25, rep=100, grad_to_none=None,
                                           quantiles=None, return_mode="all")

        def time_execution_with_do_bench_impl(kernel_fn, args, num_warmup=3, num_trials=10,
                                              discard_first=1, verbose=True, device=None):
            di = triton_runtime.driver.active.get_device_interface()
            kernel_fn(*args)
            di.synchronize(device=device)
            cache = triton_runtime.driver.active.get_empty_cache_for_benchmark()
            start_event = [di.Event(enable_timing=True) for i in range(num_trials)]
            end_event = [di.Event(enable_timing=True) for i in range(num_trials)]
            for _ in range(num_warmup):
                kernel_fn(*args)
            di.synchronize(device=device)
            for i in range(num_trials):
                triton_runtime.driver.active.clear_cache(cache)
                start_event[i].record()
                kernel_fn(*args)
                end_event[i].record()
            di.synchronize(device=device)
            return [s.elapsed_time(e) for s, e in zip(start_event, end_event)]
    """,
    # ---- KernelBench, first layout (src/eval.py, kernel_fn(*args), no discard)
    "src/__init__.py": "",
    "src/eval.py": """
        import fakelog
        import torch

        def time_execution_with_cuda_event(kernel_fn, *args, num_warmup=3, num_trials=10, verbose=True,
                                           device=None):
            for _ in range(num_warmup):
                kernel_fn(*args)
                torch.cuda.synchronize(device=device)
            elapsed_times = []
            for trial in range(num_trials):
                start_event = torch.cuda.Event(enable_timing=True)
                end_event = torch.cuda.Event(enable_timing=True)
                start_event.record()
                kernel_fn(*args)
                end_event.record()
                torch.cuda.synchronize(device=device)
                elapsed_times.append(start_event.elapsed_time(end_event))
            return elapsed_times
    """,
    # ---- a user's own harness
    "userbench.py": """
        import fakelog

        def bench(x, scale=2):
            fakelog.LOG.append("body")
            return x * scale

        def boom():
            fakelog.LOG.append("body")
            raise ValueError("boom")

        class Runner:
            def run(self, x):
                fakelog.LOG.append("body")
                return ("run", x)
            @staticmethod
            def srun(x):
                fakelog.LOG.append("body")
                return ("srun", x)
            @classmethod
            def crun(cls, x):
                fakelog.LOG.append("body")
                return (cls.__name__, x)
    """,
}


def _write_fakes(root: Path) -> None:
    for rel, src in FAKES.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(src))


def _is_fake(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in FAKE_PREFIXES)


class Sandbox:
    def __init__(self, root: Path, log: list[str], fakelog: ModuleType) -> None:
        self.root = root
        self.log = log
        self.fakelog = fakelog

    def reset(self) -> None:
        self.fakelog.reset()

    def fn(self, name: str = "fn") -> Any:
        return self.fakelog.make_fn(name)

    def status(self, target: str) -> dict[str, str]:
        return next(e for e in autoregion.status() if e["target"] == target)

    def between(self) -> tuple[list[str], list[str], list[str]]:
        """(before enter, inside, after exit) for a log with exactly one region."""
        assert self.log.count("enter") == 1, self.log
        assert self.log.count("exit") == 1, self.log
        i, j = self.log.index("enter"), self.log.index("exit")
        assert i < j
        return self.log[:i], self.log[i + 1 : j], self.log[j + 1 :]


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Sandbox]:
    """Fake packages on sys.path (real ones of the same names hidden), a
    recording krex.region, and autoregion fully undone afterwards."""
    saved = {n: m for n, m in sys.modules.items() if _is_fake(n)}
    for n in saved:
        del sys.modules[n]
    _write_fakes(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    fakelog = importlib.import_module("fakelog")
    log: list[str] = fakelog.LOG

    class Recorder:
        def __init__(self) -> None:
            self.grant = None

        def __enter__(self) -> Recorder:
            log.append("enter")
            return self

        def __exit__(self, *exc: object) -> None:
            log.append("exit")

    monkeypatch.setattr(krex, "region", Recorder)
    autoregion.uninstall()
    try:
        yield Sandbox(tmp_path, log, fakelog)
    finally:
        autoregion.uninstall()
        for n in [n for n in sys.modules if _is_fake(n)]:
            del sys.modules[n]
        sys.modules.update(saved)


# ------------------------------------------------------------------ parsing


def test_parse_builtins_all_and_user_targets() -> None:
    names = [t.name for t in autoregion.parse("do_bench")]
    assert names == ["triton.testing:do_bench"]
    timer = {t.qualname for t in autoregion.parse("torch_timer")}
    assert timer == {"Timer.timeit", "Timer.blocked_autorange", "Timer.adaptive_autorange", "Timer.repeat"}
    every = {t.name for group in autoregion.BUILTINS.values() for t in group}
    assert {t.name for t in autoregion.parse("all")} == every
    assert {t.name for t in autoregion.parse(" 1 ")} == every
    kb = {t.name for t in autoregion.parse("kernelbench")}
    assert "kernelbench.timing:time_execution_with_cuda_event" in kb
    assert "triton.testing:do_bench" in kb  # KernelBench's "do_bench" method calls it
    mixed = autoregion.parse("DO_BENCH, mybench.timing:run , pkg.mod:Runner.run,do_bench,")
    assert [t.name for t in mixed] == ["triton.testing:do_bench", "mybench.timing:run", "pkg.mod:Runner.run"]
    assert [t.strategy for t in mixed[1:]] == [autoregion.WHOLE, autoregion.WHOLE]


@pytest.mark.parametrize("value", ["", "0", "   "])
def test_off_values_install_nothing(value: str) -> None:
    assert autoregion.parse(value) == []
    autoregion.uninstall()
    autoregion.install(value)
    assert not autoregion.installed()
    assert autoregion.status() == []


@pytest.mark.parametrize(
    "value, words",
    [
        ("module:", "names no function"),
        (":func", "names no module"),
        ("a:b:c", "more than one"),
        ("do_bnch", "did you mean 'do_bench'"),
        ("do_bench,nope", "unknown built-in 'nope'"),
        ("mybench.run", "unknown built-in"),
        ("my-bench:run", "not a module name"),
        ("mybench:run()", "not a function"),
        ("mybench:Runner.", "not a function"),
        ("__main__:bench", "__main__"),
        ("true", "unknown built-in"),
    ],
)
def test_malformed_values_raise_usage_error(value: str, words: str) -> None:
    with pytest.raises(UsageError) as ei:
        autoregion.parse(value)
    assert words in str(ei.value)
    assert ei.value.fix
    assert ei.value.exit_code == 2
    autoregion.uninstall()
    with pytest.raises(UsageError):
        autoregion.install(value)
    assert not autoregion.installed()


def test_dotted_name_without_colon_suggests_the_colon_form() -> None:
    with pytest.raises(UsageError) as ei:
        autoregion.parse("mybench.timing.run")
    assert "mybench.timing:run" in ei.value.fix


def test_install_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KREX_AUTO_REGION", "module:")
    with pytest.raises(UsageError):
        autoregion.install()


# ------------------------------------------------------------------ do_bench


def test_do_bench_region_covers_exactly_the_timed_loop(sandbox: Sandbox) -> None:
    autoregion.install("do_bench")
    assert sandbox.status("triton.testing:do_bench")["state"] == "pending"
    import triton.testing as tt

    assert getattr(tt.do_bench, autoregion.MARK) == "triton.testing:do_bench"
    assert sandbox.status("triton.testing:do_bench")["state"] == "wrapped"
    sandbox.reset()
    ms = tt.do_bench(sandbox.fn(), warmup=10, rep=20)
    before, inside, after = sandbox.between()
    # estimate: 5 calls averaging 2 ms -> 5 warm-up and 10 timed calls
    assert before.count("fn") == 1 + 5 + 5  # compile call, estimate, warm-up
    assert before.count("clear") == 5  # estimate only
    assert before[-1] == "fn"  # the last warm-up call; nothing of the timed loop yet
    assert inside[0] == "clear"  # the first timed iteration starts with its L2 flush
    assert inside.count("fn") == 10 and inside.count("clear") == 10
    assert inside[-11:] == ["sync"] + ["elapsed"] * 10  # final synchronize and event reads inside
    assert after == []
    # the value is the original's
    sandbox.reset()
    assert ms == tt.do_bench.__wrapped__(sandbox.fn(), warmup=10, rep=20)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"quantiles": [0.5, 0.2, 0.8]},
        {"quantiles": [0.5]},
        {"return_mode": "all"},
        {"return_mode": "min"},
        {"return_mode": "median"},
    ],
)
def test_do_bench_returns_what_the_original_returns(sandbox: Sandbox, kwargs: dict[str, Any]) -> None:
    autoregion.install("do_bench")
    import triton.testing as tt

    sandbox.reset()
    got = tt.do_bench(fn=sandbox.fn(), warmup=5, rep=12, **kwargs)
    sandbox.reset()
    want = tt.do_bench.__wrapped__(fn=sandbox.fn(), warmup=5, rep=12, **kwargs)
    assert got == want and type(got) is type(want)


def test_do_bench_already_imported_is_wrapped_at_install(sandbox: Sandbox) -> None:
    import triton.testing as tt

    original = tt.do_bench
    autoregion.install("do_bench")
    assert tt.do_bench is not original and tt.do_bench.__wrapped__ is original
    from triton.testing import do_bench  # a later from-import gets the wrapper too

    sandbox.reset()
    do_bench(sandbox.fn(), warmup=4, rep=8)
    before, inside, _ = sandbox.between()
    assert before.count("fn") == 1 + 5 + 2 and inside.count("fn") == 4


def test_clear_cache_hook_is_pass_through_outside_do_bench(sandbox: Sandbox) -> None:
    autoregion.install("do_bench")
    import triton.runtime as rt
    import triton.testing as tt

    tt.do_bench(sandbox.fn(), warmup=2, rep=2)  # installs the class-level hook
    sandbox.reset()
    rt.driver.active.clear_cache(object())
    assert sandbox.log == ["clear"]


def test_do_bench_inside_an_explicit_region_and_exceptions(sandbox: Sandbox) -> None:
    autoregion.install("do_bench")
    import triton.testing as tt

    def bad() -> None:
        raise RuntimeError("kernel failed")

    sandbox.reset()
    with pytest.raises(RuntimeError, match="kernel failed"):
        tt.do_bench(bad)
    assert "enter" not in sandbox.log  # failed in the compile call, before any region
    assert sandbox.status("triton.testing:do_bench")["state"] == "wrapped"  # not degraded by an error

    calls = [0]
    fn = sandbox.fn()

    def fails_when_timed() -> None:
        calls[0] += 1
        fn()
        if calls[0] > 1 + 5 + 3:
            raise RuntimeError("late failure")

    sandbox.reset()
    with pytest.raises(RuntimeError, match="late failure"):
        tt.do_bench(fails_when_timed, warmup=6, rep=20)
    assert sandbox.log.count("enter") == 1 and sandbox.log[-1] == "exit"  # the region was left


def test_do_bench_unknown_layout_falls_back_to_the_whole_call(sandbox: Sandbox) -> None:
    autoregion.install("do_bench")
    import triton.testing as tt

    tt.CLEAR_IN_WARMUP = True  # the boundary rule never matches
    sandbox.reset()
    first = tt.do_bench(sandbox.fn(), warmup=4, rep=8)
    assert "enter" not in sandbox.log  # that call could not be protected...
    st = sandbox.status("triton.testing:do_bench")
    assert st["state"] == "whole" and "timed loop being recognised" in st["detail"]
    sandbox.reset()
    second = tt.do_bench(sandbox.fn(), warmup=4, rep=8)  # ...later ones are, whole
    assert sandbox.log[0] == "enter" and sandbox.log[-1] == "exit"
    assert first == second


def test_do_bench_without_triton3_driver_wraps_the_whole_call(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    import legacybench
    import triton.testing as tt

    monkeypatch.setattr(tt, "do_bench", legacybench.do_bench)
    autoregion.install("do_bench")
    sandbox.reset()
    tt.do_bench(sandbox.fn())
    assert sandbox.log[0] == "enter" and sandbox.log[-1] == "exit"
    st = sandbox.status("triton.testing:do_bench")
    assert st["state"] == "whole" and "older than Triton 3" in st["detail"]


def test_do_bench_flushing_without_clear_cache_is_whole_from_the_first_call(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    import legacy30
    import triton.testing as tt

    monkeypatch.setattr(tt, "do_bench", legacy30.do_bench)
    autoregion.install("do_bench")
    sandbox.reset()
    tt.do_bench(sandbox.fn())
    assert sandbox.log[0] == "enter" and sandbox.log[-1] == "exit"  # protected from the first call on
    st = sandbox.status("triton.testing:do_bench")
    assert st["state"] == "whole" and "clear_cache" in st["detail"]


# ------------------------------------------------------------------ do_bench_cudagraph


def test_do_bench_cudagraph_region_starts_after_capture(sandbox: Sandbox) -> None:
    autoregion.install("do_bench_cudagraph")
    import triton.testing as tt

    sandbox.reset()
    got = tt.do_bench_cudagraph(sandbox.fn(), rep=10)
    before, inside, after = sandbox.between()
    assert before.count("fn") == 1 + 5 + 5  # warm-up, estimate, the captured calls
    assert before[-1] == "capture_end"
    assert "fn" not in inside and "capture_begin" not in inside
    assert inside.count("replay") == 10
    assert inside[-5:] == ["record", "replay", "record", "sync", "elapsed"]  # last replay, its sync and read
    assert after == []
    sandbox.reset()
    assert got == tt.do_bench_cudagraph.__wrapped__(sandbox.fn(), rep=10)
    import torch

    assert getattr(torch.cuda.CUDAGraph.capture_end, autoregion.MARK)


def test_cudagraph_captures_inside_fn_do_not_start_the_region(sandbox: Sandbox) -> None:
    autoregion.install("do_bench_cudagraph")
    import torch
    import triton.testing as tt

    inner = sandbox.fn()
    seen = [0]

    def fn_with_own_graph() -> None:  # like torch.compile(mode="reduce-overhead") on its first call
        seen[0] += 1
        if seen[0] == 1:
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                inner()
        inner()

    sandbox.reset()
    tt.do_bench_cudagraph(fn_with_own_graph, rep=10)
    before, inside, _ = sandbox.between()
    assert before.count("capture_end") == 2 and "fn" not in inside


# ------------------------------------------------------------------ torch.utils.benchmark.Timer (fake)


def test_timer_timeit_warmup_outside_timed_call_inside(sandbox: Sandbox) -> None:
    autoregion.install("torch_timer")
    import torch.utils.benchmark as tb

    fn = sandbox.fn()
    sandbox.reset()
    m = tb.Timer(stmt="fn()", globals={"fn": fn}).timeit(number=300)
    before, inside, after = sandbox.between()
    assert before.count("fn") == 3  # warm-up: number // 100
    assert inside.count("fn") == 300 and inside[0] == "sync"  # the timer's own synchronize starts it
    assert after == [] and m.number_per_run == 300


@pytest.mark.parametrize("method", ["blocked_autorange", "adaptive_autorange"])
def test_timer_autorange_estimate_outside_loop_inside(sandbox: Sandbox, method: str) -> None:
    autoregion.install("torch_timer")
    from torch.utils.benchmark import Timer

    fn = sandbox.fn()
    sandbox.reset()
    m = getattr(Timer(stmt="fn()", globals={"fn": fn}), method)(min_run_time=0.05)
    before, inside, _ = sandbox.between()
    assert before.count("fn") > 0  # the block-size estimate doubles as warm-up
    assert inside.count("fn") == m.number_per_run * len(m.raw_times)
    assert sandbox.status(f"torch.utils.benchmark.utils.timer:Timer.{method}")["state"] == "wrapped"


def test_timer_repeat_still_raises_and_enters_no_region(sandbox: Sandbox) -> None:
    autoregion.install("torch_timer")
    from torch.utils.benchmark import Timer

    sandbox.reset()
    with pytest.raises(NotImplementedError):
        Timer(stmt="pass").repeat()
    assert "enter" not in sandbox.log
    assert sandbox.status("torch.utils.benchmark.utils.timer:Timer.repeat")["state"] == "wrapped"


def test_timer_nested_timer_in_stmt_does_not_confuse_the_outer(sandbox: Sandbox) -> None:
    autoregion.install("torch_timer")
    from torch.utils.benchmark import Timer

    fn = sandbox.fn()
    inner = Timer(stmt="fn()", globals={"fn": fn})
    sandbox.reset()
    Timer(stmt="inner._timeit(1)", globals={"inner": inner}).timeit(number=200)
    before, inside, _ = sandbox.between()
    assert before.count("fn") == 2 and inside.count("fn") == 200


# ------------------------------------------------------------------ KernelBench


def test_kernelbench_cuda_event_trials_inside(sandbox: Sandbox) -> None:
    autoregion.install("kernelbench")
    from kernelbench import timing

    sandbox.reset()
    times = timing.get_timing_function("cuda_event")(
        sandbox.fn("k"), [1, 2], num_warmup=4, num_trials=6, verbose=False
    )
    before, inside, after = sandbox.between()
    assert before.count("k") == 4 and before[-1] == "k"
    assert inside.count("k") == 7 and inside.count("l2") == 7  # 6 trials + 1 discarded, L2 flush each
    assert inside[-1] == "elapsed" and after == []
    sandbox.reset()
    assert times == timing.time_execution_with_cuda_event.__wrapped__(
        sandbox.fn("k"), [1, 2], num_warmup=4, num_trials=6, verbose=False
    )


def test_kernelbench_do_bench_impl_counts_its_compile_call(sandbox: Sandbox) -> None:
    autoregion.install("kernelbench")
    from kernelbench import timing

    sandbox.reset()
    timing.time_execution_with_do_bench_impl(sandbox.fn("k"), [], 3, 5)  # positional num_warmup
    before, inside, _ = sandbox.between()
    assert before.count("k") == 1 + 3 and inside.count("k") == 5
    assert inside[0] == "sync"  # the synchronize that ends the warm-up, then the trials


def test_kernelbench_zero_warmup_and_old_layout(sandbox: Sandbox) -> None:
    autoregion.install("kernelbench")
    from kernelbench import timing

    sandbox.reset()
    timing.time_execution_with_cuda_event(sandbox.fn("k"), [], num_warmup=0, num_trials=2, discard_first=0)
    before, inside, _ = sandbox.between()
    assert before == [] and inside.count("k") == 2

    import src.eval as old_eval  # kernel_fn(*args) with keyword-only num_warmup

    sandbox.reset()
    old_eval.time_execution_with_cuda_event(sandbox.fn("k"), 1, 2, num_trials=3)  # default num_warmup=3
    before, inside, _ = sandbox.between()
    assert before.count("k") == 3 and inside.count("k") == 3
    assert sandbox.status("src.eval:time_execution_with_host_time")["state"] == "absent"
    assert sandbox.status("kernelbench.eval:time_execution_with_cuda_event")["state"] == "pending"


def test_kernelbench_do_bench_method_goes_through_triton(sandbox: Sandbox) -> None:
    autoregion.install("kernelbench")
    from kernelbench import timing

    sandbox.reset()
    times = timing.get_timing_function("do_bench")(sandbox.fn("k"), [])
    before, inside, _ = sandbox.between()
    assert inside[0] == "clear" and isinstance(times, list) and len(times) == inside.count("k")


# ------------------------------------------------------------------ user targets


def test_user_function_imported_after_install(sandbox: Sandbox) -> None:
    autoregion.install("userbench:bench,userbench:Runner.run,userbench:Runner.srun,userbench:Runner.crun")
    assert sandbox.status("userbench:bench")["state"] == "pending"
    import userbench
    from userbench import bench

    sandbox.reset()
    assert bench(21, scale=2) == 42 and sandbox.log == ["enter", "body", "exit"]
    for call, want in [
        (lambda: userbench.Runner().run(1), ("run", 1)),
        (lambda: userbench.Runner.srun(2), ("srun", 2)),
        (lambda: userbench.Runner().srun(2), ("srun", 2)),
        (lambda: userbench.Runner.crun(3), ("Runner", 3)),
    ]:
        sandbox.reset()
        assert call() == want
        assert sandbox.log == ["enter", "body", "exit"]
    assert all(e["state"] == "wrapped" for e in autoregion.status())


def test_user_function_imported_before_install(sandbox: Sandbox) -> None:
    import userbench

    original = userbench.bench
    autoregion.install("userbench:bench,userbench:boom")
    assert userbench.bench is not original and userbench.bench.__wrapped__ is original
    sandbox.reset()
    assert userbench.bench(5) == 10 and sandbox.log == ["enter", "body", "exit"]
    sandbox.reset()
    with pytest.raises(ValueError, match="boom"):
        userbench.boom()
    assert sandbox.log == ["enter", "body", "exit"]
    autoregion.install("userbench:bench")  # installing again wraps nothing twice
    sandbox.reset()
    userbench.bench(1)
    assert sandbox.log == ["enter", "body", "exit"]


def test_missing_and_unwrappable_targets_are_recorded_not_raised(sandbox: Sandbox) -> None:
    autoregion.install("userbench:nothere,userbench:Nope.run,userbench:Runner,builtins:int.bit_length")
    import userbench

    assert userbench.bench(1) == 2
    st = {e["target"]: e for e in autoregion.status()}
    assert st["userbench:nothere"]["state"] == "missing"
    assert st["userbench:Nope.run"]["state"] == "missing"
    assert st["userbench:Runner"]["state"] == "unsupported"
    assert st["builtins:int.bit_length"]["state"] == "failed"  # cannot set attributes of int
    assert (5).bit_length() == 3  # the original is left in place


def test_outside_krex_wrappers_behave_like_originals(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    region_mod = sys.modules["krex.proc.region"]  # (`import krex.region` would give the patched attribute)
    monkeypatch.setattr(krex, "region", region_mod.region)  # the real one
    for var in ("KREX_SHM", "KREX_SOCKET", "KREX_STRICT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(region_mod, "_warned", False)
    autoregion.install("do_bench,userbench:bench")
    import triton.testing as tt
    import userbench

    sandbox.reset()
    with pytest.warns(RuntimeWarning, match="not running under KREX"):
        got = tt.do_bench(sandbox.fn(), warmup=5, rep=10, quantiles=[0.5, 0.2])
    sandbox.reset()
    assert got == tt.do_bench.__wrapped__(sandbox.fn(), warmup=5, rep=10, quantiles=[0.5, 0.2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warns once only
        assert userbench.bench(4) == 8


def test_uninstall_restores_originals(sandbox: Sandbox) -> None:
    autoregion.install("do_bench,torch_timer")
    import torch.utils.benchmark.utils.timer as tm
    import triton.testing as tt

    tt.do_bench(sandbox.fn(), warmup=2, rep=2)
    assert getattr(tm.Timer.timeit, autoregion.MARK, None)
    autoregion.uninstall()
    assert not hasattr(tt.do_bench, autoregion.MARK)
    assert not hasattr(tm.Timer.timeit, autoregion.MARK)
    assert not hasattr(tm.Timer._timeit, autoregion.MARK)
    import triton.runtime as rt

    assert not hasattr(type(rt.driver.active).clear_cache, autoregion.MARK)
    assert not autoregion.installed() and autoregion.status() == []


# ------------------------------------------------------------------ sitecustomize (subprocesses)


KREX_ROOT = str(Path(krex.__file__).resolve().parents[1])  # where `import krex` finds this krex


def _env(*path: str | Path, **extra: str) -> dict[str, str]:
    """The test's environment without KREX_* variables; PYTHONPATH = `path`,
    then this krex's root (so children import it even when it is not installed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KREX_") and k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, path), KREX_ROOT])
    env.update(extra)
    return env


def _py(code: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def other_site(tmp_path: Path) -> Path:
    """A second sitecustomize, later on the path, like a user's or Debian's."""
    d = tmp_path / "other"
    d.mkdir()
    (d / "sitecustomize.py").write_text("import builtins\nbuiltins.OTHER_SITECUSTOMIZE = __file__\n")
    _write_fakes(tmp_path / "fakes")
    return d


PROBE = """
    import builtins, json, sys
    print(json.dumps({
        "finders": [type(f).__module__ + "." + type(f).__name__ for f in sys.meta_path],
        "krex": sorted(m for m in sys.modules if m == "krex" or m.startswith("krex.")),
        "other": getattr(builtins, "OTHER_SITECUSTOMIZE", None),
        "site": getattr(sys.modules.get("sitecustomize"), "__file__", None),
    }))
"""


def _probe(out: str) -> dict[str, Any]:
    import json

    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def test_hook_unset_costs_nothing_and_still_chains(tmp_path: Path, other_site: Path) -> None:
    hook = str(autoregion.hook_dir())
    for value in (None, "", "0"):
        extra = {} if value is None else {"KREX_AUTO_REGION": value}
        r = _py(PROBE, _env(hook, other_site, **extra), tmp_path)
        assert r.returncode == 0, r.stderr
        got = _probe(r.stdout)
        assert not any("autoregion" in f for f in got["finders"])
        assert got["krex"] == []  # not even `import krex`
        assert got["other"] == str(other_site / "sitecustomize.py")
        assert got["site"] == str(other_site / "sitecustomize.py")
        assert r.stderr == ""


def test_hook_twice_on_the_path_runs_each_sitecustomize_once(tmp_path: Path, other_site: Path) -> None:
    (other_site / "sitecustomize.py").write_text(
        "import builtins\nbuiltins.OTHER_SITECUSTOMIZE = getattr(builtins, 'OTHER_SITECUSTOMIZE', 0) + 1\n"
    )
    link = tmp_path / "hook-link"
    link.symlink_to(autoregion.hook_dir(), target_is_directory=True)
    for value in ("", "userbench:bench"):
        r = _py(PROBE, _env(autoregion.hook_dir(), link, other_site, KREX_AUTO_REGION=value), tmp_path)
        assert r.returncode == 0 and "Error" not in r.stderr, r.stderr
        assert _probe(r.stdout)["other"] == 1


def test_hook_alone_on_the_path_is_harmless(tmp_path: Path) -> None:
    r = _py(PROBE, _env(autoregion.hook_dir()), tmp_path)
    assert r.returncode == 0 and r.stderr == ""
    assert _probe(r.stdout)["krex"] == []


def test_hook_set_installs_wraps_and_chains(tmp_path: Path, other_site: Path) -> None:
    code = (
        PROBE
        + """
    import userbench
    from krex.proc import autoregion
    assert getattr(userbench.bench, autoregion.MARK) == "userbench:bench"
    assert userbench.bench(3) == 6
    print([e["state"] for e in autoregion.status()])
    """
    )
    env = _env(autoregion.hook_dir(), other_site, tmp_path / "fakes", KREX_AUTO_REGION="userbench:bench")
    r = _py(code, env, tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    got = _probe(lines[0])
    assert got["finders"][0] == "krex.proc.autoregion.hook._Finder"
    assert got["other"] == str(other_site / "sitecustomize.py")
    assert lines[-1] == "['wrapped']"
    assert "not running under KREX" in r.stderr  # region() outside KREX: a no-op that warns once


def test_hook_malformed_value_reports_and_goes_on(tmp_path: Path, other_site: Path) -> None:
    r = _py(PROBE, _env(autoregion.hook_dir(), other_site, KREX_AUTO_REGION="module:"), tmp_path)
    assert r.returncode == 0
    assert "Error in sitecustomize" in r.stderr and "UsageError" in r.stderr
    assert "names no function" in r.stderr and "fix:" in r.stderr
    got = _probe(r.stdout)
    assert got["other"] == str(other_site / "sitecustomize.py")  # the chain still ran
    assert not any("autoregion._Finder" in f for f in got["finders"])


# ------------------------------------------------------------------ the real torch Timer (CPU wheel)

REAL_TIMER = """
    import json
    import krex
    from krex.proc import autoregion

    log = []

    class Recorder:
        def __enter__(self):
            log.append("enter"); return self
        def __exit__(self, *exc):
            log.append("exit")

    krex.region = Recorder
    autoregion.install("torch_timer")
    from torch.utils.benchmark import Timer

    def work():
        log.append("stmt")

    out = {}
    m = Timer(stmt="work()", globals={"work": work}).timeit(number=500)
    out["timeit"] = [log.index("enter"), log.count("stmt"), log.index("exit"), m.number_per_run]
    for meth in ("blocked_autorange", "adaptive_autorange"):
        log.clear()
        m = getattr(Timer(stmt="work()", globals={"work": work}), meth)(min_run_time=0.01)
        i, j = log.index("enter"), log.index("exit")
        out[meth] = [i, log[i:j].count("stmt"), m.number_per_run * len(m.raw_times), j == len(log) - 1]
    log.clear()
    try:
        Timer(stmt="pass").repeat()
    except NotImplementedError:
        out["repeat"] = log
    out["status"] = sorted({e["state"] for e in autoregion.status()})
    print(json.dumps(out))
"""


def test_real_torch_timer(tmp_path: Path) -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (pip install torch, the CPU wheel is enough)")
    r = _py(REAL_TIMER, _env(), tmp_path)
    assert r.returncode == 0, r.stderr
    out = _probe(r.stdout)
    enter, stmts, exit_, number = out["timeit"]
    assert enter == 5 and stmts == 5 + 500 and exit_ == 5 + 1 + 500 and number == 500  # warm-up 500 // 100
    for meth in ("blocked_autorange", "adaptive_autorange"):
        enter, inside, measured, exits_last = out[meth]
        assert enter > 0 and inside == measured and exits_last
    assert out["repeat"] == []
    assert out["status"] == ["wrapped"]


# ------------------------------------------------------------------ real Triton and torch on a GPU

REAL_TRITON = """
    import json, sys
    try:
        import torch
        import triton
        import triton.language as tl
        import triton.testing
        ok = torch.cuda.is_available()
    except ImportError as e:
        ok = False
    if not ok:
        print(json.dumps({"skip": "needs torch with CUDA, triton and a GPU"}))
        sys.exit(0)
    import krex
    from krex.proc import autoregion

    log = []

    class Recorder:
        def __enter__(self):
            log.append("enter"); return self
        def __exit__(self, *exc):
            log.append("exit")

    krex.region = Recorder
    autoregion.install("do_bench,do_bench_cudagraph,torch_timer")  # triton.testing: already imported

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    x = torch.zeros(1 << 22, device="cuda")
    a = torch.randn(2048, 2048, device="cuda")

    def fn():
        log.append("fn")
        add_one[(x.numel() // 1024,)](x, x.numel(), BLOCK=1024)  # compiled on the first call
        return a @ a

    def split():
        i, j = log.index("enter"), log.index("exit")
        return {"before": log[:i].count("fn"), "inside": log[i:j].count("fn"), "after": log[j:].count("fn"),
                "regions": log.count("enter")}

    out = {"versions": [torch.__version__, triton.__version__]}
    times = triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="all")
    out["do_bench"] = dict(split(), n=len(times))
    log.clear()
    ms, q = triton.testing.do_bench(fn), triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8])
    out["types"] = [type(ms).__name__, type(q).__name__, len(q), log.count("enter")]
    log.clear()
    with torch.cuda.stream(torch.cuda.Stream()):
        g_times = triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="all")
    out["cudagraph"] = dict(split(), n=len(g_times))
    from torch.utils.benchmark import Timer

    log.clear()
    m = Timer(stmt="fn()", globals={"fn": fn}).timeit(number=50)
    out["timeit"] = dict(split(), n=m.number_per_run)
    log.clear()
    m = Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.1)
    out["blocked_autorange"] = dict(split(), n=m.number_per_run * len(m.raw_times))
    out["status"] = {e["target"]: e["state"] for e in autoregion.status()}
    print(json.dumps(out))
"""


@pytest.mark.gpu
def test_real_triton_and_torch_on_a_gpu(tmp_path: Path) -> None:
    script = tmp_path / "real_triton.py"  # @triton.jit needs its source in a file
    script.write_text(textwrap.dedent(REAL_TRITON))
    r = subprocess.run(
        [sys.executable, str(script)], env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr
    out = _probe(r.stdout)
    if "skip" in out:
        pytest.skip(out["skip"])
    db = out["do_bench"]
    assert db["regions"] == 1 and db["inside"] == db["n"] and db["after"] == 0
    assert db["before"] >= 1 + 5 + 1  # compile call, estimate, at least one warm-up call
    assert out["types"][:3] == ["float", "list", 3] and out["types"][3] == 2
    cg = out["cudagraph"]
    assert cg["regions"] == 1 and cg["inside"] == 0 and cg["n"] == 10  # captured before, replayed inside
    for meth in ("timeit", "blocked_autorange"):
        assert out[meth]["inside"] == out[meth]["n"] and out[meth]["before"] > 0
    assert set(out["status"].values()) == {"wrapped"}


def test_entering_a_target_announces_its_region_before_the_warm_up(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The outermost call of a wrapped target says a region comes soon (krexd shrinks the
    siblings' queues during the warm-up), once, before anything of the harness runs."""
    import krex.proc.autoregion.core as core

    monkeypatch.setattr(core, "soon", lambda: sandbox.log.append("soon"))
    autoregion.install("do_bench")
    import triton.testing as tt

    sandbox.reset()
    tt.do_bench(sandbox.fn(), warmup=10, rep=20)
    before, _inside, _after = sandbox.between()
    assert before[0] == "soon" and sandbox.log.count("soon") == 1, sandbox.log
