"""`krex.Executor`: run benchmarking commands under KREX from Python, as futures.

    with krex.Executor(device="sim") as ex:
        fut = ex.submit(["python", "bench.py", "--candidate", "b"], auto_region="do_bench")
        res = fut.result()          # a RunResult
        res.exit_status, res.wall_s, [(r.duration_s, r.clean) for r in res.regions]

Each command runs exactly as ``krex run --report FILE -- ARGV`` would, in a guardian
process of its own (krex.runner.guardian_argv: the native guardian where it was built),
so its whole process tree gets a slot, its regions are exclusive, and the report says
what each region was. The executor starts the node's daemon on demand, as `krex run`
does, and runs at most ``max_workers`` commands at a time: by default as many as the
daemon has slots (on the GPU given, or on all GPUs), so no command queues for a slot.

A command's own failure (non-zero exit, timeout, a stop) is a result, never an
exception, unless ``check=True`` (then CommandFailed). KREX's own failures (exit 125
with a ``krex_error`` in the report, a guardian that cannot start) raise the KrexError
subclass the guardian reported, with its fix.

``shutdown(cancel_futures=True)`` (and leaving a ``with`` block by an exception) cancels
the commands not started and stops the running ones: SIGTERM to each guardian, which
forwards it to its command's process group, kills what outlives the command and ends any
region it held (siblings thaw); after ``stop_grace_s`` every process of the tree still
alive is killed. Their futures end with a RunResult whose ``stopped`` is True.

The library never prints."""

from __future__ import annotations

import contextlib
import os
import queue
import shlex
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from krex import errors, runner
from krex.errors import KrexError, UsageError

if TYPE_CHECKING:
    from krex.compare.run import Comparison, FigureSource

__all__ = ["CommandFailed", "Executor", "RegionRecord", "RunResult"]

TAIL_BYTES = 64 * 1024  # how much of each output a result keeps by default
STOP_GRACE_S = 5.0  # after SIGTERM to a guardian, before its tree is killed


class CommandFailed(KrexError):
    """A command submitted with ``check=True`` did not succeed (``result`` says how)."""

    exit_code = 1

    def __init__(self, message: str, fix: str, result: RunResult) -> None:
        super().__init__(message, fix)
        self.result = result


# ------------------------------------------------------------------------------------ results


@dataclass(frozen=True)
class RegionRecord:
    """One region of a command, from its `krex run --report`. Times: ``duration_s`` is how
    long the region was exclusive (the report's region_s), ``entry_s`` how long entering it
    took (queue wait, gate, drain, freeze, pin), ``granted_at`` the wall-clock time it was
    granted and ``offset_s`` that time after the command started (both None when the
    report has no grant time)."""

    index: int
    label: str
    duration_s: float
    entry_s: float
    queue_wait_s: float
    granted_at: float | None
    offset_s: float | None
    contaminated: bool
    cut: bool
    flags: tuple[str, ...]
    reasons: tuple[str, ...]
    end: str
    raw: Mapping[str, Any] = field(repr=False, compare=False)

    @property
    def clean(self) -> bool:
        """Exclusive from entry to end: not contaminated, not cut, no flag."""
        return not (self.contaminated or self.cut or self.flags)


def _num(v: Any, default: float = 0.0) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return default
    return f if f == f else default  # NaN -> default


def regions_from_report(
    report: Mapping[str, Any] | None, t0_monotonic: float | None = None, started_at: float | None = None
) -> tuple[RegionRecord, ...]:
    """The report's region records as RegionRecords. ``t0_monotonic`` / ``started_at``: when
    the command started (time.monotonic() and time.time()), for offsets and wall-clock times."""
    out = []
    regs = (report or {}).get("regions") or []
    for i, r in enumerate(x for x in regs if isinstance(x, dict)):
        grant_ns = r.get("t_grant_ns")
        offset = granted = None
        if isinstance(grant_ns, (int, float)) and t0_monotonic is not None:
            offset = grant_ns / 1e9 - t0_monotonic
            granted = None if started_at is None else started_at + offset
        out.append(
            RegionRecord(
                index=i,
                label=str(r.get("label") or ""),
                duration_s=_num(r.get("region_s")),
                entry_s=_num(r.get("entry_s")),
                queue_wait_s=_num(r.get("queue_wait_s")),
                granted_at=granted,
                offset_s=offset,
                contaminated=bool(r.get("contaminated")),
                cut=bool(r.get("cut")),
                flags=tuple(str(f) for f in r.get("flags") or []),
                reasons=tuple(str(x) for x in r.get("reasons") or []),
                end=str(r.get("end") or ""),
                raw=r,
            )
        )
    return tuple(out)


