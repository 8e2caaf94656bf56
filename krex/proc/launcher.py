"""`krex run`: put one command under KREX.

The guardian of a command is the native `krex` (interpose/guardian.c): it stays outside the
command's slot, forwards signals to the command's process group, returns its exit status
and frees the slot however the command ends (SIGKILL included). This module does what only
Python does before it (`run_command`: the report path, the command, the static-cudart and
chunk warnings, starting krexd when none answers, `--no-daemon`), then execs it; and what
the native guardian's finisher (krex.proc.finish) needs when krexd went away."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from krex.errors import CommandNotFound, KrexError, NotExecutable, NotFound, UsageError
from krex.node.optin import auto_region_report, auto_region_warning, trust_notes
from krex.proc.spawn import Launch, spawn_and_wait

__all__ = ["auto_region_report", "auto_region_warning", "trust_notes", "run_command", "exec_guardian"]

if TYPE_CHECKING:
    from krex.proc.client import Client

# Imports inside functions keep `krex run`'s start-up short: every module
# loaded here is paid by every command.

def resolve_command(cmd: Sequence[str]) -> str:
    if not cmd or not cmd[0]:
        raise UsageError("no command given", "put the command after --, e.g. krex run -- python bench.py")
    exe = cmd[0]
    if "/" in exe:
        # A name with a slash is a path, as for execvp: returned as given, since
        # str(Path("./prog")) would be "prog", which execvp looks up on PATH.
        p = Path(exe)
        if not p.exists():
            raise CommandNotFound(f"command not found: {exe}", "check the path")
        if p.is_dir() or not os.access(p, os.X_OK):
            raise NotExecutable(
                f"{exe} is not executable", f"chmod +x {exe}, or run it through its interpreter"
            )
        return exe
    found = _which(exe)
    if not found:
        raise CommandNotFound(f"command not found: {exe}", "check the spelling, or that it is on PATH")
    return found


def _which(name: str) -> str | None:
    """shutil.which(name) without importing shutil (bz2, lzma, fnmatch) on every `krex run`:
    the first executable file of that name on PATH."""
    for d in os.get_exec_path():
        p = os.path.join(d, name)
        if os.access(p, os.X_OK) and not os.path.isdir(p):
            return p
    return None


def run_direct(
    cmd: Sequence[str],
    device: str,
    gpu: int | None,
    n_gpus: int,
    shm_name: str | None = None,
    extra_env: dict[str, str] | None = None,
) -> int:
    """First-version run without a daemon: claim a slot in the segment directly."""
    from krex.node.shm import Segment
    from krex.proc.envvars import opt_in_env

    exe = resolve_command(cmd)
    seg = Segment.create(shm_name, n_gpus=n_gpus)
    try:
        if gpu is None:
            snap = seg.snapshot()
            load = [sum(1 for s in snap.slots if s.gpu == g) for g in range(seg.n_gpus)]
            gpu = load.index(min(load))
        seg.check_gpu(gpu)
        slot = seg.claim_slot(gpu)
        try:
            env = dict(os.environ)
            env.update(opt_in_env(device, seg.name))
            env.update({"KREX_SLOT": str(slot), "KREX_GPU": str(gpu), "CUDA_VISIBLE_DEVICES": str(gpu)})
            env["KREX_SLOT_GEN"] = str(int(seg.raw.slots[slot].generation))
            env.update(extra_env or {})
            return spawn_and_wait(Launch([exe, *cmd[1:]], env, slot, gpu))
        finally:
            seg.release_slot(slot)
    finally:
        seg.close()


def _static_cudart_warning(exe: str) -> str | None:
    from krex.device.elfcheck import inspect

    if inspect(exe).static_cudart:
        return (
            f"{exe} links the CUDA runtime statically: KREX cannot gate its launches (freezing still "
            "protects its siblings). Rebuild it with `nvcc -cudart shared`."
        )
    return None


def connect_daemon(device: str, gpu: int | None) -> tuple[Client, str | None]:
    """The daemon for `krex run`, and the device kind ("sim"/"gpu") if it had to be found here.

    A daemon that answers has discovered the GPUs itself: its admission reply says which
    device it runs and refuses an unknown `gpu`, so no GPU discovery (NVML) runs here (None).
    Only when none answers are the GPUs discovered and `gpu` checked here, so a refused
    command never starts a daemon; then one is started for that device."""
    from krex.errors import NotFound
    from krex.proc.client import Client

    if device not in ("sim", "gpu", "auto"):
        raise UsageError(f"unknown device {device!r}", "use one of: auto, gpu, sim")
    try:
        return Client.connect(), None
    except NotFound:
        pass
    kind, count = discover_kind(device)
    if gpu is not None and not 0 <= gpu < count:
        raise NotFound(
            f"unknown GPU {gpu}: this node has {count} GPU(s) (0..{count - 1})",
            "pick a GPU index from `krex status`",
        )
    # `auto` that found no GPU starts krexd with `auto` (it finds the same): its notes then say
    # that no GPU was found, not that `--device sim` was asked for.
    return Client.connect(autostart=True, device=device if kind == "sim" else kind), kind


def discover_kind(device: str) -> tuple[str, int]:
    """("sim" or "gpu", GPU count) for `--device auto|gpu|sim` (krex.device.gpus.discover)."""
    from krex.device.gpus import discover

    info = discover(device)
    return ("sim" if info.kind == "sim" else "gpu"), info.count


def _journal_regions(
    slot: int,
    t_start: float,
    report: dict[str, object],
    notify: Callable[[str], None],
    t_end: float | None = None,
) -> list[dict[str, Any]]:
    """This slot's regions since `t_start` (and up to `t_end`), read from the journal: only
    when krexd went away with its own record of the command. Where the journal has rotated
    past `t_start` (its oldest record is later), regions may be missing: the report says so
    (`regions_incomplete`)."""
    from krex import paths
    from krex.node import journal

    try:
        path = paths.journal_path()
        jr = journal.read_counted(path)
        if jr.skipped:
            report["journal_skipped_lines"] = jr.skipped
        oldest = min((float(r["ts"]) for r in jr.records), default=None)
        if journal.rotated(path, journal.KEEP).exists() and oldest is not None and oldest > t_start:
            report["regions_incomplete"] = (
                f"krexd went away, and the journal {path} has rotated since the command started: "
                "regions it ran before "
                f"{time.strftime('%H:%M:%S', time.localtime(oldest))} are not listed or counted"
            )
            notify(f"krex: warning: {report['regions_incomplete']}")
        return [
            r
            for r in jr.records
            if r.get("owner_slot") == slot
            and "event" not in r
            and t_start <= float(r["ts"]) <= (t_end if t_end is not None else 1e300)
        ]
    except NotFound:
        return []
    except KrexError as e:  # never fatal: the command ran; the report says what is missing
        report["journal_error"] = str(e)
        notify(f"krex: warning: {e}")
        return []


def journal_cut_region(gpu: int, slot: int, owner_pid: int, why: str, age: float, ts: float) -> None:
    """Journal a region of our command that lost its daemon (`age` seconds after it began,
    at `ts`): nobody else will. The guardian's finisher (krex.proc.finish), after its
    command."""
    from krex import paths
    from krex.node import journal

    rec = {
        "ts": ts,
        "gpu": gpu,
        "owner_slot": slot,
        "owner_pid": owner_pid,
        "end": "daemon-lost",
        "contaminated": True,
        "reasons": [f"{why} during the region after {age:.3f} s: from then on it was not exclusive"],
        "flags": ["daemon-lost"],
        "region_s": round(age, 6),
        "recorded_by": "guardian",
    }
    with contextlib.suppress(OSError, KrexError):
        journal.append(paths.journal_path(), rec)


# ------------------------------------------------------------------- `krex run` as a function


def chunk_setting_note(value: str) -> str | None:
    """The warning for a KREX_COPY_CHUNK_BYTES the shim will not take as given (its rule,
    krex_chunk_bytes: not a byte count gets the default, below the minimum gets the minimum;
    each process flags `chunk-setting`), else None."""
    if not value:
        return None
    from krex.native import ffi, lib

    out = ffi.new("uint64_t *")
    how = lib.krex_chunk_bytes(value.encode(errors="surrogateescape"), out)
    if how == lib.KREX_CHUNK_BAD:
        return (f"krex: warning: KREX_COPY_CHUNK_BYTES={value!r} is not a byte count (0 turns splitting "
                f"off): the default {lib.KREX_COPY_CHUNK_BYTES} is used")
    if how == lib.KREX_CHUNK_CLAMPED:
        return (f"krex: warning: KREX_COPY_CHUNK_BYTES={value} is below the smallest chunk, "
                f"KREX_COPY_CHUNK_MIN_BYTES ({lib.KREX_COPY_CHUNK_MIN_BYTES}): that is used")
    return None


def dropped_on_broken_pipe(notify: Callable[[str], None]) -> Callable[[str], None]:
    """`notify`, dropping its notes once their reader is gone (`krex run ... 2>&1 | head -1`:
    EPIPE): the command's status and report matter more than notes nobody reads."""
    gone = False

    def say(text: str) -> None:
        nonlocal gone
        if gone:
            return
        try:
            notify(text)
        except BrokenPipeError:
            gone = True

    return say


