"""krexd under connection floods and descriptor exhaustion.

Before, every connection held a thread of its own for its whole life, and the accept loop
ended on any error: ~1,000 idle connections from any member of the daemon's group hit
the 1,024-descriptor limit, accept() failed with EMFILE, krexd cut the running region
without journaling it and exited 0 (so systemd's Restart=on-failure left it down).
Now connections wait for their next request in one selector (threads only serve
requests), each peer process and each non-owner user get a bounded number, connections
that never finish a frame are closed after a timeout, descriptor exhaustion is waited
out, and krexd exits non-zero whenever it stops without being asked to."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_until
from helpers.krex_world import Krex, frozen_reason, hold_with_siblings

from krex.node import conns

pytestmark = [
    pytest.mark.cgroup,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: real cgroups and freezers"),
]

FLOODER = Path(__file__).resolve().parents[1] / "helpers" / "flooder.py"


@pytest.fixture
def kx() -> Iterator[Krex]:
    k = Krex()
    try:
        yield k
    finally:
        (k.out / "flood.stop").write_text("")
        k.cleanup()


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _flood(kx: Krex, procs: int, per: int, mode: str) -> list[dict[str, Any]]:
    """Start the flooders and wait until each has opened its connections."""
    p = subprocess.Popen(
        [sys.executable, str(FLOODER), str(kx.sock), str(procs), str(per), mode, str(kx.out)],
        env=kx.env(),
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    kx.popens.append(p)
    wait_until(lambda: len(list(kx.out.glob(f"flood-{mode}-*.json"))) >= procs, 120, "the flooders")
    return _flood_state(kx, mode)


def _flood_state(kx: Krex, mode: str = "*") -> list[dict[str, Any]]:
    out = []
    for f in kx.out.glob(f"flood-{mode}-*.json"):
        with contextlib.suppress(ValueError):
            out.append(json.loads(f.read_text()))
    return out


def _alive(d: subprocess.Popen[bytes]) -> str:
    return "" if d.poll() is None else f"krexd exited with {d.returncode}"


def test_a_silent_flood_under_a_low_descriptor_limit_stops_neither_krexd_nor_its_region(kx: Krex) -> None:
    d = kx.start_daemon(slots=3)
    resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (1024, 1024))
    ready = hold_with_siblings(kx, "h1")
    base = _threads(d.pid)
    state = _flood(kx, 20, 60, "silent")  # 1,200 connections that never send a byte
    time.sleep(1.0)
    # Before: krexd exited 0 here (accept: EMFILE), the region cut and not journaled.
    assert not _alive(d), _alive(d)
    threads = _threads(d.pid)
    print(
        f"{sum(s['opened'] for s in state)} silent connections held; krexd threads {base} -> {threads}, "
        f"descriptors {_fds(d.pid)} of 1024"
    )
    assert threads <= base + 8, f"krexd runs {threads} threads (was {base}) for idle connections"
    t0 = time.monotonic()
    st = kx.status()  # a new client is served during the flood
    print(f"status answered in {time.monotonic() - t0:.3f} s during the flood")
    assert st["regions"], st["regions"]
    kx.touch("own")
    assert kx.cmds["own"].wait(30) == 0, kx.cmds["own"].output()
    res = kx.result("own")
    assert res["end"] and res["end"]["end"] == "end", res
    recs = [r for r in kx.journal() if r["owner_pid"] == ready["pid"]]
    assert recs and recs[-1]["end"] == "end", recs
    kx.wait(lambda: frozen_reason(kx.progress("h1")[2]) is None, 10, "h1 thawed")
    kx.stop_all("h1")
    assert "Traceback" not in kx.daemon_log()
    p = kx.krex("daemon", "stop")
    assert p.returncode == 0, p.stderr
    assert d.wait(30) == 0


def test_descriptor_exhaustion_is_waited_out(kx: Krex) -> None:
    d = kx.start_daemon(slots=2)
    soft, hard = resource.prlimit(d.pid, resource.RLIMIT_NOFILE)
    lim = _fds(d.pid) + 2
    resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (lim, hard))
    _flood(kx, 2, 20, "silent")
    time.sleep(1.0)
    # Before: krexd exited 0 at the first EMFILE.
    assert not _alive(d), _alive(d)
    kx.wait(lambda: "descriptor" in kx.daemon_log(), 10, "krexd to log the exhaustion")
    resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (soft, hard))
    assert kx.status()["daemon"]["pid"] == d.pid
    assert "Traceback" not in kx.daemon_log()


def test_one_process_gets_a_bounded_number_of_connections_and_a_clear_error_beyond(kx: Krex) -> None:
    from krex.errors import Busy
    from krex.proc.client import Client

    d = kx.start_daemon(slots=2)
    base = _threads(d.pid)
    per = conns.PER_PID + 20
    state = _flood(kx, 1, per, "hello")  # each sends a request, then idles
    # Before: all 84 held a thread each.
    assert state[0]["opened"] == conns.PER_PID and state[0]["refused"] == 20, state
    assert _threads(d.pid) <= base + 8, (_threads(d.pid), base)
    held = [Client.connect(path=kx.sock) for _ in range(conns.PER_PID)]
    try:
        with pytest.raises(Busy, match="connections"):
            Client.connect(path=kx.sock).request({"op": "hello"})
    finally:
        for c in held:
            c.close()
    assert not _alive(d)


def test_connections_that_never_finish_a_frame_are_closed_after_the_timeout(kx: Krex) -> None:
    d = kx.start_daemon(slots=2)
    base = _threads(d.pid)
    _flood(kx, 1, 5, "silent")
    _flood(kx, 2, 5, "partial")
    _flood(kx, 3, 5, "hello")  # each sent a whole request: kept, waiting for the next
    t0 = time.monotonic()

    def closed(mode: str) -> int:
        return sum(s["closed_by_peer"] for s in _flood_state(kx, mode))

    assert _threads(d.pid) <= base + 8, (_threads(d.pid), base)
    # Before: held for ever, a thread each.
    kx.wait(
        lambda: closed("silent") + closed("partial") >= 15,
        conns.SILENT_S + 10,
        "krexd to close the silent and half-sent connections",
    )
    took = time.monotonic() - t0
    print(f"silent and half-sent connections closed after {took:.1f} s (timeout {conns.SILENT_S:g} s)")
    assert closed("silent") == 5 and closed("partial") == 10
    assert closed("hello") == 0
    assert not _alive(d)


PATCHED = """
import errno, os, socket, sys
trigger = sys.argv.pop(1)
real = socket.socket.accept
def accept(self):
    if os.path.exists(trigger):
        raise OSError(errno.EBADF, "injected: the listening socket is gone")
    return real(self)
