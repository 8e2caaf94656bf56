"""A throwaway KREX world (`throwaway = true`: `krex bench`'s own world, each Ray node's world
under `krex fleet --node-root`) leaves nothing in /dev/shm once its daemon stops cleanly: the
segment, krexd's pin links and the simulated GPU's segment go. A node world keeps its
segment (a restarted krexd adopts what it records), and a throwaway world whose segment a
live process still uses keeps it too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

KREX = [sys.executable, "-m", "krex.cli.main"]
SHM = Path("/dev/shm")


def krex(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KREX, *args], env=env, capture_output=True, text=True, timeout=90)


def _files(env: dict[str, str]) -> list[str]:
    names = [env["KREX_SHM"].strip("/"), env["KREX_SIM_SHM"].strip("/")]
    return sorted(p.name for p in SHM.iterdir() if any(p.name.startswith(n) for n in names))


def _run_one(env: dict[str, str], bins: dict[str, Path]) -> None:
    p = krex(env, "run", "--device", "sim", "--", str(bins["quickregion"]))
    assert p.returncode == 0, p.stderr
    # the world's segment, krexd's pin link and the simulated GPU's segment exist meanwhile
    names = _files(env)
    assert env["KREX_SHM"].strip("/") in names and env["KREX_SIM_SHM"].strip("/") in names, names
    assert any(".krexpin-" in n for n in names), names


@pytest.mark.parametrize("throwaway", [True, False], ids=["throwaway", "node-world"])
def test_a_clean_stop_of_a_throwaway_world_removes_its_segments(
    krex_env: dict[str, str], bins: dict[str, Path], throwaway: bool
) -> None:
    env = dict(krex_env, KREX_THROWAWAY="1" if throwaway else "0")
    _run_one(env, bins)
    stop = krex(env, "daemon", "stop")
    assert stop.returncode == 0, stop.stderr
    left = _files(env)
    if throwaway:
        assert left == [], f"a throwaway world left {left} in /dev/shm"
    else:
        assert env["KREX_SHM"].strip("/") in left  # a node world keeps its segment
        assert not any(".krexpin-" in n for n in left)  # but never a stopped daemon's pin


def test_a_throwaway_world_in_use_keeps_its_segment(krex_env: dict[str, str], bins: dict[str, Path]) -> None:
    """A self-registered process (outside any `krex run`) still attached: krexd keeps the
    segment it is registered in, and says so in its log."""
    env = dict(krex_env, KREX_THROWAWAY="1")
    _run_one(env, bins)
    opt = krex(env, "env", "--device", "sim", "--export")
    assert opt.returncode == 0, opt.stderr
    # a self-registered process of the world: registered by its first GPU call, then it waits
    script = f'{opt.stdout}\nexec {bins["actor"]} k:100 sync line'
    holder = subprocess.Popen(["bash", "-c", script], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        for _ in range(2):
            assert '"rc":0' in holder.stdout.readline().replace(" ", "")
        stop = krex(env, "daemon", "stop")
        assert stop.returncode == 0, stop.stderr
        assert env["KREX_SHM"].strip("/") in _files(env)
        assert "kept" in (Path(env["KREX_STATE_DIR"]) / "krexd.log").read_text()
    finally:
        holder.kill()
        holder.wait(10)
