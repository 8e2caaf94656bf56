"""The native guardian's report when krexd cannot send it whole (krex/node/daemon.py
`_report_json`, krex/proc/finish.py `_base_report`): without the regions past the reply's
size, and made from the admission when krexd sent none."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from krex.node.daemon import Daemon, Slot
from krex.proc.finish import _base_report
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
    out: dict[str, Any] = {"leftovers": [], "action": "none", "regions": regs, "notes": []}
    fake = SimpleNamespace(info=SimpleNamespace(kind="sim"))
    Daemon._report_json(fake, s, COUNTERS, out, {})  # type: ignore[arg-type]
    return out


def test_a_report_that_fits_carries_its_regions_and_replaces_them_in_the_reply() -> None:
    out = _reply(2, 10)
    rep = json.loads(out["report_json"])
    assert out["report_regions"] is True and "regions" not in out
    assert rep["region_count"] == 2 and rep["contaminated_regions"] == 1 and len(rep["regions"]) == 2
    assert (
        rep["slot"] == 3
        and rep["admission_wait_s"] == 0.25
        and rep["device"] == "sim"
        and rep["gate_blocks"] == 1
    )


def test_regions_too_large_for_one_reply_are_left_to_the_journal() -> None:
    out = _reply(400, MAX_FRAME // 500)  # ~0.8 MiB of regions
    rep = json.loads(out["report_json"])
    assert out["report_regions"] is False and "regions" not in rep and "region_count" not in rep
    assert len(encode_reply("release", {"ok": True, **out})) < MAX_FRAME
    assert rep["gate_blocks"] == 1 and rep["leftovers_action"] == "none"


def test_the_most_regions_a_slot_keeps_fit_in_one_encoded_reply() -> None:
    """What _slot_regions lets through (just under half a frame of records) is sent whole:
    the report's text, escaped once more in the reply, still fits one frame."""
    pad = 200
    one = len(json.dumps({"label": "x" * pad, "contaminated": False, "queue_wait_s": 0.001}))
    n = (MAX_FRAME // 2) // (one + 2) - 1
    out = _reply(n, pad)
    assert out["report_regions"] is True and json.loads(out["report_json"])["region_count"] == n
    assert len(encode_reply("release", {"ok": True, **out})) < MAX_FRAME


def test_the_finisher_starts_from_krexds_report_or_from_the_admission(tmp_path: Path) -> None:
    f = tmp_path / "krexd.json"
    f.write_text(json.dumps({"slot": 3, "gpu": 0, "gate_blocks": 4}))
    assert _base_report(3, 0, str(f)) == {"slot": 3, "gpu": 0, "gate_blocks": 4}
    adm = {"admission_wait_s": 0.5, "device": "gpu", "simulated": False, "shm": "/krex-no-such-segment"}
    rep = _base_report(3, 0, json.dumps(adm))
    assert rep["admission_wait_s"] == 0.5 and rep["device"] == "gpu" and rep["simulated"] is False
    assert rep["leftovers_action"] == "unknown" and "gate_blocks" not in rep  # no segment, no counters
    assert "counters_unknown" not in rep
    rep = _base_report(3, 0, json.dumps({**adm, "released": True}))
    assert "counters_unknown" in rep and "gate_blocks" not in rep
    assert _base_report(3, 0, "") == {"slot": 3, "gpu": 0}
    f.write_text("[1, 2]")
    with pytest.raises(ValueError):
        _base_report(3, 0, str(f))


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
    adm = {"admission_wait_s": 0.1, "device": "sim", "simulated": True, "shm": "/krex-none", "released": True}
    # SLOT GPU T_START STATUS PID REGION_S LOST_TS QUIET WHY AUTO_DIR REPORT BASE
    argv = ["3", "0", "100.0", "7", "1", "-1", "120.0", "1", "", "", str(report), json.dumps(adm)]
    assert finish.main(argv) == 7
    rep = json.loads(report.read_text())
    assert [r["ts"] for r in rep["regions"]] == [110.0] and rep["region_count"] == 1, rep
    assert rep["exit_status"] == 7 and "counters_unknown" in rep and "daemon_events" not in rep
    # krexd went away (not released): no upper bound, the counters are read (none here).
    adm.pop("released")
    argv[8], argv[-1] = "krexd exited", json.dumps(adm)
    assert finish.main(argv) == 7
    rep = json.loads(report.read_text())
    assert [r["ts"] for r in rep["regions"]] == [110.0, 130.0] and "counters_unknown" not in rep
    assert [e["event"] for e in rep["daemon_events"]] == ["daemon-lost"]
