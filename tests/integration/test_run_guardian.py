"""`krex run` as a guardian (admission message, --report, signals, exit status, slot
release after SIGKILL, static-cudart warning) and the daemon's own commands
(start/stop/status, idle exit, journal)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.krex_cli import KREX, krex, status, wait_for

NVCC = shutil.which("nvcc") or next(iter(sorted(Path("/usr/local").glob("cuda*/bin/nvcc"))), None)


@pytest.fixture
def env(krex_env: dict[str, str]) -> dict[str, str]:
    return krex_env


def test_daemon_start_status_stop_and_already_running(env: dict[str, str]) -> None:
    p = krex(env, "daemon", "start", "--device", "sim", "--max-region", "5")
    assert p.returncode == 0 and "krexd started" in p.stdout, p.stderr
    st = krex(env, "daemon", "status")
    assert st.returncode == 0
    for word in ("krexd pid", "socket", "up", "freezer", "CPU partition"):
        assert word in st.stdout, st.stdout
    sock = Path(json.loads(krex(env, "daemon", "status", "--json").stdout)["daemon"]["socket"])
    assert oct(sock.stat().st_mode & 0o777) == "0o660"
    again = krex(env, "daemon", "start", "--device", "sim")
    assert again.returncode == 6 and "already running" in again.stderr and "fix:" in again.stderr
    assert krex(env, "daemon", "stop").returncode == 0
    assert krex(env, "daemon", "status").returncode == 3


def test_a_stopped_daemon_leaves_no_cgroup_behind(env: dict[str, str]) -> None:
    """krexd's freezer root (one per control segment) goes with it: stopping many
    daemons (CI, tests, a fleet's nodes) must not pile up empty cgroups."""
    from krex.node import freezer

    assert krex(env, "daemon", "start", "--device", "sim").returncode == 0
    assert krex(env, "run", "--device", "sim", "--", "true").returncode == 0
    st = json.loads(krex(env, "daemon", "status", "--json").stdout)["daemon"]
    backend = st["freezer"].removeprefix("auto (").removesuffix(")")  # "auto (cgroup2)" or the one set
    fz = freezer.detect(backend, root_name=env["KREX_SHM"].strip("/"))
    assert os.path.isdir(fz.root), f"krexd made no freezer root at {fz.root}: the test proves nothing"
    assert krex(env, "daemon", "stop").returncode == 0
    assert not os.path.exists(fz.root), f"krexd left {fz.root} behind"


def test_on_demand_daemon_exits_when_idle(env: dict[str, str]) -> None:
    p = krex(env, "daemon", "start", "--device", "sim", "--idle-exit", "1")
    assert p.returncode == 0
    assert krex(env, "run", "--device", "sim", "--", "true").returncode == 0
    wait_for(lambda: krex(env, "daemon", "status").returncode != 0, 15, "the idle daemon to exit")


def test_exit_status_signals_and_report(env: dict[str, str], tmp_path: Path) -> None:
    assert krex(env, "run", "--device", "sim", "--", "sh", "-c", "exit 7").returncode == 7
    rep = tmp_path / "report.json"
    code = "import krex\nwith krex.region():\n    pass\nwith krex.region():\n    pass\n"
    p = krex(env, "run", "--device", "sim", "--report", str(rep), "--", sys.executable, "-c", code)
    assert p.returncode == 0, p.stderr
    r = json.loads(rep.read_text())
    assert r["exit_status"] == 0 and len(r["regions"]) == 2 and r["contaminated_regions"] == 0
    for k in ("slot", "gpu", "admission_wait_s", "gate_blocks", "region_wait_s"):
        assert k in r
    # SIGTERM to the guardian reaches the command's process group; the exit status says so.
    marker = tmp_path / "started"
    proc = subprocess.Popen(
        [*KREX, "run", "--device", "sim", "--", "sh", "-c", f"touch {marker}; sleep 60"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(marker.exists, 30, "the command to start")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    wait_for(lambda: status(env)["slots"] == [], 10, "the slot to be released")


def test_sigkilled_command_frees_its_slot(env: dict[str, str], tmp_path: Path) -> None:
    marker = tmp_path / "pid"
    proc = subprocess.Popen(
        [*KREX, "run", "--device", "sim", "--", "sh", "-c", f"echo $$ > {marker}; sleep 60"], env=env
    )
    wait_for(lambda: marker.exists() and marker.read_text().strip(), 30, "the command")
    assert len(status(env)["slots"]) == 1
    os.kill(int(marker.read_text()), signal.SIGKILL)
    assert proc.wait(30) == 128 + signal.SIGKILL
    wait_for(lambda: status(env)["slots"] == [], 10, "the slot to be released")


def test_admission_waits_with_a_message(env: dict[str, str], tmp_path: Path) -> None:
    assert krex(env, "daemon", "start", "--device", "sim", "--slots-per-gpu", "1").returncode == 0
    first = tmp_path / "first"
    a = subprocess.Popen(
        [*KREX, "run", "--device", "sim", "--", "sh", "-c", f"touch {first}; sleep 2"], env=env
    )
    wait_for(first.exists, 30, "the first command")
    t0 = time.monotonic()
    b = subprocess.run(
        [*KREX, "run", "--device", "sim", "--", "true"], env=env, capture_output=True, text=True, timeout=60
    )
    waited = time.monotonic() - t0
    assert a.wait(30) == 0 and b.returncode == 0
    assert "waiting for a free slot" in b.stderr, b.stderr
    assert waited > 0.5  # it really waited for the first command's slot


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_static_cudart_is_warned_about(env: dict[str, str], tmp_path: Path) -> None:
    src = tmp_path / "k.cu"
    src.write_text("__global__ void k(){}\nint main(){return 0;}\n")
    exe = tmp_path / "static_bin"
    subprocess.run([str(NVCC), "-o", str(exe), str(src)], check=True, capture_output=True)
    p = krex(env, "run", "--device", "sim", "--", str(exe))
    assert p.returncode == 0
    assert "links the CUDA runtime statically" in p.stderr and "-cudart shared" in p.stderr


def test_journal_command(env: dict[str, str]) -> None:
    none = krex(env, "journal")
    assert none.returncode == 3 and "no journal" in none.stderr
    code = "import krex\nwith krex.region('mylabel'):\n    pass\n# journal-cmd-marker\n"
    assert krex(env, "run", "--device", "sim", "--", sys.executable, "-c", code).returncode == 0
    table = krex(env, "journal")
    assert table.returncode == 0 and "entry_ms" in table.stdout and " end" in table.stdout
    recs = json.loads(krex(env, "journal", "--json").stdout)
    assert len(recs) == 1
    # The text view says when, what the region was called and which command held it.
    import datetime as dt

    head, row = table.stdout.splitlines()[:2]
    assert head.split()[0] == "time" and "label" in head and "command" in head
    when = dt.datetime.fromtimestamp(recs[0]["ts"]).strftime("%H:%M:%S")
    assert when in row and "mylabel" in row and "journal-cmd-marker" in row, row
    assert recs[0]["cmd"].startswith(sys.executable) and recs[0]["label"] == "mylabel"
    for k in (
        "owner_pid",
        "queue_wait_s",
        "block_s",
        "drain_s",
        "freeze_s",
        "pin_s",
        "region_s",
        "contaminated",
        "freezer",
        "partition_degraded",
        "siblings_frozen",
    ):
        assert k in recs[0]


def test_a_foreground_daemon_logs_each_line_once(env: dict[str, str]) -> None:
    """`krex daemon start --foreground` logs through krexd's handler alone (the CLI's handler
    on the same logger wrote every line a second time)."""
    p = subprocess.Popen(
        [*KREX, "daemon", "start", "--foreground", "--device", "sim"],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_for(lambda: krex(env, "daemon", "status").returncode == 0, 30, "the daemon to start")
        assert krex(env, "daemon", "stop").returncode == 0
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    started = [x for x in err.splitlines() if " started: pid " in x]
    assert len(started) == 1, err[-3000:]
    assert err.count("krexd stopping") == 1, err[-3000:]
