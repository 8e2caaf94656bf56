"""krex.Executor on the simulated GPU: commands run under KREX as futures, with their
regions; KREX's own errors raise the library's exceptions; timeouts and
shutdown(cancel_futures=True) stop command trees with no orphans and no frozen siblings."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import CancelledError
from pathlib import Path

import psutil
import pytest
from helpers import sim_candidate

import krex
from krex.errors import CommandNotFound, KrexError, UsageError


@pytest.fixture
def iso(krex_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """The executor runs in this process: put the isolated KREX world into os.environ."""
    for k in list(os.environ):
        if k.startswith("KREX_") or k == "LD_PRELOAD":
            monkeypatch.delenv(k)
    for k, v in krex_env.items():
        if k.startswith("KREX_") or k == "PYTHONUNBUFFERED":
            monkeypatch.setenv(k, v)
    yield krex_env


def _daemon_status() -> dict[str, object]:
    from krex.proc.client import Client

    c = Client.connect()
    try:
        return dict(c.request({"op": "status"}))
    finally:
        c.close()


def test_submit_returns_typed_results_with_the_regions(iso: dict[str, str]) -> None:
    cand = str(sim_candidate())
    with krex.Executor(device="sim") as ex:
        width = ex.max_workers  # starts the daemon, as `krex run` would
        slots = _daemon_status()["slots_per_gpu"]
        assert width == (slots if isinstance(slots, int) else sum(slots))  # type: ignore[arg-type]
        futs = [ex.submit([cand, "--us", "300", "--iters", "5", "--region"], name=f"c{i}") for i in range(3)]
        plain = ex.submit(f"{cand} --us 100 --iters 2")  # a shell line, no region
        results = [f.result(timeout=120) for f in futs]
        unprotected = plain.result(timeout=120)
    for i, r in enumerate(results):
        assert isinstance(r, krex.RunResult) and r.name == f"c{i}"
        assert r.ok and r.exit_status == 0 and r.simulated
        assert '"mean_us"' in r.stdout and r.stdout_path is None  # the tail is kept, not the files
        (reg,) = r.regions
        assert isinstance(reg, krex.RegionRecord)
        assert 0.0015 <= reg.duration_s < r.wall_s  # 5 kernels of 300 us ran inside it
        assert reg.offset_s is not None and 0 <= reg.offset_s < r.wall_s
        assert reg.granted_at is not None and r.started_at <= reg.granted_at <= r.started_at + r.wall_s
        assert reg.clean or reg.reasons  # a flagged region always says why
    assert unprotected.ok and unprotected.regions == () and not unprotected.clean
    assert unprotected.argv[:2] == ("/bin/sh", "-c")


def test_errors_follow_the_library_hierarchy(iso: dict[str, str], tmp_path: Path) -> None:
    with krex.Executor(device="sim", max_workers=2) as ex:
        with pytest.raises(UsageError):
            ex.submit([])
        missing = ex.submit([str(tmp_path / "no-such-command")])
        failing = ex.submit(["/bin/sh", "-c", "echo oops >&2; exit 3"])
        checked = ex.submit(["/bin/sh", "-c", "exit 4"], check=True)
        with pytest.raises(CommandNotFound) as e:
            missing.result(timeout=60)
        assert isinstance(e.value, KrexError) and e.value.fix
        r = failing.result(timeout=60)
        assert r.exit_status == 3 and not r.ok and "oops" in r.stderr
        with pytest.raises(krex.CommandFailed, match="exited 4") as f:
            checked.result(timeout=60)
        assert f.value.result.exit_status == 4
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(["true"])


def _gone(pids: list[int]) -> bool:
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def test_a_timeout_kills_the_whole_tree(iso: dict[str, str], tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    with krex.Executor(device="sim", max_workers=1, stop_grace_s=2) as ex:
        r = ex.submit(["/bin/sh", "-c", f"sleep 300 & echo $! >> {pidfile}; echo $$ >> {pidfile}; wait"],
                      timeout_s=1.5).result(timeout=60)
    assert r.timed_out and not r.ok and not r.stopped
    pids = [int(x) for x in pidfile.read_text().split()]
    assert len(pids) == 2 and _gone(pids)


HOLDER = textwrap.dedent("""
    import os, subprocess, sys, time, krex
    out = sys.argv[1]
    child = subprocess.Popen(["sleep", "300"])
    with open(out + ".pids", "a") as f:
        f.write(f"{os.getpid()} {child.pid}\\n")
    with krex.region():
        open(out + ".granted", "w").close()
        time.sleep(120)
""")


def test_shutdown_cancel_stops_running_commands_cleanly(iso: dict[str, str], tmp_path: Path) -> None:
    """One command holds a region (and has a child), a sibling runs GPU work (frozen
    during that region), a third waits for a worker. shutdown(cancel_futures=True) cancels
    the third and stops the other two: every process gone, the region over, the gate open."""
    holder = tmp_path / "holder.py"
    holder.write_text(HOLDER)
    out = tmp_path / "h"
    sib_pids = tmp_path / "sib.pids"
    cand = sim_candidate()
    t0 = time.monotonic()
    ex = krex.Executor(device="sim", max_workers=2, stop_grace_s=3)
    running = ex.submit([sys.executable, str(holder), str(out)])
    deadline = time.monotonic() + 60
    while not Path(str(out) + ".granted").exists():
        assert time.monotonic() < deadline, "the holder's region was never granted"
        assert not running.done(), running.result().stderr
        time.sleep(0.05)
    sibling = ex.submit(["/bin/sh", "-c",
                         f"echo $$ >> {sib_pids}; while true; do {cand} --us 200 --iters 3 >/dev/null; done"])
    waiting = ex.submit(["/bin/sh", "-c", "exit 0"])
    # The sibling's processes, found by their command line: it may be frozen by the holder's
    # region before its shell runs a line.
    sib: list[int] = []
    deadline = time.monotonic() + 20
    while not sib and time.monotonic() < deadline:
        time.sleep(0.2)
        for p in psutil.process_iter(["cmdline"]):
            if any(str(sib_pids) in a for a in p.info["cmdline"] or []):
                sib += [p.pid, *(c.pid for c in p.children(recursive=True))]
    assert sib, "the sibling never started"
    ex.shutdown(wait=True, cancel_futures=True)
    assert time.monotonic() - t0 < 60  # nobody waited for the 120 s region
    assert waiting.cancelled()
    with pytest.raises(CancelledError):
        waiting.result()
    r1, r2 = running.result(timeout=5), sibling.result(timeout=5)
    assert r1.stopped and r2.stopped and not r1.ok
    pids = [int(x) for x in Path(str(out) + ".pids").read_text().split()] + sib
    if sib_pids.exists():
        pids += [int(x) for x in sib_pids.read_text().split()]
    deadline = time.monotonic() + 10
    while not _gone(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pids), [p for p in pids if psutil.pid_exists(p)]
    assert _daemon_status()["regions"] == []
    from krex.node.shm import Segment

    with Segment.attach() as seg:
        assert not any(g.closed for g in seg.snapshot().gates)
