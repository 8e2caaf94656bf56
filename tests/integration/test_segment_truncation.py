"""A segment shrunk by anyone who may write it (`truncate -s 0 /dev/shm/<name>`, a group
member) kills nobody: krexd, both guardians and the commands go on, the region it
happened in is flagged with the reason, and krexd gives the segment its size back and
repairs it. Before, every process that touched the segment after the truncation died of
SIGBUS (exit 135 / -7)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from helpers import wait_until
from helpers.krex_world import Krex, frozen_reason

from krex.native import lib

pytestmark = [
    pytest.mark.cgroup,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: real cgroups and freezers"),
]

GUARDIANS = {"native": {}}
SIZE = int(lib.krex_shm_size())


def _died(kx: Krex, d_pid: int) -> str:
    """Who died so far (krexd, a guardian), as `name: status`."""
    out = []
    if kx.daemon is not None and kx.daemon.poll() is not None:
        out.append(f"krexd: {kx.daemon.returncode}")
    for name, c in kx.cmds.items():
        if c.popen.poll() is not None:
            out.append(f"{name}: {c.popen.returncode}")
    return ", ".join(out)


def _truncate(kx: Krex, size: int) -> None:
    os.truncate("/dev/shm" + kx.shm, size)


def _incident_says_truncated(kx: Krex) -> list[str]:
    inc = kx.status()["segment"]["incidents"]
    return [p for i in inc for p in i["problems"] if "truncated" in p]


@pytest.mark.parametrize(("guardian", "size"), [("native", 0), ("native", 4096)])
def test_a_segment_truncated_inside_a_region_kills_nobody_and_flags_the_region(
    kx: Krex, guardian: str, size: int
) -> None:
    d = kx.start_daemon(slots=3)
    env = kx.env(**GUARDIANS[guardian])
    kx.run("h1", "hammer", "--us", "50", env=env)
    kx.wait_running("h1")
    kx.run("own", "hold", env=env)
    kx.result("own", "ready", timeout=30)
    h1 = kx.progress("h1")[2]
    assert frozen_reason(h1) is not None
    _truncate(kx, size)
    time.sleep(1.0)  # every guardian polls the segment, krexd beats into it (100 ms)
    # Before: "krexd: -7, h1: 135, own: 135" (SIGBUS)
    assert not _died(kx, d.pid), _died(kx, d.pid)
    assert Path("/dev/shm" + kx.shm).stat().st_size == SIZE, "the segment's size was not given back"
    kx.wait(lambda: _incident_says_truncated(kx), 10, "an incident that says the segment was truncated")
    kx.touch("own")
    assert kx.cmds["own"].wait(30) == 0, kx.cmds["own"].output()
    res = kx.result("own")
    assert res["end"] and not res["end"]["clean"], res
    recs = [r for r in kx.journal() if r["owner_pid"] == res["pid"]]
    assert recs and "segment" in recs[-1]["flags"], recs
    assert any("truncated" in r for r in recs[-1]["reasons"]), recs[-1]["reasons"]
    kx.wait(lambda: frozen_reason(h1) is None, 10, "h1 thawed")
    assert kx.advances("h1", timeout=10), "h1 did not run on after the region"
    kx.stop_all("h1")
    assert d.poll() is None
    p = kx.krex("daemon", "stop")
    assert p.returncode == 0, p.stderr
    assert d.wait(30) == 0


@pytest.mark.parametrize("guardian", ["native"])
def test_a_segment_truncated_between_regions_kills_nobody(kx: Krex, guardian: str) -> None:
    d = kx.start_daemon(slots=3)
    env = kx.env(**GUARDIANS[guardian])
    kx.run("h1", "hammer", "--us", "50", env=env)
    kx.wait_running("h1")
    _truncate(kx, 0)
    time.sleep(1.0)
    # Before: "krexd: -7, h1: 135"
    assert not _died(kx, d.pid), _died(kx, d.pid)
    assert kx.advances("h1", timeout=10), "h1 stopped making progress"
    kx.wait(lambda: _incident_says_truncated(kx), 10, "an incident that says the segment was truncated")
    # A region after the repair: granted, and flagged while h1 (it lived through the
    # incident, its view of the gate may be wrong) runs beside it.
    own = kx.run("own", "regions", "-n", "3", "--kernels", "2", "--us", "100", "--sleep-ms", "5", env=env)
    assert own.wait(60) == 0, own.output()
    res = kx.result("own")
    assert len(res["regions"]) == 3 and not res["errors"], res
    assert all(not r["summary"]["clean"] for r in res["regions"]), [r["summary"] for r in res["regions"]]
    kx.stop_all("h1")
    assert d.poll() is None
    os.kill(d.pid, signal.SIGTERM)
    assert d.wait(30) == 0


def test_the_shim_and_krexd_resolve_the_fault_themselves(kx: Krex) -> None:
    """A process that touches the shrunk segment before krexd's next check gives the file
    its size back itself and marks the header, so krexd still reports why."""
    from krex.node.shm import Segment

    d = kx.start_daemon(slots=2)
    with Segment.attach(kx.shm) as seg:
        before = int(lib.krex_seg_restores())
        _truncate(kx, 0)
        assert int(seg.raw.gpus[0].gate) == 0  # faults, restored, reads zero
        assert int(lib.krex_seg_restores()) == before + 1
        assert Path("/dev/shm" + kx.shm).stat().st_size == SIZE
        wait_until(lambda: _incident_says_truncated(kx), 10, "krexd to report it")
        wait_until(lambda: int(seg.raw.hdr.magic) == lib.KREX_MAGIC, 10, "the header repair")
        assert int(seg.raw.hdr.daemon_pid) == d.pid
        assert not int(seg.raw.hdr.flags) & lib.KREX_HF_RESTORED
