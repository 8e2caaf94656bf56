"""krex's pytest plugin with the real pytest-benchmark: under `krex run`, every
benchmark fixture call is a region (the journal and --report count them); outside
KREX, or with --krex-regions=off, nothing changes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pytest_benchmark")

KREX = [sys.executable, "-m", "krex.cli.main"]
TESTS = """
import time

def work(n):
    return sum(range(n))

def test_plain(benchmark):
    assert benchmark(work, 1000) == 499500

def test_pedantic(benchmark):
    assert benchmark.pedantic(work, args=(10,), rounds=3, warmup_rounds=1) == 45

def test_no_benchmark():
    time.sleep(0.01)
"""


def _pytest(
    env: dict[str, str], cwd: Path, *extra: str, under_krex: bool
) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-s",
        "--benchmark-max-time=0.05",
        "--benchmark-min-rounds=2",
        *extra,
        "test_b.py",
    ]
    report = cwd / "report.json"
    if under_krex:
        cmd = [*KREX, "run", "--device", "sim", "--report", str(report), "--", *cmd]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


def test_benchmark_fixture_calls_are_regions_under_krex(krex_env: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "test_b.py").write_text(TESTS)
    p = _pytest(krex_env, tmp_path, under_krex=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "krex: regions around pytest-benchmark timing (wrapped)" in p.stdout
    rep = json.loads((tmp_path / "report.json").read_text())
    assert len(rep["regions"]) == 2 and rep["contaminated_regions"] == 0, rep["regions"]

    off = _pytest(krex_env, tmp_path, "--krex-regions=off", under_krex=True)
    assert off.returncode == 0, off.stdout + off.stderr
    assert "krex: regions" not in off.stdout
    assert json.loads((tmp_path / "report.json").read_text())["regions"] == []


def test_plugin_is_silent_outside_krex(krex_env: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "test_b.py").write_text(TESTS)
    env = {k: v for k, v in krex_env.items() if not k.startswith("KREX_")}
    p = _pytest(env, tmp_path, under_krex=False)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "plugins: krex-" in p.stdout  # loaded through its entry point ...
    assert "krex:" not in p.stdout and "krex" not in p.stderr.lower()  # ... and silent
