"""How long a cgroup v2 freeze of N sibling processes takes, and how much of it is the
notification: N processes (idle torch with a CUDA context when --torch, else plain
Python with T threads) each in a cgroup of their own; R rounds of freezing all N at once
(one thread per group, as krexd does) and thawing. Two ways to see "frozen": poll(POLLPRI)
on cgroup.events (krexd's way, woken by the kernel's notification) and re-reading
cgroup.events in a loop. Rounds alternate the two so both see the same machine.

    python3 benchmarks/freeze_latency.py --n 8 --rounds 200 [--torch]

Needs root and cgroup v2. Prints a table; raw times as JSON to $OUT/freeze_latency.json."""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from _siblings import percentile


def mount() -> Path:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        f = line.split()
        sep = f.index("-")
        if f[sep + 1] == "cgroup2":
            return Path(f[4])
    sys.exit("no cgroup v2 mount")


def frozen(fd: int) -> bool:
    os.lseek(fd, 0, os.SEEK_SET)
    return b"frozen 1" in os.read(fd, 4096)


def wait_poll(fd: int, deadline: float) -> None:
    p = select.poll()
    p.register(fd, select.POLLPRI | select.POLLERR)
    while not frozen(fd) and time.monotonic() < deadline:
        p.poll(50)


def wait_spin(fd: int, deadline: float) -> None:
    while not frozen(fd) and time.monotonic() < deadline:
        time.sleep(0.0001)


def freeze_one(g: Path, fd: int, waiter: Callable[[int, float], None], done: list[float], i: int,
               t0: float) -> None:
    (g / "cgroup.freeze").write_text("1")
    waiter(fd, time.monotonic() + 2)
    done[i] = time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--threads", type=int, default=20, help="threads per plain-Python sibling")
    ap.add_argument("--torch", action="store_true", help="siblings are idle torch processes with a CUDA context")
    a = ap.parse_args()
    root = mount() / f"krex-freezetest-{os.getpid()}"
    root.mkdir()
    if a.torch:
        code = "import torch,time; torch.zeros(1,device='cuda'); torch.cuda.synchronize(); print('ready',flush=True); time.sleep(3600)"
    else:
        code = (f"import threading,time\nfor _ in range({a.threads}): threading.Thread(target=time.sleep,"
                "args=(3600,),daemon=True).start()\nprint('ready',flush=True); time.sleep(3600)")
    procs, groups, fds = [], [], []
    try:
        for i in range(a.n):
            g = root / f"g{i}"
            g.mkdir()
            p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
            (g / "cgroup.procs").write_text(str(p.pid))
            procs.append(p)
            groups.append(g)
            fds.append(os.open(g / "cgroup.events", os.O_RDONLY))
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().startswith("ready")
        res: dict[str, list[float]] = {"poll": [], "spin": []}
        per: dict[str, list[float]] = {"poll": [], "spin": []}
        for r in range(a.rounds):
            how = "poll" if r % 2 == 0 else "spin"
            waiter = wait_poll if how == "poll" else wait_spin
            done = [0.0] * a.n
            t0 = time.perf_counter()

            ts = [threading.Thread(target=freeze_one, args=(groups[i], fds[i], waiter, done, i, t0))
                  for i in range(a.n)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            res[how].append(time.perf_counter() - t0)
            per[how].extend(done)
            for g in groups:
                (g / "cgroup.freeze").write_text("0")
            time.sleep(0.005)
    finally:
        for g in groups:
            (g / "cgroup.freeze").write_text("0")
        for p in procs:
            p.kill()
            p.wait()
        for fd in fds:
            os.close(fd)
        time.sleep(0.2)
        for g in groups:
            g.rmdir()
        root.rmdir()

    out = Path(os.environ.get("OUT", "/tmp"))
    (out / "freeze_latency.json").write_text(json.dumps({"args": vars(a), "all": res, "per_group": per}))
    kind = "idle torch (CUDA context)" if a.torch else f"python, {a.threads} threads"
    print(f"freeze of {a.n} sibling groups at once ({kind}), {a.rounds} rounds; ms")
    print(f"{'wait':<6}{'p50':>8}{'p90':>8}{'p99':>8}{'max':>8}   per group p50/p99")
    for how in ("poll", "spin"):
        xs = res[how]
        print(f"{how:<6}{1e3 * statistics.median(xs):>8.2f}{1e3 * percentile(xs, 90):>8.2f}{1e3 * percentile(xs, 99):>8.2f}{1e3 * max(xs):>8.2f}"
              f"   {1e3 * statistics.median(per[how]):.2f}/{1e3 * percentile(per[how], 99):.2f}")


if __name__ == "__main__":
    main()
