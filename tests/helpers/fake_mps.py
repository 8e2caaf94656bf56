"""A stand-in for NVIDIA's MPS control program (nvidia-cuda-mps-control), for tests on the
simulated GPU: krexd and `krex bench` run it when KREX_MPS_CONTROL names it.

It keeps to what KREX relies on: `-d` daemonises and writes the daemon's pid to
nvidia-cuda-mps-control.pid in CUDA_MPS_PIPE_DIRECTORY (as nvidia-cuda-mps-control does) and
creates the `control` pipe's name there; without `-d` it reads a command on stdin, and `quit`
ends the daemon. It records in $FAKE_MPS_RECORD each daemon's start (start-PID.json: its pid
and MPS variables) and each command and exit (events.log); FAKE_MPS_FAIL makes `-d` fail,
FAKE_MPS_IGNORE_TERM makes the daemon ignore `quit` and SIGTERM, FAKE_MPS_SERVER gives the
daemon a child standing in for its MPS server (recorded as server-PID); the command
`shutdown_server PID -f` ends that server and the daemon starts a new one (recorded the same
way), as the real control daemon does for its next client."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_KREX = Path(sys.executable).with_name("krex")
KREX = [str(_KREX)] if _KREX.exists() else [sys.executable, "-m", "krex.cli.main"]

FAKE_CONTROL = '''\
import json, os, signal, sys, time
pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
rec = os.environ["FAKE_MPS_RECORD"]


def note(line):
    with open(os.path.join(rec, "events.log"), "a") as f:
        f.write(line + "\\n")


if sys.argv[1:] == ["-d"]:
    if os.environ.get("FAKE_MPS_FAIL"):
        sys.stderr.write("fake MPS: cannot open the GPU\\n")
        sys.exit(1)
    if os.fork():
        sys.exit(0)  # `-d` returns at once; the daemon lives on
    os.setsid()
    if os.fork():
        os._exit(0)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    pid = os.getpid()
    keep = ("CUDA_VISIBLE_DEVICES", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")
    with open(os.path.join(rec, f"start-{pid}.json"), "w") as f:
        json.dump({"pid": pid, "t": time.time(), **{k: os.environ.get(k) for k in keep}}, f)
    open(os.path.join(pipe, "control"), "w").close()
    with open(os.path.join(pipe, "pid.tmp"), "w") as f:
        f.write(str(pid))
    os.rename(os.path.join(pipe, "pid.tmp"), os.path.join(pipe, "nvidia-cuda-mps-control.pid"))

    # FAKE_MPS_SERVER: an "MPS server" below the daemon (the real one starts one per user for
    # its clients), recorded as server-PID; it ends with the daemon.
    def serve():
        child = os.fork()
        if child == 0:
            open(os.path.join(rec, f"server-{os.getpid()}"), "w").close()
            signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
            signal.signal(signal.SIGUSR1, signal.SIG_DFL)
            while True:
                signal.pause()
        return child

    server = serve() if os.environ.get("FAKE_MPS_SERVER") else 0

    # `shutdown_server PID -f` ended the server and sent SIGUSR1: a new one, as the real
    # control daemon starts one for its next client.
    def respawn(*_):
        global server
        if server:
            try:
                os.waitpid(server, 0)
            except OSError:
                pass
            server = serve()

    signal.signal(signal.SIGUSR1, respawn)

    def bye(*_):
        if server:
            try:
                os.kill(server, signal.SIGTERM)
            except OSError:
                pass
        for name in ("nvidia-cuda-mps-control.pid", "control"):
            try:
                os.unlink(os.path.join(pipe, name))
            except OSError:
                pass
        note(f"exit {pid}")
        os._exit(0)

    # FAKE_MPS_IGNORE_TERM: a control daemon slow to quit (only SIGKILL ends it).
    signal.signal(signal.SIGTERM, signal.SIG_IGN if os.environ.get("FAKE_MPS_IGNORE_TERM") else bye)
    while True:
        signal.pause()
else:
    cmd = sys.stdin.read().strip()
    note(f"command {cmd} {pipe}")
    with open(os.path.join(pipe, "nvidia-cuda-mps-control.pid")) as f:
        daemon = int(f.read())
    if cmd == "quit":
        os.kill(daemon, signal.SIGTERM)
    elif cmd.startswith("shutdown_server "):
        os.kill(int(cmd.split()[1]), signal.SIGTERM)
        os.kill(daemon, signal.SIGUSR1)
'''


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def krex(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`krex ARGS` (the installed command, else `python -m krex.cli.main`) with `env`."""
    return subprocess.run([*KREX, *args], env=env, capture_output=True, text=True, timeout=timeout)


def fake_control(tmp: Path) -> tuple[Path, Path]:
    """The stand-in program in `tmp` and its (empty) record directory."""
    prog = tmp / "fake-mps-control"
    prog.write_text(f"#!{sys.executable}\n{FAKE_CONTROL}")
    prog.chmod(0o755)
    rec = tmp / "mps-record"
    rec.mkdir()
    return prog, rec
