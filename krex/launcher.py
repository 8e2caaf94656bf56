"""`krex run`: put one command under KREX and be its guardian.

The guardian (this process) stays outside the command's slot: it forwards
signals to the command's process group, returns its exit status, and frees the
slot however the command ends (SIGKILL included)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from krex.envvars import opt_in_env
from krex.errors import CommandNotFound, NotExecutable, UsageError
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
            raise NotExecutable(f"{exe} is not executable", f"chmod +x {exe}, or run it through its interpreter")
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
            try:
                os.killpg(child.pid, signum)
            except ProcessLookupError:
                pass

    def preexec() -> None:
        for fn in launch.preexec:
            fn()

    old = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        child = subprocess.Popen(launch.cmd, env=launch.env, process_group=0,
                                 preexec_fn=preexec if launch.preexec else None)
        if on_start:
            on_start(child.pid)
        rc = child.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return rc if rc >= 0 else 128 - rc


def run_direct(cmd: Sequence[str], device: str, gpu: int | None, n_gpus: int, shm_name: str | None = None,
               extra_env: dict[str, str] | None = None) -> int:
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
