"""Start the command and wait for it: its process group (or ours on a terminal), its
cgroup joined at birth (clone3 CLONE_INTO_CGROUP) or before exec, and the guardian's
signals forwarded to it until it ends (krex run's Python guardian, krex.proc.launcher)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from krex.errors import CommandNotFound, KrexError, NotExecutable

if TYPE_CHECKING:
    import subprocess

# SIGCONT too: `timeout` sends SIGTERM then SIGCONT, and a command that stopped itself must
# resume to act on the SIGTERM.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCONT)


@dataclass
class Launch:
    cmd: list[str]
    env: dict[str, str]
    slot: int
    gpu: int
    preexec: list[Callable[[], None]] = field(default_factory=list)
    # A cgroup v2 directory the command is forked straight into (clone3 CLONE_INTO_CGROUP);
    # `preexec` then holds no join. If the kernel refuses, it joins in preexec instead.
    cgroup: str | None = None
    # Admitted pre-warmed: True while the command still waits for its slot (its first GPU call
    # blocked in the shim, where a Python command cannot run its SIGINT handler).
    still_warm: Callable[[], bool] | None = None
    warm_kill_s: float = 1.0  # KREX_WARM_KILL_NS: after a stop signal, SIGKILL it if still warm
    # Under the SIGSTOP freezer: whether krexd holds the command stopped now (a region of
    # another command); a forwarded SIGCONT would thaw it, so it waits for krexd's thaw.
    held_stopped: Callable[[], bool] | None = None


def _on_terminal() -> bool:
    """stdin is a terminal whose foreground process group is ours. The command then stays
    in our group, as the bare command would be in its caller's: the terminal's Ctrl-C and
    Ctrl-Z reach it directly and stop or interrupt the whole job, and its reads are a
    foreground job's (in a group of its own, its first read stopped it for good)."""
    try:
        return os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False


def _wait(pid: int) -> int:
    """The command's shell-style exit status (128+N for a signal).

    A signal's Python handler runs only when the main thread runs bytecode, and a blocking
    waitpid is interrupted only by a signal the kernel gives the main thread: one taken by
    another thread of the guardian (its client, timers) waited, unforwarded, until the
    command ended, and a command that had stopped itself never did. So the main thread
    sleeps in select() on the signal wakeup fd, which the C-level handler writes on any
    thread, and SIGCHLD (a no-op handler here, never ignored: that would reap the command;
    unblocked here, whatever mask the caller gave us) wakes it when the command ends. The
    bytes a caller's own wakeup fd would have got (an event loop's) are passed on to it."""
    import select

    def reap(flags: int) -> int | None:
        try:
            done, st = os.waitpid(pid, flags)
        except ChildProcessError:
            raise KrexError(
                "the command's exit status was lost (another process reaped it)",
                "do not start krex run with SIGCHLD ignored",
            ) from None
        if not done:
            return None
        rc = os.waitstatus_to_exitcode(st)
        return rc if rc >= 0 else 128 - rc

    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    old_chld = signal.signal(signal.SIGCHLD, lambda *_: None)
    old_mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    try:
        while (rc := reap(os.WNOHANG)) is None:
            select.select([r], [], [], 1.0)  # woken by any signal; the timeout is a backstop
            with contextlib.suppress(BlockingIOError):
                got = os.read(r, 512)
                if old_fd >= 0:
                    with contextlib.suppress(OSError):
                        os.write(old_fd, got)
        return rc
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        signal.signal(signal.SIGCHLD, old_chld)
        signal.set_wakeup_fd(old_fd)
        os.close(r)
        os.close(w)


def spawn_and_wait(launch: Launch, on_start: Callable[[int], None] | None = None) -> int:
    """Run the command in its own process group (in ours on a terminal, _on_terminal);
    forward signals; return a shell-style exit status (128+N for a signal)."""
    # An ignored SIGCHLD (inherited over exec) makes the kernel reap the command: its
    # status would be lost. The command gets the default as with any Popen.
    old_chld = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        return _spawn_and_wait(launch, on_start, _on_terminal())
    finally:
        signal.signal(signal.SIGCHLD, old_chld)


