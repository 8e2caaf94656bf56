"""krexd settings (krex/node/config.py): command line > environment > config file > defaults,
and every bad value named with its source and a fix. Also: the library's logger."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from krex.errors import UsageError
from krex.node.config import ON_DEMAND_IDLE_EXIT_S, Config, config_from, daemon_settings

ENV = [k for k in ("KREX_CONFIG", "XDG_CONFIG_HOME")] + [
    "KREX_SLOTS_PER_GPU",
    "KREX_MAX_REGION",
    "KREX_IDLE_EXIT",
    "KREX_FREEZER",
    "KREX_FREEZE_POLICY",
    "KREX_FREEZE_TIMEOUT",
    "KREX_DRAIN_TIMEOUT",
    "KREX_LOG_LEVEL",
]


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for k in ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))  # no user config file
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def _file(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "krex.toml"
    p.write_text(text)
    return p


def test_defaults_when_nothing_is_set() -> None:
    if Path("/etc/krex/krex.toml").exists():
        pytest.skip("this machine has /etc/krex/krex.toml")
    values, sources = daemon_settings()
    assert values == {} and sources == {}
    cfg = config_from("sim", {})
    assert cfg == Config(device="sim")
    assert cfg.freeze_policy == "gpu"  # most throughput, fewest flagged (docs/results/freeze-policies/)
    values, sources = daemon_settings(on_demand=True)
    assert values == {"idle_exit_s": ON_DEMAND_IDLE_EXIT_S}
    assert sources == {"idle_exit_s": "on-demand default"}


def test_file_then_environment_then_command_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    f = _file(
        tmp_path,
        '[daemon]\nslots_per_gpu = 3\nmax_region = 30\nidle_exit = "never"\nfreezer = "signal"\n'
        'log_level = "debug"\ndrain_timeout = 1.5\nfreeze_policy = "gpu"\n',
    )
    monkeypatch.setenv("KREX_CONFIG", str(f))
    monkeypatch.setenv("KREX_MAX_REGION", "12.5")
    monkeypatch.setenv("KREX_FREEZE_TIMEOUT", "0.5")
    cfg = config_from("sim", {"slots_per_gpu": 5, "freezer": None}, on_demand=True)
    assert cfg.slots_per_gpu == 5 and cfg.sources["slots_per_gpu"] == "command line"
    assert cfg.max_region_s == 12.5 and cfg.sources["max_region_s"] == "env KREX_MAX_REGION"
    assert cfg.freeze_timeout_s == 0.5
    assert cfg.idle_exit_s is None and cfg.sources["idle_exit_s"] == f"file {f}"  # "never" beats on-demand
    assert cfg.freezer == "signal" and cfg.log_level == "debug" and cfg.drain_timeout_s == 1.5
    assert cfg.freeze_policy == "gpu"
    monkeypatch.setenv("KREX_FREEZE_POLICY", "adaptive")
    assert config_from("sim", {}).freeze_policy == "adaptive"
    assert config_from("sim", {"freeze_policy": "all"}).freeze_policy == "all"


def test_user_config_file_is_found(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    d = tmp_path / "xdg" / "krex"
    d.mkdir(parents=True)
    (d / "krex.toml").write_text("[daemon]\nmax_region = 7\n")
    assert config_from("sim", {}).max_region_s == 7.0


@pytest.mark.parametrize(
    ("var", "value", "words"),
    [
        ("KREX_MAX_REGION", "abc", ["KREX_MAX_REGION='abc'", "seconds"]),
        ("KREX_MAX_REGION", "nan", ["KREX_MAX_REGION='nan'"]),
        ("KREX_SLOTS_PER_GPU", "2.5", ["KREX_SLOTS_PER_GPU", "whole number"]),
        ("KREX_SLOTS_PER_GPU", "0", ["KREX_SLOTS_PER_GPU", "1..64"]),
        ("KREX_FREEZER", "ice", ["KREX_FREEZER", "cgroup2"]),
        ("KREX_FREEZE_POLICY", "some", ["KREX_FREEZE_POLICY", "adaptive"]),
        ("KREX_IDLE_EXIT", "-1", ["KREX_IDLE_EXIT", "never"]),
        ("KREX_LOG_LEVEL", "loud", ["KREX_LOG_LEVEL", "debug"]),
    ],
)
def test_bad_environment_is_named(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, words: list[str]
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(UsageError) as ei:
        daemon_settings()
    text = f"{ei.value} {ei.value.fix}"
    for w in words:
        assert w in text


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[daemon]\nmax_regoin = 5\n", ["unknown key", "max_regoin", "max_region"]),
        ("[daemon]\nmax_region = 'x'\n", ["max_region = 'x'"]),
        ("[daemon\n", ["not valid TOML"]),
        ("daemon = 3\n", ["[daemon] must be a table"]),
        ("[daemon]\nslots_per_gpu = true\n", ["slots_per_gpu = True"]),
    ],
)
def test_bad_file_is_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str, words: list[str]
) -> None:
    f = _file(tmp_path, text)
    monkeypatch.setenv("KREX_CONFIG", str(f))
    with pytest.raises(UsageError) as ei:
        daemon_settings()
    assert str(f) in str(ei.value)
    for w in words:
        assert w in str(ei.value) + ei.value.fix


def test_missing_config_file_is_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KREX_CONFIG", str(tmp_path / "nope.toml"))
    with pytest.raises(UsageError, match="does not exist"):
        daemon_settings()


def test_library_logs_to_krex_logger_with_null_handler() -> None:
    import krex  # noqa: F401

    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("krex").handlers)
    # Importing and using the library prints nothing, even with Python's last-resort handler.
    code = (
        "import logging, krex, krex.proc.client, krex.node.daemon\n"
        "logging.getLogger('krex.proc.client').info('hidden')\n"
        "logging.getLogger('krex.proc.client').warning('shown by lastResort only without NullHandler')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout == "" and p.stderr == "", p.stderr
