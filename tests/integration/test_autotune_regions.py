"""Inductor's autotuning benchmarks get regions of their own under KREX without any
setting: on the H200, a torch.compile'd kernel whose autotuning ran
outside regions was built 22% slower in 5 of 12 runs, in 0 of 12 with them
(docs/results/autotune-regions/). Real `krex run`, real krexd, the simulated GPU; torch is a
fake package (the control flow of torch/_inductor/runtime/benchmarking.py, as in
tests/unit/test_harnesses.py), its benchmark making one gated GPU call."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.fakes import FAKE_INDUCTOR_HOOK

KREX = [sys.executable, "-m", "krex.cli.main"]

BENCHMARKING = FAKE_INDUCTOR_HOOK + """
class InductorBenchmarker:
    @gpu_benchmark_lock
    def benchmark_gpu(self, _callable, **kwargs):
        _callable()
        return 1.0

benchmarker = InductorBenchmarker()
"""

# One autotuning benchmark per candidate config, each one launch on the simulated GPU.
COMPILE = """
import sys
sys.path.insert(0, sys.argv[1])
from cp_worker import Gpu
from torch._inductor.runtime import benchmarking
g = Gpu()
for config in range(3):
    benchmarking.benchmarker.benchmark_gpu(lambda: (g.kernel(10), g.synchronize()))
