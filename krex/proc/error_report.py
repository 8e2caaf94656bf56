"""The --report of a native `krex run` that KREX failed (interpose/guardian.c: krexd refused
or did not answer the admission, sent an admit reply it cannot read, could not move the
command into its slot, or the command's exec failed). The guardian has said the error; this
process, exec'd by it, writes the report as krex.proc.launcher.run_command writes one and
exits with the status.

argv: REPORT STATUS KIND MESSAGE FIX EXTRA (KIND: a class name of krex/errors.py, or
CommandNotFound / NotExecutable; EXTRA: the caller's members, a JSON object's text from
krex.proc.launcher, "" none)."""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    from krex.errors import RUN_FAILURE, KrexError
    from krex.node.optin import report_extra
    from krex.proc.launcher import _write_report

    report, status, kind, message, fix, extra = argv
    data = {"exit_status": int(status), "krex_error": {"kind": kind, "message": message, "fix": fix}}
    try:
        _write_report(report, {**data, **report_extra(extra)})
    except KrexError as e:
        sys.stderr.write(f"krex: error: {e}\n  fix: {e.fix}\n")
        return RUN_FAILURE
    return int(status)


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)