@dataclass(frozen=True)
class RunResult:
    """What came of one submitted command. ``exit_status`` is shell style (128+N: killed
    by signal N; None: it never started); ``stdout``/``stderr`` are the last bytes of each
    (``tail_bytes`` of the executor); ``report`` is the full `krex run --report` JSON."""

    argv: tuple[str, ...]
    name: str
    exit_status: int | None
    wall_s: float
    started_at: float
    stdout: str
    stderr: str
    regions: tuple[RegionRecord, ...]
    report: Mapping[str, Any] | None = field(repr=False)
    timed_out: bool = False
    stopped: bool = False
    error: str | None = None
    stdout_path: Path | None = None  # the whole output, when the executor keeps its files
    stderr_path: Path | None = None
    files: Mapping[str, Path] = field(default_factory=dict, repr=False)  # caller's extra files

    @property
    def ok(self) -> bool:
        return self.exit_status == 0 and not self.timed_out and not self.stopped

    @property
    def clean(self) -> bool:
        """At least one region, and every region exclusive from entry to end."""
        return bool(self.regions) and all(r.clean for r in self.regions)

    @property
    def region_s(self) -> float:
        return sum(r.duration_s for r in self.regions)

    @property
    def simulated(self) -> bool:
        return bool((self.report or {}).get("simulated"))


def _krex_error(report: Mapping[str, Any] | None, error: str | None) -> KrexError | None:
    """The KrexError a guardian reported (`krex_error` in its report), as its own class."""
    kerr = (report or {}).get("krex_error")
    if not isinstance(kerr, dict):
        return None
    cls = getattr(errors, str(kerr.get("kind")), None)
    if not (isinstance(cls, type) and issubclass(cls, KrexError)) or cls is errors.Timeout:
        cls = KrexError
    return cls(str(kerr.get("message") or error or "krex run failed"), str(kerr.get("fix") or ""))


# ------------------------------------------------------------------------------------ executor


@dataclass
class _Job:
    future: futures.Future[RunResult]
    argv: list[str]
    name: str
    spec: runner.Spec
    check: bool
    extra_files: dict[str, Path]


_STOP = object()


