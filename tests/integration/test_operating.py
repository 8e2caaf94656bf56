"""Operating krexd: its log (start, configuration, forced region ends, drain timeouts,
fail-opens, each with a timestamp and pids), the settings of an on-demand daemon from a
config file and the environment, and the CLI's -v/-q."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

KREX = [sys.executable, "-m", "krex.cli.main"]
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} krexd\[(\d+)\] (DEBUG|INFO|WARNING|ERROR) (.*)$")


def krex(env: dict[str, str], *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KREX, *args], env=env, capture_output=True, text=True, timeout=timeout)


def log_lines(env: dict[str, str]) -> list[tuple[int, str, str]]:
    p = Path(env["KREX_STATE_DIR"]) / "krexd.log"
    out = []
    for line in p.read_text().splitlines() if p.exists() else []:
        m = LINE.match(line)
        if m:
            out.append((int(m.group(1)), m.group(2), m.group(3)))
    return out


def wait_log(env: dict[str, str], pattern: str, timeout: float = 30) -> tuple[int, str, str]:
    rx = re.compile(pattern)
    t = time.monotonic() + timeout
    while time.monotonic() < t:
        for rec in log_lines(env):
            if rx.search(rec[2]):
                return rec
        time.sleep(0.05)
    raise AssertionError(
        f"no krexd.log line matching {pattern!r}; log:\n" + "\n".join(map(str, log_lines(env)))
    )


def test_on_demand_daemon_takes_config_file_and_env_and_logs_a_forced_end(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    conf = tmp_path / "krex.toml"
    conf.write_text("[daemon]\nmax_region = 0.3\nslots_per_gpu = 3\n")
    env = dict(krex_env, KREX_CONFIG=str(conf), KREX_FREEZE_TIMEOUT="1.5")
    code = "import krex, time\nwith krex.region():\n    time.sleep(3)\n"
    p = krex(env, "run", "--device", "sim", "--", sys.executable, "-c", code)
    assert p.returncode == 0, p.stderr
    st = json.loads(krex(env, "daemon", "status", "--json").stdout)
    pid = st["daemon"]["pid"]
    assert st["daemon"]["max_region_s"] == 0.3 and st["slots_per_gpu"] == [3]
    assert st["daemon"]["idle_exit_s"] == 120.0  # on-demand: exits when idle
    lpid, level, msg = wait_log(env, r"^krexd \S+ started: pid \d+")
    assert lpid == pid and level == "INFO" and f"pid {pid}" in msg and env["KREX_SHM"] in msg
    _, _, cfg = wait_log(env, r"^config: ")
    assert f"max_region_s=0.3 (file {conf})" in cfg
    assert f"slots_per_gpu=3 (file {conf})" in cfg
    assert "freeze_timeout_s=1.5 (env KREX_FREEZE_TIMEOUT)" in cfg
    assert "idle_exit_s=120.0 (on-demand default)" in cfg
    _, level, forced = wait_log(env, r"ended by force: max-region")
    assert level == "WARNING" and re.search(r"slot \d+ pid \d+ tid \d+", forced)
    assert krex(env, "daemon", "stop").returncode == 0
    wait_log(env, r"^krexd stopping: shutdown requested by pid \d+")
    wait_log(env, rf"^krexd stopped \(pid {pid}, 1 region")


def test_krexd_logs_a_drain_timeout(krex_env: dict[str, str], bins: dict[str, Path]) -> None:
    env = dict(krex_env, KREX_DRAIN_TIMEOUT="0.3")
    actor = 0
    sib = subprocess.Popen(
        [*KREX, "run", "--device", "sim", "--", str(bins["actor"]), "k:100", "line"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sib.stdout is not None
        while True:  # the actor prints a "start" line, then one per action
            line = json.loads(sib.stdout.readline())
            if str(line["act"]).startswith("k"):
                break  # the kernel is launched: the process is registered with its drain helper
        actor = int(line["pid"])
        os.kill(actor, signal.SIGSTOP)  # a stopped sibling cannot ack the drain
        code = "import krex\nwith krex.region():\n    pass\n"
        p = krex(env, "run", "--device", "sim", "--", sys.executable, "-c", code)
        assert p.returncode == 0, p.stderr
        _, level, msg = wait_log(env, r"granted CONTAMINATED")
        assert level == "WARNING" and f"pids [{actor}] did not ack the drain within 0.3s" in msg, msg
    finally:
        if actor:
            os.kill(actor, signal.SIGCONT)
        if sib.stdin:
            sib.stdin.close()
        sib.wait(timeout=60)


def test_krexd_logs_fail_opens(krex_env: dict[str, str], bins: dict[str, Path]) -> None:
    env = krex_env
    assert krex(env, "daemon", "start", "--device", "sim").returncode == 0
    assert krex(env, "pause", "--gpu", "0", "--for", "1").returncode == 0
    # The command's kernel waits at the closed gate until the pause lease lapses, then
    # passes (a fail-open, I5); krexd notices the counter and says so.
    p = krex(env, "run", "--device", "sim", "--", str(bins["actor"]), "k:100", "sleep:300")
    assert p.returncode == 0, p.stderr
    _, level, msg = wait_log(env, r"gpu 0: 1 fail-open\(s\) \(total 1\)")
    assert level == "WARNING" and "expired pause lease" in msg


def test_bad_setting_is_named_before_a_daemon_starts(krex_env: dict[str, str]) -> None:
    env = dict(krex_env, KREX_MAX_REGION="soon")
    p = krex(env, "daemon", "start", "--device", "sim")
    assert p.returncode == 2 and "KREX_MAX_REGION='soon'" in p.stderr and "fix:" in p.stderr
    # An on-demand start fails the same way, and the error points at the log that says why.
    r = krex(env, "run", "--device", "sim", "--", "true")
    assert r.returncode != 0 and "KREX_MAX_REGION" in r.stderr and "krexd.log" in r.stderr


def test_verbose_and_quiet(krex_env: dict[str, str]) -> None:
    env = krex_env
    v = krex(env, "-v", "run", "--device", "sim", "--", "true")
    assert v.returncode == 0 and "krex: INFO krex.proc.client: starting krexd" in v.stderr, v.stderr
    assert krex(env, "daemon", "stop").returncode == 0
    plain = krex(env, "run", "--device", "sim", "--", "true")
    assert plain.returncode == 0 and "starting krexd" not in plain.stderr
    assert krex(env, "daemon", "stop").returncode == 0
    q = krex(env, "-q", "run", "--device", "sim", "--", "sh", "-c", "echo out; echo err >&2")
    assert q.returncode == 0 and q.stdout == "out\n" and q.stderr == "err\n"
    both = krex(env, "-v", "-q", "status")
    assert both.returncode == 2 and "contradict" in both.stderr


@pytest.mark.parametrize("flag", ["-q", ""])
def test_quiet_silences_batch_progress(krex_env: dict[str, str], tmp_path: Path, flag: str) -> None:
    cmds = tmp_path / "cmds.txt"
    cmds.write_text("true\ntrue\n")
    args = [flag] if flag else []
    p = krex(krex_env, *args, "batch", str(cmds), "-j", "2", "--device", "sim", "--out", str(tmp_path / "o"))
    assert p.returncode == 0, p.stderr
    assert ("krex batch:" in p.stderr) == (not flag), p.stderr
