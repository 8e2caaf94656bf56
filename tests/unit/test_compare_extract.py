"""krex.compare.extract (a run's figure from its output) and krex.compare.pyperf_export
(the runs as pyperf JSON, loaded back with pyperf itself)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from krex.compare.design import block_order
from krex.compare.extract import FigureNotFound, parse_figure, parse_key_path
from krex.compare.pyperf_export import pyperf_documents, write_pyperf
from krex.compare.run import Comparison, RunFigure
from krex.compare.stats import plan_looks
from krex.errors import UsageError

KERNELBENCH_OUT = """\
Running with config ...
[INFO] Evaluating kernel against reference code (LOCAL)
========================================
[Eval] Kernel eval result: compiled=True correctness=True metadata={'hardware': 'NVIDIA H200'} runtime=0.131 \
runtime_stats={'mean': 0.131, 'std': 0.002}
----------------------------------------
[Timing] PyTorch Reference Eager exec time: 0.25 ms
[Timing] PyTorch Reference torch.compile time: 0.2 ms
[Timing] Custom Kernel exec time: 0.131 ms
----------------------------------------
[Speedup] Speedup over eager: 1.91x
"""

PYTEST_BENCHMARK = {
    "machine_info": {"node": "x"},
    "benchmarks": [
        {"name": "test_mm", "stats": {"min": 0.0011, "median": 0.0012, "mean": 0.00125}},
        {"name": "test_add", "stats": {"min": 0.0001, "median": 0.0002, "mean": 0.00021}},
    ],
}


def test_kernelbench_preset_reads_the_custom_kernel_time_and_else_the_runtime() -> None:
    src = parse_figure("kernelbench")
    assert src.read(KERNELBENCH_OUT) == pytest.approx(0.131) and src.unit == "ms"
    only_result = "[Eval] Kernel eval result: compiled=True correctness=True runtime=0.42 runtime_stats={}\n"
    assert src.read(only_result) == pytest.approx(0.42)


def test_do_bench_preset_takes_the_last_ms_figure_or_a_bare_number() -> None:
    src = parse_figure("do_bench")
    assert src.read("warm-up 3.0 ms\ncandidate: 0.512 ms\n") == pytest.approx(0.512)
    assert src.read("compiling...\n0.0875\n") == pytest.approx(0.0875)
    assert src.read("time: 1.5e-02 ms") == pytest.approx(0.015)
    with pytest.raises(FigureNotFound, match="no match"):
        src.read("nothing here\n")


def test_pytest_benchmark_preset_and_key_paths() -> None:
    text = json.dumps(PYTEST_BENCHMARK, indent=2)
    assert parse_figure("pytest-benchmark").read(text) == pytest.approx(0.0012)
    assert parse_figure("json:benchmarks[name=test_add].stats.min").read(text) == pytest.approx(0.0001)
    assert parse_figure("json:benchmarks[1].stats.mean").read(text) == pytest.approx(0.00021)
    assert parse_key_path("a.0.b[2][k=v].c") == ["a", 0, "b", 2, ("k", "v"), "c"]


def test_json_figure_from_the_last_json_line_among_logs() -> None:
    out = 'log line\n{"mean_us": 1.0}\nmore log\n{"mean_us": 512.5, "pid": 3}\ntime: 0.5 ms\n'
    assert parse_figure("json:mean_us").read(out) == pytest.approx(512.5)
    with pytest.raises(FigureNotFound, match="no JSON document"):
        parse_figure("json:missing").read(out)


def test_regex_figure_and_bad_input_are_usage_errors_with_a_fix() -> None:
    assert parse_figure(r"re:took (\d+) us").read("took 12 us\ntook 14 us\n") == 14
    assert parse_figure(r"re:\d+\.\d+").read("a 1.25 b") == pytest.approx(1.25)
    for bad in ("nope", "re:(unclosed", "json:"):
        with pytest.raises(UsageError) as e:
            parse_figure(bad)
        assert e.value.fix
    with pytest.raises(FigureNotFound, match="not a positive number"):
        parse_figure("json:v").read('{"v": 0}')
    with pytest.raises(UsageError, match="unit"):
        parse_figure("json:v", unit="minutes")


def test_blocks_are_palindromes_of_a_random_order() -> None:
    import random

    rng = random.Random(1)
    seen = set()
    for b in range(20):
        slots = block_order(3, b, rng)
        seq = [s.candidate for s in slots]
        assert seq[:3] == seq[3:][::-1] and sorted(seq[:3]) == [0, 1, 2]
        # every candidate's two runs sit at the same mean position in the block
        pos = {c: [s.position for s in slots if s.candidate == c] for c in range(3)}
        assert all(sum(p) == 5 for p in pos.values())
        seen.add(tuple(seq[:3]))
    assert len(seen) > 1  # randomized, not a fixed rotation


def _comparison(values: dict[int, list[float]], unit: str = "ms") -> Comparison:
    src = parse_figure("json:t", unit=unit)
    cmp = Comparison(["base", "fast"], [["./a"], ["./b", "--x"]], src, 0.95, 10, None, 1,
                     plan_looks(3, 5, 0.05, 1), started_at=1_800_000_000.0)
    for c, vs in values.items():
        for i, v in enumerate(vs):
            cmp.runs.append(RunFigure(c, i // 2, i % 2, v, 1.5, 0.2, 1))
    cmp.runs.append(RunFigure(1, 9, 0, None, 1.0, 0.1, 1, left_out="region flagged: region-core"))
    return cmp


def test_pyperf_documents_hold_one_benchmark_per_candidate_in_seconds() -> None:
    docs = pyperf_documents(_comparison({0: [1.0, 1.1, 0.9], 1: [0.5, 0.52, 0.49]}))
    assert set(docs) == {"base", "fast"}
    d = docs["fast"]
    assert d["version"] == "1.0"
    (bench,) = d["benchmarks"]
    assert bench["metadata"] == {"name": "krex-compare", "unit": "second", "loops": 1}
    # the left-out run is not there
    assert [r["values"] for r in bench["runs"]] == [[pytest.approx(v)] for v in (0.0005, 0.00052, 0.00049)]
    assert all(r["metadata"]["duration"] == 1.5 for r in bench["runs"])
    with pytest.raises(UsageError, match="unit"):
        no_unit = parse_figure("json:t")
        pyperf_documents(Comparison(["a", "b"], [["a"], ["b"]], no_unit, 0.95, 10, None, 1, []))


def test_pyperf_loads_the_files_and_compare_to_reads_them(tmp_path: Path) -> None:
    pyperf = pytest.importorskip("pyperf")
    values = {0: [1.0, 1.1, 0.9, 1.05, 0.95, 1.0], 1: [0.5, 0.52, 0.49, 0.51, 0.5, 0.5]}
    paths = write_pyperf(_comparison(values), tmp_path)
    suite = pyperf.BenchmarkSuite.load(str(paths[1]))
    bench = suite.get_benchmark("krex-compare")
    assert bench.get_nvalue() == 6 and bench.get_unit() == "second"
    assert bench.median() == pytest.approx(0.0005)
    p = subprocess.run([sys.executable, "-m", "pyperf", "compare_to", *map(str, paths)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "faster" in p.stdout
