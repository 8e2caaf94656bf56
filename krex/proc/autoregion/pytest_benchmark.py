"""pytest-benchmark's fixture: ``BenchmarkFixture._raw`` and ``_raw_pedantic`` (calibration,
warm-up and rounds) are each one whole region. krex's pytest plugin turns this on by
itself under KREX."""

from __future__ import annotations

from krex.proc.autoregion.core import WHOLE, Target

_PYTEST_BENCHMARK = "pytest_benchmark.fixture"
TARGETS = {
    "pytest_benchmark": (
        Target(_PYTEST_BENCHMARK, "BenchmarkFixture._raw", WHOLE, source="pytest_benchmark"),
        Target(_PYTEST_BENCHMARK, "BenchmarkFixture._raw_pedantic", WHOLE, source="pytest_benchmark"),
    ),
}
