"""Case 1 of the trust issue, in the C core and the shim: a reused slot number never
lets an old process through.

* A slot number is not handed out while a process registered under it lives.
* A process whose KREX_SLOT_GEN is older than its slot's generation (its command ended
  and the slot went to another command) registers as a sibling of everyone: it waits
  at a gate closed for the slot's new owner, and every region counts its in-flight
  submissions."""

from __future__ import annotations

import time

from helpers import Harness, wait_until

from krex.native import lib


def test_a_slot_with_a_live_registered_process_is_not_handed_out(harness: Harness) -> None:
    h = harness
    s = h.claim()
    c = h.spawn("actor", ["k:5", "line"], h.env(s))
    c.expect(lambda d: d["act"] == "k", 30, "the kernel")
    wait_until(lambda: h.proc(c.pid), 10, "the record")
    h.seg.release_slot(s)  # its command "ended", but this process lives on
    again = h.claim()
    assert again != s, "the slot of a live registered process was handed to a new command"
    c.close_stdin()
    assert c.wait(30) == 0
    h.seg.release_slot(again)
    assert h.claim() == s  # once the process is gone, the number is free again


def test_a_process_of_an_older_slot_generation_waits_at_the_new_owners_gate(harness: Harness) -> None:
    h = harness
    s = h.claim()
    old_gen = int(h.seg.raw.slots[s].generation)
    h.seg.release_slot(s)
    assert h.claim() == s
    new_gen = int(h.seg.raw.slots[s].generation)
    assert new_gen != old_gen
    word = h.seg.close_gate(0, owner_slot=s, holder=lib.KREX_HOLDER_PAUSE, lease_s=120)
    stale = h.spawn("actor", ["k:5"], h.env(s, KREX_SLOT_GEN=str(old_gen)))
    fresh = h.spawn("actor", ["k:5"], h.env(s, KREX_SLOT_GEN=str(new_gen)))
    assert fresh.wait(30) == 0, "the slot's current command was blocked by its own gate"
    wait_until(lambda: h.proc(stale.pid) and h.proc(stale.pid).blocked, 30, "the stale process to block")
    time.sleep(0.2)
    assert h.ops(stale.pid, life=False) == [], "a process of an older generation passed the new owner's gate"
    rec = h.proc(stale.pid)
    assert rec.slot == lib.KREX_PROC_STALE and "stale-slot" in rec.flags, rec
    # Its in-flight work counts against the slot's owner like any sibling's.
    h.seg.open_gate(0, word)
    assert stale.wait(30) == 0
    assert len(h.ops(stale.pid, life=False)) == 1
