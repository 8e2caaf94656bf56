"""krexd's settings, from the command line, the environment or a config file.

Precedence: command line > environment > config file > defaults. The config file is
``$KREX_CONFIG`` if set (``/dev/null`` for none), else the first that exists of
``${XDG_CONFIG_HOME:-~/.config}/krex/krex.toml`` and ``/etc/krex/krex.toml``; its
``[daemon]`` table holds the keys below. This matters most for the daemon that
``krex run`` or a self-registering process starts on demand: nobody passes it flags.

  key              environment            meaning (default)
  slots_per_gpu    KREX_SLOTS_PER_GPU     admission limit per GPU (from the CPU slice)
  max_region       KREX_MAX_REGION        seconds before a region is ended by force (60)
  idle_exit        KREX_IDLE_EXIT         seconds idle before exiting; "never" (on-demand 120,
                                          `krex daemon start` never)
  freezer          KREX_FREEZER           freeze backend: cgroup2, cgroup1, signal (first that works)
  freeze_policy    KREX_FREEZE_POLICY     which siblings a region freezes: all, gpu, adaptive (all)
  lend_cores       KREX_LEND_CORES        commands may run on their GPU's region core while no region
                                          needs it; a region moves them off it (off)
  freeze_timeout   KREX_FREEZE_TIMEOUT    seconds to wait for a group to report frozen (2)
  drain_timeout    KREX_DRAIN_TIMEOUT     seconds to wait for in-flight work and drain acks (5)
  log_level        KREX_LOG_LEVEL         debug, info, warning, error (info)
  group            KREX_GROUP             share the daemon with this group: members run commands
                                          and pause, only its user or root stop it (its own group)
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from krex.errors import UsageError
from krex.node import freezepolicy

ON_DEMAND_IDLE_EXIT_S = 120.0
FREEZERS = ("cgroup2", "cgroup1", "signal")
LOG_LEVELS = ("debug", "info", "warning", "error")


def _num(lo: float, hi: float, integer: bool = False) -> Callable[[Any], Any]:
    def conv(v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError("not a number")
        x = float(v) if not isinstance(v, (int, float)) else v
        if integer and float(x) != int(float(x)):
            raise ValueError("not a whole number")
        if not math.isfinite(float(x)) or not lo <= float(x) <= hi:
            raise ValueError(f"not in [{lo:g}, {hi:g}]")
        return int(float(x)) if integer else float(x)

    return conv


def _idle(v: Any) -> float | None:
    if isinstance(v, str) and v.strip().lower() in ("never", "none", "off"):
        return None
    return float(_num(0.1, 1e9)(v))


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("not a yes/no value")


def _choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    def conv(v: Any) -> str:
        s = str(v).strip().lower()
        if s not in options:
            raise ValueError(f"not one of {', '.join(options)}")
        return s

    return conv


def _group(v: Any) -> str:
    s = str(v).strip()
    if not s or any(c.isspace() for c in s):
        raise ValueError("not a group name or gid")
    return s


@dataclass(frozen=True)
class Key:
    name: str  # Config field
    file_key: str
    env: str
    conv: Callable[[Any], Any]
    hint: str


KEYS = (
    Key("slots_per_gpu", "slots_per_gpu", "KREX_SLOTS_PER_GPU", _num(1, 64, True), "a whole number 1..64"),
    Key("max_region_s", "max_region", "KREX_MAX_REGION", _num(0.001, 1e9), "seconds, e.g. 60"),
    Key("idle_exit_s", "idle_exit", "KREX_IDLE_EXIT", _idle, "seconds, e.g. 120, or never"),
    Key("freezer", "freezer", "KREX_FREEZER", _choice(FREEZERS), "one of " + ", ".join(FREEZERS)),
    Key(
        "freeze_policy",
        "freeze_policy",
        "KREX_FREEZE_POLICY",
        _choice(freezepolicy.POLICIES),
        "one of " + ", ".join(freezepolicy.POLICIES),
    ),
    Key("lend_cores", "lend_cores", "KREX_LEND_CORES", _bool, "1 or 0 (true or false)"),
    Key("freeze_timeout_s", "freeze_timeout", "KREX_FREEZE_TIMEOUT", _num(0.01, 3600), "seconds, e.g. 2"),
    Key("drain_timeout_s", "drain_timeout", "KREX_DRAIN_TIMEOUT", _num(0.01, 3600), "seconds, e.g. 5"),
    Key("log_level", "log_level", "KREX_LOG_LEVEL", _choice(LOG_LEVELS), "one of " + ", ".join(LOG_LEVELS)),
    Key("group", "group", "KREX_GROUP", _group, "a group name or gid whose members share the daemon"),
)


def config_file() -> Path | None:
    """The config file in force, or None."""
    raw = os.environ.get("KREX_CONFIG")
    if raw:
        p = Path(raw)
        if not p.exists():
            raise UsageError(
                f"KREX_CONFIG={raw!r} does not exist", "point KREX_CONFIG at a TOML file, or unset it"
            )
        return p
    xdg = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    for p in (Path(xdg) / "krex" / "krex.toml", Path("/etc/krex/krex.toml")):
        if p.is_file():
            return p
    return None


def _read_toml(p: Path) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    try:
        with open(p, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise UsageError(f"cannot read the config file {p}: {e.strerror}", "fix its permissions") from e
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"the config file {p} is not valid TOML: {e}", "fix its syntax") from e
    table = data.get("daemon", {})
    if not isinstance(table, dict):
        raise UsageError(f"{p}: [daemon] must be a table", "write the keys under a [daemon] header")
    unknown = sorted(set(table) - {k.file_key for k in KEYS})
    if unknown:
        raise UsageError(
            f"{p}: unknown key(s) in [daemon]: {', '.join(unknown)}",
            "use " + ", ".join(k.file_key for k in KEYS),
        )
    return table


def daemon_settings(
    overrides: dict[str, Any] | None = None, on_demand: bool = False
) -> tuple[dict[str, Any], dict[str, str]]:
    """({Config field: value}, {Config field: where it came from}) for the keys that are
    set anywhere; the daemon's own defaults fill the rest. ``overrides`` are command-line
    values (None means not given)."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if on_demand:
        values["idle_exit_s"], sources["idle_exit_s"] = ON_DEMAND_IDLE_EXIT_S, "on-demand default"
    path = config_file()
    table = _read_toml(path) if path else {}
    for k in KEYS:
        if k.file_key in table:
            try:
                values[k.name] = k.conv(table[k.file_key])
            except (TypeError, ValueError) as e:
                raise UsageError(
                    f"{path}: {k.file_key} = {table[k.file_key]!r}: {e}", f"use {k.hint}"
                ) from None
            sources[k.name] = f"file {path}"
        raw = os.environ.get(k.env)
        if raw not in (None, ""):
            try:
                values[k.name] = k.conv(raw)
            except (TypeError, ValueError) as e:
                raise UsageError(f"{k.env}={raw!r}: {e}", f"set {k.env} to {k.hint}") from None
            sources[k.name] = f"env {k.env}"
    for name, v in (overrides or {}).items():
        if v is not None:
            values[name], sources[name] = v, "command line"
    return values, sources
