"""`krex run`: put one command under KREX and be its guardian.

The guardian (this process) stays outside the command's slot: it forwards
signals to the command's process group, returns its exit status, and frees the
slot however the command ends (SIGKILL included)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from krex.errors import CommandNotFound, KrexError, NotExecutable, NotFound, UsageError
from krex.node.optin import (
    auto_region_kept,
    auto_region_report,
    auto_region_warning,
    gate_counters,
    region_tally,
    release_notes,
    run_report,
    trust_notes,
)
from krex.proc.spawn import Launch, spawn_and_wait

__all__ = ["auto_region_report", "auto_region_warning", "trust_notes", "run_command", "run_guarded"]

if TYPE_CHECKING:

    from krex.proc.client import Client

# Imports inside functions keep `krex run`'s start-up short: every module
# loaded here is paid by every command.

# KREX_RUN_TRACE=1: the guardian's steps as CLOCK_MONOTONIC stamps, written to stderr at exit
# by the console script (benchmarks/run_breakdown.py reads them). Off: one lookup, no cost.
TRACE: list[tuple[str, int]] | None = [] if os.environ.get("KREX_RUN_TRACE") else None


def mark(step: str) -> None:
    if TRACE is not None:
        TRACE.append((step, time.monotonic_ns()))


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


@dataclass
class RunResult:
    exit_status: int
    slot: int
    gpu: int
    admission_wait_s: float
    warnings: list[str]
    report: dict[str, object]


def _set_affinity(cpus: list[int]) -> Callable[[], None]:
    def apply() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)

    return apply


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


def _run_kind(device: str, found: str | None, adm: dict[str, Any]) -> str:
    """The kind the command opts into: `--device sim` or a simulated daemon under `auto`
    is "sim"; `--device gpu` is "gpu" (a simulated daemon: only after discovery here finds
    a real GPU, as when the daemon was not asked)."""
    if found is not None:
        return found
    if device == "sim" or (device == "auto" and adm.get("device") == "sim"):
        return "sim"
    if device == "gpu" and adm.get("device") == "sim":
        return discover_kind("gpu")[0]  # raises NotFound without a real GPU
    return "gpu"


def run_guarded(
    cmd: Sequence[str],
    device: str,
    gpu: int | None,
    notify: Callable[[str], None] = lambda _m: None,
    freeze: str | None = None,
    keep_leftovers: bool = False,
    tenant: str | None = None,
) -> RunResult:
    """`krex run`: admission through the daemon (started on demand), a slot
    cgroup joined before exec, signal forwarding, and a guardian that thaws its
    own command if the daemon disappears (invariant I5). `device`: auto, gpu or sim;
    with a daemon running, no GPU discovery happens here (connect_daemon)."""
    from krex.node.optin import start_notes
    from krex.proc.watch import Guardian, Stop

    mark("imported")
    exe = resolve_command(cmd)
    warns = [w for w in [_static_cudart_warning(exe)] if w]
    for w in warns:
        notify("warning: " + w)
    mark("resolved")
    client, found = connect_daemon(device, gpu)
    mark("connected")
    adm, device, env_parts = _admit(client, found, device, gpu, freeze, tenant, notify)
    slot, g = int(adm["slot"]), int(adm["gpu"])
    simulated = adm.get("device") == "sim" or device == "sim"
    placed = adm.get("cgroup") or {}
    notes = adm.get("notes")  # krexd's, the same the native guardian prints
    if not (isinstance(notes, list) and all(isinstance(n, str) for n in notes)):
        notes = start_notes(simulated, warm=bool(adm.get("warm")), cgroup_note=str(placed.get("note") or ""))
    for line in notes:
        notify(line)
    env, auto_value, auto_dir = _command_env(env_parts, slot)
    group_path, backend = str(adm["group"]), str(adm["freezer"])
    child_pid: list[int] = []
    joined, born_in, preexec = _placement(client, adm, group_path, backend)

    stop = Stop()
    guardian = Guardian(
        client.daemon_pid,
        client.sock.fileno(),
        str(adm["shm"]),
        slot,
        g,
        backend,
        group_path,
        child_pid,
        notify,
    )
    watcher = threading.Thread(target=guardian.watch, args=(stop,), daemon=True)

    def _started(pid: int) -> None:
        mark("spawned")
        child_pid.append(pid)
        watcher.start()  # after the spawn: _clone_into_cgroup needs a single thread
        if joined is not None:
            return  # the daemon already has it (and moved it into the slot before exec)
        try:
            client.request({"op": "started", "pid": pid})
        except KrexError as e:  # the command runs anyway; it is just not frozen as a sibling
            notify(f"krex: warning: krexd did not take the command into its slot: {e}")
        mark("started")

    t_start = time.time()
    mark("env")
    try:
        launch = Launch([exe, *cmd[1:]], env, slot, g, preexec, cgroup=born_in)
        status = _spawn(launch, adm, slot, joined, _started)
    finally:
        mark("exited")
        stop.set()
        if watcher.ident is not None:
            watcher.join(timeout=2)
        stop.close()
        mark("watcher")
        rel, counters = _release(client, adm, slot, keep_leftovers)
        mark("released")
        dev = str(adm.get("device") or device)
        report = run_report(slot, g, adm.get("admission_wait_s"), dev, simulated, counters, rel)
        _add_regions(report, rel, slot, t_start, notify, guardian.events, auto_value, auto_dir)
    # The same notes krexd renders for the native guardian (optin.release_notes).
    for line in release_notes(
        rel if isinstance(rel.get("regions"), list) else {**rel, "journal_error": None}, report
    ):
        notify(line)
    report["exit_status"] = status
    return RunResult(status, slot, g, float(str(adm.get("admission_wait_s", 0))), warns, report)


def _add_regions(
    report: dict[str, Any],
    rel: dict[str, Any],
    slot: int,
    t_start: float,
    notify: Callable[[str], None],
    events: list[dict[str, object]],
    auto_value: str,
    auto_dir: Path | None,
) -> None:
    """Into the command's report: its regions (krexd's record, else the journal's), the
    guardian's daemon events and what KREX_AUTO_REGION wrapped."""
    labels = rel.get("region_auto_labels") if isinstance(rel.get("region_auto_labels"), dict) else None
    if "regions" in report:  # krexd's own record of the command
        regs: list[dict[str, Any]] = report["regions"]
    else:  # no reply: the daemon is gone, and its record with it (the guardian may have journaled)
        regs = _journal_regions(slot, t_start, report, notify)
        report["regions"] = regs
        report.update(region_tally(regs))
    if events:
        report["daemon_events"] = events
    if auto_dir is not None:
        auto = auto_region_report(auto_value, auto_dir, regs, labels=labels)
        if auto_region_kept(auto):
            report["auto_region"] = auto


