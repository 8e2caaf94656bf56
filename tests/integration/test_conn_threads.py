"""krexd serves requests on connection threads that it keeps for the next requests
(starting one per connection was a share of each `krex run`'s admission), and a
connection holds no thread between its requests: it waits in krexd's selector
(krex/node/conns.py)."""

from __future__ import annotations

import os
import time

from helpers.krex_world import Krex

from krex.proc.client import Client


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


def test_connection_threads_are_kept_and_serve_the_next_requests(kx: Krex) -> None:
    d = kx.start_daemon()
    _close(_open(kx, 1))
    time.sleep(0.3)
    base = _tasks(d.pid)
    _close(_open(kx, 8))
    time.sleep(0.3)
    warm = _tasks(d.pid)
    assert len(warm) <= len(base) + 8, (len(warm), len(base))
    for _ in range(3):
        _close(_open(kx, 8))
        time.sleep(0.3)
        now = _tasks(d.pid)
        # Kept threads serve the next connections: no new thread per connection (8 a round
        # would be). krexd's own short-lived workers (journal, inspection) may add a few
        # while the machine is busy, hence the slack below one round's worth.
        assert len(now) <= len(warm) + 4, f"{len(now)} threads after a round (was {len(warm)})"


def test_open_connections_between_requests_hold_no_thread(kx: Krex) -> None:
    d = kx.start_daemon()
    _close(_open(kx, 1))  # krexd's own threads are all up, and one connection thread
    time.sleep(0.3)
    base = len(_tasks(d.pid))
    conns = _open(kx, 40)
    try:
        time.sleep(0.3)
        # Before (a thread per connection): 40 more threads while they stay open.
        assert len(_tasks(d.pid)) <= base + 4, (len(_tasks(d.pid)), base)
        for c in conns:  # each still answered on its own connection
            assert c.request({"op": "hello"})["ok"]
    finally:
        _close(conns)


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
