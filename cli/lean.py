"""The Python `krex` front door: `krex run` without click. The installed `krex` is the
native guardian (interpose/guardian.c), which runs the common `krex run` itself and execs
`python -m krex.cli.lean ARGV` for every other command line; where it cannot be built,
bin/krex calls main() here directly.

`krex run` starts once per benchmarked command, so its start-up is paid by every
command. This module parses `krex [-v|-q] run [OPTIONS] [--] CMD...` by hand
and imports only what the guardian needs (no click, no bench, no other command);
anything it does not take plainly (help, --version, another command, an option it
does not know, a value click would refuse) goes to the click CLI (`krex.cli.main`)
unchanged, so every message and exit status of those cases stays click's.

The run itself is `krex.proc.launcher.run_command`, shared with the click `run` command: it
does what only Python does (start krexd, the static-cudart warning) and execs the native
guardian for the run."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any

from krex.errors import KrexError
from krex.proc import runopts


def setup_cli_logging(verbose: int, quiet: bool) -> None:
    """The library logs to the `krex` logger (NullHandler by default); the CLI shows
    warnings, -v info, -vv debug, -q errors only."""
    level = logging.ERROR if quiet else {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)
    lg = logging.getLogger("krex")
    if not any(getattr(h, "_krex_cli", False) for h in lg.handlers):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("krex: %(levelname)s %(name)s: %(message)s"))
        h._krex_cli = True  # type: ignore[attr-defined]
        lg.addHandler(h)
    lg.setLevel(level)


def parse_run(argv: list[str]) -> dict[str, Any] | None:
    """The options of `krex [-v|-q] run ...` as the click CLI would read them, or None
    when the click CLI must handle `argv` (it then also writes any error)."""
    o: dict[str, Any] = {"verbose": 0, "quiet": False, **runopts.defaults(runopts.RUN)}
    i = 0
    while i < len(argv) and argv[i] != "run":  # the group's own options
        a = argv[i]
        if a in ("-q", "--quiet"):
            o["quiet"] = True
        elif a == "--verbose":
            o["verbose"] += 1
        elif len(a) > 1 and a[0] == "-" and set(a[1:]) <= {"v", "q"} and a[1] != "-":
            o["verbose"] += a.count("v")
            o["quiet"] = o["quiet"] or "q" in a
        else:
            return None
        i += 1
    if i == len(argv) or (o["verbose"] and o["quiet"]):
        return None
    try:  # `run`'s options; the first other word starts CMD (as click)
        i = runopts.scan(argv, i + 1, runopts.RUN, o, click_like=True)
    except ValueError:
        return None  # -h, --help, an unknown option: click's messages
    o["cmd"] = argv[i:]
    if not o["cmd"] or runopts.bad_choice(runopts.RUN, o):
        return None
    if o["gpu"] is not None:
        if not o["gpu"].isdigit() or not o["gpu"].isascii():
            return None
        o["gpu"] = int(o["gpu"])
    rep = o["report"] or ""
    bad_report = rep == "" or os.path.isdir(rep) or (os.path.exists(rep) and not os.access(rep, os.W_OK))
    if o["report"] is not None and bad_report:
        return None  # click.Path's own checks and messages
    return o


def _say(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> Any:
    """The `krex` console script: `krex run` here, everything else in the click CLI."""
    args = list(sys.argv[1:] if argv is None else argv)
    o = parse_run(args)
    if o is None:
        from krex.cli.main import main as click_main

        return click_main(args)
    setup_cli_logging(o["verbose"], o["quiet"])
    notify = (lambda _m: None) if o["quiet"] else _say
    from krex.proc.launcher import run_command

    try:
        status = run_command(
            o["cmd"], notify=notify, quiet=o["quiet"], **{opt.dest: o[opt.dest] for opt in runopts.RUN}
        )
    except KrexError as e:  # as cli.main.main prints it
        _say(f"krex: error: {e}")
        if e.fix:
            _say(f"  fix: {e.fix}")
        _exit(e.exit_code)
    except KeyboardInterrupt:  # as click's Abort
        _say("\nkrex: aborted")
        _exit(130)
    _exit(status)


def _exit(code: int) -> None:
    """Exit without the interpreter's teardown (module and thread clean-up costs every
    command milliseconds): everything the run owes is done and flushed by now."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":  # the native `krex` (interpose/guardian.c) hands command lines here
    sys.exit(main())
