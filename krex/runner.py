"""Run commands as child processes, at most N at a time: the one runner of `krex batch`,
`krex bench` and `krex fleet`.

* `guardian_argv` puts a command under the KREX guardian with a report file: the native one
  (``krex/_lib/krex --entry PYTHON``), which hands what it does not run itself to
  ``python -m krex.proc.launcher`` (the library entry of `krex run`, never the CLI, which
  prepares the run and execs it back), or that entry itself for another Python (its own
  krex's guardian runs the command).
* `Spec` says how to run one command (argv, environment, output files, timeout, the
  guardian's report); `Outcome` is what came of it (exit status, times, the report,
  a timeout and what the hung processes were doing).
* `run_one` runs one command in the calling thread (a fleet task; bench's warm-up):
  it returns to Python often enough for a KeyboardInterrupt (a Ray cancel, Ctrl-C)
  to get through, then interrupts the command like Ctrl-C would.
* `Pool` runs many, ``width`` at a time, from the calling thread: one waiter thread per
  child, every callback on the calling thread. A cancel (the event, or a
  KeyboardInterrupt in the calling thread) stops starting commands and escalates
  ``stop_signals`` to the running ones, ``grace_s`` apart.

Every child gets a session of its own, so a Ctrl-C on the terminal reaches only the
runner, which then signals each child once (and escalates if it does not finish).
The library never prints."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from krex.proc import runopts
from krex.proc.runopts import native_guardian
from krex.pystart import module_argv

__all__ = [
    "GUARDIAN_MODULE",
    "Outcome",
    "Pool",
    "Spec",
    "Started",
    "guardian_argv",
    "native_guardian",
    "kill_tree",
    "read_report",
    "run_one",
    "start",
    "tail_lines",
    "tree_state",
]

GUARDIAN_MODULE = "krex.proc.launcher"
TICK_S = 0.5  # how often a pool wakes its caller with a "tick" (progress, cancels)
GRACE_S = 10.0  # after a cancel: how long each escalation step (SIGINT, SIGTERM) waits
J = TypeVar("J")


def guardian_argv(
    cmd: Sequence[str],
    report: Path | str,
    device: str = "auto",
    gpu: int | None = None,
    freeze: str | None = None,
    python: str = sys.executable,
    tenant: str | None = None,
    daemon_slots_per_gpu: int | None = None,
    daemon_idle_exit_s: float | None = None,
) -> list[str]:
    """argv that runs ``cmd`` under a guardian, as `krex run --report` would: same
    behaviour, report and exit statuses. The daemon options start the node's daemon
    with those settings when none answers (else it starts on demand, as for `krex run`)."""
    values = {"device": device, "report": str(report), "gpu": gpu, "freeze": freeze, "tenant": tenant,
              "slots": daemon_slots_per_gpu, "idle_exit": daemon_idle_exit_s}
    entry = [*runopts.to_argv(runopts.ENTRY, values), "--", *cmd]
    native = native_guardian()
    # The native guardian (interpose/guardian.c) runs the common case without a Python start
    # per command (about 0.2 s a command under load on the H200) and hands every
    # other case to `python -m krex.proc.launcher` with these same options: only for this
    # interpreter, whose krex is the one it was built with (another may have none, or another).
    same = _same_python(python)
    if native is not None and same is not None:
        return [str(native), "--entry", same, *entry]
    return [*module_argv(GUARDIAN_MODULE, python), *entry]


def _same_python(python: str) -> str | None:
    """`python` as an absolute path if it is this interpreter by that very path, else None.
    Not resolved through links: every venv's python links to the same base interpreter, and
    another venv has another krex (or none)."""
    import shutil

    found = python if "/" in python else shutil.which(python)
    if found is None or os.path.abspath(found) != os.path.abspath(sys.executable):
        return None
    return os.path.abspath(found)


@dataclass
class Spec:
    argv: list[str]
    stdout: Path
    stderr: Path
    env: dict[str, str] | None = None  # None: this process's environment
    cwd: str | None = None
    timeout_s: float | None = None  # then the whole process tree is killed (after noting its state)
    report: Path | None = None  # the guardian's report file, read back into Outcome.report
    preexec_fn: Callable[[], None] | None = None


@dataclass
class Outcome:
    spec: Spec
    returncode: int | None  # Popen's (negative: killed by that signal); None: never started
    started_at: float  # epoch seconds
    ended_at: float
    wall_s: float  # monotonic
    timed_out: bool = False
    cancelled: bool = False  # interrupted by the runner (a cancel)
    hang: list[dict[str, Any]] | None = None  # tree_state() of a timed-out command, before the kill
    report: dict[str, Any] | None = None
    error: str | None = None  # why there is no report, or what went wrong around the command
    start_error: str | None = None

    @property
    def exit_status(self) -> int | None:
        """Shell style: the status, or 128+N for signal N; 127 if it could not start."""
        if self.returncode is None:
            return 127 if self.start_error else None
        return self.returncode if self.returncode >= 0 else 128 - self.returncode

    def read(self, max_bytes: int = 1 << 20) -> tuple[str, str]:
        """(stdout, stderr), each its last ``max_bytes``."""
        return _read_tail(self.spec.stdout, max_bytes), _read_tail(self.spec.stderr, max_bytes)


def _read_tail(path: Path, n: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def tail_lines(text: str, n: int = 3, limit: int = 400) -> str:
    """The last ``n`` non-empty lines of ``text`` joined by " | ", at most ``limit`` characters."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return " | ".join(lines[-n:])[-limit:]


