"""krex/node/coretime.py: the time a cgroup's processes spend on one CPU, counted by the
kernel (a perf cpu-clock counter per cgroup and CPU), processes that come and go included."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from krex.node import coretime


def _v2_root() -> str | None:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[2] == "cgroup2":
            return parts[1]
    return None


def test_a_freezer_that_is_not_cgroup_v2_says_why_it_cannot_be_watched(tmp_path: Path) -> None:
    why = coretime.available(None, 0)
    assert why is not None and "cgroup v2" in why
    why = coretime.available(str(tmp_path), 0)  # a directory, not a cgroup
    assert why is not None and str(tmp_path) in why


@pytest.mark.skipif(os.geteuid() != 0 or _v2_root() is None or len(os.sched_getaffinity(0)) < 2,
                    reason="needs root, cgroup v2 and two CPUs")
def test_short_lived_children_on_the_cpu_are_counted_and_named_others_not() -> None:
    root = _v2_root()
    assert root is not None
    cg = Path(root) / f"krex-coretime-test-{os.getpid()}"
    cg.mkdir()
    try:
        cpu, other = sorted(os.sched_getaffinity(0))[-1], sorted(os.sched_getaffinity(0))[0]
        assert coretime.available(str(cg), cpu) is None
        ws = coretime.watch(str(cg), [cpu])
        ws[0].start()
        code = (
            "import os, sys, time\n"
            f"os.sched_setaffinity(0, {{{other}}})\n"
            f"open('{cg}/cgroup.procs', 'w').write(str(os.getpid()))\n"
            "def burn(c, s):\n"
            "    pid = os.fork()\n"
            "    if pid == 0:\n"
            "        os.sched_setaffinity(0, {c}); t = time.process_time()\n"
            "        while time.process_time() - t < s: pass\n"
            "        os._exit(0)\n"
            "    os.waitpid(pid, 0); return pid\n"
            f"pids = [burn({cpu}, 0.02) for _ in range(3)]\n"
            f"burn({other}, 0.1)\n"
            "print(' '.join(map(str, pids)))\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        pids = {int(x) for x in out.stdout.split()}
        time.sleep(0.01)
        use = ws[0].stop()
        assert 0.06e9 <= use.ns < 0.09e9, use.ns  # 3 x 20 ms on `cpu`, not the 100 ms on `other`
        assert pids <= use.pids, (pids, use.pids)
        # Kept for the next region: counted from its start again, with only its samples.
        ws[0].start()
        assert ws[0].stop().ns < 0.01e9
        ws[0].close()
        assert ws[0].stop().ns == 0 and ws[0].fd == -1
    finally:
        cg.rmdir()
