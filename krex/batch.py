"""`krex batch`: run a file of commands under KREX, at most N at a time.

Each command runs as its own `krex run` guardian *process* (krex.runner:
``python -m krex.proc.launcher --report F -- ...``, the library entry of `krex run`),
not a thread: a guardian installs signal handlers, forwards signals to its
command's process group and thaws its own command if the daemon dies (I5), and
all of that only works in a process of its own. krex.runner.Pool runs them, at
most N at a time, each in a session of its own, so a Ctrl-C on the terminal
reaches only the batch, which then forwards exactly one SIGINT to each running
guardian (and escalates if they do not finish).

Input (`load_commands` / `parse_commands`):

* a text file with one shell command per line, run as ``/bin/sh -c LINE``
  (blank lines and lines starting with ``#`` are skipped), or
* a JSON list whose items are argv lists (``[["python", "bench.py"], ...]``),
  run without a shell; a plain string item is a shell line. A file named
  ``*.json`` must be JSON; any other file is JSON if it starts with ``[`` and
  parses as a list, else lines.

Output (in `out_dir`): per command ``cmd-NNN.json`` (argv, exit status, wall
time, stdout/stderr paths, and the `krex run` report: regions, waits, gate
blocks, contamination), ``cmd-NNN.stdout`` and ``cmd-NNN.stderr``, and
``summary.json`` (see `summarize`).

The library never prints: progress goes to the `progress` callback as
`BatchEvent`s, called on the thread that called `run_batch`."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from krex import runner
from krex.bench.metrics import percentile
from krex.errors import KrexError, NotFound, PermissionDenied, UsageError
from krex.runner import TICK_S, Outcome, Pool, Spec, guardian_argv

__all__ = [
    "BatchCommand",
    "BatchEvent",
    "BatchFailed",
    "BatchSummary",
    "CommandResult",
    "check_args",
    "default_out_dir",
    "load_commands",
    "parse_commands",
    "run_batch",
    "summarize",
]

SHELL = "/bin/sh"
FILE_HELP = "FILE holds one shell command per line (# comments), or a JSON list of argv lists"
GRACE_S = runner.GRACE_S  # after a cancel: how long guardians get for each escalation step (SIGINT, SIGTERM)


class BatchFailed(KrexError):
    """Some commands of a batch exited non-zero (everything was still written)."""

    exit_code = 1


# --------------------------------------------------------------------------------------- input


@dataclass(frozen=True)
class BatchCommand:
    index: int  # 1-based position among the commands (comments and blank lines not counted)
    argv: list[str]  # what `krex run` is given
    line: str | None = None  # the shell line it came from, None for an argv item
    source_line: int | None = None  # line number in the file, for text input

    @property
    def display(self) -> str:
        return self.line if self.line is not None else shlex.join(self.argv)


def _shell(index: int, line: str, source_line: int | None = None) -> BatchCommand:
    return BatchCommand(index, [SHELL, "-c", line], line, source_line)


def _from_json(data: Any, source: str) -> list[BatchCommand]:
    if not isinstance(data, list):
        raise UsageError(f"{source}: the JSON must be a list of commands, got {type(data).__name__}",
                         'write e.g. [["python", "bench.py", "--n", "1"], ["./bench2"]]')
    out: list[BatchCommand] = []
    for i, item in enumerate(data):
        where = f"{source}: item {i} ({json.dumps(item)[:60]})"
        if isinstance(item, str):
            if "\0" in item:
                raise UsageError(f"{where} holds a NUL byte", "a command cannot contain \\u0000; remove it")
            if not item.strip():
                raise UsageError(f"{where} is an empty command", "remove it, or give a command")
            out.append(_shell(len(out) + 1, item.strip()))
        elif isinstance(item, list) and item and all(isinstance(a, str) for a in item) and item[0]:
            if any("\0" in a for a in item):
                raise UsageError(f"{where} holds a NUL byte", "an argument cannot contain \\u0000; remove it")
            out.append(BatchCommand(len(out) + 1, list(item)))
        else:
            raise UsageError(f"{where} is not an argv list",
                             "each item must be a non-empty list of strings (or a shell command string)")
    return out


def parse_commands(text: str, source: str = "<input>", force_json: bool = False) -> list[BatchCommand]:
    """Parse batch input (see the module docstring). Raises UsageError when no command is in it,
    or when it holds a NUL byte (a binary file; no argv can carry one)."""
    text = text.removeprefix("\ufeff")  # a UTF-8 byte order mark (some editors save one) is no command
    if "\0" in text:
        no = text[: text.index("\0")].count("\n") + 1
        raise UsageError(f"{source}: line {no} holds a NUL byte: this is not a text file of commands",
                         f"give a text file; {FILE_HELP}")
    stripped = text.strip()
    commands: list[BatchCommand] | None = None
    if force_json or stripped.startswith("["):
        try:
            data = json.loads(text)
        except ValueError as e:
            if force_json:
                raise UsageError(f"{source} is not valid JSON: {e}",
                                 'give a JSON list of argv lists, e.g. [["python", "bench.py"]]') from None
        else:
            if force_json or isinstance(data, list):
                commands = _from_json(data, source)
    if commands is None:
        commands = []
        for no, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if line and not line.startswith("#"):
                commands.append(_shell(len(commands) + 1, line, no))
    if not commands:
        raise UsageError(f"{source} holds no command", FILE_HELP)
    return commands


def load_commands(path: str) -> list[BatchCommand]:
    """Read a batch file; ``-`` reads standard input."""
    if path == "-":
        return parse_commands(sys.stdin.read(), "<stdin>")
    p = Path(path)
    if not p.exists():
        raise NotFound(f"batch file {path} does not exist", f"check the path; {FILE_HELP}")
    if p.is_dir():
        raise UsageError(f"batch file {path} is a directory", f"give a file; {FILE_HELP}")
    try:
        text = p.read_text(encoding="utf-8", errors="surrogateescape")
    except PermissionError as e:
        raise PermissionDenied(f"cannot read batch file {path}: {e.strerror}", "check its permissions") from e
    except OSError as e:
        raise KrexError(f"cannot read batch file {path}: {e.strerror}", "check the file") from e
    return parse_commands(text, path, force_json=p.suffix.lower() == ".json")


# -------------------------------------------------------------------------------------- output


@dataclass
class CommandResult:
    command: BatchCommand
    exit_status: int | None  # None: never started (the batch was cancelled first)
    wall_s: float
    started_at: float | None  # epoch seconds
    ended_at: float | None
    stdout: str
    stderr: str
    report: dict[str, Any] | None  # the `krex run --report` JSON; None if krex run wrote none
    error: str | None = None  # why there is no report, or what went wrong around the command
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.exit_status == 0

    @property
    def regions(self) -> list[dict[str, Any]]:
        regs = (self.report or {}).get("regions") or []
        return [r for r in regs if isinstance(r, dict)]

    def to_json(self) -> dict[str, Any]:
        regs = self.regions
        return {
            "index": self.command.index,
            "command": self.command.display,
            "argv": self.command.argv,
            "shell": self.command.line is not None,
            "source_line": self.command.source_line,
            "exit_status": self.exit_status,
            "ok": self.ok,
            "not_run": self.exit_status is None,
            "wall_s": round(self.wall_s, 6),
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "stdout": self.stdout,
            "stderr": self.stderr,
            "regions": len(regs),
            "region_s": round(sum(_num(r.get("region_s")) for r in regs), 6),
            "contaminated_regions": sum(1 for r in regs if r.get("contaminated")),
            "cut_regions": sum(1 for r in regs if r.get("cut")),
            "auto_region": (self.report or {}).get("auto_region"),
            "leftovers": len((self.report or {}).get("leftovers") or []),
            "warnings": self.warnings,
            "error": self.error,
            "report": self.report,
        }


def _num(v: Any) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return 0.0
    return f if math.isfinite(f) else 0.0


def _dist(values: Sequence[float]) -> dict[str, Any]:
    def r(v: float | None) -> float | None:
        return None if v is None else round(v, 6)

    def pct(q: float) -> float | None:
        return r(percentile(values, q)) if values else None

    return {"count": len(values), "total_s": round(sum(values), 6), "p50_s": pct(50), "p95_s": pct(95),
            "max_s": r(max(values) if values else None)}


def summarize(results: Sequence[CommandResult], total_wall_s: float, jobs: int, device: str,
              out_dir: str, interrupted: bool = False) -> dict[str, Any]:
    """The batch summary (what summary.json holds). Pure: computed from the results only.

    region_share = sum of region_s over all regions / sum of the commands' wall times.
    region_waits: queue_wait_s of every region (time from asking for the GPU to the grant)."""
    ran = [r for r in results if r.exit_status is not None]
    failed = [r for r in ran if not r.ok]
    regs = [reg for r in ran for reg in r.regions]
    cmd_wall = sum(r.wall_s for r in ran)
    region_s = sum(_num(reg.get("region_s")) for reg in regs)
    admission = [_num((r.report or {}).get("admission_wait_s")) for r in ran if r.report]
    return {
        "commands": len(results),
        "ran": len(ran),
        "succeeded": len(ran) - len(failed),
        "failures": len(failed),
        "failed": [{"index": r.command.index, "exit_status": r.exit_status, "command": r.command.display,
                    "stderr": r.stderr, "error": r.error} for r in failed],
        "not_run": [r.command.index for r in results if r.exit_status is None],
        "interrupted": interrupted,
        "jobs": jobs,
        "device": device,
        "dir": out_dir,
        "total_wall_s": round(total_wall_s, 6),
        "command_wall_s": round(cmd_wall, 6),
        "throughput_per_min": round(60.0 * len(ran) / total_wall_s, 3) if total_wall_s > 0 else None,
        "regions": len(regs),
        "region_s": round(region_s, 6),
        "region_share": round(region_s / cmd_wall, 6) if cmd_wall > 0 else None,
        "region_waits": _dist([_num(reg.get("queue_wait_s")) for reg in regs]),
        "admission_waits": _dist(admission),
        "contaminated_regions": sum(1 for reg in regs if reg.get("contaminated")),
        "contaminated": [{"index": r.command.index, "reasons": reg.get("reasons", [])}
                         for r in ran for reg in r.regions if reg.get("contaminated")],
        "gate_blocks": sum(int(_num((r.report or {}).get("gate_blocks"))) for r in ran),
        "fail_opens": sum(int(_num((r.report or {}).get("fail_opens"))) for r in ran),
        "partition_degraded": any(bool(reg.get("partition_degraded")) for reg in regs),
        "cut_regions": sum(1 for reg in regs if reg.get("cut")),
        "region_flags": _flag_counts(regs),
        "simulated": any(bool((r.report or {}).get("simulated")) for r in ran),
        # Per command: how many regions it made and which automatic-region targets fired.
        "per_command": [_per_command(r) for r in ran],
        "no_region_commands": [r.command.index for r in ran if not r.regions],
        "leftovers": sum(len((r.report or {}).get("leftovers") or []) for r in ran),
    }


def _flag_counts(regs: Sequence[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for reg in regs:
        for f in reg.get("flags") or []:
            out[str(f)] = out.get(str(f), 0) + 1
    return out


def _per_command(r: CommandResult) -> dict[str, Any]:
    auto = (r.report or {}).get("auto_region") or {}
    return {
        "index": r.command.index,
        "regions": len(r.regions),
        "auto_value": auto.get("value"),
        "auto_wrapped": auto.get("wrapped") or [],
        "auto_targets": [
            {"target": t.get("target"), "state": t.get("state"), "regions": t.get("regions")}
            for t in auto.get("targets") or []
        ],
    }


@dataclass
class BatchSummary:
    out_dir: Path
    results: list[CommandResult]
    data: dict[str, Any]  # summary.json

    @property
    def failures(self) -> int:
        return int(self.data["failures"])

    @property
    def interrupted(self) -> bool:
        return bool(self.data["interrupted"])


@dataclass
class BatchEvent:
    """Progress of a batch: `kind` "start" (a command started), "done" (one finished;
    `result` set) or "tick" (time passed; sent about every TICK_S seconds)."""

    kind: Literal["start", "done", "tick"]
    total: int
    done: int
    running: int
    failed: int
    elapsed_s: float
    command: BatchCommand | None = None
    result: CommandResult | None = None
    cancelling: bool = False
    jobs: int = 0  # commands at most at once (-j, or the daemon's slots by default)


def default_out_dir(now: float | None = None, base: Path | None = None, prefix: str = "krex-batch") -> Path:
    """A new ./PREFIX-<timestamp>[-N] directory name."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    root = (base or Path.cwd()) / f"{prefix}-{stamp}"
    p, n = root, 1
    while p.exists():
        n += 1
        p = root.with_name(f"{root.name}-{n}")
    return p


