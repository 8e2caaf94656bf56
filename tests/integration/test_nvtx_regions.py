"""KREX_NVTX_REGION: NVTX ranges of an unmodified C++ harness (tests/c/nvtx_ranges.cpp,
NVTX v3 headers) become regions under `krex run` and `krex env`, on the simulated GPU;
ranges that do not match pass through; another NVTX tool configured before KREX still
gets every range."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import CC, REPO

KREX = [sys.executable, "-m", "krex.cli.main"]
# What tests/c/nvtx_ranges.cpp opens, by the name of the range that is a region under
# the pattern "k-*" (its outermost matching range on that thread).
EXPECTED = ["k-push", "k-outer", "k-in-other", "k-ex", "k-wide-??", "k-reg", "k-cpp", "k-cpp-domain",
            "k-start", "k-cross", "k-after-cross", "k-thread", "k-thread", "k-host", "k-handed"]
# Each mark the program prints, and the region it must fall in (None: none).
MARK_REGION = {"k-push": "k-push", "other-push": None, "k-inner": "k-outer", "k-in-other": "k-in-other",
               "k-ex": "k-ex", "k-wide": "k-wide-??", "k-reg": "k-reg", "k-cpp": "k-cpp",
               "k-cpp-domain": "k-cpp-domain", "k-start": "k-start", "k-cross": "k-cross",
               "k-after-cross": "k-after-cross", "k-thread": "k-thread", "k-start-nested": "k-host",
               "k-push-in-handed": "k-handed", "other-start": None}


@pytest.fixture
def prog(bins: dict[str, Path]) -> Path:
    if "nvtx_ranges" not in bins:
        pytest.skip("no NVTX v3 headers (nvtx3/nvToolsExt.h of a CUDA toolkit) on this machine")
    return bins["nvtx_ranges"]


def _run(
    env: dict[str, str], prog: Path, report: Path, **extra: str
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    p = subprocess.run([*KREX, "run", "--device", "sim", "--report", str(report), "--", str(prog)],
                       env={**env, **extra}, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    marks = [json.loads(x) for x in p.stdout.splitlines() if x.strip()]
    assert marks[-1] == {"done": True}
    return marks[:-1], json.loads(report.read_text())


def _check_marks(marks: list[dict[str, Any]], regions: list[dict[str, Any]]) -> None:
    for m in marks:
        inside = [r["label"] for r in regions if r["t_grant_ns"] <= m["ns"] <= r["t_end_ns"]]
        want = MARK_REGION[m["name"]]
        assert inside == ([f"nvtx:{want}"] if want else []), (m, inside)


def test_matching_ranges_of_every_kind_become_regions(krex_env: dict[str, str], prog: Path,
                                                      tmp_path: Path) -> None:
    marks, rep = _run(krex_env, prog, tmp_path / "r.json", KREX_NVTX_REGION="k-*")
    regions = rep["regions"]
    assert sorted(r["label"] for r in regions) == sorted(f"nvtx:{n}" for n in EXPECTED)
    assert all(r["region_s"] > 0 and not r["cut"] for r in regions)
    _check_marks(marks, regions)
    threads = {m["tid"] for m in marks if m["name"] == "k-thread"}
    assert len(threads) == 2  # two threads, a region each, one after the other
    t = sorted((r["t_grant_ns"], r["t_end_ns"]) for r in regions if r["label"] == "nvtx:k-thread")
    assert t[0][1] <= t[1][0]


def test_a_pattern_list_and_ranges_that_do_not_match(
    krex_env: dict[str, str], prog: Path, tmp_path: Path
) -> None:
    _, rep = _run(krex_env, prog, tmp_path / "a.json", KREX_NVTX_REGION="k-push, k-cpp*")
    assert sorted(r["label"] for r in rep["regions"]) == ["nvtx:k-cpp", "nvtx:k-cpp-domain", "nvtx:k-push"]
    marks, rep = _run(krex_env, prog, tmp_path / "b.json", KREX_NVTX_REGION="nothing-matches")
    assert rep["regions"] == [] and len(marks) == len(MARK_REGION) + 1  # k-thread twice
    _, rep = _run(krex_env, prog, tmp_path / "c.json")  # no KREX_NVTX_REGION: NVTX untouched
    assert rep["regions"] == []


def test_another_nvtx_tool_still_sees_every_range(
    krex_env: dict[str, str], prog: Path, tmp_path: Path
) -> None:
    tool = tmp_path / "libtool.so"
    subprocess.run([CC, "-shared", "-fPIC", "-O2", "-o", str(tool), str(REPO / "tests/c/lib/nvtx_tool.c")],
                   check=True)
    alone = tmp_path / "alone.json"
    p = subprocess.run([str(prog)], env={**krex_env, "NVTX_INJECTION64_PATH": str(tool),
                                         "NVTX_TOOL_OUT": str(alone),
                                         "LD_LIBRARY_PATH": str(REPO / "krex/_lib")},
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    chained = tmp_path / "chained.json"
    marks, rep = _run(krex_env, prog, tmp_path / "r.json", KREX_NVTX_REGION="k-*",
                      NVTX_INJECTION64_PATH=str(tool), NVTX_TOOL_OUT=str(chained))
    counts = json.loads(chained.read_text())
    assert counts == json.loads(alone.read_text())
    assert counts["pushes"] > 0 and counts["starts"] == 5 and counts["regs"] == 1
    assert sorted(r["label"] for r in rep["regions"]) == sorted(f"nvtx:{n}" for n in EXPECTED)
    _check_marks(marks, rep["regions"])


def test_krex_env_gives_an_unmodified_process_its_nvtx_regions(krex_env: dict[str, str], prog: Path) -> None:
    out = subprocess.run([*KREX, "env", "--device", "sim", "--nvtx-region", "k-push"], env=krex_env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    env = dict(krex_env)
    for line in out.splitlines():
        k, _, v = line.partition("=")
        env[k] = v.strip("'")
    assert env["KREX_NVTX_REGION"] == "k-push"
    p = subprocess.run([str(prog)], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    journal = Path(env["KREX_STATE_DIR"]) / "journal.jsonl"
    labels = [json.loads(x).get("label") for x in journal.read_text().splitlines()]
    assert labels == ["nvtx:k-push"]


def test_outside_krex_the_variable_changes_nothing(prog: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KREX_", "NVTX_"))}
    env.update(KREX_NVTX_REGION="k-*", LD_PRELOAD=str(REPO / "krex/_lib/libkrex_interpose.so"),
               LD_LIBRARY_PATH=str(REPO / "krex/_lib"), KREX_SIM_SHM=f"/krex-nvtx-out-{os.getpid()}")
    p = subprocess.run([str(prog)], env=env, capture_output=True, text=True, timeout=60)
    Path(f"/dev/shm/krex-nvtx-out-{os.getpid()}").unlink(missing_ok=True)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