def _admit(
    client: Client,
    found: str | None,
    device: str,
    gpu: int | None,
    freeze: str | None,
    tenant: str | None,
    notify: Callable[[str], None],
) -> tuple[dict[str, Any], str, tuple[dict[str, Any], dict[str, Any]]]:
    """Admission: krexd's reply, the device kind the command runs on, and the command's
    variables (set, prepended) from the reply. Whatever fails, the slot is given back."""
    from krex.node.optin import queue_note

    waited: list[bool] = []

    def on_event(ev: dict[str, object]) -> None:
        if not waited:
            notify(queue_note(ev.get("slots_busy")))
            waited.append(True)

    admitted = False
    try:
        req = {"op": "admit", "gpu": gpu, "freeze": freeze, "device": device, "tenant": tenant}
        adm = client.request(req, on_event=on_event)
        admitted = True
        kind = _run_kind(device, found, adm)
        # krexd's admit reply carries the command's variables (optin.opt_in_parts and the
        # slot's), the same ones the native guardian applies.
        put, pre = adm.get("env_set"), adm.get("env_prepend")
        if not isinstance(put, dict) or not isinstance(pre, dict):
            raise KrexError(
                "krexd's admit reply has no environment for the command (an older krexd?)",
                "restart krexd (`krex daemon stop`; it starts on demand)",
            )
        mark("admitted")
    except BaseException:
        # Admitted: release. Still waiting (Ctrl-C in the queue): krexd reads nothing more
        # from us until it answers the admit, so a release would wait out its timeout;
        # closing the connection drops the queued request.
        if admitted:
            with contextlib.suppress(KrexError, OSError):
                client.request({"op": "release"})
        client.close()
        raise
    return adm, kind, (put, pre)