print("done")
"""


@pytest.fixture
def fake_torch(tmp_path: Path) -> Path:
    root = tmp_path / "fakes"
    for rel, text in {
        "torch/__init__.py": "",
        "torch/_inductor/__init__.py": "",
        "torch/_inductor/runtime/__init__.py": "",
        "torch/_inductor/runtime/benchmarking.py": BENCHMARKING,
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return root


def _run(
    env: dict[str, str], fakes: Path, tmp_path: Path, auto: str | None
) -> tuple[dict[str, object], str]:
    e = dict(env, PYTHONPATH=str(fakes))
    e.pop("KREX_AUTO_REGION", None)
    if auto is not None:
        e["KREX_AUTO_REGION"] = auto
    rep = tmp_path / f"report-{auto}.json"
    helpers = Path(__file__).resolve().parents[1] / "helpers"
    p = subprocess.run(
        [*KREX, "run", "--device", "sim", "--report", str(rep), "--", sys.executable, "-c", COMPILE,
         str(helpers)],
        env=e,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0 and "done" in p.stdout, p.stderr
    return json.loads(rep.read_text()), p.stderr


def test_autotuning_benchmarks_get_regions_without_any_setting(
    krex_env: dict[str, str], fake_torch: Path, tmp_path: Path
) -> None:
    report, err = _run(krex_env, fake_torch, tmp_path, None)
    regions = report["regions"]
    assert isinstance(regions, list) and len(regions) == 3, report
    assert all(not r["contaminated"] for r in regions), [r["reasons"] for r in regions]
    assert "KREX_AUTO_REGION" not in err, err  # the implicit target is no setting to warn about


def test_krex_auto_region_0_turns_them_off(
    krex_env: dict[str, str], fake_torch: Path, tmp_path: Path
) -> None:
    report, _err = _run(krex_env, fake_torch, tmp_path, "0")
    assert report["regions"] == [], report


def test_a_setting_of_its_own_keeps_the_implicit_target(
    krex_env: dict[str, str], fake_torch: Path, tmp_path: Path
) -> None:
    """A harness's own target (`do_bench`, `kernelbench`) does not cover autotuning, so the
    implicit `inductor` comes with it: on the H200 the CPU-heavy family, run with
    KREX_AUTO_REGION=do_bench, built a 16.6% slower kernel in 2 of 12 krex runs without it.
    `do_bench,inductor` names it outright; `0` turns everything off."""
    for value in ("do_bench", "do_bench,inductor", "kernelbench"):
        report, _err = _run(krex_env, fake_torch, tmp_path, value)
        regions = report["regions"]
        assert isinstance(regions, list) and len(regions) == 3, (value, report)


def test_outside_krex_the_hook_does_nothing(fake_torch: Path) -> None:
    """The hook directory on PYTHONPATH without KREX: no finder, the module is torch's own."""
    from helpers import clean_env

    from krex.node.optin import hook_dir

    code = (
        "import sys\nfrom torch._inductor.runtime import benchmarking as b\n"
        "print(b._gpu_benchmark_lock_context is None,"
        " any('Implicit' in type(f).__name__ for f in sys.meta_path))"
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(clean_env(), PYTHONPATH=f"{hook_dir()}:{fake_torch}"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0 and p.stdout.split() == ["True", "False"], (p.stdout, p.stderr)


# ---------------------------------------------------------------- the implicit target breaks nothing
# The implicit target must never break a program nor wait for a region of its own command.

HELPERS = Path(__file__).resolve().parents[1] / "helpers"

# The user's command holds its own region and, inside it, runs a worker process of the
# same command (Inductor's autotune_in_subproc / a compile worker / a user's subprocess)
# whose code calls Inductor's benchmarker. Without the implicit target the worker's benchmark
# just runs (same slot: the gate is the command's own). With it, a worker that asked krexd for
# a region of its own would queue behind the parent's region while the parent waits for the
# worker: a deadlock until --max-region (60 s default) cuts the user's region.
PARENT = """
import subprocess, sys, time
import krex
CHILD = '''
import sys
sys.path.insert(0, sys.argv[1])
from cp_worker import Gpu
from torch._inductor.runtime import benchmarking
g = Gpu()
benchmarking.benchmarker.benchmark_gpu(lambda: (g.kernel(10), g.synchronize()))
print("child done")
'''
t0 = time.monotonic()
with krex.region() as r:
    try:
        p = subprocess.run([sys.executable, "-c", CHILD, sys.argv[1]], timeout=float(sys.argv[2]))
        print("child rc", p.returncode, "after", round(time.monotonic() - t0, 1))
    except subprocess.TimeoutExpired:
        print("HUNG: the worker's benchmark waited for the region its parent holds")
print("clean", r.clean, "cut", r.cut)
"""

THREADED = """
import sys, threading
sys.path.insert(0, sys.argv[1])
import krex
from cp_worker import Gpu
from torch._inductor.runtime import benchmarking
g = Gpu()
def tune():
    benchmarking.benchmarker.benchmark_gpu(lambda: (g.kernel(10), g.synchronize()))
with krex.region():
    t = threading.Thread(target=tune, daemon=True)
    t.start()
    t.join(float(sys.argv[2]))
    print("HUNG" if t.is_alive() else "thread done")
"""


def _krex_run(env: dict[str, str], fakes: Path, code: str, limit: float) -> subprocess.CompletedProcess[str]:
    e = dict(env, PYTHONPATH=str(fakes))
    e.pop("KREX_AUTO_REGION", None)
    return subprocess.run(
        [*KREX, "run", "--device", "sim", "--", sys.executable, "-c", textwrap.dedent(code), str(HELPERS),
         str(limit)],
        env=e, capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize(
    "code, done", [(PARENT, "child done"), (THREADED, "thread done")], ids=["process", "thread"]
)
def test_a_benchmark_inside_its_commands_own_region_does_not_hang(
    krex_env: dict[str, str], fake_torch: Path, code: str, done: str
) -> None:
    """A worker process of the command, or another thread of the process, benchmarks while
    the user's region holds the GPU: no region of its own (it would wait for that one)."""
    p = _krex_run(krex_env, fake_torch, code, 10)
    assert p.returncode == 0, p.stderr
    assert "HUNG" not in p.stdout and done in p.stdout, (p.stdout, p.stderr[-2000:])


def test_krex_auto_region_0_control(krex_env: dict[str, str], fake_torch: Path) -> None:
    """Control: with KREX_AUTO_REGION=0 (no implicit target) the worker finishes."""
    e = dict(krex_env, PYTHONPATH=str(fake_torch), KREX_AUTO_REGION="0")
    p = subprocess.run(
        [*KREX, "run", "--device", "sim", "--", sys.executable, "-c", textwrap.dedent(PARENT), str(HELPERS),
         "10"],
        env=e, capture_output=True, text=True, timeout=120,
    )
    assert p.returncode == 0 and "child done" in p.stdout and "HUNG" not in p.stdout, (p.stdout, p.stderr)


def _in_pidns(env: dict[str, str], fakes: Path, auto: str | None) -> subprocess.CompletedProcess[str]:
    e = dict(env, PYTHONPATH=str(fakes))
    e.pop("KREX_AUTO_REGION", None)
    if auto is not None:
        e["KREX_AUTO_REGION"] = auto
    return subprocess.run(
        [*KREX, "run", "--device", "sim", "--", "unshare", "-p", "-f", "--mount-proc", sys.executable, "-c",
         COMPILE, str(HELPERS)],
        env=e, capture_output=True, text=True, timeout=120,
    )


def test_autotuning_in_a_pid_namespace_of_its_own_is_not_broken(
    krex_env: dict[str, str], fake_torch: Path
) -> None:
    """A command that runs its Python in a pid namespace of its own (a container runtime,
    `unshare -p`): KREX_AUTO_REGION=0 (no implicit target) works; the implicit
    target must not make the user's autotuning fail."""
    off = _in_pidns(krex_env, fake_torch, "0")
    assert off.returncode == 0 and "done" in off.stdout, off.stderr[-2000:]
    on = _in_pidns(krex_env, fake_torch, None)
    assert on.returncode == 0 and "done" in on.stdout, on.stderr[-3000:]


def test_a_target_that_never_engaged_is_still_warned_about(
    krex_env: dict[str, str], fake_torch: Path, tmp_path: Path
) -> None:
    """KREX_AUTO_REGION=do_bench, but the harness never calls triton.testing.do_bench (its own
    copy, a fork): its timings had no region, and `krex run` says so even though Inductor's
    implicit autotuning regions were made."""
    e = dict(krex_env, PYTHONPATH=str(fake_torch), KREX_AUTO_REGION="do_bench")
    rep = tmp_path / "report.json"
    p = subprocess.run(
        [*KREX, "run", "--device", "sim", "--report", str(rep), "--", sys.executable, "-c", COMPILE,
         str(Path(__file__).resolve().parents[1] / "helpers")],
        env=e, capture_output=True, text=True, timeout=120,
    )
    assert p.returncode == 0 and "done" in p.stdout, p.stderr
    report = json.loads(rep.read_text())
    auto = report.get("auto_region") or {}
    do_bench = [t for t in auto.get("targets", []) if t.get("builtin") == "do_bench"]
    assert do_bench and all(t["regions"] == 0 for t in do_bench), auto
    assert "KREX_AUTO_REGION='do_bench' was set but" in p.stderr, (
        f"do_bench never made a region, yet no warning; regions={len(report['regions'])}, "
        f"stderr={p.stderr[-600:]!r}"
    )


# A torch without the hook: Inductor's benchmarker class only (KREX wraps benchmark_gpu whole).
BENCHMARKING_OLD = """
class InductorBenchmarker:
    def benchmark_gpu(self, _callable, **kwargs):
        _callable()
        return 1.0

benchmarker = InductorBenchmarker()
"""
NATIVE = Path(sys.executable).with_name("krex")


@pytest.mark.parametrize("torch_has_hook", [True, False], ids=["hook", "fallback"])
@pytest.mark.parametrize("front", ["python", "native"])
def test_krex_run_says_which_inductor_path_ran(
    krex_env: dict[str, str], fake_torch: Path, tmp_path: Path, torch_has_hook: bool, front: str
) -> None:
    """Not only in --report: `krex run`'s closing notes say whether Inductor's autotuning
    benchmarks were regions through torch's set_gpu_benchmark_lock_context hook, or through
    KREX's fallback wrapper (benchmark_gpu whole, on a torch without the hook)."""
    if front == "native" and not (NATIVE.exists() and NATIVE.read_bytes()[:4] == b"\x7fELF"):
        pytest.skip("the installed krex is not the native one")
    if not torch_has_hook:
        (fake_torch / "torch/_inductor/runtime/benchmarking.py").write_text(BENCHMARKING_OLD)
    e = dict(krex_env, PYTHONPATH=str(fake_torch))
    e.pop("KREX_AUTO_REGION", None)
    rep = tmp_path / "report.json"
    helpers = Path(__file__).resolve().parents[1] / "helpers"
    krex = [str(NATIVE)] if front == "native" else KREX
    argv = [*krex, "run", "--device", "sim", "--report", str(rep), "--"]
    p = subprocess.run([*argv, sys.executable, "-c", COMPILE, str(helpers)], env=e, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and "done" in p.stdout, p.stderr
    report = json.loads(rep.read_text())
    path = "hook" if torch_has_hook else "fallback"
    assert report["inductor_regions"] == {path: 3}, report
    line = next((ln for ln in p.stderr.splitlines() if "Inductor" in ln), "")
    if torch_has_hook:
        assert "3 region(s)" in line and "set_gpu_benchmark_lock_context hook" in line, p.stderr
    else:
        assert "3 region(s)" in line and "fallback wrapper" in line, p.stderr
