"""The end of a native `krex run` (interpose/guardian.c) whose krexd went away while the
command ran: with no `release` reply there are no notes from krexd, so this process,
exec'd by the native guardian once its command has ended, does what the Python guardian
does then (launcher.run_guarded): journal the region the loss cut, read this slot's
regions from the journal, print the same notes (krex.node.optin) and exit with the
command's status.

argv: SLOT GPU T_START STATUS PID REGION_S LOST_TS QUIET WHY AUTO_DIR
(REGION_S < 0: the loss cut no region of ours; AUTO_DIR "": none to read)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any


def main(argv: list[str]) -> int:
    from krex.node.optin import auto_region_report, region_tally, release_notes
    from krex.proc.launcher import _journal_regions, journal_cut_region

    slot, gpu, t_start, status, pid, region_s, lost_ts, quiet, why, auto_dir = argv

    def notify(text: str) -> None:
        if quiet != "1":
            sys.stderr.write(text + "\n")
            sys.stderr.flush()

    try:
        if float(region_s) >= 0:
            journal_cut_region(int(gpu), int(slot), int(pid), why, float(region_s), float(lost_ts))
        report: dict[str, Any] = {}
        regs = _journal_regions(int(slot), float(t_start), report, notify)
        report.update(region_tally(regs))
        if auto_dir:
            auto = auto_region_report("", Path(auto_dir), regs)
            if auto["processes"]:
                report["auto_region"] = auto
        for line in release_notes({}, report):
            notify(line)
    except Exception as e:  # noqa: BLE001 - the command's own status must survive any of it
        sys.stderr.write(
            f"krex: warning: krexd went away and the regions' notes could not be made "
            f"({type(e).__name__}: {e}); its regions are not known to be clean\n"
        )
    return int(status)


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)