def _error_json(e: Exception) -> dict[str, str]:
    return {"kind": type(e).__name__, "message": str(e), "fix": str(getattr(e, "fix", ""))}


def _check_report_path(report: str) -> None:
    """Before the command runs: a report that cannot be written would lose it."""
    path = os.path.abspath(report)
    parent = os.path.dirname(path)
    if os.path.isdir(path):
        raise UsageError(f"--report {report} is a directory", "give a file path, e.g. --report out/run.json")
    if not os.path.isdir(parent):
        raise UsageError(
            f"--report {report}: the directory {parent} does not exist", f"create it first: mkdir -p {parent}"
        )
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"--report {report} is not writable", "give a path in a directory you may write")


def _write_report(report: str, data: dict[str, Any]) -> None:
    import json

    try:
        with open(report, "w") as f:
            json.dump(data, f, indent=2)
    except OSError as e:
        raise KrexError(
            f"cannot write the report {report}: {e.strerror} (the command exited {data.get('exit_status')})",
            "give --report a writable path",
        ) from e


def run_command(
    cmd: list[str],
    device: str = "auto",
    gpu: int | None = None,
    report: str | None = None,
    no_daemon: bool = False,
    freeze: str | None = None,
    keep_leftovers: bool = False,
    notify: Callable[[str], None] = lambda _m: None,
    report_extra: dict[str, Any] | None = None,
    tenant: str | None = None,
    quiet: bool = False,
    entry: bool = False,
) -> int:
    """`krex run` (the console script's lean door, the click command and the library's entry
    alike): what only Python does, then the native guardian runs ``cmd`` (`exec_guardian`:
    this process becomes it and never returns). Returns only for `--no-daemon` (the
    command's exit status). A KrexError gets `krex run`'s exit status (125, or 126/127:
    errors.run_exit_code), is written to the report as ``krex_error`` and raised. ``entry``:
    the guardian says what the library's entry says (krex.runner's processes)."""
    from krex.errors import run_exit_code

    try:
        argv = _prepare(
            cmd, device, gpu, report, no_daemon, freeze, keep_leftovers, notify, tenant, quiet, entry
        )
        if isinstance(argv, int):
            return argv
    except KrexError as e:
        e.exit_code = run_exit_code(e)
        if report:
            with contextlib.suppress(OSError, KrexError):
                _write_report(
                    report, {"exit_status": e.exit_code, "krex_error": _error_json(e), **(report_extra or {})}
                )
        raise
    return exec_guardian(argv, report_extra)


