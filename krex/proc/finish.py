"""The end of a native `krex run` (interpose/guardian.c) whose krexd went away while the
command ran: with no `release` reply there are no notes from krexd, so this process,
exec'd by the native guardian once its command has ended, does what the Python guardian
does then (launcher.run_guarded): journal the region the loss cut, read this slot's
regions from the journal, print the same notes (krex.node.optin) and exit with the
command's status.

It also ends a native `krex run --report` whose krexd answered but could not send the report
(too many regions for one reply, or automatic regions' status to read): WHY "" (krexd did not
go away), QUIET 1 (krexd's notes were printed already). Either way it writes the report
from what the journal and the status directory hold.

argv: SLOT GPU T_START STATUS PID REGION_S LOST_TS QUIET WHY AUTO_DIR REPORT
(REGION_S < 0: the loss cut no region of ours; AUTO_DIR "": none to read; REPORT "": none)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any


def main(argv: list[str]) -> int:
    from krex.errors import RUN_FAILURE, KrexError
    from krex.node.optin import auto_region_report, region_tally, release_notes
    from krex.proc.launcher import _journal_regions, _write_report, journal_cut_region

    slot, gpu, t_start, status, pid, region_s, lost_ts, quiet, why, auto_dir, report_path = argv

    def notify(text: str) -> None:
        if quiet != "1":
            sys.stderr.write(text + "\n")
            sys.stderr.flush()

    report: dict[str, Any] = {"slot": int(slot), "gpu": int(gpu)}
    try:
        if float(region_s) >= 0:
            journal_cut_region(int(gpu), int(slot), int(pid), why, float(region_s), float(lost_ts))
        if why:
            report["daemon_events"] = [
                {"event": "daemon-lost", "ts": float(lost_ts), "why": why, "region_cut": float(region_s) >= 0}
            ]
        regs = _journal_regions(int(slot), float(t_start), report, notify)
        report["regions"] = regs
        report.update(region_tally(regs))
        if auto_dir:
            auto = auto_region_report("", Path(auto_dir), regs)
            if auto["processes"]:
                report["auto_region"] = auto
        for line in release_notes({}, report):
            notify(line)
    except Exception as e:  # noqa: BLE001 - the command's own status must survive any of it
        sys.stderr.write(
            f"krex: warning: the regions' notes and report could not be made "
            f"({type(e).__name__}: {e}); its regions are not known to be clean\n"
        )
        report["report_error"] = f"{type(e).__name__}: {e}"
    if report_path:
        try:
            _write_report(report_path, {**report, "exit_status": int(status)})
        except KrexError as e:
            sys.stderr.write(f"krex: error: {e}\n  fix: {e.fix}\n")
            return RUN_FAILURE
    return int(status)


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)
