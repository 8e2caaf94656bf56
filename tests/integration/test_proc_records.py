"""Process records under a claim storm (tests/c/claims.c): children of several forkers
claim records at once while a reaper frees dead ones. A claimer that loses the race
for a record must leave it as the winner sealed it; before the fix it put back the
record's OLD check over the winner's, so the record read as damaged for good and krexd
raised a false trust alarm ("damaged process record") in fork-heavy commands."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from helpers import wait_until
from helpers.krex_world import WORKER, Krex

from krex.native import lib
from krex.node.shm import Segment


def test_lost_claim_races_leave_no_record_that_reads_as_damaged(bins: dict[str, Path]) -> None:
    name = f"/krex-tclaims-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    seg = Segment.create(name, n_gpus=1)
    try:
        for _ in range(3):
            cmd = [str(bins["claims"]), name, "4", "400"]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stderr
            out = json.loads(r.stdout)
            assert out["failed"] == 0, out
            assert out["damaged"] == 0, f"records read as damaged after a claim storm: {out}"
    finally:
        seg.close()
        Segment.unlink(name)


def test_a_claim_that_lost_the_race_leaves_the_winners_seal() -> None:
    """The interleaving itself, step by step: B clears the check of a record (taking the
    old seal), A wins the record and seals it, B's pid CAS fails and B undoes its clear."""
    from krex.native import ffi, lib

    name = f"/krex-tclaims1-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    seg = Segment.create(name, n_gpus=1)
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        idx = lib.krex_proc_register(seg.raw, 0, 0, sleepers[0].pid)
        rec = seg.raw.procs[idx]
        old_seal = int(rec.check)  # what B took when it cleared the check
        rec.check = 0
        rec.pid = 0  # (B lost the record: it went to A)
        assert lib.krex_proc_register(seg.raw, 1, 0, sleepers[1].pid) == idx
        winner_seal = int(rec.check)
        assert winner_seal and winner_seal != old_seal

        lib.krex_proc_check_restore(ffi.addressof(seg.raw.procs, idx), old_seal)
        assert int(rec.check) == winner_seal, "the loser's undo overwrote the winner's seal"
        assert lib.krex_proc_audit(seg.raw, 1, ffi.NULL, 0) == 0

        # B cleared a record A had sealed already, then lost: the undo puts A's seal back.
        rec.check = 0
        lib.krex_proc_check_restore(ffi.addressof(seg.raw.procs, idx), winner_seal)
        assert int(rec.check) == winner_seal, "a cleared seal was not put back"
    finally:
        for s in sleepers:
            s.kill()
            s.wait()
        seg.close()
        Segment.unlink(name)


def test_a_region_is_flagged_while_a_sibling_has_no_process_record(kx: Krex, bins: dict[str, Path]) -> None:
    """All records taken (a command with more than KREX_MAX_PROCS GPU processes): a
    sibling that registers then has no record, so no drain helper krexd knows of, and its
    queued GPU work runs into the region. The region must say so (`drain-unknown`), never
    read clean. Before the fix the 1 ms kernel below measured ~1.9 s and END said clean."""
    kx.start_daemon(slots=4)
    go = kx.out / "go"
    kx.run_argv("owner", [str(bins["filler"]), str(lib.KREX_MAX_PROCS + 6), str(go)])
    log = kx.out / "owner.log"
    wait_until(lambda: '"filled"' in log.read_text(), 120, "the owner's children to take every record")
    kx.run_argv("sib", [str(bins["actor"]), "k:3000000", "sleep:20000"])  # queues a 3 s kernel
    sib_log = kx.out / "sib.log"
    wait_until(lambda: '"act":"k"' in sib_log.read_text(), 60, "the sibling's kernel launch")
    go.write_text("")
    wait_until(lambda: '"end"' in log.read_text(), 120, "the owner's region")
    out = json.loads(next(x for x in log.read_text().splitlines() if x.startswith('{"begin"')))
    assert out["begin"] == 0, out
    assert out["timed_ms"] > 500, f"the sibling kernel did not run in the region: this proves nothing {out}"
    assert out["end"] == 1, f"END said clean while a sibling's undrained kernel ran in the region: {out}"
    wait_until(lambda: len(kx.journal()) == 1, 30, "the region's journal record")
    (rec,) = kx.journal()  # the only region of this test
    assert rec["contaminated"] and "drain-unknown" in rec["flags"], rec
    assert any("no free process record" in r for r in rec["reasons"]), rec