def _prepare(
    cmd: list[str],
    device: str,
    gpu: int | None,
    report: str | None,
    no_daemon: bool,
    freeze: str | None,
    keep_leftovers: bool,
    notify: Callable[[str], None],
    tenant: str | None,
    quiet: bool,
    entry: bool,
) -> list[str] | int:
    """The native guardian's argv for this run, once krexd answers (started here if none
    does); or, for `--no-daemon`, the command's exit status."""
    from krex.proc import runopts

    notify = dropped_on_broken_pipe(notify)
    if report:
        _check_report_path(report)
    exe = resolve_command(cmd)  # fail on a bad command before touching anything
    note = chunk_setting_note(os.environ.get("KREX_COPY_CHUNK_BYTES", ""))
    if note:
        notify(note)
    if no_daemon:
        kind, count = discover_kind(device)
        if gpu is not None and not 0 <= gpu < count:
            raise NotFound(
                f"unknown GPU {gpu}: this node has {count} GPU(s) (0..{count - 1})",
                "pick a GPU index from `krex status`",
            )
        return run_direct(cmd, kind, gpu, count)
    if tenant is not None:
        from krex.node.regionqueue import check_tenant

        check_tenant(tenant)
    native = _native_guardian()
    warn = _static_cudart_warning(exe)
    if warn:
        notify("warning: " + warn)
    # GPU discovery happens only when no daemon answers (connect_daemon), which starts one.
    client, _found = connect_daemon(device, gpu)
    client.close()
    values = {"device": device, "gpu": gpu, "report": report, "freeze": freeze, "tenant": tenant,
              "keep_leftovers": keep_leftovers}
    if entry:
        opts = runopts.to_argv(runopts.GUARDIAN, values)
        return [native, "--entry", sys.executable, *opts, "--", *cmd]
    return [native, *(["-q"] if quiet else []), "run", *runopts.to_argv(runopts.GUARDIAN, values), "--", *cmd]


