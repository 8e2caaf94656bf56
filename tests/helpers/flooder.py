"""Open many connections to krexd and hold them, from several processes.

    flooder.py SOCKET PROCS PER_PROC MODE OUT_DIR

MODE: `silent` (connect, send nothing), `partial` (send the first 5 bytes of a frame),
`hello` (one whole hello request, read its reply, then stay idle). Each process writes
OUT_DIR/flood-MODE-PID.json {"pid", "mode", "opened", "refused", "closed_by_peer"} once its
connections are open, then holds them until OUT_DIR/flood.stop exists (checking every
0.1 s whether krexd closed them)."""

from __future__ import annotations

import json
import os
import resource
import socket
import sys
import time

from krex.protocol import FrameReader, encode


def one(sock: str, mode: str) -> tuple[socket.socket | None, bool]:
    """A connection (None if connecting failed) and whether krexd refused it at once."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect(sock)
    except OSError:
        s.close()
        return None, False
    frame = encode({"op": "hello"})
    try:
        if mode == "partial":
            s.sendall(frame[:5])
        elif mode == "hello":
            s.sendall(frame)
            r = FrameReader(s, replies=True).read()
            if r is None or not r.get("ok"):
                s.close()
                return None, True
    except OSError:
        s.close()
        return None, True
    return s, False


def child(sock: str, n: int, mode: str, out: str) -> None:
    held: list[socket.socket] = []
    refused = 0
    for _ in range(n):
        s, was_refused = one(sock, mode)
        refused += was_refused
        if s is not None:
            held.append(s)
    rec = {"pid": os.getpid(), "mode": mode, "opened": len(held), "refused": refused, "closed_by_peer": 0}
    path = os.path.join(out, f"flood-{mode}-{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(rec, f)
    os.replace(path + ".tmp", path)
    while not os.path.exists(os.path.join(out, "flood.stop")):
        time.sleep(0.1)
        closed = 0
        for s in held:
            try:
                s.setblocking(False)
                if s.recv(1, socket.MSG_PEEK) == b"":
                    closed += 1
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
        if closed != rec["closed_by_peer"]:
            rec["closed_by_peer"] = closed
            with open(path + ".tmp", "w") as f:
                json.dump(rec, f)
            os.replace(path + ".tmp", path)


def main() -> None:
    sock, procs, per, mode, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, per + 64), hard))
    kids = []
    for _ in range(procs):
        pid = os.fork()
        if pid == 0:
            try:
                child(sock, per, mode, out)
            finally:
                os._exit(0)
        kids.append(pid)
    for pid in kids:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
