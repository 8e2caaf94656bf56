"""KREX: region-granular GPU exclusivity for concurrent kernel benchmarking.

import krex
with krex.region():
    ...timed loop...

with krex.Executor() as ex:          # run benchmarking commands under KREX, as futures
    result = ex.submit(["python", "bench.py"]).result()
"""

import logging
from typing import TYPE_CHECKING, Any

from krex.proc.region import RegionWarning, region, under_krex

if TYPE_CHECKING:
    from krex.executor import CommandFailed, Executor, RegionRecord, RunResult

# The library logs to the `krex` logger and never prints; applications (the CLI,
# krexd) attach handlers. Without one, nothing is shown.
logging.getLogger("krex").addHandler(logging.NullHandler())

__version__ = "0.1.0"
__all__ = [
    "CommandFailed",
    "Executor",
    "RegionRecord",
    "RegionWarning",
    "RunResult",
    "region",
    "under_krex",
    "__version__",
]

# Imported on first use: a benchmark's `import krex` (for krex.region) stays as light as it was.
_LAZY = {"Executor", "RunResult", "RegionRecord", "CommandFailed"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from krex import executor

        return getattr(executor, name)
    raise AttributeError(f"module 'krex' has no attribute {name!r}")
