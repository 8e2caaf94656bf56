"""krexd's ledger of ended processes (krex/node/exits.py): how long a region waits for the
scrubbing of their GPU memory, counted from when krexd found each gone, and which ends were
kills. Real records in a real segment: a child that exits, one that is SIGKILLed."""

from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from krex.native import lib
from krex.node.daemon import Daemon
from krex.node.exits import Exit, Exits
from krex.node.shm import Ended, Segment

MS = 1_000_000


def _ended(pid: int = 4242, slot: int = 3, gen: int = 7, exit_ns: int = 0, gpu: int = 0) -> Ended:
    return Ended(pid, gpu, slot, gen, exit_ns)


def test_a_sized_end_waits_its_bytes_from_when_it_was_found_gone() -> None:
    x = Exits(lambda pids: 12 * MS)
    t0 = int(lib.krex_now_ns())
    x.add([_ended(exit_ns=t0 - 50 * MS)])
    until, seen = x.settle_until(0, owner_slot=1, owner_gen=1)
    assert t0 <= seen <= int(lib.krex_now_ns())
    assert until == seen + 12 * MS  # not the fixed 100 ms from the start of its exit


def test_an_unsized_exit_keeps_the_fixed_time_from_its_start_and_a_kill_from_its_discovery() -> None:
    fixed, least = int(lib.KREX_FREE_SETTLE_NS), int(lib.KREX_SETTLE_MIN_NS)
    x = Exits(lambda pids: None)
    t0 = int(lib.krex_now_ns())
    x.add([_ended(pid=1, exit_ns=t0 - 30 * MS)])
    assert x.settle_until(0, 9, 9)[0] == t0 - 30 * MS + fixed
    x.add([_ended(pid=2, exit_ns=t0 - 2 * fixed)])  # its exit began long ago: the floor from now
    y = Exits(lambda pids: None)
    y.add([_ended(pid=2, exit_ns=t0 - 2 * fixed)])
    until, seen = y.settle_until(0, 9, 9)
    assert until == seen + least
    z = Exits(lambda pids: None)
    z.add([_ended(pid=3, exit_ns=0)])  # killed: the fixed time from when krexd found it gone
    until, seen = z.settle_until(0, 9, 9)
    assert until == seen + fixed and seen >= t0


def test_the_owners_own_command_and_other_gpus_are_not_waited_for() -> None:
    x = Exits(lambda pids: 20 * MS)
    x.add([_ended(slot=3, gen=7, gpu=0)])  # the record keeps the low 32 bits of (5 << 32) | 7
    x.add([_ended(slot=4, gen=7, gpu=1)])
    assert x.settle_until(0, owner_slot=3, owner_gen=(5 << 32) | 7) == (0, 0)
    assert x.settle_until(0, owner_slot=3, owner_gen=8)[0] > 0  # the slot's next command: another's
    assert x.settle_until(1, owner_slot=3, owner_gen=7)[0] > 0
    assert x.settle_until(2, owner_slot=3, owner_gen=7) == (0, 0)


def test_kills_are_told_exits_are_not() -> None:
    told: list[Exit] = []
    x = Exits(lambda pids: None, told.append)
    now = int(lib.krex_now_ns())
    x.add([_ended(pid=10, exit_ns=now), _ended(pid=11, exit_ns=0)])
    assert [k.pid for k in told] == [11] and told[0].killed


def test_since_lists_ends_found_after_a_time() -> None:
    x = Exits(lambda pids: MS)
    x.add([_ended(pid=1)])
    mid = int(lib.krex_now_ns())
    time.sleep(0.002)
    x.add([_ended(pid=2)])
    assert [e.pid for e in x.since(0, 9, 9, mid)] == [2]


def _settle_daemon(exits: Exits) -> Any:
    return SimpleNamespace(_frees_since=lambda *a: [], _settle_until=lambda *a: (0, 0),
                           _owner_gen=lambda s: 1,
                           seg=SimpleNamespace(reap_records=lambda: 0), exits=exits)


def test_the_settle_step_waits_for_the_ledger_and_flags_an_end_found_after_it() -> None:
    x = Exits(lambda pids: 40 * MS)
    x.add([_ended(slot=5)])
    t: dict[str, float] = {}
    assert Daemon._settle(_settle_daemon(x), 0, 0, 0, t) == []  # type: ignore[arg-type]
    assert 0.035 <= t["settle_s"] < 0.2 and t["exit_settle_s"] > 0.03, t
    # An end krexd finds only after the wait (its second look): flagged, never clean.
    d = _settle_daemon(x)
    looks = []

    def reap() -> int:
        looks.append(1)
        if len(looks) == 2:
            x.add([_ended(pid=77, slot=6)])
        return 0

    d.seg = SimpleNamespace(reap_records=reap)
    reasons = Daemon._settle(d, 0, 0, 0, {})  # type: ignore[arg-type]
    assert [r[0] for r in reasons] == ["recent-free"] and "slot 6" in reasons[0][1], reasons


