"""A damaged segment header is rewritten whole from krexd's own copy: every field, the
daemon's pid and heartbeat among them. Guardians and the watchdog find krexd's heartbeat
through the header's daemon pid; left wrong, a later stop of krexd left siblings frozen
for as long as it stayed stopped."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
from helpers import wait_until
from helpers.krex_world import Krex, frozen_reason, hold_with_siblings

from krex.native import ffi, lib
from krex.node.shm import Segment

pytestmark = [
    pytest.mark.cgroup,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: real cgroups and freezers"),
]

HB_TIMEOUT_S = lib.KREX_HEARTBEAT_TIMEOUT_NS / 1e9
HDR_FIELDS = [f for f, _ in ffi.typeof("struct krex_header").fields]


def _header(seg: Segment) -> dict[str, object]:
    h = seg.raw.hdr
    return {f: (list(getattr(h, f)) if f == "reserved" else int(getattr(h, f))) for f in HDR_FIELDS}


def _damage_header(kx: Krex, seed: int) -> None:
    rng = random.Random(seed)
    n = ffi.sizeof("struct krex_header")
    with open("/dev/shm" + kx.shm, "r+b") as f:
        f.write(bytes(rng.getrandbits(8) for _ in range(n)))


def _thaw_after_sigstop(kx: Krex, d_pid: int) -> float:
    """Seconds from SIGSTOP of krexd until a frozen sibling runs again."""
    hold_with_siblings(kx, "h1")
    h1 = kx.progress("h1")[2]
    os.kill(d_pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        wait_until(lambda: frozen_reason(h1) is None, 40, "h1 to be thawed")
        took = time.monotonic() - t0
    finally:
        os.kill(d_pid, signal.SIGCONT)
    return took


def test_recovery_restores_every_header_field_and_a_stopped_krexd_still_thaws_siblings(kx: Krex) -> None:
    d = kx.start_daemon(slots=3)
    with Segment.attach(kx.shm) as seg:
        wait_until(lambda: int(seg.raw.hdr.heartbeat_ns) != 0, 10, "krexd's first beat")
        before = _header(seg)
        assert before["daemon_pid"] == d.pid, before
        _damage_header(kx, 11)
        wait_until(lambda: kx.status()["segment"]["incidents"], 10, "krexd to see the damage")
        wait_until(lambda: _header(seg)["magic"] == lib.KREX_MAGIC, 10, "the header repair")
        time.sleep(0.3)  # a few heartbeats after the repair
        after = _header(seg)
    wrong = {
        f: (after[f], before[f])
        for f in HDR_FIELDS
        if f != "heartbeat_ns" and after[f] != before[f]
    }
    # Before: daemon_pid, flags, proc_overflows and reserved kept the random bytes.
    assert not wrong, f"header fields not restored (now, before the damage): {wrong}"
    age = (int(lib.krex_now_ns()) - int(str(after["heartbeat_ns"]))) / 1e9
    assert 0 <= age < HB_TIMEOUT_S, f"heartbeat {age:.2f} s old after the repair"
    p = kx.krex("status")
    assert f"daemon pid {d.pid}," in p.stdout, p.stdout
    took = _thaw_after_sigstop(kx, d.pid)
    print(f"sibling thawed {took:.2f} s after SIGSTOP of krexd, following a header repair")
    # Before: 30 s and more (the guardian compared the header's garbage pid with krexd's).
    assert took < HB_TIMEOUT_S + 3, f"sibling stayed frozen {took:.1f} s after krexd stopped"
    kx.touch("own")  # its region holds the gate: h1 can stop only after it
    assert kx.cmds["own"].wait(30) == 0, kx.cmds["own"].output()
    kx.stop_all("h1")


def test_a_forged_daemon_pid_alone_is_an_incident_and_is_restored(kx: Krex) -> None:
    d = kx.start_daemon(slots=2)
    with Segment.attach(kx.shm) as seg:
        wait_until(lambda: int(seg.raw.hdr.heartbeat_ns) != 0, 10, "krexd's first beat")
        seg.raw.hdr.daemon_pid = 424242
        wait_until(lambda: int(seg.raw.hdr.daemon_pid) == d.pid, 10, "krexd to restore its pid")
    inc = kx.status()["segment"]["incidents"]
    assert inc and any("daemon pid" in i["problems"][0] for i in inc), inc
    assert Path("/dev/shm" + kx.shm).exists()
