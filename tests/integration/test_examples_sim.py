"""The examples in examples/sim run on the simulated GPU and behave as documented.

* victim.c compiles without CUDA headers and times kernels through every --api path;
* two victims sharing one simulated device never overlap in the trace;
* sim_example.py times kernels and copies, and --contend shows inflation;
* the C snippets of docs/simulated-gpu.md compile and launch what the doc says.

Times are real (the simulator sleeps), so bounds are loose; the one strict
comparison (contended > alone) is a logical property of the time-slicing model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from krex.native import sim_dir

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "sim"
APIS = ["rt", "drv", "drv-dlsym", "drv-gpa", "drv-entry", "hip"]
# The simulated entry point each --api value must reach.
LAUNCHED = {
    "rt": "cudaLaunchKernel",
    "drv": "cuLaunchKernel",
    "drv-dlsym": "cuLaunchKernel",
    "drv-gpa": "cuLaunchKernel",
    "drv-entry": "cuLaunchKernel",
    "hip": "hipLaunchKernel",
}
KERNEL = 0  # "cls" of kernels in the trace (KREX_CLS_KERNEL)
COPY = 1

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def victim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc})")
    lib = sim_dir()
    out = tmp_path_factory.mktemp("victim") / "victim"
    cmd = [cc, "-O2", "-Wall", "-Werror", "-I", str(ROOT / "interpose"), str(EXAMPLES / "victim.c"),
           "-L", str(lib), f"-Wl,-rpath,{lib}", "-lcudart", "-lcuda", "-l:libamdhip64.so", "-ldl",
           "-o", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT)
    return out


@pytest.fixture
def sim_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """Environment for one test: its own device timeline and trace file."""
    shm = f"/krex-test-ex-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KREX_") and k not in ("LD_PRELOAD", "CUDA_VISIBLE_DEVICES",
                                                      "HIP_VISIBLE_DEVICES")}  # fmt: skip
    env["KREX_SIM_SHM"] = shm
    env["KREX_SIM_TRACE"] = str(tmp_path / "trace.jsonl")
    yield env
    Path("/dev/shm", shm.lstrip("/")).unlink(missing_ok=True)


def trace_ops(env: dict[str, str], cls: int | None = KERNEL) -> list[dict[str, Any]]:
    path = Path(env["KREX_SIM_TRACE"])
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in recs if r.get("ev") == "op" and (cls is None or r["cls"] == cls)]


def run_json(cmd: list[str], env: dict[str, str], timeout: float = 30) -> dict[str, Any]:
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert p.returncode == 0, f"{cmd} exited {p.returncode}: {p.stderr}"
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    assert lines, f"{cmd} printed nothing; stderr: {p.stderr}"
    out = json.loads(lines[-1])
    assert isinstance(out, dict)
    return out


@pytest.mark.parametrize("api", APIS)
def test_victim_every_api(victim: Path, sim_env: dict[str, str], api: str) -> None:
    us, iters = 200, 20
    out = run_json([str(victim), "--api", api, "--us", str(us), "--iters", str(iters)], sim_env)
    assert out["api"] == api and out["us"] == us and out["iters"] == iters
    assert isinstance(out["mean_us"], float)
    assert 0.9 * us <= out["mean_us"] <= 20 * us
    pid = out["pid"]
    ops = [o for o in trace_ops(sim_env) if o["pid"] == pid]
    # The warm-up kernel plus the timed ones, all through the expected entry point, each us long.
    assert len(ops) == iters + 1
    assert {o["api"] for o in ops} == {LAUNCHED[api]}
    assert all(o["end"] - o["start"] == us * 1000 for o in ops)


def test_victim_region_without_shim_is_noop(victim: Path, sim_env: dict[str, str]) -> None:
    out = run_json([str(victim), "--region", "--us", "50", "--iters", "10"], sim_env)
    assert out["region"] is True and out["region_rc"] == 0
    assert 0.9 * 50 <= out["mean_us"] <= 20 * 50


def test_victim_reports_simulated_errors(victim: Path, sim_env: dict[str, str]) -> None:
    env = dict(sim_env, KREX_SIM_RC="3")  # every gated call returns 3
    p = subprocess.run([str(victim), "--iters", "2"], env=env, capture_output=True, text=True, timeout=30)
    assert p.returncode == 1
    assert "failed with error 3" in p.stderr


def test_two_victims_never_overlap(victim: Path, sim_env: dict[str, str]) -> None:
    us = 100
    cmds = [[str(victim), "--api", api, "--us", str(us), "--iters", "10", "--seconds", "1"]
            for api in ("rt", "drv-gpa")]  # fmt: skip
    procs = [subprocess.Popen(c, env=sim_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in cmds]  # fmt: skip
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=30)
        assert p.returncode == 0, stderr
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    pids = {o["pid"] for o in outs}
    # (A LIFE call of no cost, a drain helper's retain of a live context, uses no GPU time.)
    ops = sorted((o for o in trace_ops(sim_env, cls=None) if o["end"] > o["start"]), key=lambda o: o["start"])
    assert {o["pid"] for o in ops} == pids and len(pids) == 2
    # One simulated GPU runs one operation at a time, whoever submitted it.
    for a, b in pairwise(ops):
        assert a["end"] <= b["start"], f"overlap: {a} and {b}"
    # Not vacuous: the two processes really were interleaved on the device.
    switches = sum(a["pid"] != b["pid"] for a, b in pairwise(ops))
    assert switches >= 10
    for o in outs:
        assert 0.9 * us <= o["mean_us"] <= 20 * us


def example(*args: str) -> list[str]:
    return [sys.executable, str(EXAMPLES / "sim_example.py"), *args]


def test_sim_example_alone(sim_env: dict[str, str]) -> None:
    out = run_json(example("--us", "200", "--iters", "10", "--reps", "3", "--bytes", "50000"), sim_env)
    assert 0.9 * 200 <= out["kernel_mean_us"] <= 20 * 200
    assert 0.9 * 50 <= out["copy_mean_us"] <= 20 * 50  # 1 ns per byte
    ops = trace_ops(sim_env, cls=None)
    kernels = [o for o in ops if o["api"] == "cudaLaunchKernel"]
    copies = [o for o in ops if o["api"] == "cudaMemcpyAsync"]
    assert len(kernels) == 1 + 3 * 10 and len(copies) == 10
    assert all(o["end"] - o["start"] == 200_000 for o in kernels)
    assert all(o["cls"] == COPY and o["end"] - o["start"] == 50_000 for o in copies)


def test_sim_example_contend(sim_env: dict[str, str]) -> None:
    out = run_json(example("--contend", "--us", "200", "--iters", "10", "--reps", "5"), sim_env)
    alone, contended = out["alone_mean_us"], out["contended_mean_us"]
    assert 0.9 * 200 <= alone <= 20 * 200
    assert contended > alone
    # The hammer really ran on the same simulated device.
    pids = {o["pid"] for o in trace_ops(sim_env)}
    assert pids == {out["pid"], out["hammer_pid"]}


def doc_snippets() -> tuple[str, list[tuple[str, list[str]]]]:
    """The C snippets of docs/simulated-gpu.md: the file-scope prelude, then each
    statement block with the trace `api` names its "Trace:" line promises."""
    text = (ROOT / "docs" / "simulated-gpu.md").read_text()
    section = text.split("### C snippets", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"((?:(?!```).)*?)```c\n(.*?)```", section, flags=re.S)
    prelude = blocks[0][1]
    out = []
    for before, code in blocks[1:]:
        m = re.findall(r"Trace: (.*?)\.\s*$", before.strip(), flags=re.S)
        assert m, f"no 'Trace:' line before snippet:\n{code}"
        out.append((code, re.findall(r"`(\w+)`", m[-1])))
    return prelude, out


def test_doc_snippets_launch_what_they_say(sim_env: dict[str, str], tmp_path: Path) -> None:
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc})")
    prelude, snippets = doc_snippets()
    assert len(snippets) >= 9
    # Each snippet in its own block; a device synchronise (a "sync" trace line) after each.
    body = "\n".join("    {\n" + code + "    }\n    cudaDeviceSynchronize();" for code, _ in snippets)
    src = tmp_path / "snippets.c"
    src.write_text(prelude + "\ncudaError_t cudaDeviceSynchronize(void);\nint main(void) {\n" + body
                   + "\n    return 0;\n}\n")  # fmt: skip
    lib = sim_dir()
    exe = tmp_path / "snippets"
    subprocess.run([cc, "-O2", "-Wall", "-Werror", "-I", str(ROOT / "interpose"), str(src), "-L", str(lib),
                    f"-Wl,-rpath,{lib}", "-lcudart", "-lcuda", "-l:libamdhip64.so", "-ldl", "-o", str(exe)],
                   check=True)  # fmt: skip
    subprocess.run([str(exe)], env=sim_env, check=True, timeout=30)
    recs = [json.loads(ln) for ln in Path(sim_env["KREX_SIM_TRACE"]).read_text().splitlines()]
    got: list[list[dict[str, Any]]] = [[]]
    for r in recs:
        if r["ev"] == "sync":
            got.append([])
        elif r["ev"] == "op":
            got[-1].append(r)
    assert len(got) == len(snippets) + 1 and got[-1] == []
    for (code, want), ops in zip(snippets, got[:-1], strict=True):
        assert [o["api"] for o in ops] == want, code
        assert all(o["end"] - o["start"] == 100_000 for o in ops), code  # 100 us / 100000 bytes
