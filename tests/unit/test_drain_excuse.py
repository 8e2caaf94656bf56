"""krexd's excuse of a drain ack (krex_drain_excuse, life_freeze): a sibling frozen inside a
context, module or memory call with nothing else queued has its ack taken as given. Real
records in a real segment, one live process: the excuse and the check that allows it read
that process's record, never the record of an earlier process that had its pid."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator

import pytest

from krex.native import ffi, lib
from krex.node.shm import Segment

SIB = 2  # the sibling's slot
OWNER = 1


@pytest.fixture
def seg() -> Iterator[Segment]:
    name = f"/krex-texcuse-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    s = Segment.create(name, n_gpus=1)
    try:
        yield s
    finally:
        s.close()
        Segment.unlink(name)


@pytest.fixture
def live() -> Iterator[int]:
    p = subprocess.Popen(["sleep", "60"])
    try:
        yield p.pid
    finally:
        p.kill()
        p.wait()


def _record(seg: Segment, pid: int, *, in_life: bool, submits: int = 0, dead: bool = False) -> int:
    """A record of `pid` under the sibling's slot: inside a LIFE call or not, `submits`
    kernels since its last full drain; `dead`: that of an earlier process with the pid (its
    start time another), left until the reaper frees it."""
    i = int(lib.krex_proc_register(seg.raw, SIB, 0, pid))
    assert i >= 0
    r = seg.raw.procs[i]
    if dead:
        r.start_ticks = int(r.start_ticks) - 1
    r.has_ctx = 1
    r.drained_at = 1
    r.submits[0] = submits
    r.life_inflight = 1 if in_life else 0
    r.check = lib.krex_proc_check(ffi.addressof(seg.raw.procs, i))
    return i


@pytest.mark.parametrize("dead_in_life", [True, False])
def test_an_excuse_acks_the_live_process_not_an_earlier_one_with_its_pid(
    seg: Segment, live: int, dead_in_life: bool
) -> None:
    """An earlier process with the pid died (inside a LIFE call, or not) and its record is
    not freed yet; the live one, frozen inside its LIFE call, is excused: its own record acks."""
    dead = _record(seg, live, in_life=dead_in_life, dead=True)
    mine = _record(seg, live, in_life=True)
    assert dead != mine
    seq = int(lib.krex_drain_request(seg.raw, 0))
    assert int(lib.krex_drain_pending(seg.raw, 0, OWNER, seq, ffi.NULL, 0)) == 1
    assert seg.life_only([live]) == {live}
    assert seg.drain_excuse(0, live, seq)
    assert int(seg.raw.procs[mine].drain_ack) == seq
    assert int(lib.krex_drain_pending(seg.raw, 0, OWNER, seq, ffi.NULL, 0)) == 0


def test_a_process_with_work_queued_is_not_excusable_for_an_earlier_ones_record(
    seg: Segment, live: int
) -> None:
    """The live process has a kernel queued since its last drain: an earlier process with its
    pid, dead inside a LIFE call, does not make it read as excusable, nor excuse it."""
    _record(seg, live, in_life=True, dead=True)
    mine = _record(seg, live, in_life=True, submits=1)
    seq = int(lib.krex_drain_request(seg.raw, 0))
    assert seg.life_only([live]) == set()
    assert not seg.drain_excuse(0, live, seq)
    assert int(seg.raw.procs[mine].drain_ack) != seq