def _prepare_dir(out_dir: Path) -> None:
    if out_dir.exists():
        if not out_dir.is_dir():
            raise UsageError(f"--out {out_dir} exists and is not a directory", "choose another --out")
        if any(out_dir.iterdir()):
            raise UsageError(f"--out {out_dir} is not empty",
                             "choose a new directory (or leave --out away for ./krex-batch-<timestamp>/)")
    # A bad --out is a usage error (exit 2), whatever the errno: the argument is what to change.
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {out_dir}: cannot make the directory ({e.strerror})",
                         "give a directory you may write, e.g. --out ./results") from None
    if not os.access(out_dir, os.W_OK):
        raise UsageError(f"--out {out_dir}: the directory is not writable",
                         "give a directory you may write, e.g. --out ./results")


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def _static_cudart_warning(cmd: BatchCommand) -> list[str]:
    """`krex run` warns about a statically linked CUDA runtime, but for a shell line it
    only sees /bin/sh; look at the line's first word ourselves."""
    from krex.device.elfcheck import inspect

    if cmd.line is not None:
        try:
            words = shlex.split(cmd.line)
        except ValueError:
            return []
        if not words or "=" in words[0]:
            return []
        exe = words[0]
    else:
        exe = cmd.argv[0]
    path = exe if "/" in exe else shutil.which(exe)
    if not path or not os.path.isfile(path):
        return []
    if inspect(path).static_cudart:
        return [f"{exe} links the CUDA runtime statically: KREX cannot gate its launches (freezing "
                "still protects its siblings). Rebuild it with `nvcc -cudart shared`."]
    return []


