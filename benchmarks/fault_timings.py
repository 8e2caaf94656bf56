"""Recovery timings after faults, on the simulated GPU in private KREX worlds.

    cd <checkout> && PYTHONPATH=. python benchmarks/fault_timings.py      # root (cgroups)

Uses the tests' KREX world (tests/helpers/krex_world.py). Prints one JSON object:
  sigkill_*    krexd SIGKILLed inside a region: sibling thawed / running again
  sigstop_*    krexd SIGSTOPped inside a region: sibling (guardian) and a
               self-registered sibling (watchdog) thawed; each client call's status
               and seconds (null: hung past 25 s)
  socket_*     krexd's socket removed: back after; `krex run` status after
  pause_*      `krex pause` interrupted while waiting: gate state after
Run it against another checkout (a "before") the same way, from that checkout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path.cwd()
sys.path[:0] = [str(ROOT / "tests")]

from helpers.krex_world import KREX, WORKER, Cmd, Krex, frozen_reason  # noqa: E402
from helpers.krex_world import hold_with_siblings as _hold_with_siblings  # noqa: E402

from krex.native import LIB_DIR, lib, shim_path  # noqa: E402
from krex.node.shm import Segment  # noqa: E402


def until(pred: Callable[[], Any], limit: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if pred():
            return round(time.monotonic() - t0, 3)
        time.sleep(0.002)
    return None


def daemon_killed(out: dict[str, Any]) -> None:
    kx = Krex()
    try:
        d = kx.start_daemon(slots=3)
        _hold_with_siblings(kx, "h1")
        h1, c0 = kx.progress("h1")[2], kx.progress("h1")[0]
        d.kill()
        out["sigkill_thawed_s"] = until(lambda: frozen_reason(h1) is None, 30)
        out["sigkill_running_s"] = until(lambda: kx.progress("h1")[0] > c0 + 2, 30)
    finally:
        kx.cleanup()


def daemon_stopped(out: dict[str, Any]) -> None:
    kx = Krex()
    d = None
    try:
        d = kx.start_daemon(slots=3)
        env = kx.env(LD_PRELOAD=str(shim_path()), KREX_SOCKET=str(kx.sock), LD_LIBRARY_PATH=str(LIB_DIR))
        log = kx.out / "auto.log"
        with open(log, "wb") as f:
            p = subprocess.Popen(
                [sys.executable, str(WORKER), "hammer", str(kx.out), "--name", "auto", "--us", "50"],
                env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
            )
        kx.popens.append(p)
        kx.cmds["auto"] = Cmd("auto", p, log, kx)
        auto = kx.wait_running("auto")
        _hold_with_siblings(kx, "h1")
        h1 = kx.progress("h1")[2]
        os.kill(d.pid, signal.SIGSTOP)
        out["sigstop_guardian_thawed_s"] = until(lambda: frozen_reason(h1) is None, 30)
        out["sigstop_selfregistered_thawed_s"] = until(lambda: frozen_reason(auto) is None, 30)
        for args in (["status"], ["daemon", "status"], ["run", "--device", "sim", "--", "true"]):
            t0 = time.monotonic()
            try:
                r = kx.krex(*args, timeout=25)
                out[f"sigstop: krex {' '.join(args[:2])}"] = [r.returncode, round(time.monotonic() - t0, 2)]
            except subprocess.TimeoutExpired:
                out[f"sigstop: krex {' '.join(args[:2])}"] = ["hung", None]
    finally:
        if d is not None and d.poll() is None:
            os.kill(d.pid, signal.SIGCONT)
        kx.cleanup()


def socket_removed(out: dict[str, Any]) -> None:
    kx = Krex()
    try:
        kx.start_daemon(slots=2)
        kx.sock.unlink()
        out["socket_back_s"] = until(lambda: kx.sock.exists(), 10)
        out["socket_run_status"] = kx.krex("run", "--device", "sim", "--", "true", timeout=30).returncode
    finally:
        kx.cleanup()


def pause_interrupted(out: dict[str, Any]) -> None:
    kx = Krex()
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        seg = Segment.create(kx.shm, n_gpus=1)
        idx = lib.krex_proc_register(seg.raw, seg.claim_slot(0), 0, sleeper.pid)
        seg.raw.procs[idx].inflight = 1  # a straggler that never leaves its GPU call
        p = subprocess.Popen([*KREX, "pause", "--gpu", "0", "--timeout", "300"], env=kx.env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        until(lambda: seg.snapshot().gates[0].closed, 30)
        p.send_signal(signal.SIGINT)
        p.wait(30)
        g = seg.snapshot().gates[0]
        out["pause_sigint"] = {"status": p.returncode, "gate_closed": g.closed, "lease_left_s": g.lease_left_s}
        seg.close()
    finally:
        sleeper.kill()
        kx.cleanup()


def main() -> None:
    out: dict[str, Any] = {}
    for step in (daemon_killed, daemon_stopped, socket_removed, pause_interrupted):
        step(out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
