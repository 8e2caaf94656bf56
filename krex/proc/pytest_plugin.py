"""pytest plugin: KREX regions around pytest-benchmark's timing.

Installed with krex (entry point ``pytest11``), so it loads in every pytest run; it
does nothing unless pytest-benchmark is in use and the process runs under KREX
(``krex run -- pytest ...`` or an opted-in environment). Then each ``benchmark(fn)``
and ``benchmark.pedantic(fn, ...)`` call runs inside ``krex.region()``: exclusive
GPU for its calibration, warm-up and rounds; the rest of the test (imports, setup,
input generation, assertions) shares the GPU.

  --krex-regions=auto   (default) on under KREX, off elsewhere
  --krex-regions=on     on even without KREX (regions are then no-ops that warn once)
  --krex-regions=off    never

Same as ``KREX_AUTO_REGION=pytest_benchmark`` (krex.proc.autoregion), without having to
set it. The import of this module costs nothing but pytest's own."""

from __future__ import annotations

import os
from typing import Any

MODES = ("auto", "on", "off")


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("krex", "KREX (GPU exclusivity for timed regions)")
    group.addoption(
        "--krex-regions",
        choices=MODES,
        default=None,
        help="regions around pytest-benchmark timing: auto (under KREX), on, off; default: auto "
        "(or the KREX_PYTEST_REGIONS environment variable)",
    )


def _mode(config: Any) -> str:
    m = config.getoption("krex_regions", None) or os.environ.get("KREX_PYTEST_REGIONS") or "auto"
    return m if m in MODES else "auto"


def _active(config: Any) -> bool:
    mode = _mode(config)
    if mode == "off":
        return False
    pm = config.pluginmanager
    if not (pm.hasplugin("benchmark") or pm.hasplugin("pytest_benchmark.plugin")):
        return False  # pytest-benchmark's entry point is named "benchmark"
    if mode == "on":
        return True
    from krex.proc.region import under_krex

    return under_krex()


def pytest_configure(config: Any) -> None:
    active = _active(config)
    config._krex_regions = active  # read by the report header
    if active:
        from krex.proc import autoregion

        autoregion.install("pytest_benchmark")


def pytest_report_header(config: Any) -> str | None:
    if not getattr(config, "_krex_regions", False):
        return None
    from krex.proc import autoregion

    states = sorted({e["state"] for e in autoregion.status() if e["builtin"] == "pytest_benchmark"})
    return f"krex: regions around pytest-benchmark timing ({', '.join(states) or 'pending'})"
