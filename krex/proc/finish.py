"""The end of a native `krex run` (interpose/guardian.c) whose krexd went away while the
command ran: with no `release` reply there are no notes from krexd, so this process,
exec'd by the native guardian once its command has ended, does what krexd would have:
journal the region the loss cut, read this slot's regions from the journal, print the
notes (krex.node.optin) and exit with the command's status.

It also ends a native `krex run --report` whose krexd released the slot without a report
(it had no record of the slot left): WHY "" (krexd did not go away), QUIET 1 (krexd's notes
were printed). Either way krexd's own record of the command is gone, so the regions come
from the journal, and the report says when that may have rotated past the command's start.

argv: SLOT GPU T_START STATUS PID REGION_S LOST_TS QUIET WHY AUTO_DIR REPORT BASE
(REGION_S < 0: the loss cut no region of ours; AUTO_DIR "": none to read; REPORT "": none;
BASE: the admission as JSON ("released": krexd did release the slot). After a release,
LOST_TS is when the guardian asked for it: the journal's regions are read up to then)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any


def main(argv: list[str]) -> int:
    from krex.errors import RUN_FAILURE, KrexError
    from krex.node.optin import (
        auto_region_kept,
        auto_region_report,
        region_tally,
        release_notes,
    )
    from krex.proc.launcher import _journal_regions, _write_report, dropped_on_broken_pipe, journal_cut_region

    slot, gpu, t_start, status, pid, region_s, lost_ts, quiet, why, auto_dir, report_path, base = argv

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
        report = {**_base_report(int(slot), int(gpu), base), **report}
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
            t_end = float(lost_ts) if _released(base) else None
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
            _write_report(report_path, {**report, "exit_status": int(status), **_extra(base)})
        except KrexError as e:
            said(f"krex: error: {e}\n  fix: {e.fix}")
            return RUN_FAILURE
    return int(status)


def _extra(base: str) -> dict[str, Any]:
    """The members the guardian's caller adds to the report (krex.runner's daemon_started)."""
    import json

    try:
        extra = json.loads(base).get("report_extra") if base.startswith("{") else None
    except ValueError:
        return {}
    return extra if isinstance(extra, dict) else {}


def _released(base: str) -> bool:
    """Whether krexd released the slot before this ran (LOST_TS is then the release)."""
    import json

    try:
        return bool(json.loads(base).get("released"))
    except ValueError:
        return False


def _base_report(slot: int, gpu: int, base: str) -> dict[str, Any]:
    """The report before its regions. BASE "{...}": the admission (krexd sent no report: it
    went away, failed the release or sent none), with the gate counters read from the segment
    (krexd reads them the same way), unless the slot may have been released already
    ("released": its records may be gone or another command's). Else a bare one."""
    import json

    from krex.errors import KrexError
    from krex.node.optin import gate_counters, run_report

    if base.startswith("{"):
        adm = json.loads(base)
        counters: dict[str, Any] = {}
        if not adm.get("released"):
            try:
                from krex.node.shm import Segment

                with Segment.attach(str(adm["shm"])) as seg:
                    counters = gate_counters(p for p in seg.snapshot().procs if p.slot == slot)
            except KrexError:
                pass
        sim = bool(adm.get("simulated"))
        rep = run_report(slot, gpu, adm.get("admission_wait_s"), str(adm.get("device")), sim, counters, {})
        if adm.get("released"):
            rep["counters_unknown"] = "krexd released the slot first: its gate counters may be gone"
        return rep
    return {"slot": slot, "gpu": gpu}


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)