def _native_guardian() -> str:
    from krex.proc.runopts import native_guardian

    p = native_guardian()
    if p is None:
        raise KrexError(
            "this installation has no native guardian (krex/_lib/krex was not built)",
            "reinstall KREX with a C compiler present, or run `make native` in a checkout",
        )
    return str(p)


def exec_guardian(argv: list[str], report_extra: dict[str, Any] | None = None) -> NoReturn:
    """Become the native guardian (interpose/guardian.c) for a run this process prepared:
    KREX_GUARDIAN_PREPARED tells it this Python, its krex/_lib (where it lies) and the report's extra
    members, so it hands nothing back (it takes the variable out of the command's
    environment)."""
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    env = dict(os.environ)
    env["KREX_GUARDIAN_PREPARED"] = "\n".join(
        [os.path.abspath(sys.executable), os.path.dirname(argv[0]), json.dumps(report_extra or {})]
    )
    try:
        os.execve(argv[0], argv, env)
    except OSError as e:
        raise KrexError(f"cannot run the native guardian {argv[0]}: {e.strerror}", "reinstall krex") from None


# ------------------------------------------------------------- `python -m krex.proc.launcher`


def _parse_entry(argv: list[str], opts: dict[str, Any]) -> None:
    """Fill ``opts`` with the options the library's runner (krex.runner) passes (the CLI's
    `krex run` is the user-facing spelling of the same; both from krex.proc.runopts); as far
    as it got on an error."""
    from krex.proc import runopts

    usage = f"usage: {runopts.ENTRY_USAGE}"
    opts.update(runopts.defaults(runopts.ENTRY))
    try:
        i = runopts.scan(argv, 0, runopts.ENTRY, opts, click_like=False)
    except ValueError as e:
        raise UsageError(f"unknown or incomplete option {e.args[0]!r}", usage) from None
    opts["cmd"] = argv[i:]
    try:
        for o in runopts.ENTRY:
            if o.type in (int, float) and opts[o.dest] is not None:
                opts[o.dest] = o.type(opts[o.dest])
    except ValueError as e:
        raise UsageError(f"bad option value: {e}", usage) from None
    if runopts.bad_choice(runopts.ENTRY, opts):
        raise UsageError(f"bad --device {opts['device']!r} or --freeze {opts['freeze']!r}", usage)


def _ensure_daemon(device: str, slots: int | None, idle_exit_s: float | None) -> bool:
    """Start the node's daemon with these settings if none answers (the library's one way,
    client.start_background); True if this call started it."""
    from krex.proc.client import daemon_alive, start_background

    if daemon_alive():
        return False
    settings: dict[str, object] = {"slots_per_gpu": slots} if slots else {}
    if idle_exit_s is not None:
        settings["idle_exit_s"] = idle_exit_s
    return start_background(device, settings).ours


def main(argv: list[str] | None = None) -> None:
    """The guardian as a process of its own, spawned by krex.runner (batch, bench, fleet):
    `krex run`'s behaviour, report and exit statuses without the CLI. Notices and errors
    go to stderr as `krex run` prints them; a bad option is a KREX failure (125)."""
    import logging
    import sys

    from krex.errors import run_exit_code
    from krex.proc import runopts

    def say(text: str) -> None:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()

    h = logging.StreamHandler(sys.stderr)  # as the CLI shows the library's warnings
    h.setFormatter(logging.Formatter("krex: %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("krex").addHandler(h)
    logging.getLogger("krex").setLevel(logging.WARNING)
    o: dict[str, Any] = {}
    ran = False  # run_command writes its own errors into the report
    try:
        _parse_entry(list(sys.argv[1:] if argv is None else argv), o)
        extra: dict[str, Any] = {}
        if o["slots"] is not None or o["idle_exit"] is not None:
            extra["daemon_started"] = _ensure_daemon(o["device"], o["slots"], o["idle_exit"])
        ran = True
        status = run_command(
            o["cmd"],
            notify=say,
            report_extra=extra,
            entry=True,
            **{opt.dest: o[opt.dest] for opt in runopts.ENTRY if opt.run},
        )
    except KrexError as e:
        code = run_exit_code(e)
        if o.get("report") and not ran:
            with contextlib.suppress(OSError, KrexError):
                _write_report(o["report"], {"exit_status": code, "krex_error": _error_json(e)})
        say(f"krex: error: {e}")
        if e.fix:
            say(f"  fix: {e.fix}")
        raise SystemExit(code) from None
    except KeyboardInterrupt:  # as click's Abort in the CLI
        say("krex: aborted")
        raise SystemExit(130) from None
    raise SystemExit(status)


if __name__ == "__main__":
    main()
