"""krexd's settings: ONE table (`KEYS`) from which the config file, the environment,
`python -m krex.node.daemon`'s argparse options, `krex daemon start`'s click options and
the argv of a daemon started in the background are all made; `Config` holds the
defaults (the timing ones are krex_abi.h's KREX_*_MS, read through cffi).

Precedence: command line > environment > config file > defaults. The config file is
``$KREX_CONFIG`` if set (``/dev/null`` for none), else the first that exists of
``${XDG_CONFIG_HOME:-~/.config}/krex/krex.toml`` and ``/etc/krex/krex.toml``; its
``[daemon]`` table holds the keys below. This matters most for the daemon that
``krex run`` or a self-registering process starts on demand: nobody passes it flags.

  key              environment            flag               meaning
  slots_per_gpu    KREX_SLOTS_PER_GPU     --slots-per-gpu    admission limit per GPU (from the CPU slice)
  prewarm          KREX_PREWARM           --prewarm          commands per GPU started before a slot frees up:
                                                             they wait at their first GPU call (default 0)
  max_region       KREX_MAX_REGION        --max-region       seconds before a region is ended by force
  idle_exit        KREX_IDLE_EXIT         --idle-exit        seconds idle before exiting, or "never"
                                                             (on demand: KREX_ON_DEMAND_IDLE_EXIT_MS)
  freezer          KREX_FREEZER           --freezer          freeze backend: cgroup2, cgroup1, signal
  freeze_policy    KREX_FREEZE_POLICY     --freeze-policy    which siblings a region freezes
  lend_cores       KREX_LEND_CORES        --lend-cores       off, region or all: commands may also run on
                                                             their GPU's region core (and the housekeeping
                                                             core) while no region needs it
  drain_budget_ms  KREX_DRAIN_BUDGET_MS   --drain-budget     while commands share a GPU, the GPU work (ms) all
                                                             of them together may keep queued, each its share:
                                                             what a region's entry drains (default 4); 0: each
                                                             command by queue_cap_ms instead
  pace_tokens      KREX_PACE_TOKENS       --pace-tokens      under the drain budget, how many commands whose
                                                             queued work is longer than their share may have
                                                             it on the GPU at once (default 2, at most 4);
                                                             0: each keeps one interval in flight
  queue_cap_ms     KREX_QUEUE_CAP_MS                         with no drain budget: how long (ms) the GPU
                                                             work a command has queued may wait before its
                                                             next submissions wait for it; 0: unbounded
  early_shrink     KREX_EARLY_SHRINK                         on (default) or off: while a region is queued
                                                             or announced (an automatic region's target is
                                                             entered), siblings' queues shrink and their
                                                             context, module and memory calls wait for
                                                             its gate
  life_freeze      KREX_LIFE_FREEZE                          off (default) or on: under the gpu policy, a
                                                             region's entry freezes a sibling inside a
                                                             context, module or memory call with nothing
                                                             else queued, rather than wait for the call
  helper_nice      KREX_HELPER_NICE                          the nice krexd lends the threads a region's drain
                                                             waits for: drain helpers, and a thread inside
                                                             a context, module or memory call (root; 0: off)
  freeze_timeout   KREX_FREEZE_TIMEOUT                       seconds to wait for a group to report frozen
  drain_timeout    KREX_DRAIN_TIMEOUT                        seconds to wait for in-flight work and drain acks
  region_queue     KREX_REGION_QUEUE      --region-queue     fair (default: tenants share exclusive GPU time
                                                             by weight) or fifo (first come, first served)
  tenant_weights   KREX_TENANT_WEIGHTS    --tenant-weights   NAME=WEIGHT,... for the fair queue (others: 1)
  mps              KREX_MPS               --mps              off (default) or on: one NVIDIA MPS control
                                                             daemon per GPU, started and stopped by krexd
                                                             (krex/node/mps.py); a bare --mps means on
  mps_pipe_dir     KREX_MPS_PIPE_DIR      --mps-pipe-dir     attach to the MPS control daemon already
                                                             running at this pipe directory (never stopped)
  mps_fault_window KREX_MPS_FAULT_WINDOW                     seconds an MPS client killed by a signal flags
                                                             its GPU's regions (mps-client-fault) at most,
                                                             when no server restart is seen sooner
                                                             (default 10)
  log_level        KREX_LOG_LEVEL         --log-level        debug, info, warning, error
  group            KREX_GROUP             --group            share the daemon with this group: members run
                                                             commands and pause, only its user or root stop it
  throwaway        KREX_THROWAWAY         --throwaway        a throwaway world (a bench's own, a fleet node's
                                                             under --node-root): a clean stop removes its
                                                             segment, pins and $KREX_SIM_SHM when unused
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from krex.errors import UsageError
from krex.native import lib
from krex.node import freezepolicy, regionqueue

if TYPE_CHECKING:  # argparse is imported where a parser is built: `krex run` loads this module
    import argparse

ON_DEMAND_IDLE_EXIT_S = lib.KREX_ON_DEMAND_IDLE_EXIT_MS / 1e3
DAEMON_MODULE = "krex.node.daemon"  # what `python -m` runs to start krexd
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


LEND = ("off", "region", "all")


def _lend(v: Any) -> str:
    """off, region (the GPU's region core) or all (the housekeeping core too); the yes/no
    of older configurations still reads: yes is region."""
    s = str(v).strip().lower()
    if s in LEND:
        return s
    return "region" if _bool(v) else "off"


def _choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    def conv(v: Any) -> str:
        s = str(v).strip().lower()
        if s not in options:
            raise ValueError(f"not one of {', '.join(options)}")
        return s

    return conv


def _weights(v: Any) -> str:
    """NAME=WEIGHT pairs (regionqueue.parse_weights), kept as written."""
    try:
        regionqueue.parse_weights(str(v))
    except UsageError as e:
        raise ValueError(f"{e}; {e.fix}") from None
    return str(v).strip()


MPS_MODES = ("off", "on")


def _on_off(v: Any) -> str:
    """off or on, read as the other yes/no settings are (yes/no, true/false, 1/0, a TOML bool)."""
    return "on" if _bool(v) else "off"


def _abs_dir(v: Any) -> str:
    s = str(v).strip()
    if not s.startswith("/") or any(c.isspace() for c in s):
        raise ValueError("not an absolute path without spaces")
    return s


def _group(v: Any) -> str:
    s = str(v).strip()
    if not s or any(c.isspace() for c in s):
        raise ValueError("not a group name or gid")
    return s


@dataclass
class Config:
    """krexd's settings. The defaults live here and only here (timings: krex_abi.h)."""

    device: str = "auto"
    slots_per_gpu: int | None = None  # None: from the GPU's CPU slice (krex.node.cpus)
    # Pre-warmed starts: up to this many commands per GPU beyond slots_per_gpu are started at
    # once, to import and set up on the CPU; their first GPU call waits for a slot (shim.c).
    prewarm: int = 0
    max_region_s: float = lib.KREX_MAX_REGION_MS / 1e3
    drain_timeout_s: float = lib.KREX_DRAIN_TIMEOUT_MS / 1e3
    freeze_timeout_s: float = lib.KREX_FREEZE_TIMEOUT_MS / 1e3
    idle_exit_s: float | None = None  # None: never (a daemon started on demand: ON_DEMAND_IDLE_EXIT_S)
    freezer: str | None = None  # None: the first backend that works
    shm_name: str | None = None
    freeze_policy: str = freezepolicy.DEFAULT  # see krex/node/freezepolicy.py
    # Commands may also run on their GPU's region core(s) ("region"), and on the housekeeping
    # core ("all"), while no region needs them; a region moves every thread but the
    # measuring one off the region core (cpus.evict). "all" by default: side by side on the
    # H200 it made more commands a minute than "off" at C=8 and 16, with every band's p95
    # inflation lower (docs/results/lend-cores/).
    lend_cores: str = "all"
    # Bounded queues (interpose/pace.c): a region's entry drains what siblings queued. The
    # budget bounds all of it on a GPU (each command its share); 0 falls back to a cap per
    # command, queue_cap_ms.
    drain_budget_ms: float = float(lib.KREX_DRAIN_BUDGET_MS)
    # Long work takes turns under the budget (krex_abi.h, KREX_PACE_TOKENS): a drain then
    # waits for at most this many long intervals, not one per sibling.
    pace_tokens: int = int(lib.KREX_PACE_TOKENS)
    queue_cap_ms: float = float(lib.KREX_QUEUE_CAP_MS)
    # A region queued or announced shrinks siblings' queues and holds their LIFE calls before
    # its gate closes (krex_abi.h, KREX_PENDING_HOLD_MS).
    early_shrink: bool = True
    # Under `gpu`, a sibling inside a LIFE call with nothing else queued is frozen inside the
    # call (the freeze lands between its ioctls) and its drain ack excused, rather than
    # waited for (100-250 ms for a context creation on a loaded GPU). Off until measured on
    # a GPU that a half-done call leaves nothing that disturbs a region
    # (benchmarks/gpu_frozen_life.py; unheld.LIFE_FROZEN_SETTLE_S).
    life_freeze: bool = False
    # A region's entry waits for every sibling's drain helper to answer; at nice 0 on a full
    # node a helper sat runnable behind its own command's CPU-bound threads (H200, the
    # CPU-heavy family). krexd (root) renices each helper once, at its first region, and
    # lends it during a drain to a sibling's thread inside a LIFE call (regionchecks.py, _boost).
    helper_nice: int = -10
    # The order queued regions get the GPU: fair between tenants on exclusive time, or fifo.
    region_queue: str = regionqueue.DEFAULT
    tenant_weights: str = ""  # NAME=WEIGHT,...: shares of exclusive time under `fair` (others: 1)
    # NVIDIA MPS (krex/node/mps.py): "on" starts a control daemon per GPU; a pipe
    # directory attaches to one krexd did not start, which it then never stops.
    mps: str = "off"
    mps_pipe_dir: str | None = None
    # How long a command killed on an MPS GPU flags the GPU's regions (mps-client-fault) at
    # most, when krexd sees no server restart sooner.
    mps_fault_window_s: float = 10.0
    log_level: str = "info"
    sources: dict[str, str] = field(default_factory=dict)  # setting -> where it came from
    group: str | None = None  # share the daemon with this group (default: the daemon's own group)
    # A world made for one run (`krex bench`'s own, a fleet node's under --node-root): nothing
    # will use its segment again, so a clean stop removes it (and the simulated GPU's).
    throwaway: bool = False


@dataclass(frozen=True)
class Key:
    name: str  # Config field
    file_key: str
    env: str
    conv: Callable[[Any], Any]
    hint: str
    flag: str | None = None  # the command-line option, None: file and environment only
    help: str = ""
    choices: tuple[str, ...] = ()
    bare: str | None = None  # the value the flag alone (no value after it) means


    def default_text(self) -> str:
        """The default as help text shows it, from Config."""
        default = next(f.default for f in fields(Config) if f.name == self.name)
        if self.name == "idle_exit_s":
            return f"never; {ON_DEMAND_IDLE_EXIT_S:g} when started on demand"
        if default is None:
            return {"slots_per_gpu": "from the GPU's CPU slice", "freezer": "the first that works",
                    "group": "your own group",
                    "mps_pipe_dir": "none: krexd starts its own"}.get(self.name, "none")
        return f"{default:g}" if isinstance(default, float) else str(default)

    def metavar(self) -> str:
        if self.choices:
            return "[" + "|".join(self.choices) + "]"
        if self.name.endswith("_s"):
            return "SECONDS"
        if self.name.endswith("_ms"):
            return "MS"
        return "N" if self.name == "slots_per_gpu" else self.name.upper()

    def help_text(self) -> str:
        return f"{self.help}  [default: {self.default_text()}, or {self.env} / config file]"

    def check(self, raw: Any) -> Any:
        """The value `raw` means, or ValueError saying what is wrong and what to write."""
        try:
            return self.conv(raw)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{raw!r}: {e}; use {self.hint}") from None


KEYS = (
    Key("slots_per_gpu", "slots_per_gpu", "KREX_SLOTS_PER_GPU", _num(1, 64, True), "a whole number 1..64",
        "--slots-per-gpu", "admission limit per GPU"),
    Key("prewarm", "prewarm", "KREX_PREWARM", _num(0, 64, True), "a whole number 0..64", "--prewarm",
        "commands per GPU started before a slot frees up; they wait at their first GPU call"),
    Key("max_region_s", "max_region", "KREX_MAX_REGION", _num(0.001, 1e9), "seconds, e.g. 60",
        "--max-region", "seconds after which a region is ended by force"),
    Key("idle_exit_s", "idle_exit", "KREX_IDLE_EXIT", _idle, "seconds, e.g. 120, or never",
        "--idle-exit", "exit after this many idle seconds, or never"),
    Key("freezer", "freezer", "KREX_FREEZER", _choice(FREEZERS), "one of " + ", ".join(FREEZERS),
        "--freezer", "force a freezer backend", FREEZERS),
    Key(
        "freeze_policy",
        "freeze_policy",
        "KREX_FREEZE_POLICY",
        _choice(freezepolicy.POLICIES),
        "one of " + ", ".join(freezepolicy.POLICIES),
        "--freeze-policy",
        "which siblings a region freezes: only those the gate cannot hold (gpu, the default), "
        "all, or by the region's launch rate (adaptive)",
        freezepolicy.POLICIES,
    ),
    Key("lend_cores", "lend_cores", "KREX_LEND_CORES", _lend, "off, region or all (0/1 also read)",
        "--lend-cores", "commands may also run on their GPU's region core (region) and the housekeeping "
        "core (all) while no region needs them", ("off", "region", "all")),
    Key("drain_budget_ms", "drain_budget", "KREX_DRAIN_BUDGET_MS", _num(0, 60000),
        "milliseconds, e.g. 4, or 0 for a cap per command (queue_cap)", "--drain-budget",
        "the GPU work (ms) all commands on a GPU together may keep queued, each its share: what a "
        "region's entry drains; 0: a cap per command (queue_cap)"),
    Key("pace_tokens", "pace_tokens", "KREX_PACE_TOKENS", _num(0, int(lib.KREX_TURNS_MAX), True),
        f"a whole number 0..{lib.KREX_TURNS_MAX}", "--pace-tokens",
        "under the drain budget, how many commands whose queued work is longer than their share "
        "may have it on the GPU at once (the rest wait their turn); 0: each keeps one in flight"),
    Key("queue_cap_ms", "queue_cap", "KREX_QUEUE_CAP_MS", _num(0, 60000),
        "milliseconds, e.g. 20, or 0 for none"),
    Key("early_shrink", "early_shrink", "KREX_EARLY_SHRINK", _bool, "on or off (yes/no, 1/0)"),
    Key("life_freeze", "life_freeze", "KREX_LIFE_FREEZE", _bool, "on or off (yes/no, 1/0)"),
    Key("helper_nice", "helper_nice", "KREX_HELPER_NICE", _num(-20, 0, True), "a whole number -20..0"),
    Key("freeze_timeout_s", "freeze_timeout", "KREX_FREEZE_TIMEOUT", _num(0.01, 3600), "seconds, e.g. 2"),
    Key("drain_timeout_s", "drain_timeout", "KREX_DRAIN_TIMEOUT", _num(0.01, 3600), "seconds, e.g. 5"),
    Key("region_queue", "region_queue", "KREX_REGION_QUEUE", _choice(regionqueue.KINDS),
        "one of " + ", ".join(regionqueue.KINDS), "--region-queue",
        "the order queued regions get the GPU: fair between tenants (by exclusive GPU time) or fifo",
        regionqueue.KINDS),
    Key("tenant_weights", "tenant_weights", "KREX_TENANT_WEIGHTS", _weights,
        "NAME=WEIGHT pairs, e.g. alice=2,bob=1", "--tenant-weights",
        "shares of exclusive GPU time per tenant under the fair queue (tenants not named: 1)"),
    Key("mps", "mps", "KREX_MPS", _on_off, "off or on (yes/no, 1/0 also read)", "--mps",
        "NVIDIA MPS: one control daemon per GPU, started and stopped by krexd (--mps alone: on)",
        MPS_MODES, bare="on"),
    Key("mps_pipe_dir", "mps_pipe_dir", "KREX_MPS_PIPE_DIR", _abs_dir,
        "the absolute pipe directory of a running MPS control daemon", "--mps-pipe-dir",
        "attach to the MPS control daemon already running at this pipe directory (krexd never stops it)"),
    Key("mps_fault_window_s", "mps_fault_window", "KREX_MPS_FAULT_WINDOW", _num(0, 3600), "seconds, e.g. 10"),
    Key("log_level", "log_level", "KREX_LOG_LEVEL", _choice(LOG_LEVELS), "one of " + ", ".join(LOG_LEVELS),
        "--log-level", "what krexd logs", LOG_LEVELS),
    Key("group", "group", "KREX_GROUP", _group, "a group name or gid whose members share the daemon",
        "--group", "share the daemon with this group: members may run commands and pause, only you "
        "(or root) stop it"),
    Key("throwaway", "throwaway", "KREX_THROWAWAY", _bool, "yes or no (1 or 0)", "--throwaway",
        "a throwaway world: a clean stop removes its segment, krexd's pin links and the simulated "
        "GPU's segment ($KREX_SIM_SHM) when no process uses them", ("yes", "no")),
)
FLAGS = tuple(k for k in KEYS if k.flag)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The settings' options on an argparse parser (`python -m krex.node.daemon`); each
    lands under its Config field name, None when not given."""
    import argparse

    for k in FLAGS:
        assert k.flag is not None

        def conv(raw: str, k: Key = k) -> str:
            try:
                k.check(raw)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None
            return raw

        bare: dict[str, Any] = {"nargs": "?", "const": k.bare} if k.bare is not None else {}
        ap.add_argument(
            k.flag, dest=k.name, type=conv, default=None, help=k.help_text(), metavar=k.metavar(), **bare
        )


def overrides_from(ns: argparse.Namespace | Mapping[str, Any]) -> dict[str, Any]:
    """{Config field: value or None} of the settings with a flag, from parsed options."""
    get = ns.get if isinstance(ns, Mapping) else lambda name: getattr(ns, name, None)
    return {k.name: get(k.name) for k in FLAGS}


def to_argv(overrides: Mapping[str, Any] | None) -> list[str]:
    """The options that give a daemon started in the background these settings
    (None: not given)."""
    by_name = {k.name: k for k in FLAGS}
    argv: list[str] = []
    for name, v in (overrides or {}).items():
        if v is None:
            continue
        k = by_name.get(name)
        if k is None or k.flag is None:
            raise UsageError(f"{name} cannot be passed on krexd's command line",
                             "set it in the environment or the config file")
        argv += [k.flag, str(v)]
    return argv


def daemon_argv(device: str, log: Path | None, overrides: Mapping[str, Any] | None = None,
                on_demand: bool = False) -> list[str]:
    """The command that starts krexd: `krex daemon start`, the library's start on
    demand and the shim's (KREX_DAEMON_CMD) all use this one."""
    from krex.pystart import module_argv

    argv = [*module_argv(DAEMON_MODULE), "--device", device]
    if log is not None:
        argv += ["--log", str(log)]
    argv += to_argv(overrides)
    if on_demand:
        argv.append("--on-demand")
    return argv


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
    overrides: Mapping[str, Any] | None = None, on_demand: bool = False
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
    by_name = {k.name: k for k in KEYS}
    for name, v in (overrides or {}).items():
        if v is None:
            continue
        key = by_name.get(name)
        if key is not None:
            try:  # options arrive as the text given (argparse, click) or as values
                v = key.check(v)
            except ValueError as e:
                raise UsageError(f"{key.flag or name} {e}", f"use {key.hint}") from None
        values[name], sources[name] = v, "command line"
    return values, sources


def config_from(device: str, overrides: Mapping[str, Any], on_demand: bool = False) -> Config:
    """A Config from the command line's ``overrides`` (None: not given), the environment
    and the config file."""
    values, sources = daemon_settings(dict(overrides), on_demand=on_demand)
    return Config(device=device, **values, sources=sources)