def _spawn_and_wait(launch: Launch, on_start: Callable[[int], None] | None, shared: bool) -> int:
    child: subprocess.Popen[bytes] | None = None
    born: list[int] = []  # a pid from _clone_into_cgroup
    doomed: list[threading.Timer] = []
    # Signals that came after the handlers were set but before the command's pid was known
    # (between fork and Popen's return): delivered once it is, never dropped (`timeout`'s
    # SIGTERM and SIGCONT landing there left a self-stopped command stopped for good).
    early: list[int] = []

    def kill_if_warm(pid: int) -> None:
        # Nothing of it reached the GPU yet: stopping it for good loses nothing.
        if launch.still_warm is not None and launch.still_warm():
            with contextlib.suppress(ProcessLookupError):
                (os.kill if shared else os.killpg)(pid, signal.SIGKILL)

    def forward(signum: int, _frame: object) -> None:
        pid = child.pid if child is not None else (born[0] if born else None)
        if signum == signal.SIGCONT and launch.held_stopped is not None and launch.held_stopped():
            return
        stops = signum != signal.SIGCONT
        if stops and pid is not None and not doomed and launch.still_warm is not None and launch.still_warm():
            doomed.append(threading.Timer(launch.warm_kill_s, kill_if_warm, (pid,)))
            doomed[0].daemon = True
            doomed[0].start()
        if shared and signum in (signal.SIGINT, signal.SIGQUIT):
            return  # sharing our group, the command got the terminal's Ctrl-C and Ctrl-\ too
        if pid is None:
            early.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            (os.kill if shared else os.killpg)(pid, signum)

    def started(pid: int) -> None:
        # The forwarded signals were blocked from before the fork until the pid is known.
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if on_start:
            on_start(pid)
        while early:
            forward(early.pop(0), None)

    def child_signals() -> None:
        # In the command, last before exec: the guardian's handlers go and its mask comes
        # back. A signal forwarded before this waits (blocked) and then acts as on the
        # command; caught by the guardian's handler copied into the child, it was lost.
        for s in caught:
            signal.signal(s, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    # A signal the caller ignores (nohup's SIGHUP, a background job's SIGINT) stays ignored,
    # by the guardian and by the command, as the bare command would have it.
    caught = [s for s in FORWARDED if signal.getsignal(s) != signal.SIG_IGN]

    if launch.cgroup is not None:
        old = {s: signal.signal(s, forward) for s in caught}
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        try:
            pid = _clone_into_cgroup(replace(launch, preexec=[*launch.preexec, child_signals]), born, shared)
            if pid is not None:
                started(pid)
                return _wait(pid)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            for s, h in old.items():
                signal.signal(s, h)
        from krex.node.freezer import preexec_join

        launch = replace(launch, cgroup=None, preexec=[preexec_join(launch.cgroup), *launch.preexec])

    import subprocess  # only here: the clone above needs none of it

    def preexec() -> None:
        if not shared:
            os.setpgid(0, 0)  # own process group (Popen's process_group= needs Python 3.11)
        for fn in launch.preexec:
            fn()
        child_signals()

    old = {s: signal.signal(s, forward) for s in caught}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
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
        started(child.pid)
        rc = _wait(child.pid)
        child.returncode = rc  # reaped here: Popen must not wait for it again
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for s, h in old.items():
            signal.signal(s, h)
    return rc


_CLONE_INTO_CGROUP = 0x200000000  # linux/sched.h, Linux 5.7
_SYS_CLONE3 = 435  # the same on x86_64 and aarch64 (asm-generic)
_RESET_SIGNALS = ("SIGPIPE", "SIGXFZ", "SIGXFSZ")  # as subprocess's restore_signals


def _clone_into_cgroup(launch: Launch, born: list[int], shared: bool = False) -> int | None:
    """Fork the command directly into its slot's cgroup v2 and exec it; its pid, or None
    when the kernel cannot (then nothing was started). Moving a started process in
    (a write to cgroup.procs, as a preexec_fn does) waits for an RCU grace period under a
    lock global to the cgroup tree: 16 guardians starting at once queue there for tens of
    milliseconds each. A raw clone3 skips Python's fork bookkeeping: the child runs only
    what is imported already until execve, and only when this process has a single
    thread (with another one, the child could wait for a GIL hand-over that never comes;
    the guardian starts its watcher after the spawn). Exec errors come back through a
    pipe, as in subprocess."""
    import ctypes
    import gc

    if threading.active_count() != 1:
        return None
    try:
        cg = os.open(launch.cgroup or "", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None

    class CloneArgs(ctypes.Structure):
        _fields_ = [
            (n, ctypes.c_uint64)
            for n in (
                "flags",
                "pidfd",
                "child_tid",
                "parent_tid",
                "exit_signal",
                "stack",
                "stack_size",
                "tls",
                "set_tid",
                "set_tid_size",
                "cgroup",
            )
        ]

    args = CloneArgs(flags=_CLONE_INTO_CGROUP, exit_signal=int(signal.SIGCHLD), cgroup=cg)
    libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: the GIL stays held across the call
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    resets = [getattr(signal, n) for n in _RESET_SIGNALS if hasattr(signal, n)]
    exe, argv, env = launch.cmd[0], launch.cmd, launch.env
    maxfd = max(os.sysconf("SC_OPEN_MAX"), 1 << 16)
    r, w = os.pipe()
    gc_was = gc.isenabled()
    gc.disable()  # no finalizer may run in the child
    try:
        pid = int(syscall(_SYS_CLONE3, ctypes.byref(args), ctypes.sizeof(args)))
        if pid == 0:  # the child: no exception may leave this block
            try:
                if not shared:
                    os.setpgid(0, 0)
                for sig in resets:
                    signal.signal(sig, signal.SIG_DFL)
                for fn in launch.preexec:
                    fn()
                os.closerange(3, w)
                os.closerange(w + 1, maxfd)
                os.execve(exe, argv, env)
            except BaseException as e:  # noqa: BLE001 - reported through the pipe
                with contextlib.suppress(BaseException):
                    os.write(w, str(getattr(e, "errno", 0) or 0).encode())
            finally:
                os._exit(127)
        if gc_was:
            gc.enable()
        if pid < 0:
            return None  # ENOSYS, EINVAL, EACCES (a member's guardian), EBUSY: the caller joins
        born.append(pid)
        os.close(w)
        w = -1
        msg = b""
        while chunk := os.read(r, 64):
            msg += chunk
        if msg:  # exec failed
            os.waitpid(pid, 0)
            err = int(msg or b"0")
            if err == 2:  # ENOENT
                raise CommandNotFound(f"command not found: {exe}", "check the path")
            raise NotExecutable(
                f"cannot execute {exe}: {os.strerror(err) if err else 'failed before exec'}",
                "run it through its interpreter, or chmod +x it",
            )
        return pid
    finally:
        if gc_was:
            gc.enable()
        os.close(cg)
        os.close(r)
        if w >= 0:
            os.close(w)