socket.socket.accept = accept
from krex.node.daemon import main
main(sys.argv[1:])
"""


def test_krexd_that_stops_serving_for_good_exits_non_zero_and_journals_the_region(kx: Krex) -> None:
    trigger = kx.out / "accept-fails"
    args = [sys.executable, "-c", PATCHED, str(trigger), "--device", "sim", "--slots-per-gpu", "3"]
    kx.state.mkdir(exist_ok=True)
    with open(kx.state / "test-daemon.log", "ab") as log:
        d = subprocess.Popen(
            args, env=kx.env(), stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
        )
    kx.popens.append(d)
    kx.daemon = d
    wait_until(lambda: kx.sock.exists(), 20, "the patched daemon")
    ready = hold_with_siblings(kx, "h1")
    trigger.write_text("")  # every accept fails from now on, on every new socket too
    deadline = time.monotonic() + 60
    while d.poll() is None and time.monotonic() < deadline:
        with socket.socket(socket.AF_UNIX) as s, contextlib.suppress(OSError):
            s.settimeout(1)
            s.connect(str(kx.sock))
        time.sleep(0.2)
    rc = d.wait(10)
    # Before: 0 (the loop ended on the error and krexd stopped as if asked to).
    assert rc not in (0, None) and rc != -signal.SIGKILL, rc
    log = kx.daemon_log()
    assert "stopped serving" in log or "accept" in log, log[-2000:]
    recs = [r for r in kx.journal() if r["owner_pid"] == ready["pid"]]
    assert recs and recs[-1]["end"] == "daemon-stop", recs
    kx.wait(lambda: frozen_reason(kx.progress("h1")[2]) is None, 10, "h1 thawed")
