"""Pre-warmed starts (krexd's `prewarm`): with every slot busy, up to
`prewarm` more commands per GPU start at once, run their CPU phase, and wait at their
first GPU call (or region) until a slot frees up. Real krexd, real `krex run`, the
simulated GPU; and the faults: the waiting command killed, krexd killed or stopped
while it waits, a `warm` word forged in the segment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.krex_cli import krex, status, wait_for

KREX = [sys.executable, "-m", "krex.cli.main"]
VICTIM = str(Path(__file__).resolve().parents[1] / "helpers" / "warm_victim.py")




def start(env: dict[str, str], out: Path, name: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*KREX, "run", "--device", "sim", "--", sys.executable, VICTIM, str(out), name, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(p: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str]:
    """Its exit status and stderr, once it ends."""
    _, err = p.communicate(timeout=timeout)
    return p.returncode, err


def read(out: Path, name: str) -> dict[str, Any]:
    return dict(json.loads((out / name).read_text()))


def daemon(env: dict[str, str], prewarm: int, *extra: str) -> None:
    p = krex(
        env, "daemon", "start", "--device", "sim", "--slots-per-gpu", "1", "--prewarm", str(prewarm), *extra
    )
    assert p.returncode == 0, p.stderr


def warm_slots(env: dict[str, str]) -> list[dict[str, Any]]:
    return [s for s in status(env)["daemon"]["slots"] if s["warm"]]


def holder(env: dict[str, str], tmp_path: Path, prewarm: int) -> tuple[subprocess.Popen[str], Path]:
    """A daemon with one slot and `prewarm`, and command `a` holding that slot on the GPU
    until the returned file exists."""
    daemon(env, prewarm)
    stop_a = tmp_path / "stop-a"
    a = start(env, tmp_path, "a", "--until", str(stop_a))
    wait_for(lambda: (tmp_path / "a.gpu").exists(), 30, "the first command to hold the GPU")
    return a, stop_a


def test_prewarmed_command_runs_its_cpu_phase_then_waits_for_the_slot(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    env = krex_env
    a, stop_a = holder(env, tmp_path, 1)
    b = start(env, tmp_path, "b", "--cpu-s", "0.3", "--gpu-s", "0.2")
    # b starts at once (no admission wait) and finishes its CPU phase while a holds the slot.
    wait_for(lambda: (tmp_path / "b.cpu").exists(), 30, "the pre-warmed command's CPU phase")
    time.sleep(0.5)
    assert not (tmp_path / "b.gpu").exists(), "b's first GPU call passed while every slot was busy"
    warm = warm_slots(env)
    assert len(warm) == 1 and warm[0]["pids"], warm
    assert "pre-warmed" in krex(env, "status").stdout
    # A third command finds the pre-warmed place taken: it waits at admission, not started.
    c = start(env, tmp_path, "c", "--gpu-s", "0.1")
    time.sleep(1.0)
    assert not (tmp_path / "c.start").exists(), "a command started beyond slots + prewarm"
    t_release = time.monotonic()
    stop_a.touch()
    assert finish(a)[0] == 0
    rc_b, err_b = finish(b)
    rc_c, err_c = finish(c)
    assert rc_b == 0 and rc_c == 0, err_b + err_c
    ra, rb, rc = read(tmp_path, "a.json"), read(tmp_path, "b.json"), read(tmp_path, "c.json")
    assert rb["t_start"] < ra["t_end"], "b did not start before a's slot freed up"
    assert rb["t_cpu"] < ra["t_end"], "b's CPU phase did not overlap a"
    assert rb["t_gpu"] >= ra["t_end"] and rb["t_gpu"] >= t_release, (
        "b reached the GPU before a's slot freed up"
    )
    assert rc["t_start"] >= ra["t_end"], "c started before b was given the slot"
    assert rc["t_gpu"] >= rb["t_end"], "c reached the GPU while b held the only slot"
    assert "starting pre-warmed" in err_b, err_b
    assert "waiting for a free slot" in err_c, err_c
    assert warm_slots(env) == []


def test_without_prewarm_the_second_command_does_not_start(krex_env: dict[str, str], tmp_path: Path) -> None:
    """The control: prewarm 0 (the default) queues at admission as before."""
    env = krex_env
    a, stop_a = holder(env, tmp_path, 0)
    b = start(env, tmp_path, "b", "--cpu-s", "0.1")
    time.sleep(1.0)
    assert not (tmp_path / "b.start").exists()
    stop_a.touch()
    assert finish(a, 30)[0] == 0 and finish(b, 30)[0] == 0
    assert read(tmp_path, "b.json")["t_start"] >= read(tmp_path, "a.json")["t_end"]


def test_a_prewarmed_region_waits_for_the_slot_and_is_clean(krex_env: dict[str, str], tmp_path: Path) -> None:
    """krex.region() as the first GPU step: krexd holds the begin until the slot is given,
    so the region never closes the gate while the command is not yet allowed on the GPU."""
    env = krex_env
    a, stop_a = holder(env, tmp_path, 1)
    b = start(env, tmp_path, "b", "--region")
    wait_for(lambda: (tmp_path / "b.cpu").exists(), 30, "b's CPU phase")
    time.sleep(0.5)
    assert not (tmp_path / "b.gpu").exists(), "b's region was granted while every slot was busy"
    stop_a.touch()
    assert finish(a, 30)[0] == 0 and finish(b, 30)[0] == 0
    rb = read(tmp_path, "b.json")
    assert rb["t_gpu"] >= read(tmp_path, "a.json")["t_end"]
    assert rb["grant"] and not rb["grant"].get("contaminated"), rb["grant"]


def test_a_killed_prewarmed_command_gives_its_place_back(krex_env: dict[str, str], tmp_path: Path) -> None:
    env = krex_env
    a, stop_a = holder(env, tmp_path, 1)
    b = start(env, tmp_path, "b")
    wait_for(lambda: (tmp_path / "b.cpu").exists(), 30, "b waiting at its first GPU call")
    os.kill(read(tmp_path, "b.start")["pid"], signal.SIGKILL)
    assert finish(b, 30)[0] == 128 + signal.SIGKILL
    wait_for(lambda: warm_slots(env) == [], 10, "b's pre-warmed slot to be released")
    # The place is free again: the next command starts at once, pre-warmed.
    c = start(env, tmp_path, "c")
    wait_for(lambda: (tmp_path / "c.cpu").exists(), 10, "c to start pre-warmed")
    assert len(warm_slots(env)) == 1
    stop_a.touch()
    assert finish(a, 30)[0] == 0 and finish(c, 30)[0] == 0


def _krexd_pid(env: dict[str, str]) -> int:
    return int(status(env)["daemon"]["daemon"]["pid"])


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_prewarmed_command_never_hangs_on_a_dead_or_stopped_krexd(
    krex_env: dict[str, str], tmp_path: Path, how: str
) -> None:
    """krexd SIGKILLed or SIGSTOPped while a command waits pre-warmed: it goes on once
    krexd's heartbeat is stale (KREX_HEARTBEAT_TIMEOUT_MS), never waits for ever."""
    env = krex_env
    a, stop_a = holder(env, tmp_path, 1)
    b = start(env, tmp_path, "b")
    wait_for(lambda: (tmp_path / "b.cpu").exists(), 30, "b waiting at its first GPU call")
    time.sleep(0.3)
    assert not (tmp_path / "b.gpu").exists()
    pid = _krexd_pid(env)
    os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    try:
        wait_for(lambda: (tmp_path / "b.gpu").exists(), 30, "b to go on without krexd")
    finally:
        if how == "stop":
            os.kill(pid, signal.SIGCONT)
    stop_a.touch()
    assert finish(a, 60)[0] == 0 and finish(b, 60)[0] == 0