def read_report(
    path: Path, exit_status: int | None, stderr: Path | None
) -> tuple[dict[str, Any] | None, str | None]:
    """(the guardian's report, an error saying why there is none or what KREX failed at)."""
    try:
        loaded = json.loads(path.read_text())
    except FileNotFoundError:
        error = f"krex run wrote no report (exit {exit_status})"
        tail = tail_lines(_read_tail(stderr, 64 * 1024)) if stderr is not None else ""
        return None, error + (f": {tail}" if tail else "")
    except (OSError, ValueError) as e:
        return None, f"unreadable report {path}: {e}"
    report = loaded if isinstance(loaded, dict) else None
    kerr = (report or {}).get("krex_error")
    if isinstance(kerr, dict):  # exit 125: KREX failed, not the command
        return report, f"KREX error: {kerr.get('message')} (fix: {kerr.get('fix')})"
    return report, None


# ------------------------------------------------------------------------------ process trees


def _tree(pid: int) -> list[Any]:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def signal_tree(procs: Sequence[Any], sig: int) -> None:
    """Send ``sig`` to every process of ``procs`` (psutil.Process objects: a pid reused since
    is never hit), and SIGCONT after it so that a SIGSTOP-frozen one handles it."""
    import psutil

    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)
            if sig != signal.SIGKILL:
                p.send_signal(signal.SIGCONT)


def kill_tree(pid: int, grace_s: float = 5.0) -> None:
    """SIGTERM a process and all its descendants (found before anything dies), then
    SIGKILL what is left after ``grace_s``. Frozen processes are killed too (cgroup v2
    delivers SIGKILL to frozen tasks; SIGCONT covers SIGSTOP-frozen ones)."""
    import psutil

    procs = _tree(pid)
    signal_tree(procs, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    signal_tree(alive, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=grace_s)


def tree_state(pid: int) -> list[dict[str, Any]]:
    """What a hung command's processes are doing (for the record, before they are killed):
    state, kernel wait channel, cgroup, and the threads' states."""
    import psutil

    out: list[dict[str, Any]] = []
    for p in _tree(pid):
        d: dict[str, Any] = {"pid": p.pid}
        with contextlib.suppress(psutil.Error, OSError):
            d["cmd"] = " ".join(p.cmdline())[-160:]
            d["status"] = p.status()
            d["wchan"] = Path(f"/proc/{p.pid}/wchan").read_text().strip()
            d["cgroup"] = Path(f"/proc/{p.pid}/cgroup").read_text().strip().splitlines()[-1:]
            d["threads"] = sorted(
                {Path(f"/proc/{p.pid}/task/{t.id}/wchan").read_text().strip() for t in p.threads()}
            )
        out.append(d)
    return out


# ------------------------------------------------------------------------------------ running


@dataclass
class _Child:
    spec: Spec
    proc: subprocess.Popen[bytes]
    t0: float  # monotonic
    started_at: float  # epoch
    tree: list[Any] = field(default_factory=list)  # snapshotted at the first tree signal


def _start(spec: Spec) -> _Child:
    """Popen in a session of its own, stdin from /dev/null, output into the spec's files."""
    with open(spec.stdout, "wb") as so, open(spec.stderr, "wb") as se:
        started_at, t0 = time.time(), time.monotonic()
        proc = subprocess.Popen(
            spec.argv,
            stdin=subprocess.DEVNULL,
            stdout=so,
            stderr=se,
            env=spec.env,
            cwd=spec.cwd,
            start_new_session=True,
            close_fds=True,
            preexec_fn=spec.preexec_fn,
        )
    return _Child(spec, proc, t0, started_at)


def _not_started(spec: Spec, e: OSError) -> Outcome:
    now = time.time()
    return Outcome(spec, None, now, now, 0.0, start_error=f"could not start {spec.argv[0]}: {e}")


def _finish(
    c: _Child,
    t_end: float,
    timed_out: bool = False,
    hang: list[dict[str, Any]] | None = None,
    cancelled: bool = False,
) -> Outcome:
    rc = c.proc.returncode
    wall = t_end - c.t0
    out = Outcome(c.spec, rc, c.started_at, c.started_at + wall, wall, timed_out, cancelled, hang)
    if c.spec.report is not None:
        out.report, out.error = read_report(c.spec.report, out.exit_status, c.spec.stderr)
        if rc is not None and rc < 0:
            died = f"the krex run guardian died of signal {-rc}"
            out.error = f"{out.error}; {died}" if out.error else died
    return out


def _wait_interruptibly(proc: subprocess.Popen[bytes], deadline: float | None) -> int | None:
    """Wait for ``proc`` (None at ``deadline``), back in Python every 0.2 s so that a
    KeyboardInterrupt raised in this thread (a Ray cancel, Ctrl-C) gets through; wakes
    at once on exit (pidfd)."""
    fd = -1
    with contextlib.suppress(OSError, AttributeError):
        fd = os.pidfd_open(proc.pid)
    try:
        while True:
            step = 0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic()))
            if fd >= 0:
                select.select([fd], [], [], step)
                rc = proc.poll()
            else:
                try:
                    rc = proc.wait(timeout=step)
                except subprocess.TimeoutExpired:
                    rc = None
            if rc is not None:
                return rc
            if deadline is not None and time.monotonic() >= deadline:
                return None
    finally:
        if fd >= 0:
            os.close(fd)


