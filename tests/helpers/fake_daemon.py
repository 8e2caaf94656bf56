"""A fake krexd, run by the tests as another user: it speaks KREX's wire protocol on a
socket others may reach and answers every admission with an environment of its own
choosing (its own library in LD_PRELOAD, its own PYTHONPATH and KREX_DAEMON_CMD). It
appends one JSON line per frame it receives ({"op", "uid", "pid"}) to LOG, so a test
can tell whether a client talked to it at all.

    fake_daemon.py SOCKET LOG EVIL_LIB EVIL_PYDIR GROUP_DIR
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from typing import Any

from krex.protocol import FrameReader, ProtocolError, encode_reply, peer_cred


def admission(evil_lib: str, evil_py: str, group: str, sock: str) -> dict[str, Any]:
    return {
        "ok": True,
        "slot": 0,
        "gpu": 0,
        "physical": 0,
        "vendor": "sim",
        "visible": "0",
        "generation": 1,
        "device": "sim",
        "shm": "/krex-fake-none",
        "group": group,
        "freezer": "cgroup1",
        "shared_cpus": None,
        "admission_wait_s": 0.0,
        "notes": [],
        "warm": False,
        "auto_value": True,
        "env_set": {
            "KREX_SHM": "/krex-fake-none",
            "KREX_SOCKET": sock,
            "KREX_SLOT": "0",
            "KREX_GPU": "0",
            "KREX_SLOT_GEN": "1",
            "KREX_DAEMON_CMD": f"touch {evil_py}/daemon-cmd-ran",
            "KREX_PYTHON": "/bin/false",
            "BASH_ENV": f"{evil_py}/bashenv",
        },
        "env_prepend": {
            "LD_PRELOAD": [evil_lib, ": "],
            "PYTHONPATH": [evil_py, ":"],
            "LD_LIBRARY_PATH": [evil_py, ":"],
            "LD_AUDIT": [evil_lib, ":"],
        },
    }


def serve(conn: socket.socket, log: str, adm: dict[str, Any]) -> None:
    pid, uid, _gid = peer_cred(conn)
    reader = FrameReader(conn, replies=False)
    with conn:
        while True:
            try:
                m = reader.read_message()
            except (ProtocolError, OSError):
                return
            if m is None:
                return
            with open(log, "a") as f:
                f.write(json.dumps({"op": m.op.name, "uid": uid, "pid": pid}) + "\n")
            reply: dict[str, Any] = {"ok": True, "pid": os.getpid()}
            if m.op.name == "admit":
                reply = adm
            elif m.op.name == "release":
                reply = {"ok": True, "action": "none", "leftovers": [], "notes": []}
            try:
                conn.sendall(encode_reply(m.op.code, reply))
            except Exception:  # noqa: BLE001 - a reply that does not fit: answer a plain ok
                conn.sendall(encode_reply(m.op.code, {"ok": True}))


def main() -> None:
    sock, log, evil_lib, evil_py, group = sys.argv[1:6]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(sock)
    os.chmod(sock, 0o777)
    s.listen(16)
    adm = admission(evil_lib, evil_py, group, sock)
    with open(log, "a") as f:
        f.write(json.dumps({"op": "listening", "uid": os.getuid(), "pid": os.getpid()}) + "\n")
    while True:
        conn, _ = s.accept()
        threading.Thread(target=serve, args=(conn, log, adm), daemon=True).start()


if __name__ == "__main__":
    main()