def test_a_forged_warm_word_is_repaired(krex_env: dict[str, str], tmp_path: Path) -> None:
    """Any process of the user can write the segment: `warm` set on a running command's
    slot would hold its next process at its first GPU call for ever. krexd puts it back."""
    from krex.node.shm import Segment

    env = krex_env
    a, stop_a = holder(env, tmp_path, 0)
    slot = status(env)["daemon"]["slots"][0]["slot"]
    old = os.environ.get("KREX_SHM")
    os.environ["KREX_SHM"] = env["KREX_SHM"]
    try:
        with Segment.attach() as seg:
            seg.raw.slots[slot].warm = 1
            wait_for(lambda: seg.raw.slots[slot].warm == 0, 10, "krexd to repair the forged warm word")
    finally:
        if old is None:
            os.environ.pop("KREX_SHM")
        else:
            os.environ["KREX_SHM"] = old
    assert any("slot" in p for inc in status(env)["daemon"]["segment"]["incidents"] for p in inc["problems"])
    stop_a.touch()
    assert finish(a, 30)[0] == 0


def test_prewarm_setting_is_checked_and_shown(krex_env: dict[str, str]) -> None:
    env = krex_env
    bad = krex(env, "daemon", "start", "--device", "sim", "--prewarm", "65")
    assert bad.returncode != 0 and "prewarm" in bad.stderr and "0..64" in bad.stderr, bad.stderr
    daemon(env, 3)
    st = krex(env, "daemon", "status")
    assert "pre-warmed starts per GPU 3" in st.stdout, st.stdout