class Executor(futures.Executor):
    """A concurrent.futures.Executor whose ``submit(argv, **options)`` runs a command under
    KREX and returns a Future of its RunResult (see the module docstring).

    ``device``: auto, gpu or sim; ``gpu``: pin every command to this GPU (default: krexd
    picks the least loaded); ``out_dir``: keep every command's output and report there
    (default: a temporary directory, removed at shutdown, and only the tails are kept)."""

    def __init__(
        self,
        max_workers: int | None = None,
        *,
        device: str = "auto",
        gpu: int | None = None,
        freeze: str | None = None,
        env: Mapping[str, str] | None = None,
        out_dir: str | os.PathLike[str] | None = None,
        tail_bytes: int = TAIL_BYTES,
        stop_grace_s: float = STOP_GRACE_S,
        python: str = sys.executable,
    ) -> None:
        from krex.batch import check_args

        check_args(max_workers or 1, device)
        if max_workers is not None and max_workers < 1:
            raise UsageError(f"max_workers={max_workers}: need at least 1", "give max_workers >= 1 or None")
        self.device, self.gpu, self.freeze, self.python = device, gpu, freeze, python
        self._env = dict(os.environ if env is None else env)
        self._tail = tail_bytes
        self._grace = stop_grace_s
        self._keep = out_dir is not None
        self._dir: Path | None = Path(out_dir).absolute() if out_dir is not None else None
        self._workers_wanted = max_workers
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._running: dict[int, runner.Started] = {}  # job number -> its guardian
        self._pending: list[_Job] = []  # submitted, not yet taken by a worker
        self._count = 0
        self._ready = False
        self._shutdown = False
        self._cancelling = False
        self.kind = ""  # "sim" or "gpu", once the daemon is up

    # -------------------------------------------------------------------------- setup

    @property
    def max_workers(self) -> int:
        """How many commands run at once (the daemon's slots by default: starts it)."""
        self._ensure_ready()
        assert self._workers_wanted is not None
        return self._workers_wanted

    def _ensure_ready(self) -> None:
        """Discover the device, start krexd if none answers (once, before any guardian:
        many guardians finding none would race to start one each) and read its slots."""
        with self._lock:
            if self._ready:
                return
            from krex.device.gpus import discover
            from krex.proc.client import Client

            info = discover(self.device)
            self.kind = "sim" if info.kind == "sim" else "gpu"
            if self.gpu is not None and not 0 <= self.gpu < info.count:
                raise UsageError(
                    f"gpu={self.gpu}: this node has {info.count} {info.kind} GPU(s)",
                    f"give gpu in 0..{info.count - 1}, or None for the least loaded",
                )
            c = Client.connect(autostart=True, device=self.kind)
            try:
                st = c.request({"op": "status"})
            finally:
                c.close()
            if self._workers_wanted is None:
                self._workers_wanted = _slots(st, self.gpu)
            if self._dir is None:
                self._dir = Path(tempfile.mkdtemp(prefix="krex-executor-"))
            else:
                self._dir.mkdir(parents=True, exist_ok=True)
            self._ready = True

    # -------------------------------------------------------------------------- submit

    def submit(  # type: ignore[override]
        self,
        argv: Sequence[str] | str,
        /,
        *,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        timeout_s: float | None = None,
        gpu: int | None = None,
        freeze: str | None = None,
        auto_region: str | None = None,
        nvtx_region: str | None = None,
        check: bool = False,
        files: Mapping[str, str | os.PathLike[str]] | None = None,
    ) -> futures.Future[RunResult]:
        """Run ``argv`` (a list of arguments; a string is a shell line, run by /bin/sh -c)
        under KREX. ``env``: variables added to the executor's environment; ``auto_region``
        / ``nvtx_region``: KREX_AUTO_REGION / KREX_NVTX_REGION for this command;
        ``timeout_s``: the command's tree is killed after it (``timed_out`` set);
        ``check``: a result that is not ``ok`` raises CommandFailed from ``result()``;
        ``files``: paths the caller's command writes, handed back in ``RunResult.files``."""
        args = _argv(argv)
        if timeout_s is not None and not timeout_s > 0:
            raise UsageError(f"timeout_s={timeout_s}: must be > 0",
                             "give a positive number of seconds or None")
        self._ensure_ready()
        assert self._dir is not None
        run_env = dict(self._env)
        run_env.update(env or {})
        if auto_region is not None:
            run_env["KREX_AUTO_REGION"] = auto_region
        if nvtx_region is not None:
            run_env["KREX_NVTX_REGION"] = nvtx_region
        fut: futures.Future[RunResult] = futures.Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot submit after shutdown")
            self._count += 1
            n = self._count
            stem = self._dir / f"run-{n:05d}"
            report = stem.with_name(stem.name + ".report.json")
            g = gpu if gpu is not None else self.gpu
            spec = runner.Spec(
                runner.guardian_argv(args, report, self.kind, g, freeze or self.freeze, python=self.python),
                stem.with_name(stem.name + ".stdout"),
                stem.with_name(stem.name + ".stderr"),
                env=run_env,
                cwd=None if cwd is None else os.fspath(cwd),
                timeout_s=timeout_s,
                report=report,
            )
            job = _Job(fut, args, name or shlex.join(args), spec, check,
                       {k: Path(v) for k, v in (files or {}).items()})
            job.future._krex_job = n  # type: ignore[attr-defined]
            self._pending.append(job)
            self._queue.put(job)
            # A worker per job not yet taken that no idle worker will take, up to max_workers.
            if len(self._pending) > self._idle and len(self._threads) < (self._workers_wanted or 1):
                t = threading.Thread(target=self._work, name=f"krex-executor-{len(self._threads)}",
                                     daemon=True)
                self._threads.append(t)
                t.start()
        return fut

    def map(  # type: ignore[override]
        self, argvs: Iterable[Sequence[str] | str], timeout: float | None = None, **options: Any
    ) -> Iterator[RunResult]:
        """Submit every argv (same options each), yield their results in order."""
        fs = [self.submit(a, **options) for a in argvs]
        return (f.result(timeout) for f in fs)

    def compare(self, candidates: Sequence[Sequence[str] | str], figure: FigureSource | str,
                **options: Any) -> Comparison:
        """Is B faster than A? See krex.compare.run.compare (the options are its own)."""
        from krex.compare.run import compare

        return compare(self, candidates, figure, **options)

    # -------------------------------------------------------------------------- workers

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            job = self._queue.get()
            with self._lock:
                self._idle -= 1
                if job is _STOP:
                    return
                with contextlib.suppress(ValueError):
                    self._pending.remove(job)
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                res = self._run(job)
            except BaseException as e:  # noqa: BLE001 - it belongs to the future
                job.future.set_exception(e)
            else:
                if isinstance(res, BaseException):
                    job.future.set_exception(res)
                else:
                    job.future.set_result(res)

    def _run(self, job: _Job) -> RunResult | BaseException:
        n = job.future._krex_job  # type: ignore[attr-defined]
        with self._lock:
            if self._cancelling:  # shutdown(cancel_futures=True) came between get() and here
                return _never_started(job, "stopped before it started: the executor was shut down")
            try:
                started = runner.start(job.spec)
            except OSError as e:
                return KrexError(f"could not start the krex run guardian {job.spec.argv[0]}: {e}",
                                 "check the KREX installation (`krex doctor`)")
            self._running[n] = started
        try:
            rc = started.wait(job.spec.timeout_s)
            timed_out, hang = False, None
            if rc is None:
                timed_out, hang = True, runner.tree_state(started.pid)
                started.stop(self._grace)
            got = started.outcome(timed_out, hang)
        finally:
            with self._lock:
                self._running.pop(n, None)
        return self._result(job, started, got)

    def _result(self, job: _Job, started: runner.Started, got: runner.Outcome) -> RunResult | BaseException:
        out, err = got.read(self._tail)
        res = RunResult(
            argv=tuple(job.argv),
            name=job.name,
            exit_status=got.exit_status,
            wall_s=got.wall_s,
            started_at=got.started_at,
            stdout=out,
            stderr=err,
            regions=regions_from_report(got.report, started.t0, got.started_at),
            report=got.report,
            timed_out=got.timed_out,
            stopped=started.stopped and not got.timed_out,
            error=got.error or got.start_error,
            stdout_path=job.spec.stdout if self._keep else None,
            stderr_path=job.spec.stderr if self._keep else None,
            files=job.extra_files,
        )
        if not self._keep:
            for p in (job.spec.stdout, job.spec.stderr, job.spec.report):
                if p is not None:
                    with contextlib.suppress(OSError):
                        p.unlink()
        kerr = _krex_error(got.report, got.error)
        if kerr is not None and not res.stopped:
            return kerr
        if got.report is None and got.exit_status == errors.RUN_FAILURE and not res.stopped:
            return KrexError(got.error or f"krex run failed (exit 125): {runner.tail_lines(err)}",
                             "see the message; `krex doctor` checks the node")
        if job.check and not res.ok:
            how = ("timed out" if res.timed_out else "was stopped" if res.stopped
                   else f"exited {res.exit_status}")
            return CommandFailed(f"{job.name} {how}: {runner.tail_lines(err)}",
                                 "see RunResult.stderr (the exception's `result`)", res)
        return res

    # -------------------------------------------------------------------------- shutdown

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more submissions. ``cancel_futures``: cancel the commands not started and stop
        the running ones (see the module docstring). ``wait``: return once every worker is
        done (and the temporary directory is removed)."""
        with self._lock:
            self._shutdown = True
            running: list[runner.Started] = []
            if cancel_futures:
                self._cancelling = True
                for job in self._pending:
                    job.future.cancel()
                self._pending.clear()
                running = list(self._running.values())
            for _ in self._threads:
                self._queue.put(_STOP)
            threads = list(self._threads)
        stoppers = [threading.Thread(target=s.stop, args=(self._grace,), daemon=True) for s in running]
        for t in stoppers:
            t.start()
        if wait:
            for t in stoppers:
                t.join()
            for t in threads:
                t.join()
            if not self._keep and self._dir is not None:
                import shutil

                shutil.rmtree(self._dir, ignore_errors=True)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        # An exception (a Ctrl-C among them) leaving the block stops what runs, as a
        # batch's Ctrl-C does, instead of waiting for every command to finish.
        self.shutdown(wait=True, cancel_futures=exc_type is not None)
        return False


def _argv(argv: Sequence[str] | str) -> list[str]:
    if isinstance(argv, str):
        if not argv.strip():
            raise UsageError("an empty command", "give a list of arguments or a shell line")
        return ["/bin/sh", "-c", argv]
    args = list(argv)
    if not args or not all(isinstance(a, str) for a in args) or not args[0]:
        raise UsageError(f"not a command: {argv!r}",
                         'give a non-empty list of strings, e.g. ["python", "bench.py"], or a shell line')
    if any("\0" in a for a in args):
        raise UsageError("an argument holds a NUL byte", "remove it")
    return args


def _slots(status: Mapping[str, Any], gpu: int | None) -> int:
    """The daemon's slots: on ``gpu``, or on all its GPUs."""
    per = status.get("slots_per_gpu")
    if isinstance(per, int):
        n = per if gpu is not None else per * int((status.get("daemon") or {}).get("gpus") or 1)
    elif isinstance(per, list) and per:
        n = int(per[gpu]) if gpu is not None and gpu < len(per) else sum(int(x) for x in per)
    else:
        n = 1
    return max(1, n)


def _never_started(job: _Job, why: str) -> RunResult:
    return RunResult(tuple(job.argv), job.name, None, 0.0, 0.0, "", "", (), None, stopped=True, error=why)
