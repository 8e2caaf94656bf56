"""Automatic regions for unmodified harnesses: ``KREX_AUTO_REGION``.

    eval "$(krex env --export)"
    KREX_AUTO_REGION=do_bench python bench.py

``krex/proc/_hook/sitecustomize.py`` (on PYTHONPATH) calls :func:`install` at
interpreter start when the variable is set. Under KREX, unless the variable is "0" or
names it, it also installs ``inductor``, once Inductor's benchmarker is imported
(docs/auto-regions.md).
:func:`install` (hook.py) puts an import hook (a ``sys.meta_path`` finder) in
front of the import system; right after a target module has been executed the hook
replaces the target function or method with a wrapper. A target whose module is
already imported is wrapped at once.

Built-in targets and what their wrapper puts inside the region (one module each):

- ``do_bench`` (do_bench.py, ``triton.testing.do_bench``): the timed repetitions, from the
  first L2 flush of the timed loop through the final synchronize and the event
  reads. The compile call, the runtime estimate and the warm-up run outside.
- ``do_bench_cudagraph`` (do_bench_cudagraph.py): the graph replays (and their synchronizes) after the
  benchmark graph has been captured; warm-up, estimate and capture run outside.
- ``torch_timer`` (torch_timer.py, ``torch.utils.benchmark.Timer``): ``timeit(number)``: the timed
  ``number``-iteration call (its small warm-up call runs outside);
  ``blocked_autorange`` / ``adaptive_autorange``: the measurement loop after the
  block-size estimate; ``repeat``: from its first timed call.
- ``kernelbench`` (kernelbench.py, KernelBench's ``time_execution_with_cuda_event``,
  ``..._host_time``, ``..._do_bench_impl`` and ``..._nsight_python`` in
  ``kernelbench.timing``, ``kernelbench.eval``, ``src.timing``, ``src.eval``): the
  per-trial loop (for nsight_python_time: the profiled runs) after the last warm-up
  call. Also wraps ``do_bench``, which KernelBench's "do_bench" timing method calls.
- ``inductor`` (inductor.py, Inductor's autotuning benchmarker): every GPU benchmark call, through
  torch's own hook ``torch._inductor.runtime.benchmarking.set_gpu_benchmark_lock_context``
  (a context factory; nested entry on one thread is a no-op). A factory registered
  before keeps running, outside the region. A torch without the hook gets its
  ``TritonBenchmarker`` / ``InductorBenchmarker.benchmark_gpu`` wrapped whole.
- ``pytest_benchmark`` (pytest_benchmark.py, pytest-benchmark's fixture): ``BenchmarkFixture._raw`` and
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
The shared machinery (Target, state, patching, the probes that find the boundary)
is core.py; what KREX_AUTO_REGION names is targets.py. The library never prints."""

from krex.proc.autoregion.core import (
    CUDAGRAPH,
    DO_BENCH,
    ENV_VAR,
    INDUCTOR,
    KERNELBENCH,
    MARK,
    STATUS_DIR_ENV,
    TIMER_FIRST,
    TIMER_LOOP,
    TIMER_TIMEIT,
    WHOLE,
    Target,
    status,
)
from krex.proc.autoregion.hook import install, installed, uninstall
from krex.proc.autoregion.targets import BUILTINS, parse
from krex.proc.envvars import hook_dir

__all__ = [
    "BUILTINS",
    "CUDAGRAPH",
    "DO_BENCH",
    "ENV_VAR",
    "INDUCTOR",
    "KERNELBENCH",
    "MARK",
    "STATUS_DIR_ENV",
    "TIMER_FIRST",
    "TIMER_LOOP",
    "TIMER_TIMEIT",
    "WHOLE",
    "Target",
    "hook_dir",
    "install",
    "installed",
    "parse",
    "status",
    "uninstall",
]
