"""fork() under KREX: the child is a process of its own (own record, own
helper thread, same slot), is gated like its parent, and the parent carries
on undisturbed."""

from __future__ import annotations

import os
import signal
import time

from helpers import Harness, wait_until

from krex.native import lib

SCRIPT = ["k:5", "fork", "threads", "k:5", "threads", "sigwait", "k:5", "reap"]


def test_fork_child_is_its_own_gated_process(harness: Harness) -> None:
    h = harness
    slot, owner = h.claim(), h.claim()
    c = h.spawn("actor", SCRIPT, h.env(slot))

    def line(role: str, act: str, n: int = 1) -> dict:
        def pred() -> dict | None:
            got = [d for d in c.lines if d["role"] == role and d["act"] == act]
            return got[n - 1] if len(got) >= n else None

        return wait_until(pred, 30, f"{role} {act} #{n} (stderr {c.stderr!r})")

    fork = line("parent", "fork")
    child_pid = fork["rc"]
    assert child_pid > 0 and child_pid != c.pid
    # Right after fork the child has only the forking thread and no helper yet.
    first = line("child", "threads")
    assert first["pid"] == child_pid and first["threads"] == 1 and first["helper"] == 0
    # After its first submission it has its own helper; the parent still has its own.
    child_after, parent_after = line("child", "threads", 2), line("parent", "threads", 2)
    assert child_after["threads"] == 2 and child_after["helper"] == 1
    assert parent_after["threads"] == 2 and parent_after["helper"] == 1
    assert all(d["rc"] == 0 for d in c.lines if d["act"] == "k")

    recs = {p.pid: p for p in h.seg.snapshot().procs}
    assert set(recs) == {c.pid, child_pid}, recs
    assert recs[child_pid].slot == recs[c.pid].slot == slot
    assert recs[c.pid].submits["kernel"] == 2 and recs[child_pid].submits["kernel"] == 1
    ops = h.ops(life=False)
    assert sorted(o["pid"] for o in ops) == sorted([c.pid, c.pid, child_pid])
    assert {o["slot"] for o in ops} == {slot}

    # The child's own helper answers drains.
    res = h.seg.drain(0, owner, timeout=10)
    assert res.ok, res
    seq = int(h.seg.raw.gpus[0].drain_seq)
    recs = {p.pid: p for p in h.seg.snapshot().procs}
    assert recs[child_pid].drain_ack == seq and recs[c.pid].drain_ack == seq

    # Both block at a gate closed by another slot, and both resume on open.
    h.seg.close_gate(0, owner_slot=owner, holder=lib.KREX_HOLDER_PAUSE, lease_s=60)
    assert h.seg.wait_inflight(0, owner).ok
    for pid in (c.pid, child_pid):
        os.kill(pid, signal.SIGUSR1)
    line("parent", "sigwait")
    line("child", "sigwait")
    wait_until(
        lambda: all((r := h.proc(p)) and r.blocked >= 1 for p in (c.pid, child_pid)),
        10,
        "both processes to block at the closed gate",
    )
    time.sleep(0.1)
    assert len(h.ops(life=False)) == 3, "a submission passed the closed gate"
    assert len([d for d in c.lines if d["act"] == "k"]) == 3, "a call returned through the closed gate"
    t_open = time.monotonic_ns()
    h.seg.open_gate(0)
    assert c.wait(30) == 0, c.stderr
    late = [o for o in h.ops(life=False) if o["submit"] > t_open]
    assert sorted(o["pid"] for o in late) == sorted([c.pid, child_pid])
    assert line("parent", "reap")["rc"] == 0, "the child did not exit cleanly"
    assert [d["rc"] for d in c.lines if d["act"] == "k"] == [0] * 5