def run_one(spec: Spec, interrupt_grace_s: float = GRACE_S) -> Outcome:
    """Run one command to its end in this thread. A KeyboardInterrupt while it runs sends
    it SIGINT (SIGKILL after ``interrupt_grace_s``) and returns with ``cancelled`` set.
    A command past ``spec.timeout_s`` has its tree's state noted and is killed."""
    try:
        c = _start(spec)
    except OSError as e:
        return _not_started(spec, e)
    deadline = None if spec.timeout_s is None else c.t0 + spec.timeout_s
    try:
        rc = _wait_interruptibly(c.proc, deadline)
    except KeyboardInterrupt:
        with contextlib.suppress(ProcessLookupError):
            c.proc.send_signal(signal.SIGINT)
        try:
            c.proc.wait(timeout=interrupt_grace_s)
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()
        return _finish(c, time.monotonic(), cancelled=True)
    if rc is None:  # timed out
        hang = tree_state(c.proc.pid)
        kill_tree(c.proc.pid)
        c.proc.wait()
        return _finish(c, time.monotonic(), timed_out=True, hang=hang)
    return _finish(c, time.monotonic())


class Pool(Generic[J]):
    """Runs jobs ``width`` at a time. ``spec(job, lane)`` builds a job's Spec; ``lane`` is
    the number (0..width-1) of the free place it takes, so a caller can pin places to
    GPUs. ``done(job, outcome)`` gets every job that started (or failed to start);
    jobs never started because of a cancel get no callback.

    On a cancel each running child gets ``stop_signals[0]``, then the next one every
    ``grace_s`` while it runs; ``tree``: to its whole process tree (psutil), else to the
    child alone (a guardian forwards signals to its command itself)."""

    def __init__(
        self,
        width: int,
        *,
        cancel: threading.Event | None = None,
        stop_signals: Sequence[int] = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL),
        grace_s: float = GRACE_S,
        tree: bool = False,
        tick_s: float = TICK_S,
    ) -> None:
        if width < 1:
            raise ValueError(f"pool width {width} < 1")
        self.width = width
        self.cancel = cancel or threading.Event()
        self.stop_signals = list(stop_signals)
        self.grace_s, self.tree, self.tick_s = grace_s, tree, tick_s
        self._running: dict[int, _Child] = {}  # lane -> child
        self._step = 0  # stop signals sent so far
        self._cancelled = False  # a cancel was seen: nothing more starts
        self._step_at = 0.0

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def cancelling(self) -> bool:
        return self._cancelled

    def _signal_all(self, sig: int) -> None:
        for c in self._running.values():
            if self.tree:
                # Snapshot kept: descendants of a root that died are still reached.
                c.tree = list(dict.fromkeys([*c.tree, *_tree(c.proc.pid)]))
                signal_tree(c.tree, sig)
            else:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    c.proc.send_signal(sig)  # a no-op once the child has been reaped

    def run(
        self,
        jobs: Sequence[J],
        spec: Callable[[J, int], Spec],
        done: Callable[[J, Outcome], None],
        started: Callable[[J], None] | None = None,
        tick: Callable[[], None] | None = None,
    ) -> bool:
        """Run ``jobs`` in order; True if the run was cancelled (then not every job ran)."""
        pending = list(jobs)
        pending.reverse()  # pop() from the end = the given order
        job_of: dict[int, J] = {}
        done_q: queue.Queue[tuple[int, float, bool, list[dict[str, Any]] | None]] = queue.Queue()
        next_tick = time.monotonic() + self.tick_s

        def watch(lane: int, c: _Child) -> None:
            timed_out, hang = False, None
            try:
                c.proc.wait(timeout=c.spec.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out, hang = True, tree_state(c.proc.pid)
                kill_tree(c.proc.pid)
                c.proc.wait()
            done_q.put((lane, time.monotonic(), timed_out, hang))

        def collect(lane: int, t_end: float, timed_out: bool, hang: list[dict[str, Any]] | None) -> None:
            c = self._running.pop(lane)
            done(job_of.pop(lane), _finish(c, t_end, timed_out, hang, cancelled=self._cancelled))

        try:
            while pending or self._running:
                try:
                    now = time.monotonic()
                    if self.cancel.is_set():
                        self._cancelled = True
                        pending.clear()
                    if (
                        self._running
                        and self._cancelled
                        and self._step < len(self.stop_signals)
                        and (self._step == 0 or now - self._step_at > self.grace_s)
                    ):
                        self._signal_all(self.stop_signals[self._step])
                        self._step, self._step_at = self._step + 1, now
                    while pending and len(self._running) < self.width:
                        lane = min(set(range(self.width)) - set(self._running))
                        job = pending.pop()
                        s = spec(job, lane)
                        try:
                            c = _start(s)
                        except OSError as e:  # e.g. the interpreter vanished: this job fails, the rest go on
                            done(job, _not_started(s, e))
                            continue
                        self._running[lane] = c
                        job_of[lane] = job
                        threading.Thread(
                            target=watch, args=(lane, c), name=f"krex-runner-{lane}", daemon=True
                        ).start()
                        if started is not None:
                            started(job)
                    try:
                        item = done_q.get(timeout=0.1)
                    except queue.Empty:
                        pass
                    else:
                        collect(*item)
                        while True:
                            try:
                                item = done_q.get_nowait()
                            except queue.Empty:
                                break
                            collect(*item)
                    now = time.monotonic()
                    if now >= next_tick:
                        next_tick = now + self.tick_s
                        if tick is not None:
                            tick()
                except KeyboardInterrupt:
                    self.cancel.set()
        finally:
            # Only reached with children still running if a callback raised: don't orphan them.
            if self._running:
                self._signal_all(signal.SIGTERM)
        return self._cancelled


class Started:
    """One command started by `start`, for callers that manage commands one by one from
    threads of their own (krex.executor): wait for it, stop it, get its Outcome. Stopping
    signals the guardian first (it forwards to its command's process group and thaws what
    it froze), then kills whatever of the tree, as snapshotted, is still alive."""

    def __init__(self, child: _Child) -> None:
        self._c = child
        self._tree: list[Any] = []
        self._t_end: float | None = None  # monotonic, when the guardian was seen to exit
        self.stopped = False

    @property
    def pid(self) -> int:
        return self._c.proc.pid

    @property
    def t0(self) -> float:
        """When it was started (time.monotonic: CLOCK_MONOTONIC, the clock of a report's
        t_grant_ns)."""
        return self._c.t0

    def wait(self, timeout: float | None = None) -> int | None:
        """The guardian's return code, or None if it still runs after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        rc = _wait_interruptibly(self._c.proc, deadline)
        if rc is not None and self._t_end is None:
            self._t_end = time.monotonic()
        return rc

    def _snapshot(self) -> None:
        self._tree = list(dict.fromkeys([*self._tree, *_tree(self._c.proc.pid)]))

    def stop(self, grace_s: float = 5.0, first: int = signal.SIGTERM) -> None:
        """Signal the guardian with ``first``; after ``grace_s`` SIGKILL every process of the
        tree still alive (the snapshot taken before the first signal, and again before the
        kill). Returns once the guardian has been reaped."""
        self.stopped = True
        self._snapshot()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            self._c.proc.send_signal(first)
        if self.wait(grace_s) is None:
            self._snapshot()
            signal_tree(self._tree, signal.SIGKILL)
        self._c.proc.wait()
        if self._t_end is None:
            self._t_end = time.monotonic()
        import psutil

        alive = []
        for p in self._tree:
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
        if alive:  # the guardian went, some of its command did not
            signal_tree(alive, signal.SIGKILL)
            psutil.wait_procs(alive, timeout=grace_s)

    def outcome(self, timed_out: bool = False, hang: list[dict[str, Any]] | None = None) -> Outcome:
        """The Outcome, once the guardian has exited (report read as for a Pool's commands)."""
        t_end = self._t_end if self._t_end is not None else time.monotonic()
        return _finish(self._c, t_end, timed_out, hang, cancelled=self.stopped)


def start(spec: Spec) -> Started:
    """Start one command (in a session of its own, output into the spec's files). OSError
    when it cannot be started."""
    return Started(_start(spec))