# ----------------------------------------------------------------------------------------- run


def check_args(jobs: int | None, device: str) -> None:
    """Validate the cheap arguments (before reading any file)."""
    from krex.device import DEVICES

    if jobs is not None and jobs < 1:
        raise UsageError(f"-j {jobs}: need at least one job slot", "give -j 1 or more (e.g. -j 4)")
    if device not in DEVICES:
        raise UsageError(f"unknown device {device!r}", f"use --device {' or '.join(DEVICES)}")


MAX_SLOTS_PER_GPU = 64  # krexd's limit (config.KEYS: slots_per_gpu)


def _capacity(per_gpu: Sequence[int], gpu: int | None) -> int:
    """Commands admitted at once: on GPU `gpu`, or on every GPU (the daemon picks)."""
    return int(per_gpu[gpu]) if gpu is not None and gpu < len(per_gpu) else int(sum(per_gpu))


def _daemon_for(jobs: int | None, device: str, kind: str, info: Any, gpu: int | None) -> int:
    """Make sure a daemon runs that admits the batch's commands at once, before the
    guardians start (N guardians that all find no daemon would race to start one each);
    return -j (default: the commands that daemon admits at once). A running daemon that
    admits fewer than -j, or runs on the simulated GPU under --device gpu, is refused with
    its name and the fix: the extra commands would only wait at admission."""
    from krex.proc.client import Client, start_background
    from krex.worlds import daemon_misfit, daemon_status, describe, node_slots_per_gpu

    start_as = device if kind == "sim" else kind  # `auto` that found no GPU: krexd says so
    for _attempt in range(2):
        st = daemon_status()
        if st is not None:
            total = _capacity(st.get("slots_per_gpu") or [], gpu)
            want = total if jobs is None else jobs
            # `krex run --device sim` under a real GPU's daemon is allowed, as for one command.
            wrong_device = daemon_misfit(st, kind, 0, sim_on_gpu=True)
            if wrong_device:
                raise UsageError(f"krex batch --device {device}: {describe(st)}: {wrong_device}",
                                 "stop that daemon once it is idle (`krex daemon stop`) and run again, "
                                 "or pass the --device it runs")
            if want > total:
                where = f" on GPU {gpu}" if gpu is not None else ""
                raise UsageError(
                    f"-j {want}: {describe(st)} admits {total} command(s) at once{where}; the other "
                    f"{want - total} would wait at admission",
                    f"give -j {total} or less (without -j a batch runs {total} at once), or stop that daemon "
                    "once it is idle (`krex daemon stop`) and run again: krex batch then starts one that "
                    "admits -j commands at once",
                )
            return want
        default = _capacity(node_slots_per_gpu(kind, info.count, info.numa), gpu)
        if jobs is None or jobs <= default:
            Client.connect(autostart=True, device=start_as).close()
        else:
            need = jobs if gpu is not None else math.ceil(jobs / max(1, info.count))
            if need > MAX_SLOTS_PER_GPU:
                most = MAX_SLOTS_PER_GPU * (1 if gpu is not None else info.count)
                raise UsageError(f"-j {jobs}: krexd admits at most {MAX_SLOTS_PER_GPU} commands per GPU "
                                 f"({info.count} GPU(s) here)", f"give -j {most} or less")
            start_background(device=start_as, settings={"slots_per_gpu": need}, on_demand=True)
        # the daemon that answers now (ours, or one that won a race) decides, as above
    raise UsageError("no KREX daemon stayed up for the batch", "see `krex daemon status` and its log")


