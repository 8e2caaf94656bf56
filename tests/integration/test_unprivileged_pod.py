"""A benchmark pod that is not privileged: it shares the node daemon's socket, segment and
pid view, but not the host's cgroup tree (no /sys/fs/cgroup mount of the host, as an
unprivileged container has). Its `krex run` cannot put its command into the slot's cgroup
itself, so krexd (the privileged DaemonSet) moves it there before the command's first
instruction, with either guardian. Stood in for by a mount namespace whose /sys/fs/cgroup is
an empty tmpfs; krexd runs outside it, on the host's tree."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers.krex_world import KREX, Krex

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: real cgroups and a mount namespace"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux's unshare"),
]


def _in_pod(kx: Krex, *argv: str, **extra: str) -> subprocess.CompletedProcess[str]:
    """`krex ARGV` where /sys/fs/cgroup is empty (the host's tree is not mounted)."""
    script = 'mount -t tmpfs none /sys/fs/cgroup && exec "$@"'
    return subprocess.run(["unshare", "-m", "sh", "-c", script, "-", *KREX, *argv], env=kx.env(**extra),
                          capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("door", ["native", "python"])
def test_a_command_of_a_pod_without_the_host_cgroup_tree_runs_in_its_slot(
    kx: Krex, bins: dict[str, Path], door: str
) -> None:
    kx.start_daemon()
    lead = ["-v"] if door == "python" else []  # -v: the native door hands the line to Python's
    p = _in_pod(kx, *lead, "run", "--device", "sim", "--", "cat", "/proc/self/cgroup")
    assert p.returncode == 0, p.stdout + p.stderr
    slot = f"/{kx.shm.strip('/')}/slot-"
    assert slot in p.stdout, f"the command ran outside its slot group:\n{p.stdout}"
    # and its regions work as anywhere else
    q = _in_pod(kx, *lead, "run", "--device", "sim", "--", str(bins["quickregion"]))
    assert q.returncode == 0 and '"begin": 0' in q.stdout, q.stdout + q.stderr
