"""krex.runner: the one runner of batch, bench and fleet, with real processes; and the
guardian's library entry (`python -m krex.proc.launcher`) that it spawns instead of the CLI.

No timed asserts: sleeps only make commands overlap or hang; every wait is generous."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from krex.runner import Outcome, Pool, Spec, guardian_argv, native_guardian, run_one

pytestmark = pytest.mark.timeout(180)


def _spec(tmp: Path, name: str, script: str, timeout_s: float | None = None) -> Spec:
    return Spec(["/bin/sh", "-c", script], tmp / f"{name}.out", tmp / f"{name}.err", timeout_s=timeout_s)


def test_pool_runs_at_most_width_at_once_on_stable_lanes(tmp_path: Path) -> None:
    running: set[int] = set()
    peak = 0
    lanes: dict[int, int] = {}
    got: dict[int, Outcome] = {}

    def spec(i: int, lane: int) -> Spec:
        lanes[i] = lane
        return _spec(tmp_path, str(i), f"sleep 0.3; echo job{i}; exit {i % 3}")

    def started(i: int) -> None:
        nonlocal peak
        running.add(i)
        peak = max(peak, len(running))

    def done(i: int, o: Outcome) -> None:
        running.discard(i)
        got[i] = o

    pool: Pool[int] = Pool(2)
    assert pool.run(list(range(6)), spec, done, started) is False
    assert sorted(got) == list(range(6))
    assert peak == 2 and set(lanes.values()) == {0, 1}
    for i, o in got.items():
        assert o.exit_status == i % 3 and not o.timed_out and not o.cancelled
        assert o.read()[0].strip() == f"job{i}" and o.wall_s > 0 and o.ended_at >= o.started_at


def test_pool_timeout_notes_the_tree_and_kills_all_of_it(tmp_path: Path) -> None:
    got: list[Outcome] = []
    # A child that outlives its shell's TERM handling: the whole tree must go.
    script = "sleep 300 & echo $! > " + str(tmp_path / "child.pid") + "; wait"
    Pool[int](1).run(
        [0], lambda _j, _l: _spec(tmp_path, "hang", script, timeout_s=1.0), lambda _j, o: got.append(o)
    )
    (o,) = got
    assert o.timed_out and o.hang and o.exit_status is not None
    assert any("sleep" in (p.get("cmd") or "") for p in o.hang)
    child = int((tmp_path / "child.pid").read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_pool_cancel_escalates_and_starts_nothing_more(tmp_path: Path) -> None:
    cancel = threading.Event()
    got: dict[int, Outcome] = {}
    # Ignores SIGINT (the first stop signal): only the escalation to SIGTERM ends it.
    stubborn = "trap '' INT; while :; do sleep 0.1; done"

    def done(i: int, o: Outcome) -> None:
        got[i] = o

    pool: Pool[int] = Pool(
        1, cancel=cancel, stop_signals=(signal.SIGINT, signal.SIGTERM), grace_s=0.5, tick_s=0.1
    )
    cancelled = pool.run(
        [0, 1], lambda i, _l: _spec(tmp_path, str(i), stubborn), done, started=lambda _i: cancel.set()
    )
    assert cancelled is True
    assert list(got) == [0]  # job 1 never started, so it gets no callback
    assert got[0].cancelled and got[0].exit_status == 128 + signal.SIGTERM


def test_run_one_interrupt_stops_the_command_like_ctrl_c(tmp_path: Path) -> None:
    """A KeyboardInterrupt in the waiting thread (a Ray cancel) reaches the command as SIGINT."""
    main = threading.main_thread().ident or 0
    timer = threading.Timer(0.5, lambda: signal.pthread_kill(main, signal.SIGINT))
    timer.start()
    try:
        o = run_one(_spec(tmp_path, "int", "trap 'echo got-int; exit 7' INT; while :; do sleep 0.1; done"))
    finally:
        timer.cancel()
    assert o.cancelled and o.exit_status == 7 and "got-int" in o.read()[0]


def test_run_one_reports_a_command_that_cannot_start(tmp_path: Path) -> None:
    o = run_one(Spec([str(tmp_path / "nope")], tmp_path / "o", tmp_path / "e"))
    assert o.returncode is None and o.exit_status == 127 and o.start_error and "nope" in o.start_error


# ------------------------------------------------------------------------ the guardian entry


def test_guardian_entry_runs_krex_run_without_the_cli(krex_env: dict[str, str], tmp_path: Path) -> None:
    """The runner's guardian: exit status passed on, the report written, the command under KREX;
    KREX's own failures are 125 / 127 with `krex_error` in the report, as `krex run`."""
    report = tmp_path / "r.json"
    code = (
        "import os, sys; parent = open(f'/proc/{os.getppid()}/cmdline').read().split(chr(0)); "
        "print(os.environ['KREX_SLOT'], ' '.join(parent)); sys.exit(3)"
    )
    # No daemon answers yet: the library entry starts one (the native guardian hands over).
    p = subprocess.run(
        guardian_argv(["true"], report, device="sim"), env=krex_env, capture_output=True, timeout=120
    )
    assert p.returncode == 0 and json.loads(report.read_text())["exit_status"] == 0, p.stderr
    argv = guardian_argv([sys.executable, "-c", code], report, device="sim")
    native = native_guardian()
    assert argv[1:3] == (["--entry", sys.executable] if native else ["-m", "krex.proc.launcher"])
    p = subprocess.run(argv, env=krex_env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 3, p.stderr
    slot, parent = p.stdout.split(" ", 1)
    rep = json.loads(report.read_text())
    assert rep["exit_status"] == 3 and rep["slot"] == int(slot) and "regions" in rep
    # The command's parent is the guardian, a library process: not the CLI.
    entry = f"{native} --entry " if native else "-m krex.proc.launcher"
    assert entry in parent and "krex.cli" not in parent, parent

    p = subprocess.run(
        guardian_argv([str(tmp_path / "missing")], report, device="sim"),
        env=krex_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 127 and "krex: error: command not found" in p.stderr and "fix:" in p.stderr
    rep = json.loads(report.read_text())
    assert rep["exit_status"] == 127 and rep["krex_error"]["kind"] == "CommandNotFound"

    # An option the native guardian does not take goes to the library entry (the CLI would
    # exit 2 with click's words), which says what is wrong in the report too.
    opts = ["--report", str(report), "--bogus", "--", "true"]
    heads = [[sys.executable, "-m", "krex.proc.launcher"]]
    heads += [[str(native), "--entry", sys.executable]] if native else []
    for head in heads:
        report.unlink(missing_ok=True)
        p = subprocess.run([*head, *opts], env=krex_env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 125 and "--bogus" in p.stderr and "fix:" in p.stderr, (head, p.stderr)
        assert json.loads(report.read_text())["krex_error"]["kind"] == "UsageError"
