"""The end of a native `krex run` (interpose/guardian.c) whose krexd went away while the
command ran: with no `release` reply there are no notes from krexd, so this process,
exec'd by the native guardian once its command has ended, does what krexd would have:
journal the region the loss cut, read this slot's regions from the journal, print the
notes (krex.node.optin) and exit with the command's status.

It also ends a native `krex run --report` whose krexd released the slot without a report
(it had no record of the slot left): WHY "" (krexd did not go away), QUIET 1 (krexd's notes
were printed). Either way krexd's own record of the command is gone, so the regions come
from the journal, and the report says when that may have rotated past the command's start.

argv: SLOT GPU T_START STATUS PID REGION_S LOST_TS QUIET WHY AUTO_DIR REPORT, then the
admission: WAIT_S DEVICE SIMULATED SHM RELEASED EXTRA (REGION_S < 0: the loss cut no region
of ours; AUTO_DIR "": none to read; REPORT "": none; SIMULATED, RELEASED "1" or "0": RELEASED,
krexd did release the slot; EXTRA: the caller's members for the report, a JSON object's text
from krex.proc.launcher, "" none). After a release, LOST_TS is when the guardian asked for
it: the journal's regions are read up to then)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, NamedTuple


def main(argv: list[str]) -> int:
    from krex.errors import RUN_FAILURE, KrexError
    from krex.node.optin import (
        auto_region_kept,
        auto_region_report,
        region_tally,
        release_notes,
        report_extra,
    )
    from krex.proc.launcher import _journal_regions, _write_report, dropped_on_broken_pipe, journal_cut_region

    slot, gpu, t_start, status, pid, region_s, lost_ts, quiet, why, auto_dir, report_path = argv[:11]
    adm = Admission(*argv[11:16])
    extra = argv[16]

    def say(text: str) -> None:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()

    said = dropped_on_broken_pipe(say)

    def notify(text: str) -> None:
        if quiet != "1":
            said(text)

    def warn(what: str, e: Exception) -> None:
        said(f"krex: warning: {what} ({type(e).__name__}: {e}); its regions are not known to be clean")
        report["report_error"] = f"{what}: {type(e).__name__}: {e}"

    report: dict[str, Any] = {"slot": int(slot), "gpu": int(gpu)}
    try:  # first, and on its own: the region the loss cut is journaled whatever else fails
        if float(region_s) >= 0:
            journal_cut_region(int(gpu), int(slot), int(pid), why, float(region_s), float(lost_ts))
    except Exception as e:  # noqa: BLE001 - the command's own status must survive any of it
        warn("the cut region could not be journaled", e)
    try:
        report = {**_base_report(int(slot), int(gpu), adm), **report}
    except Exception as e:  # noqa: BLE001
        warn("the report's start could not be read", e)
    try:
        if why:
            report["daemon_events"] = [
                {"event": "daemon-lost", "ts": float(lost_ts), "why": why, "region_cut": float(region_s) >= 0}
            ]
        if "regions" not in report:
            # Up to the release (LOST_TS) when krexd released the slot: a next command in it
            # journals regions of its own.
            t_end = float(lost_ts) if adm.released == "1" else None
            regs = _journal_regions(int(slot), float(t_start), report, notify, t_end)
            report["regions"] = regs
            report.update(region_tally(regs))
        # KREX_AUTO_REGION as the guardian was given it (this process inherits its environment).
        auto_value = os.environ.get("KREX_AUTO_REGION", "").strip()
        if auto_dir or auto_value:
            auto = auto_region_report(auto_value, Path(auto_dir) if auto_dir else None, report["regions"])
            if auto_region_kept(auto):
                report["auto_region"] = auto
        for line in release_notes({}, report):
            notify(line)
    except Exception as e:  # noqa: BLE001
        warn("the regions' notes and report could not be made", e)
    if report_path:
        try:
            _write_report(report_path, {**report, "exit_status": int(status), **report_extra(extra)})
        except KrexError as e:
            said(f"krex: error: {e}\n  fix: {e.fix}")
            return RUN_FAILURE
    return int(status)


class Admission(NamedTuple):
    """The admission as the guardian hands it over (argv texts), to make the report from."""

    wait_s: str
    device: str
    simulated: str  # "1" or "0"
    shm: str
    released: str  # "1": krexd released the slot first (its records may be gone or another's)


def _base_report(slot: int, gpu: int, adm: Admission) -> dict[str, Any]:
    """The report before its regions (krexd sent no report: it went away, failed the release
    or sent none), with the gate counters read from the segment (krexd reads them the same
    way), unless the slot may have been released already."""
    from krex.errors import KrexError
    from krex.node.optin import gate_counters, run_report

    counters: dict[str, Any] = {}
    released = adm.released == "1"
    if not released:
        try:
            from krex.node.shm import Segment

            with Segment.attach(adm.shm) as seg:
                counters = gate_counters(p for p in seg.snapshot().procs if p.slot == slot)
        except KrexError:
            pass
    rep = run_report(slot, gpu, float(adm.wait_s), adm.device, adm.simulated == "1", counters, {})
    if released:
        rep["counters_unknown"] = "krexd released the slot first: its gate counters may be gone"
    return rep


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)