def run_batch(commands: Sequence[BatchCommand], jobs: int | None = None, device: str = "auto",
              out_dir: Path | str | None = None, gpu: int | None = None,
              progress: Callable[[BatchEvent], None] | None = None,
              cancel: threading.Event | None = None,
              python: str = sys.executable,
              env: dict[str, str] | None = None) -> BatchSummary:
    """Run `commands` under KREX, at most `jobs` at a time (None: as many as the node's daemon
    admits at once); write the results and the summary to `out_dir` (default
    ./krex-batch-<timestamp>/) and return them. The daemon must admit `jobs` commands at once
    (see _daemon_for): a running one that admits fewer is refused, and one started here
    gets the slots the batch needs.

    A failing command does not stop the batch. Setting `cancel` (or a KeyboardInterrupt in the
    calling thread) stops starting commands, forwards SIGINT to the running guardians (SIGTERM
    and SIGKILL follow after GRACE_S each), and still writes everything: the commands that
    never started are recorded with exit_status None and the summary says `interrupted`."""
    from krex.device.gpus import discover

    check_args(jobs, device)
    if not commands:
        raise UsageError("no commands to run", FILE_HELP)
    info = discover(device)  # NotFound (with a fix) for --device gpu on a machine without one
    kind = "sim" if info.kind == "sim" else "gpu"
    if gpu is not None and not 0 <= gpu < info.count:
        raise UsageError(f"--gpu {gpu}: this node has {info.count} {info.kind} GPU(s)",
                         f"use --gpu {'0' if info.count == 1 else f'0..{info.count - 1}'}, "
                         "or leave it away for the least loaded GPU")
    out = Path(out_dir) if out_dir is not None else default_out_dir()
    out = out.absolute()
    made = not out.exists()
    _prepare_dir(out)  # a bad --out is refused before any daemon starts
    try:
        jobs = _daemon_for(jobs, device, kind, info, gpu)
    except BaseException:
        if made:
            with contextlib.suppress(OSError):
                out.rmdir()  # nothing was written: no trace of a refused batch
        raise

    width = max(3, len(str(len(commands))))
    base_env = dict(os.environ if env is None else env)
    pool: Pool[BatchCommand] = Pool(jobs, cancel=cancel, grace_s=GRACE_S, tick_s=TICK_S)
    results: dict[int, CommandResult] = {}
    t_batch = time.monotonic()
    failed = 0

    def emit(kind_: Literal["start", "done", "tick"], cmd: BatchCommand | None = None,
             res: CommandResult | None = None) -> None:
        if progress is not None:
            progress(BatchEvent(kind_, len(commands), len(results), pool.running, failed,
                                time.monotonic() - t_batch, cmd, res, pool.cancelling, jobs))

    def spec(cmd: BatchCommand, _lane: int) -> Spec:
        stem = out / f"cmd-{cmd.index:0{width}d}"
        report = stem.with_name(stem.name + ".report.json")
        return Spec(guardian_argv(cmd.argv, report, device, gpu, python=python),
                    stem.with_name(stem.name + ".stdout"), stem.with_name(stem.name + ".stderr"),
                    env=base_env, report=report)

    def finished(cmd: BatchCommand, got: Outcome) -> None:
        nonlocal failed
        if got.spec.report is not None:
            with contextlib.suppress(OSError):
                got.spec.report.unlink()
        error = got.error or got.start_error
        res = CommandResult(cmd, got.exit_status, got.wall_s, got.started_at, got.ended_at,
                            str(got.spec.stdout), str(got.spec.stderr), got.report, error,
                            [] if got.start_error else _static_cudart_warning(cmd))
        results[cmd.index] = res
        if not res.ok:
            failed += 1
        _write_json(out / f"cmd-{cmd.index:0{width}d}.json", res.to_json())
        emit("done", cmd, res)

    interrupted = pool.run(commands, spec, finished, started=lambda cmd: emit("start", cmd),
                           tick=lambda: emit("tick"))
    total = time.monotonic() - t_batch
    all_results: list[CommandResult] = []
    for cmd in commands:
        res = results.get(cmd.index)
        if res is None:
            res = CommandResult(cmd, None, 0.0, None, None, "", "", None,
                                "not started: the batch was interrupted")
            _write_json(out / f"cmd-{cmd.index:0{width}d}.json", res.to_json())
        all_results.append(res)
    data = summarize(all_results, total, jobs, kind, str(out), interrupted)
    _write_json(out / "summary.json", data)
    return BatchSummary(out, all_results, data)
