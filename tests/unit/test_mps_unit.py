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
