"""Start the command and wait for it: its process group (or ours on a terminal), and the
caller's signals forwarded to it until it ends (`krex run --no-daemon`,
krex.proc.launcher.run_direct; every other `krex run` is the native guardian's)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
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
    # Signals that came after the handlers were set but before the command's pid was known
    # (between fork and Popen's return): delivered once it is, never dropped (`timeout`'s
    # SIGTERM and SIGCONT landing there left a self-stopped command stopped for good).
    early: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        pid = child.pid if child is not None else None
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

    import subprocess

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
