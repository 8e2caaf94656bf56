"""Automatic regions for Inductor's autotuning benchmarker (torch's
set_gpu_benchmark_lock_context hook), KernelBench's nsight_python_time and
pytest-benchmark's fixture.

The fakes are real packages in a temporary directory, so the import hook runs for
real. They follow the control flow of the upstream sources: torch's
torch/_inductor/runtime/benchmarking.py (the hook, maybe_gpu_benchmark_lock, the
gpu_benchmark_lock decorator on TritonBenchmarker/InductorBenchmarker.benchmark_gpu,
InductorBenchmarker delegating to the cudagraph variant), KernelBench's
src/kernelbench/timing.py time_execution_with_nsight_python, and pytest-benchmark's
BenchmarkFixture (__call__ -> _raw: calibrate, warm up, rounds; pedantic ->
_raw_pedantic). krex.region is a recorder that logs "enter"/"exit"."""

from __future__ import annotations

import contextlib
import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.fakes import FAKE_INDUCTOR_HOOK

import krex
from krex.errors import UsageError
from krex.proc import autoregion

PREFIXES = ("torch", "kernelbench", "hlog", "triton", "inhouse_bench")

FAKES = {
    "hlog.py": """
        LOG = []
    """,
    "torch/__init__.py": "",
    "torch/_inductor/__init__.py": "",
    "torch/_inductor/runtime/__init__.py": "",
    "torch/_inductor/runtime/benchmarking.py": FAKE_INDUCTOR_HOOK
    + textwrap.dedent("""
        import hlog

        class Benchmarker:
            @gpu_benchmark_lock
            def benchmark_gpu_with_cuda_graph(self, _callable, **kwargs):
                hlog.LOG.append("capture")
                return self.benchmark_gpu(_callable, **kwargs)

        class TritonBenchmarker(Benchmarker):
            @gpu_benchmark_lock
            def benchmark_gpu(self, _callable, **kwargs):
                hlog.LOG.append("do_bench")
                _callable()
                return 1.0

        class InductorBenchmarker(TritonBenchmarker):
            cudagraph = False
            _in = False

            def benchmark_gpu_with_cuda_graph(self, _callable, **kwargs):
                self._in = True
                try:
                    return super().benchmark_gpu_with_cuda_graph(_callable, **kwargs)
                finally:
                    self._in = False

            @gpu_benchmark_lock
            def benchmark_gpu(self, _callable, **kwargs):
                if self.cudagraph and not self._in:
                    return self.benchmark_gpu_with_cuda_graph(_callable, **kwargs)
                hlog.LOG.append("events")
                _callable()
                return 2.0

        benchmarker = InductorBenchmarker()
    """),
    "kernelbench/__init__.py": "",
    "kernelbench/profile.py": """
        import hlog

        def profile_with_nsight(fn, metrics, num_trials):
            hlog.LOG.append("ncu")
            for _ in range(num_trials):
                fn()
            return {"gpu__time_duration.sum": 1500000.0}
    """,
    "kernelbench/timing.py": """
        import hlog

        def time_execution_with_nsight_python(kernel_fn, args, num_warmup=3, num_trials=10,
                                              discard_first=1, verbose=True, device=None):
            from kernelbench.profile import profile_with_nsight
            for _ in range(num_warmup):
                kernel_fn(*args)
                hlog.LOG.append("sync")
            hlog.LOG.append("empty_cache")
            def wrapped_kernel():
                return kernel_fn(*args)
            metric_values = profile_with_nsight(wrapped_kernel, metrics=["gpu__time_duration.sum"],
                                                num_trials=num_trials)
            return [metric_values["gpu__time_duration.sum"] / 1_000_000.0]
    """,
    # ---- Triton's driver (what a do_bench fork flushes the L2 cache through)
    "triton/__init__.py": "from . import runtime\n",
    "triton/runtime/__init__.py": """
        import hlog

        class CudaDriver:
            def get_empty_cache_for_benchmark(self):
                return object()
            def clear_cache(self, cache):
                hlog.LOG.append("clear")

        class _Config:
            active = CudaDriver()

        driver = _Config()
    """,
    # ---- an in-house fork of Triton's do_bench (docs/inhouse-do-bench.md)
    "inhouse_bench.py": """
        import hlog
        from triton import runtime

        def do_bench(fn, warmup=3, rep=5, flush=True):
            fn()                                   # compile
            hlog.LOG.append("sync")
            cache = runtime.driver.active.get_empty_cache_for_benchmark()
            for _ in range(warmup):
                fn()
            times = []
            for _ in range(rep):
                if flush:
                    runtime.driver.active.clear_cache(cache)
                hlog.LOG.append("record")
                fn()
                hlog.LOG.append("record")
                times.append(1.0)
            hlog.LOG.append("sync")
            return min(times)
    """,
}
# pytest-benchmark's fixture module path is pytest_benchmark.fixture; the fake lives under
# that name too, so the built-in target finds it.
FAKES["pytest_benchmark/__init__.py"] = ""
FAKES["pytest_benchmark/fixture.py"] = """
    import hlog

    class BenchmarkFixture:
        def __init__(self):
            self._mode = None
            self.rounds = []

        def _make_runner(self, function_to_benchmark, args, kwargs):
            def runner(loops_range):
                hlog.LOG.append("timer")
                for _ in loops_range or range(1):
                    function_to_benchmark(*args, **kwargs)
                hlog.LOG.append("timer")
                return 0.001
            return runner

        def __call__(self, function_to_benchmark, *args, **kwargs):
            self._mode = "benchmark(...)"
            return self._raw(function_to_benchmark, *args, **kwargs)

        def pedantic(self, target, args=(), kwargs=None, setup=None, teardown=None, rounds=1,
                     warmup_rounds=0, iterations=1):
            self._mode = "benchmark.pedantic(...)"
            return self._raw_pedantic(target, args=args, kwargs=kwargs, setup=setup, teardown=teardown,
                                      rounds=rounds, warmup_rounds=warmup_rounds, iterations=iterations)

        def _raw(self, function_to_benchmark, *args, **kwargs):
            runner = self._make_runner(function_to_benchmark, args, kwargs)
            hlog.LOG.append("calibrate")
            runner(range(1))
            for _ in range(2):
                self.rounds.append(runner(range(1)))
            return function_to_benchmark(*args, **kwargs)

        def _raw_pedantic(self, target, args=(), kwargs=None, setup=None, teardown=None, rounds=1,
                          warmup_rounds=0, iterations=1):
            kwargs = kwargs or {}
            for _ in range(warmup_rounds + rounds):
                self._make_runner(target, args, kwargs)(None)
            return target(*args, **kwargs)
"""


