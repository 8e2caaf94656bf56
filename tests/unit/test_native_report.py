"""The native guardian's report (krex/node/admission.py `_report_json`, krex/proc/finish.py
`_base_report`): its region list shortened to what one reply holds, saying how many it
leaves out, with counts over every region; made from the admission when krexd sent none."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from krex.node import optin
from krex.node.daemon import Daemon, Slot, _fit
from krex.proc.finish import Admission, _base_report
from krex.protocol import MAX_FRAME, encode_reply

COUNTERS = {
    "gate_blocks": 1,
    "gate_blocked_ms": 2.0,
    "fail_opens": 0,
    "paced": 0,
    "paced_ms": 0.0,
    "submits": {},
}


def _reply(n_regions: int, pad: int) -> dict[str, Any]:
    s = Slot(3, 0, "run", 1, group=None)  # type: ignore[arg-type]
    s.admission_wait_s, s.simulated = 0.25, True
    regs = [{"label": "x" * pad, "contaminated": i == 0, "queue_wait_s": 0.001} for i in range(n_regions)]
    tally = optin.region_tally(regs)
    out: dict[str, Any] = {
        "leftovers": [], "action": "none", "regions": regs, "regions_dropped": 5, "regions_cap": 1000,
        "region_tally": {**tally, "region_count": tally["region_count"] + 5}, "notes": [],
    }
    fake = SimpleNamespace(info=SimpleNamespace(kind="sim"))
    Daemon._report_json(fake, s, COUNTERS, out, {})  # type: ignore[arg-type]
    return out


def test_a_report_that_fits_carries_its_regions_and_replaces_them_in_the_reply() -> None:
    out = _reply(2, 10)
    rep = json.loads(out["report_json"])
    assert "regions" not in out
    assert rep["region_count"] == 7 and rep["contaminated_regions"] == 1 and len(rep["regions"]) == 2
    assert rep["regions_dropped"] == 5 and rep["regions_cap"] == 1000
    assert (
        rep["slot"] == 3
        and rep["admission_wait_s"] == 0.25
        and rep["device"] == "sim"
        and rep["gate_blocks"] == 1
    )


def test_regions_too_large_for_one_reply_are_listed_in_part_and_counted_in_full() -> None:
    out = _reply(400, MAX_FRAME // 500)  # ~0.8 MiB of regions
    rep = json.loads(out["report_json"])
    n = len(rep["regions"])
    assert 0 < n < 400 and rep["regions_dropped"] == 405 - n, rep["regions_dropped"]
    assert rep["region_count"] == 405 and rep["contaminated_regions"] == 1
    assert len(encode_reply("release", {"ok": True, **out})) < MAX_FRAME
    assert rep["gate_blocks"] == 1 and rep["leftovers_action"] == "none"


def test_the_most_regions_a_slot_keeps_fit_in_one_encoded_reply() -> None:
    """What _slot_regions lets through (just under half a frame of records) is sent whole:
    the report's text, escaped once more in the reply, still fits one frame."""
    pad = 200
    one = {"label": "x" * pad, "contaminated": False, "queue_wait_s": 0.001}
    n = _fit([one] * 100000, MAX_FRAME // 2)
    out = _reply(n, pad)
    assert json.loads(out["report_json"])["regions_dropped"] == 5
    assert len(encode_reply("release", {"ok": True, **out})) < MAX_FRAME


def test_the_finisher_starts_from_the_admission() -> None:
    adm = Admission("0.500000", "gpu", "0", "/krex-no-such-segment", "0")
    rep = _base_report(3, 0, adm)
    assert rep["admission_wait_s"] == 0.5 and rep["device"] == "gpu" and rep["simulated"] is False
    assert rep["leftovers_action"] == "unknown" and "gate_blocks" not in rep  # no segment, no counters
    assert "counters_unknown" not in rep
    rep = _base_report(3, 0, adm._replace(released="1"))
    assert "counters_unknown" in rep and "gate_blocks" not in rep
    assert _base_report(3, 0, adm._replace(simulated="1", device="sim"))["simulated"] is True


def test_krexds_report_carries_what_only_the_guardian_saw() -> None:
    """The release request's exit status and stall (krex_req_release) land in the report
    krexd makes, with the caller's members over them all, as Python's {**data, **extra}."""
    s = Slot(3, 0, "run", 1, group=None)  # type: ignore[arg-type]
    s.admission_wait_s, s.simulated = 0.25, True
    out: dict[str, Any] = {"leftovers": [], "action": "none", "regions": [], "notes": []}
    fake = SimpleNamespace(info=SimpleNamespace(kind="sim"))
    req = {
        "exit_status": 3, "stalled_ts": 100.1234567, "stall_age_s": 2.34567, "resumed_ts": 104.5,
        "extra": json.dumps({"daemon_started": True, "exit_status": 9}),
    }
    Daemon._report_json(fake, s, COUNTERS, out, {}, req)  # type: ignore[arg-type]
    assert out["report_json"].endswith("}\n")
    rep = json.loads(out["report_json"])
    assert rep["daemon_events"] == [
        {"event": "daemon-stalled", "ts": 100.123457, "heartbeat_age_s": 2.346},
        {"event": "daemon-resumed", "ts": 104.5},
    ]
    assert rep["daemon_started"] is True and rep["exit_status"] == 9  # the caller's, over ours
    out = {"leftovers": [], "action": "none", "regions": [], "notes": []}
    plain = {"exit_status": 0, "extra": "not json"}
    Daemon._report_json(fake, s, COUNTERS, out, {}, plain)  # type: ignore[arg-type]
    rep = json.loads(out["report_json"])
    assert rep["exit_status"] == 0 and "daemon_events" not in rep and list(rep)[-1] == "exit_status"


def test_an_error_report_has_the_error_and_the_callers_members(tmp_path: Path) -> None:
    """KREX failed a native run: krex.proc.error_report writes what launcher.run_command would."""
    from krex.proc import error_report

    report = tmp_path / "r.json"
    extra = '{"daemon_started": false}'
    argv = [str(report), "126", "NotExecutable", "cannot execute x", "chmod +x it", extra]
    assert error_report.main(argv) == 126
    assert json.loads(report.read_text()) == {
        "exit_status": 126,
        "krex_error": {"kind": "NotExecutable", "message": "cannot execute x", "fix": "chmod +x it"},
        "daemon_started": False,
    }
    assert error_report.main([str(tmp_path / "no" / "r.json"), "125", "KrexError", "m", "", ""]) == 125


def test_after_a_release_the_finisher_counts_only_this_commands_regions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """krexd released the slot but sent no report (or only part): the journal's regions of
    this slot are read from the command's start up to the release, not a next command's."""
    from krex.proc import finish

    journal = tmp_path / "journal.jsonl"
    mine = (90.0, 110.0, 130.0)  # before the command, during it, after the release
    recs = [{"owner_slot": 3, "ts": t, "contaminated": False, "queue_wait_s": 0} for t in mine]
    recs.append({"owner_slot": 4, "ts": 111.0, "contaminated": True, "queue_wait_s": 0.0})
    journal.write_text("".join(json.dumps(r) + "\n" for r in recs))
    monkeypatch.setenv("KREX_JOURNAL", str(journal))
    report = tmp_path / "r.json"
    # SLOT GPU T_START STATUS PID REGION_S LOST_TS QUIET WHY AUTO_DIR REPORT,
    # then WAIT_S DEVICE SIMULATED SHM RELEASED EXTRA
    adm = ["0.1", "sim", "1", "/krex-none", "1", ""]
    argv = ["3", "0", "100.0", "7", "1", "-1", "120.0", "1", "", "", str(report), *adm]
    assert finish.main(argv) == 7
    rep = json.loads(report.read_text())
    assert [r["ts"] for r in rep["regions"]] == [110.0] and rep["region_count"] == 1, rep
    assert rep["exit_status"] == 7 and "counters_unknown" in rep and "daemon_events" not in rep
    # krexd went away (not released): no upper bound, the counters are read (none here).
    argv[8], argv[-2] = "krexd exited", "0"
    assert finish.main(argv) == 7
    rep = json.loads(report.read_text())
    assert [r["ts"] for r in rep["regions"]] == [110.0, 130.0] and "counters_unknown" not in rep
    assert [e["event"] for e in rep["daemon_events"]] == ["daemon-lost"]


def test_regions_read_from_a_journal_rotated_past_the_start_say_they_may_be_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """krexd went away (its record of the command with it): the journal is all there is,
    and where it rotated past the command's start the report and the notes say so."""
    from krex.node import journal as jr
    from krex.proc import finish

    journal = tmp_path / "journal.jsonl"
    monkeypatch.setenv("KREX_JOURNAL", str(journal))
    for t in (120.0, 130.0, 140.0):  # the regions before 120 went with the rotation
        jr.append(journal, {"owner_slot": 3, "ts": t, "contaminated": False}, limit=60)
    assert jr.rotated(journal, jr.KEEP).exists()
    report = tmp_path / "r.json"
    adm = ["0.1", "sim", "1", "/krex-none", "0", '{"daemon_started": true}']
    argv = ["3", "0", "100.0", "0", "1", "-1", "150.0", "0", "krexd exited", "", str(report), *adm]
    assert finish.main(argv) == 0
    rep = json.loads(report.read_text())
    assert "has rotated since the command started" in rep["regions_incomplete"], rep
    assert rep["daemon_started"] is True, rep
    assert "has rotated since the command started" in capsys.readouterr().err
    argv[2] = "125.0"  # started after the oldest record left: nothing is missing
    assert finish.main(argv) == 0
    assert "regions_incomplete" not in json.loads(report.read_text())