def _command_env(
    env_parts: tuple[dict[str, Any], dict[str, Any]], slot: int
) -> tuple[dict[str, str], str, Path | None]:
    """The command's environment (ours with krexd's variables), its KREX_AUTO_REGION value
    and the directory where its processes leave their auto-region status (None: none)."""
    from krex.node.optin import apply_env, own_env

    env = dict(os.environ)
    apply_env(env, *own_env(*env_parts))  # our installation's code, whatever krexd answered

    auto_value = env.get("KREX_AUTO_REGION", "").strip()
    # Each process of the command that uses KREX_AUTO_REGION (set here, or by the command
    # itself, e.g. `sh -c 'KREX_AUTO_REGION=... python ...'`) leaves its status here.
    # (A private temporary directory: the state directory may belong to another user.)
    auto_dir: Path | None = None
    with contextlib.suppress(OSError):
        auto_dir = _private_tmpdir(f"krex-auto-{slot}-")
        env["KREX_AUTO_STATUS_DIR"] = str(auto_dir)
    return env, auto_value, auto_dir


def _placement(
    client: Client, adm: dict[str, Any], group_path: str, backend: str
) -> tuple[_DaemonJoin | None, str | None, list[Callable[[], None]]]:
    """How the command gets into its slot: krexd moving it before exec (a _DaemonJoin),
    forked straight into the slot's cgroup (its path), or joining it before exec; and the
    child's steps before exec."""
    # The child waits before exec until krexd has it when the guardian cannot put it in its
    # slot itself: a group member (no write access to the cgroup), a container that does not
    # see the host's cgroup tree (an unprivileged benchmark pod), and SIGSTOP freezing,
    # where krexd must know the pid to stop it (else it would run from exec until
    # `started`, inside a region that began meanwhile).
    joined = _DaemonJoin(client) if backend == "signal" or not _can_join(group_path) else None
    affinity = _set_affinity(list(adm.get("shared_cpus") or []))
    # cgroup v2: the command is forked straight into its slot (Launch.cgroup).
    born_in = group_path if backend == "cgroup2" and joined is None and _can_join(group_path) else None
    if born_in is not None and not os.path.isfile(os.path.join(group_path, "cgroup.procs")):
        born_in = None
    preexec: list[Callable[[], None]] = [affinity]
    if born_in is None:
        from krex.node.freezer import preexec_join

        preexec.insert(0, joined.preexec if joined else preexec_join(group_path))
    return joined, born_in, preexec


def _spawn(
    launch: Launch, adm: dict[str, Any], slot: int, joined: _DaemonJoin | None, started: Callable[[int], None]
) -> int:
    """Start the command and wait for it; its exit status."""
    from krex.node.shm import Segment

    if joined is not None:
        joined.start()
    if str(adm["freezer"]) == "signal":
        group_path = str(adm["group"])
        launch.held_stopped = lambda: _signal_group_frozen(group_path)
    warm_seg = None
    if adm.get("warm"):  # the segment, to tell whether it still waits for its slot
        from krex.native import lib

        with contextlib.suppress(KrexError):
            warm_seg = Segment.attach(str(adm["shm"]))
            launch.still_warm = lambda: bool(warm_seg.raw.slots[slot].warm)
            launch.warm_kill_s = lib.KREX_WARM_KILL_NS / 1e9
    try:
        return spawn_and_wait(launch, on_start=lambda pid: started(pid))
    finally:
        if joined is not None:
            joined.close()
        if warm_seg is not None:
            warm_seg.close()