@pytest.fixture
def log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    def fake(name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in (*PREFIXES, "pytest_benchmark"))

    saved = {n: m for n, m in sys.modules.items() if fake(n)}
    for n in saved:
        del sys.modules[n]
    for rel, src in FAKES.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(src))
    monkeypatch.syspath_prepend(str(tmp_path))
    entries: list[str] = importlib.import_module("hlog").LOG

    class Recorder:
        depth = 0

        def __init__(self, label: str | None = None, soft: bool = False) -> None:
            self.label = label

        def __enter__(self) -> Recorder:
            # the real krex.region is a no-op when nested on one thread: record only the outermost
            Recorder.depth += 1
            if Recorder.depth == 1:
                entries.append("enter")
            return self

        def __exit__(self, *exc: object) -> None:
            Recorder.depth -= 1
            if Recorder.depth == 0:
                entries.append("exit")

    monkeypatch.setattr(krex, "region", Recorder)
    autoregion.uninstall()
    try:
        yield entries
    finally:
        autoregion.uninstall()
        for n in [n for n in sys.modules if fake(n)]:
            del sys.modules[n]
        sys.modules.update(saved)


def _status(name: str) -> dict[str, str]:
    return next(e for e in autoregion.status() if e["target"] == name)


INDUCTOR = "torch._inductor.runtime.benchmarking:set_gpu_benchmark_lock_context"


def test_inductor_hook_puts_each_benchmark_in_one_region(log: list[str]) -> None:
    autoregion.install("inductor")
    from torch._inductor.runtime import benchmarking as b

    assert _status(INDUCTOR)["state"] == "wrapped"
    assert b.benchmarker.benchmark_gpu(lambda: log.append("kernel")) == 2.0
    assert log == ["enter", "events", "kernel", "exit"]
    log.clear()
    # cudagraph benchmarking delegates benchmark_gpu -> with_cuda_graph -> benchmark_gpu: one region
    b.benchmarker.cudagraph = True
    b.benchmarker.benchmark_gpu(lambda: log.append("kernel"))
    assert log == ["enter", "capture", "events", "kernel", "exit"]
    log.clear()
    b.TritonBenchmarker().benchmark_gpu(lambda: log.append("kernel"))
    assert log == ["enter", "do_bench", "kernel", "exit"]


