"""`krex bench --device sim --quick`, end to end through the CLI.

Real commands (examples/workloads/sim/sim_cmd.py) on the simulated GPU, natively and
under real `krex run` guardians and a private daemon (KREX_STATE_DIR, KREX_SHM and
KREX_SIM_SHM of the test's own; the daemon the bench starts is stopped by the bench,
and again at teardown). Only the STRUCTURE of the output is asserted: files, fields,
tables, labels, cells, resume. Never a speed: the simulated GPU is no evidence, and
this machine's timing is whatever it is."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import private_world

pytestmark = pytest.mark.timeout(420)

# Until cli/main.py calls register(), run the CLI with the command added the same way.
_WRAPPER = (
    "import sys; from krex.cli.main import cli, main; "
    "from krex.cli.bench_cmd import register; register(cli); main(sys.argv[1:])"
)
LABEL = "SIMULATED GPU - logic demo, not performance evidence"
CELLS = {"native-serial", "native-repeat", "unprotected-2", "krex-2"}
RAW_KEYS = {
    "v",
    "run",
    "cell",
    "mode",
    "c",
    "rep",
    "seq",
    "name",
    "family",
    "param",
    "device",
    "exit_status",
    "timed_out",
    "ok",
    "wall_s",
    "started_at",
    "ended_at",
    "result",
    "krex",
    "error",
}
RESULT_KEYS = {
    "name",
    "family",
    "param",
    "ms",
    "correct",
    "t_total_s",
    "t_region_s",
    "region_entry_s",
    "phases",
}


def krex_cmd() -> list[str]:
    from krex.cli.main import cli

    if "bench" in cli.commands:
        return [sys.executable, "-m", "krex.cli.main"]
    return [sys.executable, "-c", _WRAPPER]


def _cgroup_mounts() -> list[str]:
    from krex.node import mounts

    found = mounts.read_mounts()
    return mounts.cgroup2_mounts(found) + mounts.cgroup1_freezer_mounts(found)


@pytest.fixture
def krex_env() -> Iterator[dict[str, str]]:
    """A private daemon world; stops the daemon and removes what it left."""
    env = private_world("bn")
    try:
        yield env
    finally:
        subprocess.run([*krex_cmd(), "daemon", "stop"], env=env, capture_output=True, timeout=60)
        for name in (env["KREX_SHM"], env["KREX_SIM_SHM"]):
            Path("/dev/shm", name.lstrip("/")).unlink(missing_ok=True)
        for mount in _cgroup_mounts():
            root = Path(mount, env["KREX_SHM"].lstrip("/"))
            for d in sorted(root.glob("*"), reverse=True):
                with contextlib.suppress(OSError):
                    d.rmdir()
            with contextlib.suppress(OSError):
                root.rmdir()
        shutil.rmtree(env["KREX_STATE_DIR"], ignore_errors=True)


def krex(args: list[str], env: dict[str, str], timeout: float = 360) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*krex_cmd(), *args], env=env, capture_output=True, text=True, timeout=timeout)


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


BENCH = ["bench", "--device", "sim", "--quick", "--concurrency", "2", "--timeout", "40"]


def _check_results(out: Path, expect_cells: set[str]) -> dict[str, Any]:
    for name in ("meta.json", "raw.jsonl", "cells.jsonl", "summary.md", "summary.json"):
        assert (out / name).is_file(), name
    for png in ("throughput.png", "inflation_cdf.png", "flip_rates.png", "critical_fraction.png"):
        p = out / png
        assert p.is_file() and p.stat().st_size > 1000, png
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png

    meta = json.loads((out / "meta.json").read_text())
    assert meta["device"] == "sim" and meta["quick"] is True and meta["corpus_names"]
    n_cmds = len(meta["corpus_names"])
    cells = jsonl(out / "cells.jsonl")
    done = {c["cell"] for c in cells}
    assert done == expect_cells
    for c in cells:
        assert {
            "cell",
            "mode",
            "c",
            "run",
            "n_runs",
            "failures",
            "makespan_s",
            "started_at",
            "ended_at",
        } <= set(c)
        assert c["n_runs"] == n_cmds and c["makespan_s"] > 0
        assert c["node_busy"] is not None and 0 < c["node_busy"] <= 1, c  # the node worked meanwhile
        if c["mode"] == "krex" and c["carried_runs"] == 0:
            assert c["krexd_cpu_s"] is not None and c["krexd_cpu_s"] > 0, c  # krexd worked too
        elif c["mode"] != "krex":
            assert c["krexd_cpu_s"] is None, c

    runs = {c["run"] for c in cells}
    raw = [r for r in jsonl(out / "raw.jsonl") if r["run"] in runs]
    assert len(raw) == n_cmds * len(expect_cells)
    for r in raw:
        assert set(r) >= RAW_KEYS, RAW_KEYS - set(r)
        assert r["device"] == "sim" and r["cell"] in expect_cells
        assert r["wall_s"] is not None and r["wall_s"] > 0
        if r["ok"]:
            res = r["result"]
            assert set(res) >= RESULT_KEYS, RESULT_KEYS - set(res)
            assert res["correct"] is True and res["ms"] > 0 and res["simulated"] is True
            assert res["name"] == r["name"]
            assert 0 <= res["t_region_s"] <= res["t_total_s"]
            assert res["under_krex"] is (r["mode"] == "krex")
        else:
            assert r["error"]
    for cell in expect_cells:
        names = sorted(r["name"] for r in raw if r["cell"] == cell)
        assert names == sorted(meta["corpus_names"]), cell
    krex_runs = [r for r in raw if r["mode"] == "krex" and r["ok"]]
    assert krex_runs, "no krex run succeeded"
    for r in krex_runs:
        assert r["krex"] is not None and {"slot", "admission_wait_s", "regions"} <= set(r["krex"])
        assert len(r["krex"]["regions"]) == 1
        assert {"queue_wait_s", "entry_s", "contaminated", "flags", "cut"} <= set(r["krex"]["regions"][0])
        if r["result"]["region_entry_s"] is not None:  # (an automatic region's grant is not the command's)
            assert "grant" in r["result"] and "entry_s" in r["result"]["grant"]
        assert r["krex"]["simulated"] is True
    summ = json.loads((out / "summary.json").read_text())
    for cell, reg in summ["regions"].items():  # the trust columns: what KREX could not vouch for
        assert {"cut", "flags", "runs_without_region", "auto_wrapped"} <= set(reg), cell
        if cell.startswith("krex"):
            assert reg["runs_without_region"] == 0 and reg["regions"] > 0

    md = (out / "summary.md").read_text()
    assert md.count(LABEL) >= 2
    for heading in (
        "## Headline: goal, paper (NVIDIA H20) and ours",
        "## Throughput",
        "## Timing inflation against native-serial",
        "## Ranking fidelity",
        "### Kendall tau per family",
        "### Pairwise flip rate per true-gap class",
        "## Critical-region fraction",
        "## Region entry overhead and queue wait",
        "## Failures",
    ):
        assert heading in md, heading
    for figure in (
        "3.4x (16.0 -> 54.8 cmds/min)",
        "41.9 cmds/min",
        "0.30%",
        "1.58%",
        "3.90%",
        "0.857",
        "0.820",
        "0.432",
        "within 3 pp of native repeat",
        ">= 4.0x",
    ):
        assert figure in md, figure
    for cell in expect_cells:
        assert f"| {cell} |" in md, cell
    s = json.loads((out / "summary.json").read_text())
    assert s["simulated"] is True and s["label"] == LABEL
    assert {t["cell"] for t in s["throughput"]} == expect_cells
    assert set(s["inflation"]) == expect_cells - {"native-serial"}
    assert set(s["ranking"]) == expect_cells
    assert {"sim-a", "sim-b"} <= set(s["truth"])
    assert s["critical"]["n"] > 0 and s["headline"]["krex_cell"] == "krex-2"
    return s


def test_bench_sim_quick_end_to_end_and_resume(krex_env: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "results"
    p = krex([*BENCH, "--out", str(out)], krex_env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    # Not a TTY: plain progress lines, one per command run, no carriage returns.
    assert "\r" not in p.stderr
    n = len(json.loads((out / "meta.json").read_text())["corpus_names"])
    progress = [ln for ln in p.stderr.splitlines() if ln.startswith("krex bench: [")]
    assert len(progress) == 4 * n
    assert f"[{4 * n}/{4 * n}]" in p.stderr
    for cell in CELLS:
        assert f"krex bench: {cell}: {n} runs" in p.stderr
    # The summary table goes to stdout, labelled.
    assert LABEL in p.stdout and "krex-2" in p.stdout and "throughput vs native serial" in p.stdout
    _check_results(out, CELLS)
    # The daemon the bench started is gone again.
    assert not Path(krex_env["KREX_STATE_DIR"], "krexd.sock").exists()

    # A finished directory without --resume is refused (a usage error with a fix).
    p = krex([*BENCH, "--out", str(out)], krex_env, timeout=60)
    assert p.returncode == 2 and "--resume" in p.stderr and "fix:" in p.stderr

    # Resume: pretend the krex-2 cell never finished. Only it runs again; the others
    # are skipped; its earlier raw lines stay in raw.jsonl but no longer count.
    cells_file = out / "cells.jsonl"
    kept = [c for c in jsonl(cells_file) if c["cell"] != "krex-2"]
    old_run = next(c["run"] for c in jsonl(cells_file) if c["cell"] == "krex-2")
    cells_file.write_text("".join(json.dumps(c) + "\n" for c in kept))
    raw_before = len(jsonl(out / "raw.jsonl"))
    p = krex(
        ["bench", "--device", "sim", "--concurrency", "2", "--timeout", "40", "--resume", str(out)], krex_env
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for cell in CELLS - {"krex-2"}:
        assert f"{cell}: already in {out}, skipped" in p.stderr, cell
    assert f"krex bench: krex-2: {n} runs" in p.stderr
    assert sum(1 for ln in p.stderr.splitlines() if ln.startswith("krex bench: [")) == n
    raw_after = jsonl(out / "raw.jsonl")
    assert len(raw_after) == raw_before + n
    assert sum(1 for r in raw_after if r["run"] == old_run) == n
    new_run = next(c["run"] for c in jsonl(cells_file) if c["cell"] == "krex-2")
    assert new_run != old_run
    s = _check_results(out, CELLS)
    assert len(s["invocations"]) == 2

    # Resume when every asked cell is finished: nothing runs, the summary is written again.
    p = krex(
        [
            "bench",
            "--resume",
            str(out),
            "--device",
            "sim",
            "--concurrency",
            "2",
            "--modes",
            "native-serial",
            "--timeout",
            "40",
        ],
        krex_env,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "native-serial: already in" in p.stderr
    assert not [ln for ln in p.stderr.splitlines() if ln.startswith("krex bench: [")]


def test_bench_runs_the_fused_family_on_the_simulated_gpu(krex_env: dict[str, str], tmp_path: Path) -> None:
    """The fused family in a quick bench: each command times its chain through the harness's
    own KernelBench-style function, which KREX_AUTO_REGION wraps (one automatic region a run,
    100 trials); the command cannot see its region's entry, so the client entry reads n/a,
    while the journal's entry quantiles, the flag scores and the (simulated: n/a) NVML table
    are there."""
    out = tmp_path / "fused"
    p = krex(
        [*BENCH, "--only", "sim-fused", "--modes", "native-serial,native-repeat,krex", "--out", str(out)],
        krex_env,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    meta = json.loads((out / "meta.json").read_text())
    names = meta["corpus_names"]
    assert len(names) >= 2 and all(n.startswith("sim-fused-") for n in names)
    assert any("compiled" in n for n in names) and any("compiled" not in n for n in names)
    raw = jsonl(out / "raw.jsonl")
    assert len(raw) == 3 * len(names) and all(r["ok"] for r in raw), [r["error"] for r in raw]
    for r in raw:
        res = r["result"]
        assert res["trials"] == 100 and res["region_entry_s"] is None and res["t_region_s"] > 0
        assert res["region"].startswith("auto")
        if r["mode"] == "krex":
            kr = r["krex"]
            assert kr["auto_region"]["wrapped"] == ["_timing:time_execution_with_cuda_event"]
            assert len(kr["regions"]) == 1 and kr["regions"][0]["t_grant_ns"] > 0
            assert "nvml" not in kr["regions"][0]  # no NVML on the simulated GPU
        else:
            assert r["krex"] is None and res["under_krex"] is False
    s = json.loads((out / "summary.json").read_text())
    assert s["regions"]["krex-2"]["client_entry_s"]["n"] == 0
    assert s["critical"]["n"] == len(names)  # native-serial's runs: each printed its t_region_s
    assert s["entry"]["krex-2"]["regions"] == len(names) and s["entry"]["krex-2"]["entry_s"]["p99"] > 0
    assert s["flags"]["krex-2"]["runs"] == len(names)
    assert s["headline"]["krex_cells"] == ["krex-2"] and s["headline"]["tau_baseline"] is None
    assert any("NVML samples: none" in n for n in s["notes"])
    md = (out / "summary.md").read_text()
    assert "## Region entry quantiles (krex cells, from the journal)" in md
    assert "## Flags against native: precision and recall" in md
    row = next(ln for ln in md.splitlines() if ln.startswith("| krex-2 | not inflated |"))
    assert row.count("n/a") == 7, row
    overhead = md.split("## Region entry overhead")[1].splitlines()
    client = next(ln for ln in overhead if ln.startswith("| krex-2 |"))
    assert client.startswith("| krex-2 | n/a | n/a |"), client


def test_bench_usage_errors(krex_env: dict[str, str], tmp_path: Path) -> None:
    p = krex(["bench", "--device", "sim", "--resume", str(tmp_path)], krex_env, timeout=60)
    assert p.returncode == 3 and "no krex bench results" in p.stderr and "fix:" in p.stderr
    p = krex(
        ["bench", "--device", "sim", "--modes", "fast", "--out", str(tmp_path / "x")], krex_env, timeout=60
    )
    assert p.returncode == 2 and "unknown mode" in p.stderr
    p = krex(
        ["bench", "--device", "sim", "--concurrency", "0", "--out", str(tmp_path / "x")], krex_env, timeout=60
    )
    assert p.returncode == 2 and "concurrency" in p.stderr
    p = krex(
        ["bench", "--device", "sim", "--only", "no-such-command", "--out", str(tmp_path / "x")],
        krex_env,
        timeout=60,
    )
    assert p.returncode == 2 and "no sim workloads" in p.stderr
    assert "Traceback" not in p.stderr


def test_bench_sigterm_mid_serial_cell_keeps_its_runs(krex_env: dict[str, str], tmp_path: Path) -> None:
    """A bench killed (SIGTERM, as `timeout` sends) in the middle of native-serial: the
    resumed bench keeps the runs that finished and runs only the others; the cell's
    makespan adds the time those kept runs took."""
    import signal
    import time

    out = tmp_path / "results"
    args = [*krex_cmd(), "bench", "--device", "sim", "--quick", "--modes", "native-serial"]
    args += ["--timeout", "40", "--out", str(out)]
    proc = subprocess.Popen(args, env=krex_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    raw = out / "raw.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not raw.exists() or len(jsonl(raw)) < 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert not (out / "cells.jsonl").exists() or not jsonl(out / "cells.jsonl")
    # Its notes reached meta.json although it never got to write its report. The warm-up ran
    # one command of each family, none of them recorded.
    meta = json.loads((out / "meta.json").read_text())
    warm = [n for n in meta["notes"] if n.startswith("warm-up:")]
    assert len(warm) == 1, meta["notes"]
    names = [n.strip() for n in warm[0].split(":", 1)[1].split(",")[:-3]]  # (then: N at a time, ...)
    from krex.bench.corpus import default_corpus_path, load_corpus

    group = {w.name: w.family or str(w.script) for w in load_corpus(default_corpus_path(), "sim", quick=True)}
    assert all(n in group for n in names), (names, group)
    assert sorted(group[n] for n in names) == sorted(set(group.values())) and len(names) > 1, names
    assert f"warm-up done: {len(names)} of {len(names)} ran cleanly" in meta["notes"], meta["notes"]
    assert all(r["run"] != "warmup" for r in jsonl(raw))
    first = [r for r in jsonl(raw) if r["ok"]]
    k = len(first)
    n = len(json.loads((out / "meta.json").read_text())["corpus_names"])
    assert 3 <= k < n, (k, n)
    span = max(r["ended_at"] for r in first) - min(r["started_at"] for r in first)

    p = krex(
        ["bench", "--device", "sim", "--modes", "native-serial", "--timeout", "40", "--resume", str(out)],
        krex_env,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"native-serial: kept {k} runs of an unfinished earlier invocation" in p.stderr
    assert f"native-serial: {n - k} runs" in p.stderr
    assert sum(1 for ln in p.stderr.splitlines() if ln.startswith("krex bench: [")) == n - k
    (cell,) = jsonl(out / "cells.jsonl")
    assert cell["n_runs"] == n and cell["carried_runs"] == k
    final = [r for r in jsonl(raw) if r["run"] == cell["run"]]
    assert sorted(r["name"] for r in final) == sorted(
        json.loads((out / "meta.json").read_text())["corpus_names"]
    )
    kept = [r for r in final if r.get("ran_in") and r["ran_in"] != cell["run"]]
    assert {r["name"] for r in kept} == {r["name"] for r in first}
    assert cell["makespan_s"] >= span + (cell["ended_at"] - cell["started_at"]) - 1e-6
    s = json.loads((out / "summary.json").read_text())
    assert s["throughput"][0]["cell"] == "native-serial"


def test_bench_sim_gpus_spreads_c_per_gpu(krex_env: dict[str, str], tmp_path: Path) -> None:
    """--gpus 0,1 on a 2-GPU simulated node: each concurrent cell keeps C commands on each GPU
    (unprotected through CUDA_VISIBLE_DEVICES, krex through `krex run --gpu`), every record says
    its GPU, the kernels really ran on that device (trace), and the summary has fidelity per GPU."""
    env = dict(krex_env, KREX_SIM_GPUS="2", KREX_SIM_TRACE=str(tmp_path / "trace.jsonl"))
    out = tmp_path / "results"
    args = ["bench", "--device", "sim", "--quick", "--modes", "native-serial,unprotected,krex"]
    p = krex([*args, "--concurrency", "1", "--gpus", "0,1", "--timeout", "60", "--out", str(out)], env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["gpus"] == [0, 1]
    recs = jsonl(out / "raw.jsonl")
    for cell in ("unprotected-1", "krex-1"):
        gpus = [r["gpu"] for r in recs if r["cell"] == cell]
        assert set(gpus) == {0, 1}, (cell, gpus)
    assert {r["gpu"] for r in recs if r["cell"] == "native-serial"} == {0}
    # Each krex run's report names the GPU the daemon admitted it on: the one asked for.
    for r in recs:
        if r["cell"] == "krex-1" and r.get("krex"):
            assert r["krex"]["gpu"] == r["gpu"], r
    # Both simulated devices executed kernels.
    ops = [json.loads(ln) for ln in (tmp_path / "trace.jsonl").read_text().splitlines()]
    devs = {e["gpu"] for e in ops if e.get("ev") == "op"}
    assert {0, 1} <= devs, devs
    s = json.loads((out / "summary.json").read_text())
    assert set(s["inflation_per_gpu"]["krex-1"]) == {"0", "1"}
    assert "### Per GPU" in (out / "summary.md").read_text()
    # A GPU that is not there is a usage error with a fix, before anything runs.
    p = krex([*args, "--gpus", "0,5", "--out", str(tmp_path / "bad")], env, timeout=60)
    assert p.returncode == 2 and "--gpus" in p.stderr and "fix:" in p.stderr, p.stderr


def test_bench_resume_keeps_the_first_invocations_modes_and_concurrency(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "results"
    first = ["bench", "--device", "sim", "--quick", "--modes", "native-serial,krex", "--concurrency", "1"]
    p = krex([*first, "--timeout", "40", "--out", str(out)], krex_env)
    assert p.returncode == 0, p.stderr[-3000:]
    cells_file = out / "cells.jsonl"
    cells_file.write_text("".join(json.dumps(c) + "\n" for c in jsonl(cells_file) if c["cell"] != "krex-1"))
    # Resume with neither --modes nor --concurrency: only the unfinished krex-1 runs, not the
    # defaults' reference, native-repeat, unprotected-2/4 or krex-2/4.
    p = krex(["bench", "--device", "sim", "--timeout", "40", "--resume", str(out)], krex_env)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stderr.splitlines()
    started = {ln.split(":")[1].strip() for ln in lines if " runs, " in ln and "at a time" in ln}
    assert started == {"krex-1"}, p.stderr[-2000:]
    assert {c["cell"] for c in jsonl(cells_file)} == {"native-serial", "krex-1"}


def test_bench_compares_freeze_policies_side_by_side(krex_env: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "results"
    args = ["bench", "--device", "sim", "--quick", "--modes", "native-serial,krex", "--concurrency", "2"]
    p = krex([*args, "--freeze", "all,gpu", "--timeout", "60", "--out", str(out)], krex_env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    cells = {c["cell"] for c in jsonl(out / "cells.jsonl")}
    assert cells == {"native-serial", "krex-2@all", "krex-2@gpu"}
    recs = jsonl(out / "raw.jsonl")
    for policy in ("all", "gpu"):
        regions = [
            g
            for r in recs
            if r["cell"] == f"krex-2@{policy}"
            for g in (r.get("krex") or {}).get("regions", [])
        ]
        assert regions, policy
        assert {g["freeze_policy"] for g in regions} == {policy}
    s = json.loads((out / "summary.json").read_text())
    assert {t["cell"] for t in s["throughput"]} >= {"krex-2@all", "krex-2@gpu"}
    assert "krex-2@gpu" in (out / "summary.md").read_text()
    p = krex([*args, "--freeze", "some", "--out", str(tmp_path / "bad")], krex_env, timeout=60)
    assert p.returncode == 2 and "freeze policy" in p.stderr, p.stderr


def test_bench_compares_prewarmed_starts(krex_env: dict[str, str], tmp_path: Path) -> None:
    """--prewarm 0,1 at C=1: krex-1 never runs two commands at once; krex-1+pw1 runs a second
    one meanwhile (its own daemon: 1 slot, prewarm 1), whose GPU phase still waits for the slot:
    no two commands' regions overlap, and the pre-warmed ones report how long they waited."""
    out = tmp_path / "results"
    args = ["bench", "--device", "sim", "--quick", "--modes", "native-serial,krex", "--concurrency", "1"]
    p = krex([*args, "--prewarm", "0,1", "--timeout", "60", "--out", str(out)], krex_env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert {c["cell"] for c in jsonl(out / "cells.jsonl")} == {"native-serial", "krex-1", "krex-1+pw1"}
    meta = json.loads((out / "meta.json").read_text())
    assert meta["invocations"][0]["prewarms"] == [0, 1]
    assert any("prewarm 1" in n for n in meta["notes"]), meta["notes"]
    recs = jsonl(out / "raw.jsonl")

    def overlaps(cell: str) -> int:
        spans = sorted((r["started_at"], r["ended_at"]) for r in recs if r["cell"] == cell)
        return sum(1 for a, b in zip(spans, spans[1:], strict=False) if b[0] < a[1])

    assert overlaps("krex-1") == 0
    assert overlaps("krex-1+pw1") > 0, "no command started before the previous one ended"
    pw = [r["krex"] for r in recs if r["cell"] == "krex-1+pw1" and r.get("krex")]
    assert any((k.get("prewarm_s") or 0) > 0 for k in pw), pw
    # The pre-warmed command ran beside regions (a sibling to freeze), which stayed clean.
    regs = [g for k in pw for g in k.get("regions") or []]
    assert regs and not any(g.get("contaminated") for g in regs), regs
    assert any((g.get("siblings_frozen") or 0) > 0 for g in regs), regs
    s = json.loads((out / "summary.json").read_text())
    assert "krex-1+pw1" in {t["cell"] for t in s["throughput"]}
    bad = krex([*args, "--prewarm", "x", "--out", str(tmp_path / "bad")], krex_env, timeout=60)
    assert bad.returncode == 2 and "--prewarm" in bad.stderr and "fix:" in bad.stderr, bad.stderr


def test_bench_uses_a_running_daemon_that_fits(krex_env: dict[str, str], tmp_path: Path) -> None:
    """A daemon that runs already with the slots the krex cells need serves them: the bench
    neither starts another nor stops it, and names it in its notes."""
    started = krex(["daemon", "start", "--device", "sim", "--slots-per-gpu", "2"], krex_env, timeout=60)
    assert started.returncode == 0, started.stderr
    out = tmp_path / "results"
    args = ["bench", "--device", "sim", "--quick", "--only", "sim-a-0", "--modes", "krex"]
    p = krex([*args, "--concurrency", "1,2", "--timeout", "60", "--out", str(out)], krex_env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    notes = json.loads((out / "meta.json").read_text())["notes"]
    assert any("using the running KREX daemon" in n and "2 slot(s) per GPU" in n for n in notes), notes
    st = json.loads(krex(["daemon", "status", "--json"], krex_env, timeout=60).stdout)
    assert st["daemon"]["regions_done"] >= 2, "the krex cells did not run under the running daemon"


def test_bench_never_measures_under_a_daemon_with_fewer_slots(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    """A daemon that runs already with fewer slots than a krex cell's C (one an earlier
    `krex run` started on demand, say) would queue that cell's commands at admission. A
    simulated bench runs in a KREX world of its own instead (private state directory,
    segment and simulated GPU, with the slots it needs, removed at the end) and leaves the
    running daemon alone; a bench on real GPUs is refused, naming the daemon and the fix."""
    started = krex(["daemon", "start", "--device", "sim", "--slots-per-gpu", "1"], krex_env, timeout=60)
    assert started.returncode == 0, started.stderr
    pid = json.loads(krex(["daemon", "status", "--json"], krex_env, timeout=60).stdout)["daemon"]["pid"]
    out = tmp_path / "results"
    args = ["bench", "--device", "sim", "--quick", "--only", "sim-a-0", "--modes", "krex"]
    args += ["--concurrency", "1,2"]
    p = krex([*args, "--timeout", "60", "--out", str(out)], krex_env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert {c["cell"] for c in jsonl(out / "cells.jsonl")} == {"krex-1", "krex-2"}
    notes = json.loads((out / "meta.json").read_text())["notes"]
    assert any(f"pid {pid}" in n and "fewer than the 2 needed" in n and "world of its own" in n
               for n in notes), notes
    # its own daemon had the 2 slots krex-2 needs; the running one served none of its regions
    own_log = (out / "krexd-own-world.log").read_text()
    assert "slots_per_gpu=2" in own_log, own_log[-2000:]
    st = json.loads(krex(["daemon", "status", "--json"], krex_env, timeout=60).stdout)
    assert st["daemon"]["pid"] == pid and st["daemon"]["regions_done"] == 0
    shm = re.search(r"segment (/krex-bench-\S+?),", " ".join(notes))
    assert shm and not Path("/dev/shm" + shm.group(1)).exists(), "the bench's own world was left behind"
    # On a real GPU (a fake NVML lists one), two worlds would not exclude each other: refused.
    fake = tmp_path / "nvml.json"
    fake.write_text(json.dumps({"gpus": [{"name": "H200", "uuid": "GPU-8932f937-d72c-4106-c12f"}]}))
    bad = krex(["bench", "--device", "gpu", "--quick", "--modes", "krex", "--concurrency", "2",
                "--out", str(tmp_path / "gpu")], dict(krex_env, KREX_NVML_FAKE=str(fake)), timeout=120)
    assert bad.returncode == 2, bad.stdout[-2000:] + bad.stderr[-2000:]
    assert f"pid {pid}" in bad.stderr and "krex daemon stop" in bad.stderr, bad.stderr[-2000:]
    assert not (tmp_path / "gpu" / "raw.jsonl").exists()


def test_bench_compares_lent_cores_side_by_side(krex_env: dict[str, str], tmp_path: Path) -> None:
    """--lend off,all: one krex cell per lend_cores value, each under a daemon the bench starts
    with that setting (the daemon's own log says so), in one results directory."""
    out = tmp_path / "results"
    args = ["bench", "--device", "sim", "--quick", "--modes", "native-serial,krex", "--concurrency", "2"]
    p = krex([*args, "--lend", "off,all", "--timeout", "60", "--out", str(out)], krex_env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    cells = {c["cell"] for c in jsonl(out / "cells.jsonl")}
    assert cells == {"native-serial", "krex-2+lend-off", "krex-2+lend-all"}
    meta = json.loads((out / "meta.json").read_text())
    assert meta["invocations"][0]["lends"] == ["off", "all"]
    for lend in ("all", "off"):
        assert any(f"lend_cores {lend}" in n for n in meta["notes"]), meta["notes"]
    log = (Path(krex_env["KREX_STATE_DIR"]) / "krexd.log").read_text()
    assert "lend_cores=all (command line)" in log and "lend_cores=off (command line)" in log, log[-2000:]
    recs = jsonl(out / "raw.jsonl")
    for cell in ("krex-2+lend-off", "krex-2+lend-all"):
        assert [r for r in recs if r["cell"] == cell and r.get("ok")], cell
    p = krex([*args, "--lend", "some", "--out", str(tmp_path / "bad")], krex_env, timeout=60)
    assert p.returncode == 2 and "--lend" in p.stderr, p.stderr


def test_lone_region_script_compares_region_no_region_and_native(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    """benchmarks/lone_region.py on the simulated GPU: each command alone, in a region, under
    krex run with no region (KREX_AUTO_REGION=0, KREX_WL_REGION=0), and natively, for an
    automatic-region command (fused) and an explicit-region one; a second call with the same
    --out runs nothing more and prints the same table."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "lone_region.py"
    out = tmp_path / "lone.jsonl"
    argv = [
        sys.executable,
        str(script),
        "--device",
        "sim",
        "-n",
        "2",
        "--out",
        str(out),
        "--noise-floor",
        "100",
    ]
    argv += ["--only", "sim-fused-conv-gn-500us,sim-single-25us"]
    p = subprocess.run(argv, env=krex_env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = jsonl(out)
    assert len(rows) == 2 * 3 * 2 and all(r["ok"] for r in rows), rows
    for r in rows:
        assert r["regions"] == {"region": 1, "no-region": 0, "native": None}[r["mode"]], r
    table = p.stdout.split("verdict\n", 1)[1].splitlines()
    for name in ("sim-fused-conv-gn-500us", "sim-single-25us"):
        line = next(ln for ln in table if ln.startswith(name))
        assert " 2/2/2 " in line and "within native noise" in line, line
    # the rotation: the first iteration starts with the region, the second without one
    fused = [r["mode"] for r in rows if r["name"] == "sim-fused-conv-gn-500us"]
    assert fused[:3] == ["region", "no-region", "native"] and fused[3] == "no-region"
    again = subprocess.run(argv, env=krex_env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and len(jsonl(out)) == len(rows)
    assert again.stdout.split("verdict\n", 1)[1] == p.stdout.split("verdict\n", 1)[1]
