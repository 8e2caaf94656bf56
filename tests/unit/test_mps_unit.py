"""krex/node/mps.py without processes: the settings, the refusals, the variables a command
gets, and which regions a control daemon's time down flags `mps-server`."""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from pathlib import Path

import pytest

from krex.device.gpus import GpuInfo
from krex.errors import MpsUnavailable, UsageError
from krex.node import config, mps
from krex.node.config import Config


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for k in ("KREX_MPS", "KREX_MPS_PIPE_DIR", "KREX_MPS_CONTROL", "KREX_CONFIG"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("KREX_STATE_DIR", str(tmp_path / "state"))


def _sim(n: int = 2) -> GpuInfo:
    return GpuInfo("sim", n, physical=list(range(n)))


def test_settings_flow_from_the_environment_and_a_bare_flag_means_on(monkeypatch: pytest.MonkeyPatch) -> None:
    assert config.config_from("sim", {}).mps == "off"
    monkeypatch.setenv("KREX_MPS", "on")
    monkeypatch.setenv("KREX_MPS_PIPE_DIR", "/run/mps")
    cfg = config.config_from("sim", {})
    assert (cfg.mps, cfg.mps_pipe_dir) == ("on", "/run/mps")
    assert cfg.sources["mps"] == "env KREX_MPS"
    ap = argparse.ArgumentParser()
    config.add_arguments(ap)
    assert ap.parse_args(["--mps"]).mps == "on" and ap.parse_args(["--mps", "off"]).mps == "off"
    assert config.to_argv({"mps": "on", "mps_pipe_dir": "/x"}) == ["--mps", "on", "--mps-pipe-dir", "/x"]
    monkeypatch.setenv("KREX_MPS_PIPE_DIR", "relative/dir")
    with pytest.raises(UsageError, match="absolute"):
        config.config_from("sim", {})


def test_off_gives_commands_nothing_and_flags_nothing() -> None:
    m = mps.Mps(Config(device="sim"), _sim())
    assert m.mode == "off" and m.command_env(0) == {} and m.flags(0, 0) == []
    assert m.status() == {"mode": "off", "gpus": []}


def test_the_simulated_gpu_has_no_mps_unless_a_control_program_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(MpsUnavailable, match="simulated GPU has no MPS"):
        mps.Mps(Config(device="sim", mps="on"), _sim())
    monkeypatch.setenv("KREX_MPS_CONTROL", "/nonexistent/control")
    with pytest.raises(MpsUnavailable, match="cannot be found"):
        mps.Mps(Config(device="sim", mps="on"), _sim())
    with pytest.raises(MpsUnavailable, match="NVIDIA's"):
        mps.Mps(Config(device="auto", mps="on"), GpuInfo("amd", 1, physical=[0]))


def test_commands_get_their_gpus_directories_and_uuid_where_known(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KREX_MPS_CONTROL", "true")
    info = GpuInfo("sim", 2, physical=[0, 1], visible=["GPU-aaaa", "1"])
    m = mps.Mps(Config(device="sim", mps="on"), info)
    root = tmp_path / "state" / "mps"
    assert m.command_env(1) == {"CUDA_MPS_PIPE_DIRECTORY": str(root / "gpu1" / "pipe"),
                                "CUDA_MPS_LOG_DIRECTORY": str(root / "gpu1" / "log")}
    assert m.command_env(0)["CUDA_VISIBLE_DEVICES"] == "GPU-aaaa"
    assert m.gpus[0].visible == "GPU-aaaa" and m.gpus[1].visible == "1"
    attached = mps.Mps(Config(device="sim", mps_pipe_dir="/run/their-mps"), info)
    assert attached.mode == "attach"
    assert attached.command_env(1) == {"CUDA_MPS_PIPE_DIRECTORY": "/run/their-mps"}


def test_a_region_is_flagged_when_the_control_daemon_was_down_at_any_time_since_it_began(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KREX_MPS_CONTROL", "true")
    m = mps.Mps(Config(device="sim", mps="on"), _sim())
    now = time.monotonic_ns()
    m.gpus[0].down = [[now - 3_000, now - 2_000]]  # down and back before the region
    assert m.flags(0, now - 1_000) == []
    # Running when it died (back up after the region began), or begun while it was down.
    assert [f for f, _t in m.flags(0, now - 2_500)] == [mps.FLAG]
    assert [f for f, _t in m.flags(0, now - 4_000)] == [mps.FLAG]
    m.gpus[0].down.append([now - 500, None])  # down now
    assert [f for f, _t in m.flags(0, now)] == [mps.FLAG]
    assert m.flags(1, 0) == []  # another GPU's control daemon is another matter


def test_the_mps_servers_below_a_control_daemon_in_use_count_as_krexs_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NVML lists the MPS server (it holds every client's context) beside the clients: the
    processes below a control daemon in use are KREX's own, or every region under MPS is
    flagged foreign-process (seen on an H100). A control daemon that is down owns nothing."""
    import subprocess
    import sys

    from krex.native import lib

    monkeypatch.setenv("KREX_MPS_CONTROL", "true")
    m = mps.Mps(Config(device="sim", mps="on"), _sim(1))
    # A stand-in control daemon with a server child that has a child of its own.
    sleeper = "import time; time.sleep(60)"
    server = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {sleeper!r}]); {sleeper}"
    control = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {server!r}]); {sleeper}"
    ctl = subprocess.Popen([sys.executable, "-c", control])
    below: set[int] = set()
    try:
        g = m.gpus[0]
        g.pid, g.start_ticks, g.state = ctl.pid, int(lib.krex_pid_start_ticks(ctl.pid)), "on"
        deadline = time.monotonic() + 10
        while len(m.servers()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        below = m.servers()
        assert len(below) == 2 and ctl.pid not in below, below
        g.state = "down"
        assert m.servers() == set()
    finally:
        for pid in (ctl.pid, *below):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        ctl.wait()


def test_a_pid_file_is_read_only_when_it_can_name_a_control_daemon(tmp_path: Path) -> None:
    """The pid file is anyone's word who can write the pipe directory: a FIFO (which would
    block krexd), a link, a number past the kernel's pid range, init or krexd's own pid is
    no pid at all."""
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    f = pipe / mps.PID_FILE
    for text, want in (("4242\n", 4242), ("1", None), (str(os.getpid()), None),
                       ("99999999999999999999", None), ("garbage", None), ("", None)):
        f.write_text(text)
        assert mps._read_pid(pipe) == want, text
    f.unlink()
    os.mkfifo(f)
    assert mps._read_pid(pipe) is None  # returns at once: never waits for a writer
    f.unlink()
    (tmp_path / "elsewhere").write_text("4242")
    f.symlink_to(tmp_path / "elsewhere")
    assert mps._read_pid(pipe) is None


def test_a_command_that_carries_the_pipe_directory_is_no_control_daemon(tmp_path: Path) -> None:
    """A command krexd admitted has CUDA_MPS_PIPE_DIRECTORY too: only a process running the
    control program (argv[0], or the script an interpreter runs) counts as a control daemon,
    so a stale pid file that names a command never gets it signalled."""
    import subprocess
    import sys

    pipe = tmp_path / "pipe"
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(pipe))
    cmd = subprocess.Popen(["sleep", "30"], env=env)
    prog = tmp_path / "fake-control"
    prog.write_text("import time; time.sleep(30)\n")
    ctl = subprocess.Popen([sys.executable, str(prog), "-d"], env=env)
    try:
        time.sleep(0.2)
        names = {mps.CONTROL_BIN, "fake-control"}
        assert mps._serves(cmd.pid, pipe) and not mps._is_control(cmd.pid, names)
        assert mps._is_control(ctl.pid, names)
        assert not mps._is_control(1, names)
    finally:
        for p in (cmd, ctl):
            p.kill()
            p.wait()


def test_attaching_trusts_only_a_directory_of_root_or_krexds_user_and_a_real_control_pid(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KREX_MPS_CONTROL", "true")
    pipe = tmp_path / "their-pipe"
    pipe.mkdir()
    (pipe / mps.CONTROL_PIPE).write_text("")
    (pipe / mps.PID_FILE).write_text("1")  # init's pid: would make every process "known"
    m = mps.Mps(Config(device="sim", mps_pipe_dir=str(pipe)), _sim(1))
    m._attach()  # pid 1 is refused as a pid, so there is none to watch...
    assert m.gpus[0].pid is None and m.servers() == set()  # ...and nothing counts as MPS's own
    os.chown(pipe, 65534, 65534)  # another user's directory
    with pytest.raises(MpsUnavailable, match="cannot be trusted"):
        m._attach()


def test_a_control_daemon_that_keeps_dying_at_once_is_restarted_ever_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No restart storm: each death within FAST_DEATH_S of its start doubles the wait."""
    monkeypatch.setenv("KREX_MPS_CONTROL", "true")
    m = mps.Mps(Config(device="sim", mps="on"), _sim(1))
    g = m.gpus[0]
    waits = []
    for _ in range(6):
        g.state, g.pid, g.start_ticks, g.started_at = "on", 2**22, 0, time.monotonic()
        now = time.monotonic()
        with m._lock:
            m._check(g)
        assert g.state == "down"
        waits.append(round(g.next_try - now))
    assert waits == [5, 10, 20, 40, 60, 60], waits


def test_a_client_killed_flags_regions_and_tells_failures_while_its_fault_is_fresh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A command killed by a signal on an MPS GPU: regions running then or begun while the
    fault is fresh are flagged mps-client-fault; a command that ran meanwhile and failed is
    told; one that succeeded, the killed one itself and one begun after the window are not."""
    monkeypatch.setenv("KREX_MPS_CONTROL", "true")
    m = mps.Mps(Config(device="sim", mps="on", mps_fault_window_s=0.2), _sim())
    before = time.monotonic_ns()
    assert m.command_exit(0, before, 41, 1, 0, "true") == (None, None)  # no fault yet: nothing to tell
    made, told = m.command_exit(0, before, 42, 137, 9, "python gemm.py")
    assert told is None and made is not None and made.signame() == "SIGKILL" and made.restart == "pending"
    assert m.gpus[0].restart_due is made and m.gpus[1].restart_due is None
    flags = m.flags(0, before)  # running when it was killed
    assert [f for f, _ in flags] == [mps.CLIENT_FLAG] and "pid 42, `python gemm.py`" in flags[0][1]
    assert [f for f, _ in m.flags(0, time.monotonic_ns())] == [mps.CLIENT_FLAG]  # begun while fresh
    assert m.flags(1, before) == []  # another GPU
    assert m.command_exit(0, before, 43, 0, 0, "ok")[1] is None  # succeeded: nothing to tell
    _, told = m.command_exit(0, time.monotonic_ns(), 44, 1, 0, "next")
    assert told is made
    notice = told.notice()
    assert notice.startswith("krex: warning: an MPS client (pid 42, `python gemm.py`) was killed by SIGKILL")
    assert notice.endswith("the MPS server refuses clients until it restarts: rerun the command")
    time.sleep(0.25)  # the window is over
    assert m.flags(0, time.monotonic_ns()) == []
    assert m.command_exit(0, time.monotonic_ns(), 45, 1, 0, "later")[1] is None
    off = mps.Mps(Config(device="sim"), _sim())
    assert off.command_exit(0, before, 42, 137, 9, "x") == (None, None) and off.flags(0, before) == []


def test_an_attached_control_daemons_server_is_never_restarted_for_a_client_fault(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KREX_MPS_CONTROL", "true")
    m = mps.Mps(Config(device="sim", mps_pipe_dir="/run/their-mps"), _sim(1))
    made, _ = m.command_exit(0, time.monotonic_ns(), 42, 137, 9, "x")
    assert made is not None and m.gpus[0].restart_due is None and made.restart.startswith("not krexd's")