@pytest.fixture
def seg() -> Any:
    name = f"/krex-ut-ledger-{os.getpid()}"
    s = Segment.create(name, n_gpus=1, exclusive=True)
    yield s
    s.close()
    Segment.unlink(name)


def _dead_child(exit_first: bool) -> int:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.write(w, b"x")
        if exit_first:
            os._exit(0)
        time.sleep(30)
        os._exit(0)
    os.close(w)
    os.read(r, 1)
    os.close(r)
    if not exit_first:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return pid


def test_records_freed_by_krexd_go_to_the_ledger_with_their_exit_start(seg: Any) -> None:
    got: list[Ended] = []
    seg.on_ended = got.extend
    pids = []
    for exit_first in (True, False):
        pid = _dead_child(exit_first)
        i = int(lib.krex_proc_register(seg.raw, 2, 0, pid))
        assert i >= 0
        seg.raw.procs[i].slot_gen = 9
        if exit_first:
            seg.raw.procs[i].exit_ns = 123
        pids.append(pid)
    assert seg.reap_records() == 2
    assert sorted((e.pid, e.slot, e.slot_gen, e.exit_ns) for e in got) == sorted(
        [(pids[0], 2, 9, 123), (pids[1], 2, 9, 0)]
    )
    assert int(seg.raw.gpus[0].slot_free_ns[2]) == 0  # reported: no fixed stamp of its own


def test_a_record_freed_where_krexd_does_not_hear_stamps_the_fixed_time(seg: Any) -> None:
    pid = _dead_child(True)
    seg.raw.slots[2].generation = (3 << 32) | 9
    i = int(lib.krex_proc_register(seg.raw, 2, 0, pid))
    seg.raw.procs[i].slot_gen = 9
    t0 = int(lib.krex_now_ns())
    assert int(lib.krex_proc_reap(seg.raw)) == 1  # no ledger: the C path alone
    g = seg.raw.gpus[0]
    assert int(g.slot_free_gen[2]) == (3 << 32) | 9
    assert int(g.slot_free_until_ns[2]) - int(g.slot_free_ns[2]) == int(lib.KREX_FREE_SETTLE_NS)
    assert int(g.slot_free_ns[2]) >= t0


def test_a_look_at_the_ledger_waits_for_records_another_thread_is_reporting(seg: Any) -> None:
    """The reaper thread frees a record, then reports it: a region's settle step reaping
    meanwhile finds the record gone already, and must still see its end in the ledger."""
    x = Exits(lambda pids: 40 * MS)
    freed = threading.Event()

    def slow_sink(ended: list[Ended]) -> None:
        freed.set()  # the record is free in the segment, not yet in the ledger
        time.sleep(0.3)
        x.add(ended)

    seg.on_ended = slow_sink
    pid = _dead_child(False)
    assert int(lib.krex_proc_register(seg.raw, 2, 0, pid)) >= 0
    reaper = threading.Thread(target=seg.reap_records)
    reaper.start()
    assert freed.wait(5)
    seg.on_ended = x.add
    seg.reap_records()  # the settle step's look: nothing left to free
    until, _ = x.settle_until(0, owner_slot=1, owner_gen=1)
    reaper.join()
    assert until > 0, "an end the reaper was reporting was missed"


def test_an_end_krexd_could_not_see_is_no_kill() -> None:
    """A record of a process outside krexd's pid namespace, freed: no exit handler wrote
    to it, yet nothing says it was killed (krexd may have freed it while it lived)."""
    told: list[Exit] = []
    x = Exits(lambda pids: None, told.append)
    x.add([Ended(5, 0, 1, 1, 0, unseen=True)])
    assert told == []
    assert x.settle_until(0, 9, 9)[0] > 0  # still waited for, as any freed record


def test_a_new_image_marks_its_old_images_record_ended_not_a_dead_ones(seg: Any) -> None:
    """exec keeps the pid and start time: the new image finds the old one's record and says
    that image ended (exit_ns). A record of a dead process whose pid it reuses is left be."""
    me = int(lib.krex_proc_register(seg.raw, 2, 0, os.getpid()))
    assert lib.krex_proc_note_exec(seg.raw, os.getpid(), 777) == 1
    assert int(seg.raw.procs[me].exit_ns) == 777
    assert lib.krex_proc_note_exec(seg.raw, os.getpid(), 888) == 1
    assert int(seg.raw.procs[me].exit_ns) == 777  # the first end stands
    seg.raw.procs[me].exit_ns = 0
    seg.raw.procs[me].start_ticks = int(seg.raw.procs[me].start_ticks) + 1  # another process's
    assert lib.krex_proc_note_exec(seg.raw, os.getpid(), 999) == 0
    assert int(seg.raw.procs[me].exit_ns) == 0