# ---------------------------------------------------------------- a waiting pre-warmed command


def test_ctrl_c_stops_a_prewarmed_python_command(krex_env: dict[str, str], tmp_path: Path) -> None:
    """Blocked in the shim's wait, a Python command cannot run its SIGINT handler: the
    guardian SIGKILLs it KREX_WARM_KILL_NS after a stop signal if it still waits (nothing of
    it reached the GPU)."""
    env = krex_env
    a, stop_a = holder(env, tmp_path, 2)
    for name, extra in (("b", {}),):
        p = start(dict(env, **extra), tmp_path, name)
        wait_for(lambda n=name: (tmp_path / f"{n}.cpu").exists(), 30, f"{name} waiting at its first GPU call")
        time.sleep(0.3)
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        rc, err = finish(p, 20)
        assert time.monotonic() - t0 < 5, f"{name} took {time.monotonic() - t0:.1f} s to stop"
        assert rc in (128 + signal.SIGKILL, 128 + signal.SIGINT, 130), (rc, err)
        assert not (tmp_path / f"{name}.gpu").exists()
    stop_a.touch()
    assert finish(a, 30)[0] == 0
    wait_for(lambda: warm_slots(env) == [], 10, "the pre-warmed slots to be released")


def test_a_process_without_krex_slot_still_waits(krex_env: dict[str, str], tmp_path: Path) -> None:
    """A process of a pre-warmed command that lost KREX_SLOT (or KREX_SLOT_GEN) registers with
    krexd by its cgroup: that registration waits for the slot too."""
    env = krex_env
    a, stop_a = holder(env, tmp_path, 1)
    b = subprocess.Popen(
        [*KREX, "run", "--device", "sim", "--", "env", "-u", "KREX_SLOT", "-u", "KREX_SLOT_GEN",
         sys.executable, VICTIM, str(tmp_path), "b"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    wait_for(lambda: (tmp_path / "b.cpu").exists(), 30, "b's CPU phase")
    time.sleep(0.8)
    assert not (tmp_path / "b.gpu").exists(), "a process without KREX_SLOT reached the GPU while warm"
    stop_a.touch()
    assert finish(a, 30)[0] == 0
    rc, err = finish(b, 60)
    assert rc == 0, err
    assert read(tmp_path, "b.json")["t_gpu"] >= read(tmp_path, "a.json")["t_end"]


def test_a_region_of_a_killed_prewarmed_command_never_runs(krex_env: dict[str, str], tmp_path: Path) -> None:
    """krex.region() waiting for a pre-warmed slot, then the command is killed: krexd drops
    the request; no region runs (and freezes nobody) for a command that is gone."""
    env = krex_env
    a, stop_a = holder(env, tmp_path, 1)
    b = start(env, tmp_path, "b", "--region")
    wait_for(lambda: (tmp_path / "b.cpu").exists(), 30, "b's region request")
    time.sleep(0.5)
    os.kill(read(tmp_path, "b.start")["pid"], signal.SIGKILL)
    finish(b, 30)
    wait_for(lambda: warm_slots(env) == [], 10, "b's slot to be released")
    time.sleep(0.5)
    stop_a.touch()
    assert finish(a, 30)[0] == 0
    journal = Path(env["KREX_STATE_DIR"]) / "journal.jsonl"
    recs = [json.loads(x) for x in journal.read_text().splitlines()] if journal.exists() else []
    assert [r for r in recs if r.get("owner_pid") == read(tmp_path, "b.start")["pid"]] == [], recs


def test_a_restarted_krexd_keeps_prewarmed_commands_waiting(krex_env: dict[str, str], tmp_path: Path) -> None:
    """krexd killed and started again while commands wait pre-warmed: the new one adopts their
    slots still warm (no false segment incident), and gives them the GPU one at a time."""
    env = krex_env
    a, stop_a = holder(env, tmp_path, 2)
    stop_b = tmp_path / "stop-b"
    b = start(env, tmp_path, "b", "--until", str(stop_b))
    wait_for(lambda: len(warm_slots(env)) == 1, 30, "b admitted pre-warmed")  # b first, then c
    c = start(env, tmp_path, "c", "--gpu-s", "0.1")
    wait_for(lambda: (tmp_path / "b.cpu").exists() and (tmp_path / "c.cpu").exists(), 30, "b and c waiting")
    os.kill(_krexd_pid(env), signal.SIGKILL)
    time.sleep(0.5)
    daemon(env, 2)
    st = status(env)["daemon"]
    assert [s["slot"] for s in st["slots"] if s["warm"]] and not st["segment"]["incidents"], st
    time.sleep(1.0)
    assert not (tmp_path / "b.gpu").exists() and not (tmp_path / "c.gpu").exists(), "warm ones let through"
    stop_a.touch()
    assert finish(a, 30)[0] == 0
    wait_for(lambda: (tmp_path / "b.gpu").exists(), 30, "b given the slot")
    time.sleep(0.5)
    assert not (tmp_path / "c.gpu").exists(), "c reached the GPU while b held the only slot"
    stop_b.touch()
    assert finish(b, 30)[0] == 0
    assert finish(c, 60)[0] == 0


@pytest.mark.parametrize("keep", [False, True])
def test_a_prewarmed_commands_leftover_child(krex_env: dict[str, str], tmp_path: Path, keep: bool) -> None:
    """The command's main process exits at once, leaving a child that will make GPU calls
    (the shell's `&`) while the command waits pre-warmed. By default the leftover is killed
    and the pre-warmed place given back; with --keep-leftovers the slot lives on, still
    waiting: the child's first GPU call passes only once root's command gives the GPU back."""
    env = krex_env
    a, stop_a = holder(env, tmp_path, 1)
    child = f"{sys.executable} {VICTIM} {tmp_path} b --cpu-s 0.3"
    b = subprocess.Popen(
        [*KREX, "run", "--device", "sim", *(["--keep-leftovers"] if keep else []), "--", "sh", "-c",
         f"{child} >/dev/null 2>&1 & while [ ! -f {tmp_path}/b.cpu ]; do sleep 0.02; done; exit 0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: (tmp_path / "b.cpu").exists(), 30, "the child's CPU phase")
    pid = read(tmp_path, "b.start")["pid"]
    if not keep:
        assert finish(b, 30)[0] == 0
        wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 10, "the leftover to be killed")
        wait_for(lambda: warm_slots(env) == [], 10, "the pre-warmed place to be given back")
        assert not (tmp_path / "b.gpu").exists()
    else:
        time.sleep(0.5)
        assert not (tmp_path / "b.gpu").exists(), "the leftover's GPU call passed while every slot was busy"
        assert len(warm_slots(env)) == 1
        t_stop = time.monotonic()
        stop_a.touch()
        wait_for(lambda: (tmp_path / "b.gpu").exists(), 30, "the leftover's GPU call once the slot is free")
        assert read(tmp_path, "b.gpu")["t"] >= t_stop
        assert finish(b, 60)[0] == 0
        wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 30, "the leftover to finish")
    stop_a.touch()
    assert finish(a, 30)[0] == 0
