"""NVIDIA MPS under krexd (krex/node/mps.py), with real processes on the simulated GPU and
a stand-in control program named by KREX_MPS_CONTROL: krexd starts one control daemon per
GPU with that GPU's variables, hands its commands the pipe directory, quits it on a clean
stop, flags a region whose control daemon died `mps-server` and starts a new one once no
region holds the GPU, refuses to start when it cannot have MPS, and never stops a control
daemon it attached to. A command killed by a signal (an MPS client killed) flags the regions
on its GPU `mps-client-fault`, tells a command that fails meanwhile, and has the server
restarted once no region holds the GPU; without MPS the same kill does none of it.

The stand-in (tests/helpers/fake_mps.py) keeps to what krexd relies on: `-d` daemonises
and writes the daemon's pid to nvidia-cuda-mps-control.pid in CUDA_MPS_PIPE_DIRECTORY (as
nvidia-cuda-mps-control does) and creates the `control` pipe's name there; without `-d` it
reads a command on stdin: `quit` ends the daemon, `shutdown_server PID -f` its stand-in
server (FAKE_MPS_SERVER), which it then starts again. It records its environment and each
command in $FAKE_MPS_RECORD."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.fake_mps import KREX
from helpers.fake_mps import alive as _alive
from helpers.fake_mps import fake_control as _fake
from helpers.fake_mps import krex as _krex
from helpers.krex_world import WORKER

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="Linux only"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: real cgroups and freezers"),
]

PID_FILE = "nvidia-cuda-mps-control.pid"

def _env(krex_env: dict[str, str], prog: Path, rec: Path) -> dict[str, str]:
    return dict(krex_env, KREX_MPS_CONTROL=str(prog), FAKE_MPS_RECORD=str(rec))


def _starts(rec: Path) -> list[dict[str, Any]]:
    return sorted((json.loads(p.read_text()) for p in rec.glob("start-*.json")), key=lambda r: r["t"])


def _events(rec: Path) -> list[str]:
    p = rec / "events.log"
    return p.read_text().splitlines() if p.exists() else []


def _mps_status(env: dict[str, str]) -> dict[str, Any]:
    p = _krex(env, "status", "--json")
    assert p.returncode == 0, p.stderr
    return dict(json.loads(p.stdout)["daemon"]["mps"])


def _wait(cond: Any, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _in_region(env: dict[str, str], bins: dict[str, Path], *run_args: str) -> subprocess.Popen[str]:
    """`krex run` of an actor whose region has begun when this returns and lasts until a line
    comes on its stdin (then it ends the region and exits 0)."""
    actor = [str(bins["actor"]), "begin", "line", "end"]
    cmd = subprocess.Popen([*KREX, "run", *run_args, "--device", "sim", "--", *actor], env=env,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert cmd.stdout is not None
        line = cmd.stdout.readline()
        while line and '"act":"begin"' not in line:  # the actor's start line comes first
            line = cmd.stdout.readline()
        assert '"rc":0' in line, (line, cmd.poll())
    except BaseException:
        cmd.kill()
        cmd.wait()
        raise
    return cmd


def test_start_makes_private_dirs_and_a_control_daemon_per_gpu_that_commands_use_and_stop_quits(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    prog, rec = _fake(tmp_path)
    env = _env(krex_env, prog, rec)
    state = Path(env["KREX_STATE_DIR"])
    p = _krex(env, "daemon", "start", "--device", "sim", "--mps")
    assert p.returncode == 0, p.stderr
    pipe, logd = state / "mps" / "gpu0" / "pipe", state / "mps" / "gpu0" / "log"
    for d in (state / "mps", state / "mps" / "gpu0", pipe, logd):
        assert d.is_dir() and (d.stat().st_mode & 0o777) == 0o700, d
    (start,) = _starts(rec)
    assert start["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe)
    assert start["CUDA_MPS_LOG_DIRECTORY"] == str(logd)
    assert start["CUDA_VISIBLE_DEVICES"] == "0"  # the simulated GPU has no UUID: its index
    assert int((pipe / PID_FILE).read_text()) == start["pid"] and _alive(start["pid"])
    st = _mps_status(env)
    assert st["mode"] == "own" and st["gpus"][0]["state"] == "on" and st["gpus"][0]["pid"] == start["pid"]
    shown = _krex(env, "status")
    assert f"gpu 0: on, pid {start['pid']}, pipe {pipe}" in shown.stdout, shown.stdout

    run = _krex(env, "run", "--device", "sim", "--", "sh", "-c",
                'echo "pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY"')
    assert run.returncode == 0, run.stderr
    assert f"pipe={pipe} log={logd}" in run.stdout, run.stdout
    # A process that opts in with `krex env --export` gets the same MPS variables.
    exported = _krex(env, "env", "--export", "--device", "sim")
    assert exported.returncode == 0, exported.stderr
    assert f"export CUDA_MPS_PIPE_DIRECTORY={pipe}" in exported.stdout.splitlines(), exported.stdout
    assert f"export CUDA_MPS_LOG_DIRECTORY={logd}" in exported.stdout.splitlines(), exported.stdout
    assert "CUDA_MPS" not in _krex(env, "env", "--export", "--device", "sim", "--gpu", "1").stdout

    stop = _krex(env, "daemon", "stop")
    assert stop.returncode == 0, stop.stderr
    _wait(lambda: not _alive(start["pid"]), "the control daemon to quit")
    assert f"command quit {pipe}" in _events(rec) and f"exit {start['pid']}" in _events(rec)


def test_a_control_daemon_killed_mid_region_flags_it_and_is_restarted_after_the_region(
    krex_env: dict[str, str], tmp_path: Path, bins: dict[str, Path]
) -> None:
    prog, rec = _fake(tmp_path)
    env = _env(krex_env, prog, rec)
    p = _krex(env, "daemon", "start", "--device", "sim", "--mps", "on")
    assert p.returncode == 0, p.stderr
    (first,) = _starts(rec)
    cmd = _in_region(env, bins)
    try:
        assert cmd.stdin is not None
        os.kill(first["pid"], signal.SIGKILL)
        _wait(lambda: _mps_status(env)["gpus"][0]["state"] == "down", "krexd to see it down")
        time.sleep(0.5)  # several watcher rounds: no restart while the region holds the GPU
        assert len(_starts(rec)) == 1 and _mps_status(env)["gpus"][0]["state"] == "down"
        # Down: no pid (the dead one would read as running).
        assert _mps_status(env)["gpus"][0]["pid"] is None
        assert "gpu 0: down, pid -," in _krex(env, "status").stdout
        done = _ended(cmd, "go\n")
        assert done.returncode == 0, done.stderr
    finally:
        if cmd.poll() is None:
            cmd.kill()
    (region,) = _regions(env)
    assert "mps-server" in region["flags"] and region["contaminated"], region
    _wait(lambda: len(_starts(rec)) == 2 and _mps_status(env)["gpus"][0]["state"] == "on", "the restart")
    second = _starts(rec)[1]
    assert second["pid"] != first["pid"] and _alive(second["pid"])
    st = _mps_status(env)["gpus"][0]
    assert st["pid"] == second["pid"] and st["restarts"] == 1
    # A region after the restart is clean of it.
    run = _krex(env, "run", "--device", "sim", "--", str(bins["actor"]), "begin", "end")
    assert run.returncode == 0, run.stderr
    last = _regions(env)[-1]
    assert "mps-server" not in last["flags"], last
    assert _krex(env, "daemon", "stop").returncode == 0
    _wait(lambda: not _alive(second["pid"]), "the new control daemon to quit")


def test_an_mps_server_that_exits_mid_region_flags_that_region_only(
    krex_env: dict[str, str], tmp_path: Path, bins: dict[str, Path]
) -> None:
    """The MPS server holds every client's context: when it exits (killed, crashed), each
    client's GPU work fails. A region it cut is flagged mps-server with the server's pid; the
    control daemon lives on, and the next region is clean."""
    prog, rec = _fake(tmp_path)
    env = dict(_env(krex_env, prog, rec), FAKE_MPS_SERVER="1")
    assert _krex(env, "daemon", "start", "--device", "sim", "--mps", "on").returncode == 0
    _wait(lambda: list(rec.glob("server-*")), "the fake MPS server")
    server = int(next(rec.glob("server-*")).name.split("-")[1])
    time.sleep(0.5)  # the watcher has seen the server
    cmd = _in_region(env, bins)
    try:
        assert cmd.stdin is not None
        os.kill(server, signal.SIGKILL)
        _wait(lambda: not _alive(server), "the server to die")
        done = _ended(cmd, "go\n")
        assert done.returncode == 0, done.stderr
    finally:
        if cmd.poll() is None:
            cmd.kill()
    (region,) = _regions(env)
    assert "mps-server" in region["flags"] and region["contaminated"], region
    assert any(f"pid {server}" in r for r in region.get("reasons", [])), region
    assert _mps_status(env)["gpus"][0]["state"] == "on"  # the control daemon itself lives on
    run = _krex(env, "run", "--device", "sim", "--", str(bins["actor"]), "begin", "end")
    assert run.returncode == 0, run.stderr
    last = _regions(env)[-1]
    assert "mps-server" not in last["flags"], (last.get("reasons"), region.get("reasons"))
    assert _krex(env, "daemon", "stop").returncode == 0


def test_a_control_daemon_that_cannot_start_fails_the_daemon_start_with_the_reason(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    prog, rec = _fake(tmp_path)
    env = dict(_env(krex_env, prog, rec), FAKE_MPS_FAIL="1")
    p = _krex(env, "daemon", "start", "--device", "sim", "--mps")
    assert p.returncode != 0
    assert "cannot start the MPS control daemon for GPU 0" in p.stderr, p.stderr
    assert "fake MPS: cannot open the GPU" in p.stderr and "without --mps" in p.stderr, p.stderr
    assert _krex(env, "daemon", "status").returncode == 3  # no krexd runs
    assert not _starts(rec)


def test_an_attached_control_daemon_is_used_and_never_stopped(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    prog, rec = _fake(tmp_path)
    env = _env(krex_env, prog, rec)
    pipe = tmp_path / "their-mps"
    pipe.mkdir(mode=0o700)
    theirs = dict(env, CUDA_MPS_PIPE_DIRECTORY=str(pipe))
    assert subprocess.run([str(prog), "-d"], env=theirs, timeout=30).returncode == 0
    _wait(lambda: (pipe / PID_FILE).exists(), "their control daemon")
    pid = int((pipe / PID_FILE).read_text())
    try:
        p = _krex(env, "daemon", "start", "--device", "sim", "--mps-pipe-dir", str(pipe))
        assert p.returncode == 0, p.stderr
        st = _mps_status(env)
        assert st["mode"] == "attach" and st["gpus"][0]["state"] == "attached" and st["gpus"][0]["pid"] == pid
        run = _krex(env, "run", "--device", "sim", "--", "sh", "-c", 'echo "pipe=$CUDA_MPS_PIPE_DIRECTORY"')
        assert run.returncode == 0 and f"pipe={pipe}" in run.stdout, (run.stdout, run.stderr)
        assert _krex(env, "daemon", "stop").returncode == 0
        time.sleep(0.3)
        assert _alive(pid) and not any(e.startswith("command quit") for e in _events(rec)), _events(rec)
        assert len(_starts(rec)) == 1  # krexd started none of its own
    finally:
        os.kill(pid, signal.SIGTERM)


def test_mps_on_the_simulated_gpu_without_a_control_program_is_refused(krex_env: dict[str, str]) -> None:
    env = {k: v for k, v in krex_env.items() if k != "KREX_MPS_CONTROL"}
    p = _krex(env, "daemon", "start", "--device", "sim", "--mps")
    assert p.returncode != 0
    assert "the simulated GPU has no MPS" in p.stderr and "without --mps" in p.stderr, p.stderr


def test_a_stale_control_daemon_of_a_previous_krexd_is_stopped_at_start(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    prog, rec = _fake(tmp_path)
    env = _env(krex_env, prog, rec)
    assert _krex(env, "daemon", "start", "--device", "sim", "--mps").returncode == 0
    (first,) = _starts(rec)
    daemon_pid = json.loads(_krex(env, "status", "--json").stdout)["daemon"]["daemon"]["pid"]
    os.kill(daemon_pid, signal.SIGKILL)  # krexd dies: its control daemon lives on
    _wait(lambda: not _alive(daemon_pid), "krexd to die")
    assert _alive(first["pid"])
    p = _krex(env, "daemon", "start", "--device", "sim", "--mps")
    assert p.returncode == 0, p.stderr
    _wait(lambda: not _alive(first["pid"]), "the stale control daemon to be stopped")
    assert len(_starts(rec)) == 2 and _mps_status(env)["gpus"][0]["state"] == "on"
    assert _krex(env, "daemon", "stop").returncode == 0


def test_daemon_stop_waits_while_krexd_stops_control_daemons_slow_to_quit(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    """Two GPUs whose control daemons ignore `quit` and SIGTERM: krexd needs about 10 s for
    each (its quit wait, then SIGTERM's, then SIGKILL); `krex daemon stop` waits for that
    (krexd's shutdown reply says how long it may take) instead of giving up after 10 s."""
    prog, rec = _fake(tmp_path)
    env = dict(_env(krex_env, prog, rec), KREX_SIM_GPUS="2", FAKE_MPS_IGNORE_TERM="1")
    assert _krex(env, "daemon", "start", "--device", "sim", "--mps").returncode == 0
    _wait(lambda: len(_starts(rec)) == 2, "both control daemons")
    t0 = time.monotonic()
    stop = _krex(env, "daemon", "stop", timeout=120)
    took = time.monotonic() - t0
    assert stop.returncode == 0 and "krexd stopped" in stop.stdout, (stop.stdout, stop.stderr)
    assert took > 15, took  # both control daemons' quit ran before krexd exited
    assert not any(_alive(s["pid"]) for s in _starts(rec))


def _killed_mps_krexd(env: dict[str, str], rec: Path) -> dict[str, Any]:
    """Start krexd with --mps, SIGKILL it: its control daemon lives on; that daemon's start."""
    assert _krex(env, "daemon", "start", "--device", "sim", "--mps").returncode == 0
    (first,) = _starts(rec)
    daemon_pid = json.loads(_krex(env, "status", "--json").stdout)["daemon"]["daemon"]["pid"]
    os.kill(daemon_pid, signal.SIGKILL)
    _wait(lambda: not _alive(daemon_pid), "krexd to die")
    assert _alive(first["pid"])
    return first


def test_a_krexd_without_mps_stops_a_previous_krexds_control_daemon_no_command_uses(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    prog, rec = _fake(tmp_path)
    env = _env(krex_env, prog, rec)
    first = _killed_mps_krexd(env, rec)
    assert _krex(env, "daemon", "start", "--device", "sim").returncode == 0  # without --mps
    _wait(lambda: not _alive(first["pid"]), "the left control daemon to be stopped")
    assert f"command quit {first['CUDA_MPS_PIPE_DIRECTORY']}" in _events(rec)
    assert not Path(first["CUDA_MPS_PIPE_DIRECTORY"]).exists()
    st = _mps_status(env)
    assert st == {"mode": "off", "gpus": []}, st
    assert "MPS" not in _krex(env, "status").stdout


def test_a_krexd_without_mps_leaves_a_previous_krexds_control_daemon_its_commands_use(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    prog, rec = _fake(tmp_path)
    env = _env(krex_env, prog, rec)
    first = _killed_mps_krexd(env, rec)
    pipe = first["CUDA_MPS_PIPE_DIRECTORY"]
    client = subprocess.Popen(["sleep", "120"], env=dict(env, CUDA_MPS_PIPE_DIRECTORY=pipe))
    try:
        assert _krex(env, "daemon", "start", "--device", "sim").returncode == 0
        time.sleep(0.3)
        assert _alive(first["pid"]) and not any(e.startswith("command quit") for e in _events(rec))
        (left,) = _mps_status(env)["left"]
        assert left["pid"] == first["pid"] and left["pipe_dir"] == pipe and client.pid in left["clients"]
        shown = _krex(env, "status").stdout
        assert f"control daemon pid {first['pid']} left by a previous krexd (pipe {pipe})" in shown, shown
    finally:
        client.kill()
        client.wait()
        os.kill(first["pid"], signal.SIGTERM)
    _wait(lambda: not _alive(first["pid"]), "the control daemon to end")
    assert "left" not in _mps_status(env)  # gone: no longer shown


def _regions(env: dict[str, str]) -> list[dict[str, Any]]:
    journal = Path(env["KREX_STATE_DIR"]) / "journal.jsonl"
    return [json.loads(x) for x in journal.read_text().splitlines() if '"owner_slot"' in x]


def _journal_events(env: dict[str, str], name: str) -> list[dict[str, Any]]:
    journal = Path(env["KREX_STATE_DIR"]) / "journal.jsonl"
    if not journal.exists():
        return []
    return [r for r in map(json.loads, journal.read_text().splitlines()) if r.get("event") == name]


def _started(env: dict[str, str], *cmd: str) -> tuple[subprocess.Popen[str], int]:
    """`krex run CMD` once CMD runs (exec'd): the guardian, and the command's pid. Started
    before a region (a command admitted during one starts frozen until it ends)."""
    guardian = subprocess.Popen([*KREX, "run", "--device", "sim", "--", *cmd], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    kids: list[int] = []
    exe = Path(shutil.which(cmd[0]) or cmd[0]).resolve()  # (sh may be dash)

    def running() -> bool:
        kids[:] = []
        with contextlib.suppress(OSError, IndexError):
            children = Path(f"/proc/{guardian.pid}/task/{guardian.pid}/children")
            kids.extend(map(int, children.read_text().split()))
            return Path(f"/proc/{kids[0]}/exe").resolve() == exe
        return False

    try:
        _wait(running, f"{cmd[0]} to run")
    except BaseException:
        guardian.kill()
        guardian.wait()
        raise
    return guardian, kids[0]


def _ended(guardian: subprocess.Popen[str], line: str = "") -> subprocess.CompletedProcess[str]:
    out, err = guardian.communicate(line, timeout=60)
    return subprocess.CompletedProcess(guardian.args, guardian.returncode, out, err)


def _killed(guardian: subprocess.Popen[str], pid: int) -> subprocess.CompletedProcess[str]:
    """SIGKILL the command `pid` of `krex run` `guardian`: what `krex run` then said."""
    os.kill(pid, signal.SIGKILL)
    done = _ended(guardian)
    assert done.returncode == 128 + signal.SIGKILL, done.stderr
    return done


def _fault_env(krex_env: dict[str, str], tmp_path: Path, server: bool = True,
               window_s: float = 120) -> tuple[dict[str, str], Path]:
    prog, rec = _fake(tmp_path)
    # Room for siblings beside the region's command, which run on (the `gpu` policy freezes
    # none that never used the GPU); by default a window the test never waits out.
    env = dict(_env(krex_env, prog, rec), KREX_MPS_FAULT_WINDOW=f"{window_s:g}", **_SIBLINGS_RUN)
    if server:
        env["FAKE_MPS_SERVER"] = "1"
    return env, rec


_SIBLINGS_RUN = {"KREX_SLOTS_PER_GPU": "4", "KREX_FREEZE_POLICY": "gpu"}


def _last_fault(env: dict[str, str]) -> dict[str, Any]:
    faults = _mps_status(env)["gpus"][0].get("client_faults") or [{}]
    return dict(faults[-1])


def _servers(rec: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in rec.glob("server-*"))


def test_an_mps_client_killed_beside_a_region_flags_it_tells_a_failure_and_restarts_the_server_after(
    krex_env: dict[str, str], tmp_path: Path, bins: dict[str, Path]
) -> None:
    """A command killed by SIGKILL under MPS (an MPS client killed, maybe inside its kernels,
    which fails the server's other clients for a while): the region running then is flagged
    mps-client-fault with the pid; a command that fails meanwhile is told (stderr, --report);
    the server restart waits for the region to end, then the control daemon is asked
    (`shutdown_server PID -f`) and the fault is over."""
    env, rec = _fault_env(krex_env, tmp_path)
    assert _krex(env, "daemon", "start", "--device", "sim", "--mps").returncode == 0
    _wait(lambda: _servers(rec), "the fake MPS server")
    (server,) = _servers(rec)
    victim_run, victim = _started(env, "sleep", "60")
    failing, _ = _started(env, "sh", "-c", "read x; exit 3")
    holder = _in_region(env, bins)
    try:
        assert holder.stdin is not None
        _killed(victim_run, victim)
        _wait(lambda: _last_fault(env).get("restart") == "deferred", "the restart to wait for the region")
        (fault,) = _mps_status(env)["gpus"][0]["client_faults"]
        assert (fault["pid"], fault["signal"], fault["command"]) == (victim, "SIGKILL", "sleep 60"), fault
        assert not any("shutdown_server" in e for e in _events(rec))  # not while the region holds the GPU

        failed = _ended(failing, "go\n")
        assert failed.returncode == 3, failed.stderr
        notice = [x for x in failed.stderr.splitlines() if "an MPS client" in x]
        assert len(notice) == 1, failed.stderr
        assert f"an MPS client (pid {victim}, `sleep 60`) was killed by SIGKILL at " in notice[0], notice
        assert notice[0].endswith("the MPS server refuses clients until it restarts: rerun the command")

        done = _ended(holder, "go\n")
        assert done.returncode == 0, done.stderr
    finally:
        for p in (holder, failing, victim_run):
            if p.poll() is None:
                p.kill()
                p.wait()
    (region,) = [r for r in _regions(env) if "mps-client-fault" in r["flags"]]
    assert region["contaminated"] and any(f"pid {victim}" in r for r in region["reasons"]), region
    (event,) = _journal_events(env, "mps-client-fault")
    assert event["pid"] == victim and event["signal"] == "SIGKILL", event
    assert f"EVENT: MPS client pid {victim} (`sleep 60`)" in _krex(env, "journal").stdout

    # The region ended: the restart is asked for, and the control daemon starts a new server.
    pipe = Path(env["KREX_STATE_DIR"]) / "mps" / "gpu0" / "pipe"
    _wait(lambda: f"command shutdown_server {server} -f {pipe}" in _events(rec), "the server restart")
    _wait(lambda: len(_servers(rec)) == 2, "the new server")
    _wait(lambda: str(_last_fault(env).get("restart")).startswith("requested after"), "the restart noted")
    assert not _alive(server)
    # The fault is over: a failure now is not tied to it, and a region now is clean of it.
    later = _krex(env, "run", "--device", "sim", "--", "sh", "-c", "exit 1")
    assert later.returncode == 1 and "MPS client" not in later.stderr, later.stderr
    run = _krex(env, "run", "--device", "sim", "--", str(bins["actor"]), "begin", "end")
    assert run.returncode == 0, run.stderr
    assert "mps-client-fault" not in _regions(env)[-1]["flags"], _regions(env)[-1]
    assert _krex(env, "daemon", "stop").returncode == 0


def test_an_mps_client_killed_with_no_region_has_its_server_restarted_at_once(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    env, rec = _fault_env(krex_env, tmp_path)
    assert _krex(env, "daemon", "start", "--device", "sim", "--mps").returncode == 0
    _wait(lambda: _servers(rec), "the fake MPS server")
    (server,) = _servers(rec)
    time.sleep(0.5)  # the watcher has seen the server
    guardian, victim = _started(env, "sleep", "60")
    _killed(guardian, victim)
    pipe = Path(env["KREX_STATE_DIR"]) / "mps" / "gpu0" / "pipe"
    _wait(lambda: f"command shutdown_server {server} -f {pipe}" in _events(rec), "the server restart")
    _wait(lambda: len(_servers(rec)) == 2, "the new server")
    _wait(lambda: _last_fault(env).get("restart") == f"requested (server pid {server})", "the restart noted")
    assert _last_fault(env)["pid"] == victim
    assert _krex(env, "daemon", "stop").returncode == 0


def test_with_no_server_restart_seen_a_fault_tells_the_commands_after_it_for_its_window(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    """No MPS server known (none to restart, none seen restarting): the fault counts for its
    window (KREX_MPS_FAULT_WINDOW); a command started just after it that fails is told, one
    that succeeds is not, and a failure after the window is not."""
    env, rec = _fault_env(krex_env, tmp_path, server=False, window_s=4)
    assert _krex(env, "daemon", "start", "--device", "sim", "--mps").returncode == 0
    guardian, victim = _started(env, "sleep", "60")
    _killed(guardian, victim)
    report = tmp_path / "report.json"
    failed = _krex(env, "run", "--device", "sim", "--report", str(report), "--", "sh", "-c", "exit 3")
    assert failed.returncode == 3, failed.stderr
    assert f"an MPS client (pid {victim}, `sleep 60`) was killed by SIGKILL at " in failed.stderr, failed
    told = json.loads(report.read_text())["mps_client_fault"]
    assert told["pid"] == victim and told["signal"] == "SIGKILL", told
    ok = _krex(env, "run", "--device", "sim", "--", "true")
    assert ok.returncode == 0 and "MPS client" not in ok.stderr, ok.stderr
    _wait(lambda: _last_fault(env).get("restart", "").startswith("none: no MPS server"), "the restart noted")
    assert not any("shutdown_server" in e for e in _events(rec))
    time.sleep(4.2)  # the window is over
    later = _krex(env, "run", "--device", "sim", "--", "sh", "-c", "exit 1")
    assert later.returncode == 1 and "MPS client" not in later.stderr, later.stderr
    assert _krex(env, "daemon", "stop").returncode == 0


@pytest.mark.parametrize("end", ["killed", "exited"])
def test_a_gpu_process_below_a_command_that_is_killed_is_a_client_fault_and_one_that_exits_is_not(
    krex_env: dict[str, str], tmp_path: Path, end: str
) -> None:
    """An MPS client need not be the command krex run started: a child of it that used the
    GPU and is SIGKILLed (its exit handlers never ran; no one but its parent hears the
    signal) is a client fault like the command's own (journaled, the server restarted); the
    same child exiting by itself is none."""
    env, rec = _fault_env(krex_env, tmp_path)
    assert _krex(env, "daemon", "start", "--device", "sim", "--mps").returncode == 0
    _wait(lambda: _servers(rec), "the fake MPS server")
    (server,) = _servers(rec)
    time.sleep(0.5)  # the watcher has seen the server
    out = tmp_path / "kid"
    out.mkdir()
    go = out / "kid.go"
    kid_cmd = f"{sys.executable} {WORKER} life {out} --name kid --calls 3 --exit-on {go} & wait $!"
    guardian, _root = _started(env, "sh", "-c", kid_cmd)
    _wait(lambda: (out / "kid.ready").exists(), "the child's GPU calls", timeout=60)
    kid = int(json.loads((out / "kid.ready").read_text())["pid"])
    if end == "killed":
        os.kill(kid, signal.SIGKILL)
    else:
        go.touch()
    done = _ended(guardian)
    assert done.returncode == (128 + signal.SIGKILL if end == "killed" else 0), done.stderr
    pipe = Path(env["KREX_STATE_DIR"]) / "mps" / "gpu0" / "pipe"
    if end == "killed":
        _wait(lambda: _last_fault(env).get("pid") == kid, "the child's fault")
        assert _last_fault(env)["signal"].startswith("a signal or a crash"), _last_fault(env)
        _wait(lambda: f"command shutdown_server {server} -f {pipe}" in _events(rec), "the server restart")
        (event,) = _journal_events(env, "mps-client-fault")
        assert event["pid"] == kid and "slot" in event["command"], event
    else:
        time.sleep(1.0)  # krexd's reaper has freed its record (every 0.1 s)
        assert not _mps_status(env)["gpus"][0].get("client_faults"), _mps_status(env)
        assert not _journal_events(env, "mps-client-fault")
        assert not any("shutdown_server" in e for e in _events(rec))
    assert _krex(env, "daemon", "stop").returncode == 0


_EXECS = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, sys.argv[1])
    from cp_worker import Gpu
    g = Gpu(); g.kernel(1); g.synchronize()  # a GPU image: it registers
    os.execv("/bin/sleep", ["sleep", "0.3"])  # ... and ends as _exit would, in a new image
    """
)


def test_a_gpu_process_that_execs_a_program_that_exits_is_no_client_fault(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    """exec ends the GPU image as _exit does (its exit handlers skipped, by its own choice);
    the new image uses no GPU and exits: no client fault, no server restart."""
    env, rec = _fault_env(krex_env, tmp_path)
    assert _krex(env, "daemon", "start", "--device", "sim", "--mps").returncode == 0
    _wait(lambda: _servers(rec), "the fake MPS server")
    time.sleep(0.5)  # the watcher has seen the server
    script = tmp_path / "execs.py"
    script.write_text(_EXECS)
    guardian, _root = _started(env, "sh", "-c", f"{sys.executable} {script} {WORKER.parent}; true")
    done = _ended(guardian)
    assert done.returncode == 0, done.stderr
    time.sleep(1.0)  # krexd's reaper has freed its record (every 0.1 s)
    assert not _mps_status(env)["gpus"][0].get("client_faults"), _mps_status(env)
    assert not _journal_events(env, "mps-client-fault")
    assert not any("shutdown_server" in e for e in _events(rec))
    assert _krex(env, "daemon", "stop").returncode == 0


def test_a_gpu_process_in_a_pid_namespace_of_its_own_is_no_client_fault(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    """A GPU process in a pid namespace of its own (a container): its record's pid means
    another process (or none) to krexd, which frees the record while it lives. That is no
    end krexd saw, and its exit, a clean one, is no kill: no client fault, no restart."""
    if not shutil.which("unshare"):
        pytest.skip("needs unshare(1)")
    env, rec = _fault_env(krex_env, tmp_path)
    assert _krex(env, "daemon", "start", "--device", "sim", "--mps").returncode == 0
    _wait(lambda: _servers(rec), "the fake MPS server")
    time.sleep(0.5)  # the watcher has seen the server
    out = tmp_path / "kid"
    out.mkdir()
    go = out / "kid.go"
    worker = f"{sys.executable} {WORKER} life {out} --name kid --calls 3 --exit-on {go}"
    kid_cmd = f"unshare -pf --mount-proc {worker}"
    guardian, _root = _started(env, "sh", "-c", kid_cmd)
    _wait(lambda: (out / "kid.ready").exists(), "the child's GPU calls", timeout=60)
    time.sleep(1.0)  # krexd's reaper has looked at its record (every 0.1 s)
    assert not _mps_status(env)["gpus"][0].get("client_faults"), _mps_status(env)
    go.touch()
    assert _ended(guardian).returncode == 0
    time.sleep(1.0)
    assert not _mps_status(env)["gpus"][0].get("client_faults"), _mps_status(env)
    assert not _journal_events(env, "mps-client-fault")
    assert not any("shutdown_server" in e for e in _events(rec))
    assert _krex(env, "daemon", "stop").returncode == 0


def test_a_command_killed_without_mps_flags_nothing_and_tells_nothing(
    krex_env: dict[str, str], bins: dict[str, Path]
) -> None:
    """The negative control: the same kill beside a region, with krexd not running MPS."""
    env = dict(krex_env, **_SIBLINGS_RUN)
    assert _krex(env, "daemon", "start", "--device", "sim").returncode == 0
    victim_run, victim = _started(env, "sleep", "60")
    failing, _ = _started(env, "sh", "-c", "read x; exit 3")
    holder = _in_region(env, bins)
    try:
        assert holder.stdin is not None
        _killed(victim_run, victim)
        failed = _ended(failing, "go\n")
        assert failed.returncode == 3 and "MPS client" not in failed.stderr, failed.stderr
        done = _ended(holder, "go\n")
        assert done.returncode == 0, done.stderr
    finally:
        for p in (holder, failing, victim_run):
            if p.poll() is None:
                p.kill()
                p.wait()
    (region,) = _regions(env)
    assert not any(f.startswith("mps-") for f in region["flags"]), region
    assert not _journal_events(env, "mps-client-fault")
