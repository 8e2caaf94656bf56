"""`krex run --no-daemon`'s signal forwarding around the command's start (krex.proc.spawn)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

# Runs spawn_and_wait on a command that stops itself, with a preexec that holds the fork
# inside Popen (the parent does not know the pid yet) while a thread sends the guardian
# SIGTERM then SIGCONT, as `timeout` does. Prints the command's exit status.
DRIVER = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    from krex.proc.spawn import Launch, spawn_and_wait

    def timeout_like():
        time.sleep(0.3)  # the child is forked and sleeping in its preexec
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGCONT)

    threading.Thread(target=timeout_like, daemon=True).start()
    launch = Launch(["sh", "-c", "kill -STOP $$; exit 0"], dict(os.environ), 0, 0,
                    preexec=[lambda: time.sleep(0.8)])
    print(spawn_and_wait(launch, on_start=lambda pid: print("pid", pid, flush=True)), flush=True)
    """
)


def test_signals_between_fork_and_the_known_pid_reach_the_command() -> None:
    """A SIGTERM and SIGCONT that reach the guardian after it forked the command but before
    Popen returned its pid are delivered once the pid is known: the self-stopped command
    resumes and dies of the SIGTERM (143). Dropped, it stays stopped for good."""
    _run(DRIVER)


# The same command, with no preexec delay; the guardian's SIGTERM and SIGCONT are taken by
# another thread of it (thread-directed here, as the kernel may pick any thread that does
# not block them), while the main thread waits for the command.
OTHER_THREAD = textwrap.dedent(
    """
    import signal, threading, time
    from krex.proc.spawn import Launch, spawn_and_wait

    other = threading.Thread(target=time.sleep, args=(60,), daemon=True)
    other.start()

    def timeout_like():
        time.sleep(0.5)  # the command stopped itself
        signal.pthread_kill(other.ident, signal.SIGTERM)
        signal.pthread_kill(other.ident, signal.SIGCONT)

    threading.Thread(target=timeout_like, daemon=True).start()
    launch = Launch(["sh", "-c", "kill -STOP $$; exit 0"], {"PATH": "/usr/bin:/bin"}, 0, 0)
    print(spawn_and_wait(launch, on_start=lambda pid: print("pid", pid, flush=True)), flush=True)
    """
)


def test_a_signal_another_thread_takes_is_forwarded_while_the_command_runs() -> None:
    """A signal the kernel gives a thread other than the main one runs its handler only
    when the main thread runs Python: the guardian's wait for its command must wake for it
    (it slept in waitpid, and a self-stopped command under `timeout` stayed stopped)."""
    _run(OTHER_THREAD)


def _run(driver: str) -> None:
    try:
        r = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        for line in out.splitlines():  # leave no stopped command behind
            if line.startswith("pid "):
                os.killpg(int(line.split()[1]), signal.SIGKILL)
        raise AssertionError("the command never resumed: the guardian's signals were lost") from None
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == "143", (r.stdout, r.stderr)


def test_a_caller_that_blocks_sigchld_still_gets_the_end_at_once() -> None:
    """The wait is woken by SIGCHLD: a caller's blocked SIGCHLD (inherited) must not leave
    the guardian to its 1 s backstop."""
    driver = textwrap.dedent(
        """
        import signal, time
        from krex.proc.spawn import Launch, spawn_and_wait
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        t = time.monotonic()
        rc = spawn_and_wait(Launch(["sleep", "0.05"], {"PATH": "/usr/bin:/bin"}, 0, 0))
        print(rc, round(time.monotonic() - t, 3))
        """
    )
    r = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=30)
    rc, took = r.stdout.split()
    assert rc == "0" and float(took) < 0.5, (r.stdout, r.stderr)


def test_a_signal_the_caller_ignores_stays_ignored_for_the_command() -> None:
    """nohup's SIGHUP: ignored by the caller, so ignored by the command (as bare) and not
    forwarded as a kill."""
    driver = textwrap.dedent(
        """
        import os, signal, threading, time
        from krex.proc.spawn import Launch, spawn_and_wait
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        def hup():
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGHUP)
        threading.Thread(target=hup, daemon=True).start()
        cmd = ["sh", "-c", "grep SigIgn /proc/self/status; sleep 0.6; echo survived"]
        print(spawn_and_wait(Launch(cmd, {"PATH": "/usr/bin:/bin"}, 0, 0)))
        """
    )
    r = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=30)
    lines = r.stdout.split("\n")
    ign = int(lines[0].split()[1], 16)
    assert ign & (1 << (signal.SIGHUP - 1)), r.stdout
    assert "survived" in r.stdout and lines[-2] == "0", (r.stdout, r.stderr)