def test_the_flag_ends_with_the_processes_that_had_no_record(kx: Krex, bins: dict[str, Path]) -> None:
    """A long-lived command whose GPU process found no record and then exited: once that
    process is gone, regions are clean again (before, the slot's count never went down and
    every region on the GPU was flagged for as long as the command lived)."""
    kx.start_daemon(slots=4)
    go = kx.out / "go"
    filler = kx.run_argv("filler", [str(bins["filler"]), str(lib.KREX_MAX_PROCS + 6), str(go)])
    log = kx.out / "filler.log"
    wait_until(lambda: '"filled"' in log.read_text(), 120, "the filler's children to take every record")
    # Registers without a record (the table is full), exits; its command lives on. Its
    # cudaMalloc (a LIFE call) arms the exit hold, whose count goes to the slot's shared
    # counter here: the hold must not keep it (every region would wait for it).
    kx.run_argv("long", ["sh", "-c", f"{bins['actor']} k:1 sync malloc && echo done && exec sleep 600"])
    wait_until(lambda: "done" in (kx.out / "long.log").read_text(), 60, "the long command's GPU process")
    with Segment.attach(kx.env()["KREX_SHM"]) as seg:
        listed = [int(e) & 0xFFFFFFFF for sl in seg.raw.slots for e in sl.unrecorded_pids if int(e)]
        held = {s: int(sl.inflight) for s, sl in enumerate(seg.raw.slots) if int(sl.inflight)}
    assert listed, "the long command's GPU process found a record: this proves nothing"
    assert held == {}, f"a process that has exited still counts in its slot: {held}"
    go.write_text("")
    assert filler.wait(120) == 0  # its region, then it kills its children: the records free up

    own = kx.run_argv("own", [str(bins["actor"]), "k:1", "begin", "k:10", "sync", "end"])
    assert own.wait(60) == 0
    acts = [json.loads(x) for x in (kx.out / "own.log").read_text().splitlines() if x.startswith('{"act"')]
    (end,) = [a for a in acts if a["act"] == "end"]
    assert end["rc"] == 0, f"a region flagged for a process that no longer lives: {kx.journal()[-1]}"


def test_a_sibling_in_another_pid_namespace_flags_the_regions(kx: Krex, bins: dict[str, Path]) -> None:
    """A sibling in a pid namespace with a /proc of its own (a container): its record's
    pid means another process to krexd, which then cannot tell whether it lives nor be
    sure its queued work is drained. The regions of that GPU say so (drain-unknown)."""
    if not shutil.which("unshare"):
        pytest.skip("needs unshare(1)")
    kx.start_daemon(slots=3)
    kx.run_argv("sib", ["unshare", "-pf", "--mount-proc", str(bins["actor"]), "k:1", "sync", "sleep:8000"])
    wait_until(lambda: '"act":"sync"' in (kx.out / "sib.log").read_text(), 30, "the sibling's registration")
    own = kx.run_argv("own", [str(bins["actor"]), "k:1", "sync", "begin", "k:10", "sync", "end"])
    assert own.wait(60) == 0
    acts = [json.loads(x) for x in (kx.out / "own.log").read_text().splitlines() if x.startswith('{"act"')]
    end = next(a for a in acts if a["act"] == "end")
    (rec,) = kx.journal()
    assert end["rc"] == 1 and "drain-unknown" in rec["flags"], rec
    assert any("pid namespace" in r for r in rec["reasons"]), rec


def test_a_commands_own_process_in_another_pid_namespace_does_not_flag_its_regions(
    kx: Krex, bins: dict[str, Path]
) -> None:
    """The owner's own processes are its own work: one of them in a pid namespace of its
    own (a container child) must not flag the owner's regions (only siblings' do)."""
    if not shutil.which("unshare"):
        pytest.skip("needs unshare(1)")
    kx.start_daemon(slots=2)
    actor = str(bins["actor"])
    child = f"unshare -pf --mount-proc {actor} k:1 sync sleep:3000"  # registers, then sleeps
    script = f"{child} & sleep 1; {actor} k:1 sync begin k:10 sync end; wait"
    own = kx.run_argv("own", ["sh", "-c", script])
    assert own.wait(60) == 0
    acts = [json.loads(x) for x in (kx.out / "own.log").read_text().splitlines() if x.startswith('{"act"')]
    end = next(a for a in acts if a["act"] == "end")
    assert end["rc"] == 0, kx.journal()


def test_a_region_right_after_a_sibling_in_another_pid_namespace_ended_waits_for_its_memory(kx: Krex) -> None:
    """krexd cannot find a process of another pid namespace gone (its record's pid means
    another process, or none, to krexd): its exit stamps the fixed settle time itself, and
    a region granted right after its end waits for its memory, or is flagged."""
    if not shutil.which("unshare"):
        pytest.skip("needs unshare(1)")
    settle_s = int(lib.KREX_FREE_SETTLE_NS) / 1e9
    kx.start_daemon(slots=3)
    res, t_stamp = kx.regions_across_an_end(
        lambda go: kx.run_argv("sib", ["unshare", "-pf", "--mount-proc", sys.executable, str(WORKER), "life",
                                       str(kx.out), "--name", "sib", "--calls", "30", "--exit-on", str(go)])
    )
    assert t_stamp, "the sibling's exit left no stamp"
    window = [r["grant"] for r in res["regions"] if t_stamp < r["t_grant"] < t_stamp + 1.5 * settle_s * 1e9]
    assert window, "no region was granted right after the sibling ended: this proves nothing"
    early = [r["grant"] for r in res["regions"] if t_stamp < r["t_grant"] < t_stamp + 0.9 * settle_s * 1e9]
    assert all(g["contaminated"] for g in early), early  # none granted clean before its memory settled