def _release(
    client: Client, adm: dict[str, Any], slot: int, keep_leftovers: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """After the command: its slot's gate counters, then the slot released (krexd's reply,
    {} when it did not answer: then the group is removed here)."""
    from krex.node.shm import Segment

    counters: dict[str, Any] = {}
    try:
        with Segment.attach(str(adm["shm"])) as seg:
            counters = gate_counters(p for p in seg.snapshot().procs if p.slot == slot)
    except KrexError:
        pass
    mark("counters")
    rel: dict[str, Any] = {}
    with contextlib.suppress(KrexError, OSError):
        rel = client.request({"op": "release", "leftovers": "keep" if keep_leftovers else "kill"})
    client.close()
    if not rel and str(adm["freezer"]) != "signal":
        # No krexd removes the command's group now: left empty in the caller's job or pod
        # cgroup, it would keep the scheduler from removing that. Busy, it stays.
        with contextlib.suppress(OSError):
            os.rmdir(str(adm["group"]))
    return rel, counters


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


def _private_tmpdir(prefix: str) -> Path:
    """tempfile.mkdtemp (mode 0700, a fresh random name) without importing tempfile and
    random on the launch path; the directories tempfile.gettempdir() would try, in order."""
    env = [os.environ.get(k) for k in ("TMPDIR", "TEMP", "TMP")]
    last: OSError = FileNotFoundError("no temporary directory")
    for base in [d for d in env if d] + ["/tmp", "/var/tmp", os.getcwd()]:
        for _ in range(100):
            p = Path(base, prefix + os.urandom(6).hex())
            try:
                os.mkdir(p, 0o700)
                return p
            except FileExistsError:
                continue
            except OSError as e:  # not writable, missing: the next candidate
                last = e
                break
    raise last


def _signal_group_frozen(path: str) -> bool:
    """Whether the SIGSTOP freezer's state file says krexd holds the group stopped (unreadable:
    taken as held, so a forwarded SIGCONT never thaws a sibling inside a region)."""
    import json

    try:
        with open(path) as f:
            return bool(json.load(f).get("frozen", False))
    except FileNotFoundError:
        return False
    except (OSError, ValueError, AttributeError):
        return True


def _can_join(group_path: str) -> bool:
    """Whether this guardian can put its command into the slot's cgroup itself: the group is
    visible here and writable. Else krexd moves it (_DaemonJoin): a member of a shared daemon's
    group, or a container without the host's cgroup tree (an unprivileged benchmark pod), where
    the command would otherwise run outside its slot and never be frozen as a sibling."""
    procs = os.path.join(group_path, "cgroup.procs")
    return os.path.isfile(procs) and os.access(procs, os.W_OK)


class _DaemonJoin:
    """For a guardian that may not write its slot's cgroup (a member of a shared
    daemon's group): the child sends its pid and waits before exec; a thread here
    asks krexd to move it into the slot (`started` with join) and then lets it go.
    So the command still runs inside its slot from its first instruction."""

    def __init__(self, client: object) -> None:
        self.client = client
        self.pid_r, self.pid_w = os.pipe()
        self.go_r, self.go_w = os.pipe()
        self.error: str | None = None
        self.thread: threading.Thread | None = None

    def preexec(self) -> None:  # in the child, between fork and exec
        # Only the guardian may hold the go pipe's write end: if it dies meanwhile, the
        # read below then ends (EOF) instead of waiting forever on our own copy.
        os.close(self.go_w)
        os.close(self.pid_r)
        os.write(self.pid_w, str(os.getpid()).encode())
        if os.read(self.go_r, 1) != b"1":
            raise OSError("krexd could not move the command into its slot")

    def _serve(self) -> None:
        raw = os.read(self.pid_r, 32)
        if not raw:
            return
        ok = b"0"
        try:
            self.client.request({"op": "started", "pid": int(raw), "join": True})  # type: ignore[attr-defined]
            ok = b"1"
        except (KrexError, ValueError) as e:
            self.error = str(e)
        os.write(self.go_w, ok)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def close(self) -> None:
        os.close(self.pid_w)  # a child that never started: the thread reads EOF
        if self.thread is not None:
            self.thread.join(timeout=10)
        for fd in (self.pid_r, self.go_r, self.go_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.error:
            raise KrexError(f"krexd could not move the command into its slot: {self.error}", "see krexd.log")


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
) -> int:
    """`krex run` (the console script's lean door and the click command alike): run ``cmd``
    under KREX, write the report, return the command's exit status. A KrexError gets
    `krex run`'s exit status (125, or 126/127: errors.run_exit_code), is written to the
    report as ``krex_error`` and raised."""
    from krex.errors import run_exit_code

    try:
        status, data = _run_command(
            cmd, device, gpu, report, no_daemon, freeze, keep_leftovers, notify, tenant
        )
        if report and data is not None:
            _write_report(report, {**data, **(report_extra or {})})
        return status
    except KrexError as e:
        e.exit_code = run_exit_code(e)
        if report:
            with contextlib.suppress(OSError, KrexError):
                _write_report(
                    report, {"exit_status": e.exit_code, "krex_error": _error_json(e), **(report_extra or {})}
                )
        raise


def _run_command(
    cmd: list[str],
    device: str,
    gpu: int | None,
    report: str | None,
    no_daemon: bool,
    freeze: str | None,
    keep_leftovers: bool,
    notify: Callable[[str], None],
    tenant: str | None = None,
) -> tuple[int, dict[str, object] | None]:
    notify = dropped_on_broken_pipe(notify)
    if report:
        _check_report_path(report)
    resolve_command(cmd)  # fail on a bad command before touching anything
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
        return run_direct(cmd, kind, gpu, count), None
    # GPU discovery happens only when no daemon answers (connect_daemon).
    if tenant is not None:
        from krex.node.regionqueue import check_tenant

        check_tenant(tenant)
    res = run_guarded(
        cmd, device, gpu, notify=notify, freeze=freeze, keep_leftovers=keep_leftovers, tenant=tenant
    )
    return res.exit_status, res.report


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
