"""krexd serves each connection on a thread of its own, and keeps a thread whose
connection ended for the next one (starting one per connection was a share of each
`krex run`'s admission): reused, never shared by two live connections."""

from __future__ import annotations

import os
import time

from test_regions import Krex, kx

from krex.proc.client import Client

__all__ = ["kx"]  # the fixture, used by name


def _tasks(pid: int) -> set[int]:
    return {int(t) for t in os.listdir(f"/proc/{pid}/task")}


def _open(kx: Krex, n: int) -> list[Client]:
    conns = [Client.connect(path=kx.sock) for _ in range(n)]
    for c in conns:
        assert c.request({"op": "hello"})["ok"]
    return conns


def _close(conns: list[Client]) -> None:
    for c in conns:
        c.close()


def test_connection_threads_are_kept_and_serve_the_next_connections(kx: Krex) -> None:
    d = kx.start_daemon()
    conns = _open(kx, 8)
    busy = _tasks(d.pid)
    _close(conns)
    time.sleep(0.3)
    # Idle, they wait for the next connections (they used to end with their connection).
    assert _tasks(d.pid) == busy
    for _ in range(3):
        _close(_open(kx, 8))
        time.sleep(0.3)
        assert _tasks(d.pid) == busy, "new threads for connections while as many were idle"


def test_connections_open_at_once_each_get_a_thread(kx: Krex) -> None:
    kx.start_daemon()
    conns = [Client.connect(path=kx.sock) for _ in range(40)]
    try:
        # Served one after another while all 40 stay open: a connection handed to a thread
        # that still serves another one would never be answered.
        for c in reversed(conns):
            assert c.request({"op": "hello"})["ok"]
    finally:
        for c in conns:
            c.close()
    time.sleep(0.2)
    conns = [Client.connect(path=kx.sock) for _ in range(40)]  # now on the kept threads
    try:
        for c in conns:
            assert c.request({"op": "hello"})["ok"]
    finally:
        for c in conns:
            c.close()
