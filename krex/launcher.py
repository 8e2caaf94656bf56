"""`krex run`: put one command under KREX and be its guardian.

The guardian (this process) stays outside the command's slot: it forwards
signals to the command's process group, returns its exit status, and frees the
slot however the command ends (SIGKILL included)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from krex.envvars import opt_in_env
from krex.errors import CommandNotFound, KrexError, NotExecutable, UsageError
from krex.shm import Segment

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def resolve_command(cmd: Sequence[str]) -> str:
    if not cmd or not cmd[0]:
        raise UsageError("no command given", "put the command after --, e.g. krex run -- python bench.py")
    exe = cmd[0]
    if "/" in exe:
        p = Path(exe)
        if not p.exists():
            raise CommandNotFound(f"command not found: {exe}", "check the path")
        if p.is_dir() or not os.access(p, os.X_OK):
            raise NotExecutable(
                f"{exe} is not executable", f"chmod +x {exe}, or run it through its interpreter"
            )
        return str(p)
    found = shutil.which(exe)
    if not found:
        raise CommandNotFound(f"command not found: {exe}", "check the spelling, or that it is on PATH")
    return found


@dataclass
class Launch:
    cmd: list[str]
    env: dict[str, str]
    slot: int
    gpu: int
    preexec: list[Callable[[], None]] = field(default_factory=list)


def spawn_and_wait(launch: Launch, on_start: Callable[[int], None] | None = None) -> int:
    """Run the command in its own process group; forward signals; return a
    shell-style exit status (128+N for a signal)."""
    child: subprocess.Popen[bytes] | None = None

    def forward(signum: int, _frame: object) -> None:
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signum)

    def preexec() -> None:
        os.setpgid(0, 0)  # own process group (Popen's process_group= needs Python 3.11)
        for fn in launch.preexec:
            fn()

    old = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        try:
            child = subprocess.Popen(launch.cmd, env=launch.env, preexec_fn=preexec)
        except FileNotFoundError:
            raise CommandNotFound(f"command not found: {launch.cmd[0]}", "check the path") from None
        except OSError as e:  # ENOEXEC, EACCES: a file that cannot be executed
            raise NotExecutable(
                f"cannot execute {launch.cmd[0]}: {e.strerror}",
                "run it through its interpreter, or chmod +x it",
            ) from None
        if on_start:
            on_start(child.pid)
        rc = child.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return rc if rc >= 0 else 128 - rc


def run_direct(
    cmd: Sequence[str],
    device: str,
    gpu: int | None,
    n_gpus: int,
    shm_name: str | None = None,
    extra_env: dict[str, str] | None = None,
) -> int:
    """First-version run without a daemon: claim a slot in the segment directly."""
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
    from krex.elfcheck import inspect

    if inspect(exe).static_cudart:
        return (
            f"{exe} links the CUDA runtime statically: KREX cannot gate its launches (freezing still "
            "protects its siblings). Rebuild it with `nvcc -cudart shared`."
        )
    return None


def run_guarded(
    cmd: Sequence[str],
    device: str,
    gpu: int | None,
    notify: Callable[[str], None] = lambda _m: None,
    freeze: str | None = None,
) -> RunResult:
    """`krex run`: admission through the daemon (started on demand), a slot
    cgroup joined before exec, signal forwarding, and a guardian that thaws its
    own command if the daemon disappears (invariant I5)."""
    import threading

    from krex import freezer, journal, paths
    from krex.client import Client
    from krex.shm import Segment

    exe = resolve_command(cmd)
    warns = [w for w in [_static_cudart_warning(exe)] if w]
    for w in warns:
        notify("warning: " + w)
    client = Client.connect(autostart=True, device=device)
    waited: list[bool] = []

    def on_event(ev: dict[str, object]) -> None:
        if not waited:
            notify(f"krex: waiting for a free slot ({ev.get('slots_busy')} commands are running)...")
            waited.append(True)

    adm = client.request({"op": "admit", "gpu": gpu, "freeze": freeze}, on_event=on_event)
    slot, g = int(adm["slot"]), int(adm["gpu"])
    sim = adm.get("physical") is not None and device == "sim"
    env = dict(os.environ)
    env.update(opt_in_env("sim" if sim or device == "sim" else "gpu", str(adm["shm"])))
    env.update(
        {
            "KREX_SLOT": str(slot),
            "KREX_GPU": str(g),
            "CUDA_VISIBLE_DEVICES": str(adm["physical"]),
            "KREX_SOCKET": str(paths.socket_path()),
        }
    )
    if adm.get("vendor") == "amd":  # HIP reads HIP_VISIBLE_DEVICES before CUDA_VISIBLE_DEVICES
        env["HIP_VISIBLE_DEVICES"] = str(adm["physical"])
    group_path, backend = str(adm["group"]), str(adm["freezer"])
    preexec = [freezer.preexec_join(group_path), _set_affinity(list(adm.get("shared_cpus") or []))]

    # A second connection the daemon never writes to: EOF on it means the daemon died.
    stop = threading.Event()
    child_pid: list[int] = []

    def watch() -> None:
        w: Client | None = None
        try:
            w = Client.connect()
            w.sock.recv(1)
        except (OSError, KrexError):
            pass
        finally:
            if w:
                w.close()
        if stop.is_set():
            return
        with_contextlib_thaw(backend, group_path, child_pid)
        notify("krex: the daemon went away; your command was thawed and keeps running")

    def _started(pid: int) -> None:
        child_pid.append(pid)
        client.request({"op": "started", "pid": pid})

    threading.Thread(target=watch, daemon=True).start()
    t_start = time.time()
    try:
        status = spawn_and_wait(
            Launch([exe, *cmd[1:]], env, slot, g, preexec),
            on_start=lambda pid: _started(pid),
        )
    finally:
        stop.set()
        report: dict[str, object] = {"slot": slot, "gpu": g, "admission_wait_s": adm.get("admission_wait_s")}
        try:
            with Segment.attach(str(adm["shm"])) as seg:
                procs = [p for p in seg.snapshot().procs if p.slot == slot]
                report["gate_blocks"] = sum(p.blocked for p in procs)
                report["gate_blocked_ms"] = round(sum(p.blocked_ms for p in procs), 3)
                report["fail_opens"] = sum(p.fail_opens for p in procs)
                report["submits"] = (
                    {k: sum(p.submits[k] for p in procs) for k in procs[0].submits} if procs else {}
                )
        except KrexError:
            pass
        with contextlib.suppress(KrexError, OSError):
            client.request({"op": "release"})
        client.close()
        try:
            regs = [
                r
                for r in journal.read(paths.journal_path())
                if r.get("owner_slot") == slot and float(str(r.get("ts", 0))) >= t_start
            ]
        except KrexError:
            regs = []
        report["regions"] = regs
        report["contaminated_regions"] = sum(1 for r in regs if r.get("contaminated"))
        report["region_wait_s"] = round(sum(float(str(r.get("queue_wait_s", 0))) for r in regs), 6)
    report["exit_status"] = status
    return RunResult(status, slot, g, float(str(adm.get("admission_wait_s", 0))), warns, report)


def with_contextlib_thaw(backend: str, group_path: str, pids: list[int]) -> None:
    """Thaw our own command without the daemon (I5): write the cgroup's freeze
    file or SIGCONT the tree."""
    import contextlib
    import signal as _signal

    with contextlib.suppress(KrexError, OSError):
        if backend == "cgroup2":
            Path(group_path, "cgroup.freeze").write_text("0")
        elif backend == "cgroup1":
            Path(group_path, "freezer.state").write_text("THAWED")
    for pid in pids:
        with contextlib.suppress(OSError):
            os.killpg(pid, _signal.SIGCONT)
