"""`krex bench` with its MPS cells on the simulated GPU, through the CLI, with the stand-in
MPS control program (tests/helpers/fake_mps.py) named by KREX_MPS_CONTROL.

unprotected-mps-C runs its commands as clients of a control daemon the bench starts for the
cell (pipe directory under the state directory, log directory beside the results) and quits
after it; krex-mps-C runs under a krexd the bench starts with MPS on. Only the structure is
asserted (cells, environments, control daemons started and quit, summary tables), never a
speed. Without a control program the MPS modes are a usage error before anything runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.fake_mps import alive as _alive
from helpers.fake_mps import fake_control
from helpers.fake_mps import krex as _krex

pytestmark = [
    pytest.mark.timeout(420),
    pytest.mark.skipif(sys.platform != "linux", reason="Linux only"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: real cgroups and freezers"),
]

MPS_KEYS = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_VISIBLE_DEVICES")
# Runs a corpus command and adds the MPS variables it ran with to its JSON result line.
WRAPPER = f'''\
import json, os, subprocess, sys
p = subprocess.run([sys.executable, *sys.argv[1:]], stdout=subprocess.PIPE, text=True)
lines = p.stdout.splitlines()
for i in reversed(range(len(lines))):
    if lines[i].startswith("{{"):
        d = json.loads(lines[i])
        d["mps_env"] = {{k: os.environ.get(k) for k in {MPS_KEYS!r}}}
        lines[i] = json.dumps(d)
        break
print("\\n".join(lines), flush=True)
sys.exit(p.returncode)
'''


def _corpus(tmp: Path) -> Path:
    """Four commands of the simulated corpus's sim-a family, each run through WRAPPER."""
    from krex.bench.corpus import default_corpus_path, load_corpus

    (tmp / "wrap.py").write_text(WRAPPER)
    items = [
        {"name": w.name, "device": "sim", "script": "wrap.py", "args": [str(w.script), *w.args],
         "family": w.family, "param": w.param, "truth": w.truth, "work": w.work, "quick": True,
         "expect_ms": w.expect_ms, "est_wall_s": w.est_wall_s}
        for w in load_corpus(default_corpus_path(), "sim", quick=True, only=["sim-a-"])[:4]
    ]
    (tmp / "manifest.py").write_text(f"WORKLOADS = {items!r}\n")
    return tmp / "manifest.py"


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_bench_runs_unprotected_and_krex_cells_under_mps_beside_the_others(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    prog, rec = fake_control(tmp_path)
    env = dict(krex_env, KREX_MPS_CONTROL=str(prog), FAKE_MPS_RECORD=str(rec))
    state = Path(env["KREX_STATE_DIR"])
    # What a killed bench left: its control daemon, under a pid no process has.
    dead = next(n for n in range(4194000, 4194300) if not os.path.exists(f"/proc/{n}"))
    stale = state / f"bench-mps-{dead}" / "gpu0" / "pipe"
    stale.mkdir(parents=True, mode=0o700)
    assert subprocess.run([str(prog), "-d"], env=dict(env, CUDA_MPS_PIPE_DIRECTORY=str(stale)),
                          timeout=30).returncode == 0
    deadline = time.monotonic() + 20
    while not (stale / "nvidia-cuda-mps-control.pid").exists():  # the daemon writes it when up
        assert time.monotonic() < deadline, "the stale control daemon did not start"
        time.sleep(0.05)
    (left,) = [json.loads(f.read_text()) for f in rec.glob("start-*.json")]
    (rec / f"start-{left['pid']}.json").unlink()
    out = tmp_path / "results"
    p = _krex(env, "bench", "--device", "sim", "--corpus", str(_corpus(tmp_path)), "--modes",
              "native-serial,unprotected,unprotected-mps,krex,krex-mps", "--concurrency", "2",
              "--timeout", "60", "--no-plots", "--out", str(out), timeout=360)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    cells = {c["cell"] for c in _jsonl(out / "cells.jsonl")}
    assert cells == {"native-serial", "unprotected-2", "unprotected-mps-2", "krex-2", "krex-mps-2"}

    # Two control daemons: the bench's own for unprotected-mps-2, krexd's for krex-mps-2.
    starts = sorted((json.loads(f.read_text()) for f in rec.glob("start-*.json")), key=lambda r: r["t"])
    assert len(starts) == 2, starts
    bench_pipe = next(Path(s["CUDA_MPS_PIPE_DIRECTORY"]) for s in starts if "bench-mps-" in
                      s["CUDA_MPS_PIPE_DIRECTORY"])
    krexd_pipe = state / "mps" / "gpu0" / "pipe"
    assert {s["CUDA_MPS_PIPE_DIRECTORY"] for s in starts} == {str(bench_pipe), str(krexd_pipe)}
    bench_start = next(s for s in starts if s["CUDA_MPS_PIPE_DIRECTORY"] == str(bench_pipe))
    assert bench_pipe.is_relative_to(state)
    assert bench_start["CUDA_MPS_LOG_DIRECTORY"] == str(out / "mps" / "unprotected-mps-2" / "gpu0")
    assert bench_start["CUDA_VISIBLE_DEVICES"] == "0"
    # Both quit (the bench's after its cell, krexd's when the bench stopped krexd), and the
    # bench's pipe directory is gone.
    events = (rec / "events.log").read_text().splitlines()
    for s in starts:
        assert f"command quit {s['CUDA_MPS_PIPE_DIRECTORY']}" in events, events
        assert f"exit {s['pid']}" in events and not _alive(s["pid"]), events
    assert not bench_pipe.exists()
    assert f"command quit {stale}" in events and not _alive(left["pid"]) and not stale.parent.parent.exists()

    # Each cell's commands ran with its MPS variables, and only the MPS cells' had any.
    recs = _jsonl(out / "raw.jsonl")
    assert all(r["ok"] for r in recs), [r.get("error") for r in recs]
    for r in recs:
        got = r["result"]["mps_env"]
        if r["cell"] == "unprotected-mps-2":
            assert got == {"CUDA_MPS_PIPE_DIRECTORY": str(bench_pipe),
                           "CUDA_MPS_LOG_DIRECTORY": bench_start["CUDA_MPS_LOG_DIRECTORY"],
                           "CUDA_VISIBLE_DEVICES": "0"}, got
        elif r["cell"] == "krex-mps-2":
            assert got["CUDA_MPS_PIPE_DIRECTORY"] == str(krexd_pipe), got
            assert r["krex"]["regions"], r["krex"]
        else:
            assert got["CUDA_MPS_PIPE_DIRECTORY"] is None, (r["cell"], got)
    notes = json.loads((out / "meta.json").read_text())["notes"]
    assert any("MPS on" in n and "krex-mps" in n for n in notes), notes
    assert any(n.startswith("unprotected-mps-2: MPS control daemons") for n in notes), notes

    s = json.loads((out / "summary.json").read_text())
    assert {t["cell"] for t in s["throughput"]} == cells - set()
    (row,) = s["headline"]["mps_throughput"]
    assert row["cell"] == "krex-mps-2" and row["unprotected_cell"] == "unprotected-2"
    assert row["unprotected_mps_cell"] == "unprotected-mps-2" and row["vs_unprotected_mps"] > 0
    assert "krex-mps-2" in s["headline"]["krex_cells"]
    assert {"unprotected-mps-2", "krex-mps-2"} <= set(s["inflation"]) and "krex-mps-2" in s["flags"]
    assert "krex-mps-2" in s["entry"] and "unprotected-mps-2" in s["ranking"]
    md = (out / "summary.md").read_text()
    assert "### Under NVIDIA MPS" in md and "throughput vs unprotected-mps (same C)" in md
    assert "| krex-mps-2 |" in md and "| unprotected-mps-2 |" in md


def test_bench_mps_modes_without_a_control_program_are_a_usage_error(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    env = {k: v for k, v in krex_env.items() if k != "KREX_MPS_CONTROL"}
    args = ["bench", "--device", "sim", "--quick", "--concurrency", "2", "--no-plots"]
    out = tmp_path / "sim"
    p = _krex(env, *args, "--modes", "native-serial,unprotected-mps", "--out", str(out), timeout=60)
    assert p.returncode == 2, p.stderr
    assert "the simulated GPU has none" in p.stderr and "drop unprotected-mps and krex-mps" in p.stderr
    assert not out.exists()  # refused before anything ran
    missing = dict(env, KREX_MPS_CONTROL=str(tmp_path / "no-such-control"))
    out = tmp_path / "missing"
    p = _krex(missing, *args, "--modes", "krex-mps", "--out", str(out), timeout=60)
    assert p.returncode == 2, p.stderr
    assert "no-such-control" in p.stderr and "cannot be found" in p.stderr and "fix:" in p.stderr, p.stderr
    assert not out.exists()


def test_the_cells_control_daemon_is_quit_when_the_bench_is_stopped_or_it_cannot_start(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    """SIGTERM in the middle of an unprotected-mps cell (as `timeout` sends): the bench stops
    its commands and quits the cell's control daemon before it exits. A control daemon that
    cannot start fails the bench with the reason, and leaves nothing running."""
    import signal

    prog, rec = fake_control(tmp_path)
    env = dict(krex_env, KREX_MPS_CONTROL=str(prog), FAKE_MPS_RECORD=str(rec))
    args = [sys.executable, "-m", "krex.cli.main", "bench", "--device", "sim", "--corpus",
            str(_corpus(tmp_path)), "--modes", "unprotected-mps", "--concurrency", "2", "--repeat", "20",
            "--timeout", "60", "--no-plots"]
    out = tmp_path / "stopped"
    proc = subprocess.Popen([*args, "--out", str(out)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        raw = out / "raw.jsonl"
        deadline = time.monotonic() + 120
        while not (raw.exists() and raw.read_text().count("\n") >= 2):  # the cell is under way
            assert time.monotonic() < deadline and proc.poll() is None, "the cell did not start"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    (start,) = [json.loads(f.read_text()) for f in rec.glob("start-*.json")]
    events = (rec / "events.log").read_text().splitlines()
    assert f"command quit {start['CUDA_MPS_PIPE_DIRECTORY']}" in events and not _alive(start["pid"]), events
    assert not Path(start["CUDA_MPS_PIPE_DIRECTORY"]).exists()

    failing = dict(env, FAKE_MPS_FAIL="1")
    p = _krex(failing, *args[3:], "--repeat", "1", "--out", str(tmp_path / "failed"), timeout=360)
    assert p.returncode != 0, p.stderr
    assert "cannot start the MPS control daemon for the cell's GPU 0" in p.stderr, p.stderr
    assert "fake MPS: cannot open the GPU" in p.stderr, p.stderr
    assert len(list(rec.glob("start-*.json"))) == 1  # no second control daemon ever ran


def test_an_unprotected_mps_cell_beside_a_running_krexd_with_mps_says_so(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    prog, rec = fake_control(tmp_path)
    env = dict(krex_env, KREX_MPS_CONTROL=str(prog), FAKE_MPS_RECORD=str(rec))
    assert _krex(env, "daemon", "start", "--device", "sim", "--mps", timeout=60).returncode == 0
    out = tmp_path / "results"
    p = _krex(env, "bench", "--device", "sim", "--corpus", str(_corpus(tmp_path)), "--modes",
              "unprotected-mps", "--concurrency", "2", "--timeout", "60", "--no-plots", "--out", str(out),
              timeout=360)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    notes = json.loads((out / "meta.json").read_text())["notes"]
    assert any("has MPS control daemons of its own on the GPU beside this cell's" in n for n in notes), notes
    assert len(list(rec.glob("start-*.json"))) == 2  # krexd's, and the cell's own