def test_inductor_hook_keeps_a_harness_context_and_uninstalls(log: list[str]) -> None:
    from torch._inductor.runtime import benchmarking as b

    @contextlib.contextmanager
    def harness_lock() -> Iterator[None]:
        log.append("lock")
        yield
        log.append("unlock")

    b.set_gpu_benchmark_lock_context(harness_lock)
    autoregion.install("inductor")  # the module is imported already: registered at once
    assert "runs first" in _status(INDUCTOR)["detail"]
    b.benchmarker.benchmark_gpu(lambda: None)
    assert log == ["lock", "enter", "events", "exit", "unlock"]
    autoregion.uninstall()
    assert b._gpu_benchmark_lock_context is harness_lock
    log.clear()
    b.benchmarker.benchmark_gpu(lambda: None)
    assert log == ["lock", "events", "unlock"]


def test_torch_without_the_hook_wraps_benchmark_gpu_whole(log: list[str], tmp_path: Path) -> None:
    src = tmp_path / "torch/_inductor/runtime/benchmarking.py"
    text = src.read_text().replace("def set_gpu_benchmark_lock_context", "def _renamed_in_this_version")
    src.write_text(text)
    autoregion.install("inductor")
    from torch._inductor.runtime import benchmarking as b

    st = _status(INDUCTOR)
    assert st["state"] == "whole" and "InductorBenchmarker.benchmark_gpu" in st["detail"]
    b.benchmarker.benchmark_gpu(lambda: None)
    assert log == ["enter", "events", "exit"]


def test_kernelbench_nsight_python_time_profiled_runs_inside(log: list[str]) -> None:
    autoregion.install("kernelbench")
    from kernelbench import timing

    calls: list[int] = []
    out = timing.time_execution_with_nsight_python(
        lambda *a: calls.append(1), [1], num_warmup=3, num_trials=4
    )
    assert out == [1.5]
    i, j = log.index("enter"), log.index("exit")
    # from the return of the last warm-up call (as for cuda_event): the profiled runs inside
    assert log[:i] == ["sync"] * 2
    assert log[i + 1 : j] == ["sync", "empty_cache", "ncu"] and len(calls) == 3 + 4


def test_pytest_benchmark_fixture_calls_are_regions(log: list[str]) -> None:
    autoregion.install("pytest_benchmark")
    from pytest_benchmark.fixture import BenchmarkFixture

    bm = BenchmarkFixture()
    assert bm(lambda x: x * 2, 21) == 42
    assert log[0] == "enter" and log[-1] == "exit" and log.count("enter") == 1
    assert "calibrate" in log and log.count("timer") == 6
    log.clear()
    assert BenchmarkFixture().pedantic(lambda: 7, rounds=3, warmup_rounds=1) == 7
    assert log == ["enter", *["timer"] * 8, "exit"]
    states = {e["state"] for e in autoregion.status() if e["builtin"] == "pytest_benchmark"}
    assert states == {"wrapped"}


def test_all_includes_the_new_harnesses() -> None:
    names = {t.source for t in autoregion.parse("all")}
    assert {"inductor", "pytest_benchmark", "kernelbench"} <= names
    assert any(t.qualname == "time_execution_with_nsight_python" for t in autoregion.parse("kernelbench"))


def test_inhouse_do_bench_fork_with_the_do_bench_strategy(log: list[str]) -> None:
    autoregion.install("inhouse_bench:do_bench@do_bench")
    import inhouse_bench

    n: list[int] = []
    assert inhouse_bench.do_bench(lambda: (n.append(1), log.append("fn")), warmup=3, rep=4) == 1.0
    i, j = log.index("enter"), log.index("exit")
    assert log[:i] == ["fn", "sync", "fn", "fn", "fn"]  # compile and warm-up outside
    assert log[i + 1 : j] == ["clear", "record", "fn", "record"] * 4 + ["sync"]
    assert _status("inhouse_bench:do_bench")["state"] == "wrapped"
    # A fork that does not flush between warm-up and timed loop: no boundary, so from then on
    # the whole call is the region, and status says so.
    log.clear()
    inhouse_bench.do_bench(lambda: log.append("fn"), warmup=1, rep=2, flush=False)
    assert "enter" not in log  # that one call ran without a region (it was not recognised)
    assert _status("inhouse_bench:do_bench")["state"] == "whole"
    log.clear()
    inhouse_bench.do_bench(lambda: log.append("fn"), warmup=1, rep=1, flush=False)
    assert log[0] == "enter" and log[-1] == "exit"


def test_user_strategy_is_checked() -> None:
    assert autoregion.parse("m.bench:f@kernelbench")[0].strategy == autoregion.KERNELBENCH
    assert autoregion.parse("m.bench:f")[0].strategy == autoregion.WHOLE
    with pytest.raises(UsageError, match="unknown strategy 'fast'"):
        autoregion.parse("m.bench:f@fast")
