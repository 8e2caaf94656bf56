"""krexd's watchdog: a small process of its own, started by krexd, that is never
frozen nor stopped with it. If krexd's heartbeat goes stale (krexd stopped or
hung) it thaws every slot group of that daemon, so commands without a guardian
(processes that registered themselves, `krex env`) are not left frozen behind a
hung daemon; guardians of `krex run` do the same for their own command. When
krexd is gone it thaws everything once more and exits.

    python -m krex.node.watchdog DAEMON_PID SHM ROOT_NAME FREEZER"""

from __future__ import annotations

import contextlib
import os
import sys
import time

from krex.errors import KrexError
from krex.native import lib
from krex.node import freezer
from krex.node.shm import Segment, heartbeat_stale


def watch(daemon_pid: int, shm: str, root_name: str, backend: str) -> None:
    fz = freezer.detect(backend, root_name=root_name)
    seg = Segment.attach(shm)
    poll_s = lib.KREX_GUARDIAN_POLL_NS / 1e9
    rescued = False
    try:
        while os.getppid() == daemon_pid:
            time.sleep(poll_s)
            if int(seg.raw.hdr.daemon_pid) != daemon_pid:
                continue
            stale = heartbeat_stale(seg.heartbeat_age())
            if stale and not rescued:
                with contextlib.suppress(KrexError, OSError):
                    fz.thaw_all()
            rescued = stale
        with contextlib.suppress(KrexError, OSError):  # krexd is gone
            fz.thaw_all()
    finally:
        seg.close()


def main(argv: list[str] | None = None) -> None:
    a = sys.argv[1:] if argv is None else argv
    try:
        watch(int(a[0]), a[1], a[2], a[3])
    except KrexError as e:
        os.write(2, f"krex watchdog: error: {e}\n".encode())
        raise SystemExit(e.exit_code) from None


if __name__ == "__main__":
    main()
