"""Test helper: a CPU-burning process tree that publishes progress counters.

usage: burner.py DIR LEVEL LEVELS

Process LEVEL writes (pid, counter) as two int64 into DIR/level<LEVEL> through a shared
mapping, spinning the CPU and bumping the counter about every millisecond. Unless it is the
last level, it first starts LEVEL+1 as its own child. Each process dies with its parent
(PR_SET_PDEATHSIG) so a crashed test run leaves nothing spinning.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import signal
import struct
import subprocess
import sys
import time


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main() -> None:
    out, level, levels = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    _die_with_parent()
    if level + 1 < levels:
        subprocess.Popen([sys.executable, __file__, out, str(level + 1), str(levels)])
    path = os.path.join(out, f"level{level}")
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("qq", os.getpid(), 0))
    os.replace(tmp, path)  # readers never see a half-written file
    with open(path, "r+b") as f:
        mem = mmap.mmap(f.fileno(), 16)
    counter = 0
    while True:
        end = time.perf_counter() + 0.001
        while time.perf_counter() < end:
            pass
        counter += 1
        struct.pack_into("q", mem, 8, counter)


if __name__ == "__main__":
    main()
