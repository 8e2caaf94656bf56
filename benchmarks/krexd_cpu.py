"""Where krexd's CPU goes per `krex run`: an isolated daemon, waves of N
`krex -q run --device DEVICE -- python -c pass` started at once, and krexd's user and system
CPU per command from /proc, split into its long-lived threads and the rest (connection
threads that ended). With --py-spy, py-spy records krexd meanwhile (--gil: only the thread
holding the GIL, i.e. Python work) as collapsed stacks, summed per function at the end.

    python3 benchmarks/krexd_cpu.py --krex-bin .venv/bin/krex -n 16 --waves 15
    python3 benchmarks/krexd_cpu.py --krex-bin .venv/bin/krex --py-spy $(which py-spy) --out spy.txt

py-spy stops krexd to sample it: the CPU figures of a run with it are inflated."""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TCK = os.sysconf("SC_CLK_TCK")


def cpu(path: str) -> tuple[float, float]:
    """(user, system) CPU seconds of /proc/PID/stat or /proc/PID/task/TID/stat."""
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / TCK, int(fields[12]) / TCK


def threads(pid: int) -> dict[str, tuple[float, float]]:
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            out[t] = cpu(f"/proc/{pid}/task/{t}/stat")
    return out


def summarize(raw: Path, top: int = 40) -> str:
    """py-spy's raw (collapsed) stacks as inclusive and self sample counts per function."""
    incl: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n_s = line.rpartition(" ")
        n = int(n_s)
        frames = [re.sub(r"\s*\(([^()]*/)?([^/()]*):\d+\)$", r" (\2)", f) for f in stack.split(";")[1:]]
        total += n
        for f in set(frames):
            incl[f] += n
        if frames:
            own[frames[-1]] += n
    rows = [f"total samples {total}"]
    rows += [f"{c:6d} {100 * c / max(total, 1):5.1f}%  {f}" for f, c in incl.most_common(top)]
    rows += ["--- self"] + [f"{c:6d} {100 * c / max(total, 1):5.1f}%  {f}" for f, c in own.most_common(20)]
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--krex-bin", required=True, help="the krex console script to measure")
    ap.add_argument("--device", choices=["sim", "gpu"], default="sim")
    ap.add_argument("-n", type=int, default=16, help="commands started at once (default 16)")
    ap.add_argument("--waves", type=int, default=15, help="waves measured, after 2 not counted")
    ap.add_argument("--py-spy", default=None, help="py-spy executable: also record krexd's Python stacks")
    ap.add_argument("--out", default="krexd-spy.txt", help="where py-spy's raw stacks go")
    a = ap.parse_args()

    world = Path(tempfile.mkdtemp(prefix="krexd-cpu-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KREX_")}
    env.pop("LD_PRELOAD", None)
    tag = str(os.getpid())
    env.update(KREX_STATE_DIR=str(world / "state"), KREX_SHM=f"/krexd-cpu-{tag}", KREX_SIM_SHM=f"/krexd-cpusim-{tag}")
    if a.device == "sim":
        env["KREX_SIM_TRACE"] = str(world / "trace.jsonl")
    krex = a.krex_bin
    r = subprocess.run([krex, "daemon", "start", "--device", a.device, "--slots-per-gpu", str(a.n)],
                       env=env, capture_output=True, text=True, timeout=60)
    if r.returncode:
        sys.exit(f"krex daemon start failed: {r.stderr.strip()}")
    st = subprocess.run([krex, "daemon", "status", "--json"], env=env, capture_output=True, text=True, timeout=60)
    dpid = int(json.loads(st.stdout)["daemon"]["pid"])
    argv = [krex, "-q", "run", "--device", a.device, "--", sys.executable, "-c", "pass"]
    walls: list[float] = []

    def wave() -> None:
        t = time.monotonic()
        ps = [subprocess.Popen(argv, env=env) for _ in range(a.n)]
        bad = [rc for rc in (p.wait() for p in ps) if rc != 0]
        walls.append(time.monotonic() - t)
        if bad:
            sys.exit(f"krex run failed: {bad}")

    spy = None
    try:
        wave()
        wave()
        walls.clear()
        if a.py_spy:
            spy = subprocess.Popen([a.py_spy, "record", "-p", str(dpid), "-r", "1000", "-f", "raw", "-o", a.out,
                                    "--threads", "--gil"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.5)
        p0, t0 = cpu(f"/proc/{dpid}/stat"), threads(dpid)
        for _ in range(a.waves):
            wave()
        p1, t1 = cpu(f"/proc/{dpid}/stat"), threads(dpid)
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
        subprocess.run([krex, "daemon", "stop"], env=env, capture_output=True, timeout=60)
    n = a.waves * a.n
    total = sum(p1) - sum(p0)
    kept = sum(sum(t1[t]) - sum(t0[t]) for t in t1 if t in t0)
    walls.sort()
    print(f"krexd CPU per command: user {(p1[0] - p0[0]) / n * 1e3:.2f} ms, sys {(p1[1] - p0[1]) / n * 1e3:.2f} ms, "
          f"total {total / n * 1e3:.2f} ms (threads alive throughout {kept / n * 1e3:.2f}, threads that ended "
          f"{(total - kept) / n * 1e3:.2f}); wave wall p50 {walls[len(walls) // 2] * 1e3:.0f} ms; {n} commands, "
          f"{a.n} at once{', py-spy attached (inflated)' if spy else ''}")
    if spy is not None and Path(a.out).exists():
        print(summarize(Path(a.out)))


if __name__ == "__main__":
    main()
