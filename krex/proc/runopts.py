"""`krex run`'s options: ONE table (`OPTIONS`) from which the click command (cli/main.py
`run`), the console script's lean door (cli/lean.py), the guardian's library entry
(`python -m krex.proc.launcher`, spawned by krex.runner), the argv the runner builds
for it (krex.runner.guardian_argv), the argv Python's door execs the native guardian with
(launcher.run_command) and the options that guardian parses (`GUARDIAN`: krex_build.py
reads this file's source into krex_runopts.h, which interpose/guardian.c includes) are
all made. None of them has an environment
variable: the daemon's settings (krex.node.config) do.

Light on purpose: the lean door reads it before anything else, so it imports neither
click nor GPU discovery (only the tuples of devices and freeze policies)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from krex.device import DEVICES
from krex.node.freezepolicy import POLICIES


@dataclass(frozen=True)
class RunOption:
    dest: str  # run_command's keyword, the key of the parsed options
    flag: str  # how a command line spells it
    type: type  # bool: a flag without a value; else the value's type (int, float, str)
    help: str
    choices: tuple[str, ...] = ()
    default: Any = None
    metavar: str = ""  # the value in a usage line (choices: a|b|c)
    path: bool = False  # a file KREX writes (click: a writable file path)
    run: bool = True  # an option of `krex run` (the click command and the lean door)
    entry: bool = True  # an option of the guardian's entry (`python -m krex.proc.launcher`)
    native: bool = True  # the native guardian (interpose/guardian.c) takes it (else Python acts on it first)

    @property
    def is_flag(self) -> bool:
        return self.type is bool

    def usage(self) -> str:
        if self.is_flag:
            return f"[{self.flag}]"
        return f"[{self.flag} {'|'.join(self.choices) if self.choices else self.metavar}]"


OPTIONS: tuple[RunOption, ...] = (
    RunOption("device", "--device", str, "real GPU or the simulated one", choices=DEVICES, default="auto"),
    RunOption("gpu", "--gpu", int, "GPU index (default: the least loaded)", metavar="N"),
    RunOption("report", "--report", str, "write a JSON report: regions, waits, gate blocks, contamination",
              metavar="FILE", path=True),
    RunOption("no_daemon", "--no-daemon", bool,
              "claim a slot directly in shared memory (no regions, no freezing)", default=False, entry=False,
              native=False),
    RunOption("freeze", "--freeze", str,
              "which siblings this command's regions freeze (default: the daemon's policy)",
              choices=POLICIES),
    RunOption("tenant", "--tenant", str,
              "whose share of the GPU's exclusive time this command's regions use (default: your user name)",
              metavar="NAME"),
    RunOption("keep_leftovers", "--keep-leftovers", bool,
              "processes that outlive CMD keep running (as a frozen sibling during other regions) "
              "instead of being killed when CMD exits", default=False),
    RunOption("slots", "--daemon-slots-per-gpu", int,
              "if no daemon answers, start one with this many slots per GPU", metavar="N", run=False,
              native=False),
    RunOption("idle_exit", "--daemon-idle-exit", float,
              "if no daemon answers, start one that exits after this many idle seconds", metavar="S",
              run=False, native=False),
)
RUN = tuple(o for o in OPTIONS if o.run)  # `krex run`
ENTRY = tuple(o for o in OPTIONS if o.entry)  # `python -m krex.proc.launcher`
GUARDIAN = tuple(o for o in OPTIONS if o.native)  # the native guardian (its krex_runopts.h)
ENTRY_USAGE = f"python -m krex.proc.launcher {' '.join(o.usage() for o in ENTRY)} -- CMD..."


def defaults(options: Iterable[RunOption]) -> dict[str, Any]:
    return {o.dest: o.default for o in options}


def scan(argv: list[str], i: int, options: Iterable[RunOption], into: dict[str, Any],
         click_like: bool) -> int:
    """Read the options of ``argv`` from index ``i`` into ``into`` (raw strings; flags True,
    the last one wins) and return the index where the command starts (after a ``--``).
    ``click_like``: ``--flag=value`` is taken and the first word that is not an option starts
    the command, as click reads `krex run`; else only ``--`` ends the options. Raises
    ValueError naming the option for an unknown or incomplete one (``into`` holds what came
    before it)."""
    by_flag = {o.flag: o for o in options}
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return i + 1
        if click_like and (not a.startswith("-") or a == "-"):
            return i
        name, eq, value = a.partition("=") if click_like else (a, "", "")
        o = by_flag.get(name)
        if o is None or (o.is_flag and eq):
            raise ValueError(a)
        if o.is_flag:
            into[o.dest] = True
        else:
            if not eq:
                if i + 1 >= len(argv):
                    raise ValueError(a)
                i += 1
                value = argv[i]
            into[o.dest] = value
        i += 1
    return i


def bad_choice(options: Iterable[RunOption], values: Mapping[str, Any]) -> RunOption | None:
    """The first option whose value (when given) is not one of its choices."""
    for o in options:
        v = values.get(o.dest)
        if o.choices and v is not None and v not in o.choices:
            return o
    return None


def to_argv(options: Iterable[RunOption], values: Mapping[str, Any]) -> list[str]:
    """The command line that gives these values (None, False and "" are left out)."""
    argv: list[str] = []
    for o in options:
        v = values.get(o.dest)
        if v is None or v is False or v == "":
            continue
        if o.is_flag:
            argv.append(o.flag)
        else:
            argv += [o.flag, f"{v:g}" if isinstance(v, float) else str(v)]
    return argv


def native_guardian() -> Path | None:
    """The native guardian built into this installation (krex/_lib/krex, which takes the
    GUARDIAN options), or None where it could not be built."""
    p = Path(__file__).resolve().parents[1] / "_lib" / "krex"
    with contextlib.suppress(OSError), open(p, "rb") as f:
        if f.read(4) == b"\x7fELF" and os.access(p, os.X_OK):
            return p
    return None
