"""NVIDIA MPS (Multi-Process Service) for the time between regions: with `mps = "on"`
krexd runs one MPS control daemon per GPU it manages, so its commands' kernels can run
concurrently outside regions; with `mps_pipe_dir` it attaches to one it did not start.

What krexd starts, it stops; what it did not start it never stops (attach mode). Per GPU N:

- the control daemon runs as ``<control> -d`` (``nvidia-cuda-mps-control`` on PATH, or
  $KREX_MPS_CONTROL) with CUDA_VISIBLE_DEVICES = the GPU's UUID if known (else its
  physical index), CUDA_MPS_PIPE_DIRECTORY = <state dir>/mps/gpuN/pipe and
  CUDA_MPS_LOG_DIRECTORY = <state dir>/mps/gpuN/log (made 0700 by krexd). The GPU's
  compute mode is never changed.
- its pid is read from ``nvidia-cuda-mps-control.pid`` in the pipe directory, where
  the control daemon writes it (a stand-in control program must do the same).
- a command admitted on GPU N gets the same pipe and log directories, and the GPU's UUID
  as CUDA_VISIBLE_DEVICES where known (the MPS server renumbers indices; a UUID names
  the same device in the server and in the client).
- a clean stop sends ``quit`` to the control program with the same pipe directory, waits,
  then SIGTERM and SIGKILL; a start first stops and clears what a previous krexd of the
  same state directory left (the daemon lock says no other krexd uses it).

A control daemon that dies is a fault: every region on its GPU at that moment, and every
region that begins while it is down, is flagged `mps-server`. krexd starts a new one once
no region holds the GPU (attached ones are not restarted: they are not krexd's).

A command killed by a signal is an MPS client killed, maybe inside its kernels: the GPU's
MPS server then fails or refuses its other clients for a while (on an H100 the next client's
first CUDA call failed). krexd records it (ClientFault, from the guardian's `release`):
every region on that GPU then, and every region that begins while the fault is fresh
(until the server is seen restarted, at most `mps_fault_window` seconds), is flagged
`mps-client-fault` with the pid; a command that ran in that time and exits non-zero is told
(its `release` reply). krexd asks the control daemon to restart the server
(``shutdown_server PID -f``; the control daemon starts a new one for the next client) once
no region holds the GPU, and never for an attached control daemon (not krexd's)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from krex import paths
from krex.errors import KrexError, MpsUnavailable
from krex.native import lib
from krex.node import procfs

if TYPE_CHECKING:
    from krex.device.gpus import GpuInfo
    from krex.node.config import Config

log = logging.getLogger("krex.node.daemon")

CONTROL_ENV = "KREX_MPS_CONTROL"  # names the control program (tests: a stand-in)
CONTROL_BIN = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"  # in the pipe directory, written by the control daemon
START_LOG = "krex-start.log"  # what `<control> -d` printed, in the log directory
CONTROL_PIPE = "control"  # the control daemon's named pipe in the pipe directory
FLAG = "mps-server"
CLIENT_FLAG = "mps-client-fault"
FAULT_WINDOW_S = 10.0  # how long a client's fault counts at most when no server restart is seen
START_WAIT_S = 10.0  # for `-d` to return and the pid file to name a live process
QUIT_WAIT_S = 5.0  # for `quit` to end it, before SIGTERM (then SIGKILL after as long again)
WATCH_S = 0.2  # how often the watcher checks the control daemons
RETRY_S = 5.0  # between restarts that failed
# A control daemon that dies within FAST_DEATH_S of its start is restarted after a delay
# that doubles with each such death (up to BACKOFF_MAX_S): no restart storm.
FAST_DEATH_S = 10.0
BACKOFF_MAX_S = 60.0
PID_MAX = 4194304  # the kernel's PID_MAX_LIMIT: a larger number names no process


@dataclass
class ClientFault:
    """A command on an MPS GPU killed by a signal (an MPS client killed, maybe mid-kernel)."""

    gpu: int
    pid: int
    command: str
    signal: int
    ts: float  # time.time() when krexd learned of it (the command's release)
    at_ns: int  # the same, in time.monotonic_ns
    until_ns: int  # fresh until then: the server seen restarted, else at_ns + the window
    servers: frozenset[int]  # the GPU's MPS servers at that time
    restart: str = "pending"  # what krexd did about the server (see Mps._restart_server)

    def signame(self) -> str:
        if not self.signal:  # a process below the command: no one waits for it but its parent
            return "a signal or a crash (it ended without its exit handlers)"
        try:
            return signal.Signals(self.signal).name
        except ValueError:
            return f"signal {self.signal}"

    def when(self) -> str:
        ms = int(self.ts * 1e3) % 1000
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.ts)) + f".{ms:03d}"

    def notice(self) -> str:
        """`krex run`'s line for a command that failed while the fault was fresh."""
        return (f"krex: warning: an MPS client (pid {self.pid}, `{self.command}`) was killed by "
                f"{self.signame()} at {self.when()}; the MPS server refuses clients until it restarts: "
                "rerun the command")

    def as_dict(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "pid": self.pid, "command": self.command, "signal": self.signame(),
                "ts": self.ts, "restart": self.restart}


@dataclass
class GpuMps:
    """One GPU's control daemon as krexd sees it."""

    gpu: int
    visible: str  # CUDA_VISIBLE_DEVICES for the control daemon
    uuid: str | None  # the GPU's UUID (or MIG id), also given to commands; None: unknown
    pipe: Path
    log_dir: Path | None  # None: attached (its log directory is its starter's)
    state: str = "down"  # on, down, restarting, attached
    pid: int | None = None
    start_ticks: int = 0  # the pid's start time: a reused pid is another process
    restarts: int = 0
    next_try: float = 0.0
    # (down since, up again at or None) in time.monotonic_ns, newest last
    down: list[list[int | None]] = field(default_factory=list)
    error: str = ""
    started_at: float = 0.0  # time.monotonic() of the last start
    fast_deaths: int = 0  # deaths in a row within FAST_DEATH_S of their start
    # The MPS servers below the control daemon (pid -> start ticks) as last seen, and those
    # seen gone since, as (pid, time.monotonic_ns when noticed), newest last.
    servers: dict[int, int] = field(default_factory=dict)
    server_deaths: list[tuple[int, int]] = field(default_factory=list)
    # Clients killed by a signal, newest last; the one whose server restart waits (a region
    # holds the GPU, or the watcher has not come to it yet).
    client_faults: list[ClientFault] = field(default_factory=list)
    restart_due: ClientFault | None = None


def gpu_uuids(info: GpuInfo) -> list[str | None]:
    """Each managed GPU's UUID where the selection named it or NVML says it; else None."""
    out: list[str | None] = []
    for g in range(info.count):
        tok = info.visible_token(g)
        out.append(tok if tok.startswith(("GPU-", "MIG-")) else None)
    if info.kind != "nvidia" or all(out):
        return out
    try:
        from krex.device.nvml import FakeNvml, RealNvml, fake_path

        fake = fake_path()
        nv = FakeNvml(fake) if fake else RealNvml()
        try:
            return [u or nv.uuid(info.physical[g]) for g, u in enumerate(out)]
        finally:
            nv.close()
    except Exception as e:  # noqa: BLE001 - no NVML: the physical index still names the GPU
        log.info("MPS: GPU UUIDs unknown (%s): the control daemons get physical indices", e)
        return out


def control_program() -> str:
    raw = os.environ.get(CONTROL_ENV, "").strip()
    found = shutil.which(raw or CONTROL_BIN)
    if found is None:
        what = f"{CONTROL_ENV}={raw!r}" if raw else f"{CONTROL_BIN} is not on PATH: it"
        raise MpsUnavailable(
            f"MPS was asked for, but {what} cannot be found or run",
            f"install the NVIDIA driver's MPS tools ({CONTROL_BIN}) or put them on PATH, set "
            f"{CONTROL_ENV} to the control program, or start krexd without --mps",
        )
    return found


def control_names() -> set[str]:
    """The program names a control daemon's process may carry (_is_control)."""
    names = {CONTROL_BIN}
    if os.environ.get(CONTROL_ENV, "").strip():
        names.add(os.path.basename(os.environ[CONTROL_ENV].strip()))
    return names


def _alive(pid: int | None, ticks: int) -> bool:
    return pid is not None and bool(lib.krex_pid_alive(pid, ticks))


def _read_pid(pipe: Path) -> int | None:
    """The pid in the pipe directory's pid file: a regular file (never a FIFO or a link,
    which would block or lead elsewhere) holding a number that can name a process other
    than init and krexd itself."""
    try:
        fd = os.open(pipe / PID_FILE, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.read(fd, 32).decode("ascii", "replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)
    if not raw.isdigit() or not 1 < int(raw) <= PID_MAX or int(raw) == os.getpid():
        return None
    return int(raw)


def _serves(pid: int, pipe: Path) -> bool:
    """Was process `pid` started for the pipe directory `pipe` (its environment says so)?"""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return False
    return f"CUDA_MPS_PIPE_DIRECTORY={pipe}".encode() in env.split(b"\0")


def _is_control(pid: int, names: set[str]) -> bool:
    """Is `pid` a control daemon: run by root or krexd's user, its program (argv[0], or the
    script an interpreter runs, argv[1]) one of `names`? A pid file is anyone's word; a
    command (whose environment also names the pipe directory) or init is never one."""
    try:
        if os.stat(f"/proc/{pid}").st_uid not in (0, os.geteuid()):
            return False
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    progs = [os.path.basename(a.decode(errors="replace")) for a in argv[:2]]
    return bool(set(progs) & names)


def private_dir(p: Path) -> Path:
    """Make `p` (0700, krexd's own) if needed and check it: never a planted link."""
    try:
        p.mkdir(mode=0o700, exist_ok=True)
    except FileExistsError:
        pass  # a file or a dangling link: check_dir says which
    except OSError as e:
        raise MpsUnavailable(f"cannot create the MPS directory {p}: {e.strerror}",
                             "set KREX_STATE_DIR to a writable directory") from e
    paths.check_dir(p, "MPS directory")
    os.chmod(p, 0o700, follow_symlinks=False)
    return p


def _tail(p: Path) -> str:
    try:
        text = p.read_bytes()[-2000:].decode(errors="replace")
    except OSError:
        return ""
    return " | ".join(text.strip().splitlines()[-3:])


def _clients(pipe: Path, control_pid: int) -> set[int]:
    """The processes whose environment names `pipe` as their MPS pipe directory, other than
    the control daemon and the processes below it (its MPS servers): its clients."""
    entry = f"CUDA_MPS_PIPE_DIRECTORY={pipe}".encode()
    found = set(procfs.environ_scan(entry, [b"CUDA_MPS_PIPE_DIRECTORY"]))
    return found - {control_pid, os.getpid()} - procfs.descendants([control_pid], procfs.proc_table())


class StartFailed(Exception):
    """Why `<control> -d` gave no control daemon (the caller words the error)."""


def start_control(control: str, names: set[str], env: dict[str, str], pipe: Path, log_dir: Path) -> int:
    """Run `<control> -d` with `env` (which names `pipe` and `log_dir`, both made already) and
    wait for the control daemon's pid in `pipe`; its pid. Raises StartFailed with the reason."""
    # Its output goes to a file, not a pipe: the daemonised child may keep the descriptors.
    out_path = log_dir / START_LOG
    try:
        fd = paths.open_private(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            p = subprocess.run([control, "-d"], env=env, stdin=subprocess.DEVNULL,
                               stdout=fd, stderr=fd, timeout=START_WAIT_S, start_new_session=True)
        finally:
            os.close(fd)
    except (OSError, KrexError, subprocess.TimeoutExpired) as e:
        raise StartFailed(str(e)) from None
    if p.returncode != 0:
        said = _tail(out_path) or "no output"
        raise StartFailed(f"`{control} -d` exited {p.returncode}: {said}")
    deadline = time.monotonic() + START_WAIT_S
    while time.monotonic() < deadline:
        pid = _read_pid(pipe)
        if pid is not None and _alive(pid, 0) and _is_control(pid, names):
            return pid
        time.sleep(0.02)
    raise StartFailed(f"no live pid in {pipe / PID_FILE} {START_WAIT_S:g} s after `-d`")


def tell_control(
    control: str, pipe: Path, log_dir: Path | None, text: str
) -> subprocess.CompletedProcess[bytes]:
    """Send one command (`quit`, `shutdown_server PID -f`) to the control daemon at `pipe`,
    as `echo TEXT | <control>` does. Raises OSError or subprocess.TimeoutExpired."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["CUDA_MPS_PIPE_DIRECTORY"] = str(pipe)
    if log_dir is not None:
        env["CUDA_MPS_LOG_DIRECTORY"] = str(log_dir)
    return subprocess.run([control], input=f"{text}\n".encode(), env=env, capture_output=True,
                          timeout=QUIT_WAIT_S)


def quit_control(control: str, pipe: Path, pid: int | None, ticks: int, log_dir: Path | None) -> None:
    """Ask the control daemon at `pipe` to quit; SIGTERM then SIGKILL `pid` if it stays."""
    if control:  # none known (krexd without MPS of its own): the signals alone
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            tell_control(control, pipe, log_dir, "quit")
    for sig in (signal.SIGTERM, signal.SIGKILL):
        deadline = time.monotonic() + QUIT_WAIT_S
        while _alive(pid, ticks) and time.monotonic() < deadline:
            time.sleep(0.02)
        if not _alive(pid, ticks):
            return
        assert pid is not None
        log.warning("MPS: control daemon pid %d did not quit: sending %s", pid, sig.name)
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


def clear_stale(control: str, names: set[str], pipe: Path, who: str) -> int | None:
    """Stop the control daemon `who` left in `pipe` (its log directory beside it) and remove
    the pipe directory; the pid it stopped, if any."""
    if not pipe.is_dir() or pipe.is_symlink():
        return None
    pid = _read_pid(pipe)
    if pid is not None and _alive(pid, 0):
        log.warning("MPS: stopping control daemon pid %d left by %s (%s)", pid, who, pipe)
        # Signalled only if it is that control daemon: the pid may be another process's
        # now, and a command krexd admitted carries the same pipe directory.
        mine = _serves(pid, pipe) and _is_control(pid, names)
        quit_control(control, pipe, pid if mine else None, int(lib.krex_pid_start_ticks(pid)) if mine else 0,
                     pipe.parent / "log")
    else:
        pid = None
    shutil.rmtree(pipe, ignore_errors=True)
    return pid


def _below(root: int) -> set[int]:
    """Every process below `root` (its children, theirs, ...)."""
    out: set[int] = set()
    todo = [root]
    while todo:
        kids = procfs.children(todo.pop())
        if kids is None:  # no /proc/PID/task/*/children: one scan of /proc
            return procfs.descendants([root], procfs.proc_table()) - {root}
        new = set(kids) - out
        out |= new
        todo.extend(new)
    return out


class Mps:
    """krexd's MPS control daemons: none (off), one per GPU of its own, or an attached one."""

    def __init__(self, cfg: Config, info: GpuInfo) -> None:
        self.mode = "attach" if cfg.mps_pipe_dir else ("own" if cfg.mps == "on" else "off")
        self.fault_window_ns = int(cfg.mps_fault_window_s * 1e9)
        self.gpus: dict[int, GpuMps] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._busy: Callable[[int], bool] = lambda _g: False
        self._control = ""
        self._names = control_names()
        self._watcher: threading.Thread | None = None
        # Control daemons a previous krexd started that this one, without MPS of its own,
        # left running because commands still use them (status's `left`).
        self.left: list[dict[str, Any]] = []
        if self.mode == "off":
            return
        if cfg.mps_pipe_dir and cfg.mps == "off" and cfg.sources.get("mps", "default") != "default":
            raise MpsUnavailable("mps is off but mps_pipe_dir names a control daemon to attach to",
                                 "drop one of them (a pipe directory alone means attach)")
        if info.kind == "amd":
            raise MpsUnavailable("MPS is NVIDIA's: this node's GPUs are AMD", "start krexd without --mps")
        if info.kind == "sim" and not os.environ.get(CONTROL_ENV):
            raise MpsUnavailable(
                "the simulated GPU has no MPS",
                f"start krexd without --mps, or on a GPU (tests name a stand-in control program in "
                f"{CONTROL_ENV})",
            )
        if self.mode == "own":
            self._control = control_program()
        uuids = gpu_uuids(info)
        root = paths.state_dir() / "mps"
        for g in range(info.count):
            visible = uuids[g] or str(info.physical[g])
            if self.mode == "attach":
                assert cfg.mps_pipe_dir is not None
                self.gpus[g] = GpuMps(g, visible, uuids[g], Path(cfg.mps_pipe_dir), None, "attached")
            else:
                base = root / f"gpu{g}"
                self.gpus[g] = GpuMps(g, visible, uuids[g], base / "pipe", base / "log")

    # ------------------------------------------------------------------ start and stop
    def start(self, busy: Callable[[int], bool]) -> None:
        """Start (or attach to) every GPU's control daemon, then watch them. ``busy(g)``:
        a region holds GPU g now (no restart then). Raises MpsUnavailable, having stopped
        what it started, when one cannot start."""
        if self.mode != "own":
            self._left_behind()
        if self.mode == "off":
            return
        self._busy = busy
        if self.mode == "attach":
            self._attach()
        else:
            root = private_dir(paths.state_dir() / "mps")
            for d in sorted(root.glob("gpu*")):  # a previous krexd's, any GPU count
                if not d.is_symlink() and d.is_dir():  # a planted link: private_dir refuses it
                    self._clear_stale(d / "pipe")
            try:
                for m in self.gpus.values():
                    self._start_one(m)
            except KrexError:
                self.stop()
                raise
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="mps")
        self._watcher.start()

    def _left_behind(self) -> None:
        """Without MPS of its own (off, attach), stop the control daemons a previous krexd of
        this state directory started and left (it was killed): no region runs yet, and one
        that no command uses (as an MPS client) serves nothing. One that commands still use
        is left running for them, logged and shown in `krex status`."""
        root = paths.state_dir() / "mps"
        if root.is_symlink() or not root.is_dir():
            return
        ours = {m.pipe for m in self.gpus.values()}  # attached there on purpose: never stopped
        control = ""
        with contextlib.suppress(MpsUnavailable):
            control = control_program()
        for pipe in sorted(root.glob("gpu*/pipe")):
            if pipe in ours or pipe.parent.is_symlink() or pipe.is_symlink() or not pipe.is_dir():
                continue
            pid = _read_pid(pipe)
            if pid is None or not _alive(pid, 0):
                continue
            if not (_serves(pid, pipe) and _is_control(pid, self._names)):  # the pid is another's now
                continue
            clients = _clients(pipe, pid)
            if not clients:
                clear_stale(control, self._names, pipe, "a previous krexd (this one has no MPS of its own)")
                continue
            log.warning("MPS: control daemon pid %d left by a previous krexd (%s) still serves %d command(s) "
                        "(pids %s): left running for them", pid, pipe, len(clients), sorted(clients)[:8])
            self.left.append({"pid": pid, "ticks": int(lib.krex_pid_start_ticks(pid)), "pipe_dir": str(pipe),
                              "clients": sorted(clients)})

    def _attach(self) -> None:
        m0 = next(iter(self.gpus.values()))
        pipe = m0.pipe
        try:
            st = os.lstat(pipe)
        except OSError:
            st = None
        if st is None or not stat.S_ISDIR(st.st_mode) or st.st_uid not in (0, os.geteuid()):
            raise MpsUnavailable(
                f"{pipe} is not a directory of root's or krexd's user: its control daemon's word "
                "cannot be trusted (a link, another user's, or missing)",
                "point --mps-pipe-dir at the pipe directory of a control daemon root or you started",
            )
        if not (os.path.exists(pipe / CONTROL_PIPE) or _read_pid(pipe)):
            raise MpsUnavailable(
                f"no MPS control daemon at {pipe}: no {CONTROL_PIPE} pipe or {PID_FILE} there",
                f"start one (CUDA_MPS_PIPE_DIRECTORY={pipe} {CONTROL_BIN} -d) or fix --mps-pipe-dir",
            )
        pid = _read_pid(pipe)
        ticks = int(lib.krex_pid_start_ticks(pid)) if pid else 0
        if pid is not None and not (_alive(pid, ticks) and _is_control(pid, self._names)):
            raise MpsUnavailable(f"the MPS control daemon at {pipe} (pid {pid}) is not running, or "
                                 f"pid {pid} is not a control daemon of root or krexd's user",
                                 "start it again, or fix --mps-pipe-dir")
        for m in self.gpus.values():
            m.pid, m.start_ticks = pid, ticks
        log.info("MPS: attached to the control daemon at %s (pid %s); krexd will not stop it",
                 pipe, pid or "unknown: not watched")

    def _env(self, m: GpuMps) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        env.update(CUDA_VISIBLE_DEVICES=m.visible, CUDA_MPS_PIPE_DIRECTORY=str(m.pipe))
        if m.log_dir is not None:
            env["CUDA_MPS_LOG_DIRECTORY"] = str(m.log_dir)
        return env

    def _start_one(self, m: GpuMps) -> None:
        assert m.log_dir is not None
        private_dir(m.pipe.parent)
        private_dir(m.pipe)
        private_dir(m.log_dir)
        try:
            pid = start_control(self._control, self._names, self._env(m), m.pipe, m.log_dir)
        except StartFailed as e:
            raise self._failed(m, str(e)) from None
        with self._lock:
            m.pid, m.start_ticks, m.state, m.error = pid, int(lib.krex_pid_start_ticks(pid)), "on", ""
            m.started_at = time.monotonic()
        log.info("MPS: gpu %d: control daemon pid %d (CUDA_VISIBLE_DEVICES=%s, pipe %s)",
                 m.gpu, pid, m.visible, m.pipe)

    def _failed(self, m: GpuMps, why: str) -> MpsUnavailable:
        return MpsUnavailable(
            f"cannot start the MPS control daemon for GPU {m.gpu}: {why}",
            f"see {m.log_dir}/control.log; check `{self._control}` runs (the NVIDIA driver's MPS), "
            "or start krexd without --mps",
        )

    def _quit(self, pipe: Path, pid: int | None, ticks: int, log_dir: Path | None) -> None:
        quit_control(self._control, pipe, pid, ticks, log_dir)

    def _clear_stale(self, pipe: Path) -> None:
        """Stop and clear what a previous krexd of this state directory left in `pipe`."""
        clear_stale(self._control, self._names, pipe, "a previous krexd")

    def stop(self) -> None:
        """Stop the control daemons krexd started (never an attached one)."""
        self._stop.set()
        if self.mode != "own":
            return
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(START_WAIT_S + 2 * QUIT_WAIT_S)  # a restart under way ends first
        for m in self.gpus.values():
            with self._lock:
                pid, ticks, m.state = m.pid, m.start_ticks, "down"
            if pid is not None and _alive(pid, ticks):
                self._quit(m.pipe, pid, ticks, m.log_dir)
                log.info("MPS: gpu %d: control daemon pid %d stopped", m.gpu, pid)
            elif pid is None and os.path.exists(m.pipe / CONTROL_PIPE):
                # A start that never got a pid it could trust may still have left a daemon.
                self._quit(m.pipe, None, 0, m.log_dir)

    def stop_bound_s(self) -> float:
        """The longest `stop` may take: a restart under way ends (the watcher's join), then
        each control daemon krexd started gets `quit`, SIGTERM and SIGKILL, one after another."""
        if self.mode != "own":
            return 0.0
        return START_WAIT_S + 2 * QUIT_WAIT_S + len(self.gpus) * 3 * QUIT_WAIT_S

    # ----------------------------------------------------------------- faults
    def _check(self, m: GpuMps) -> None:
        """Mark `m` down if its control daemon died, and note its MPS servers that are gone
        (call with self._lock)."""
        self._check_servers(m)
        if m.state in ("on", "attached") and m.pid is not None and not _alive(m.pid, m.start_ticks):
            m.down.append([time.monotonic_ns(), None])
            del m.down[:-32]
            now = time.monotonic()
            m.fast_deaths = m.fast_deaths + 1 if now - m.started_at < FAST_DEATH_S else 0
            if m.fast_deaths:
                m.next_try = now + min(BACKOFF_MAX_S, RETRY_S * 2 ** (m.fast_deaths - 1))
            log.warning("MPS: gpu %d: control daemon pid %d died; regions on this GPU are flagged %s%s",
                        m.gpu, m.pid, FLAG, "" if m.state == "attached" else " until it runs again")
            m.state = "down"

    def _check_servers(self, m: GpuMps) -> None:
        """An MPS server that exits takes its clients' GPU work with it (every client gets
        an error): note each one seen gone, for the regions it cut (flags())."""
        now = time.monotonic_ns()
        for pid, ticks in list(m.servers.items()):
            if not _alive(pid, ticks):
                del m.servers[pid]
                m.server_deaths.append((pid, now))
                del m.server_deaths[:-32]
                log.warning("MPS: gpu %d: MPS server pid %d exited; a region it cut is flagged %s",
                            m.gpu, pid, FLAG)
                self._recovered(m, now, f"its MPS server pid {pid} exited (the next client gets a new one)",
                                pid)
        if m.pid is not None and m.state in ("on", "attached") and _alive(m.pid, m.start_ticks):
            for pid in _below(m.pid):
                ticks = int(lib.krex_pid_start_ticks(pid))
                if pid not in m.servers and _alive(pid, ticks):  # not an unreaped one, noted already
                    m.servers[pid] = ticks
                    # A new server replaces one the fault saw (none seen: only the window ends it).
                    self._recovered(m, now, f"a new MPS server pid {pid} runs")

    def _recovered(self, m: GpuMps, now: int, why: str, gone: int | None = None) -> None:
        """A server restart ends the fresh client faults of `m` (call with self._lock): the
        exit of server `gone` those that saw it; a new server (`gone` None) those that saw
        one it replaces (a fault that saw none ends with its window only)."""
        for f in m.client_faults:
            if f.until_ns > now and (gone in f.servers if gone is not None else bool(f.servers)):
                f.until_ns = now
                log.info("MPS: gpu %d: the fault of MPS client pid %d is over: %s", m.gpu, f.pid, why)

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_S):
            with self._lock:
                todo = []
                servers: list[tuple[GpuMps, ClientFault]] = []
                for m in self.gpus.values():
                    self._check(m)
                    if self.mode == "attach" and m.state == "down":
                        self._reattach(m)
                    if (self.mode == "own" and m.state == "down" and time.monotonic() >= m.next_try
                            and not self._busy(m.gpu)):
                        m.state = "restarting"
                        todo.append(m)
                    due = m.restart_due
                    if due is not None and due.restart == "pending" and self._busy(m.gpu):
                        due.restart = "deferred"
                        log.info("MPS: gpu %d: the MPS server restart after client pid %d waits: a region "
                                 "holds the GPU", m.gpu, due.pid)
                    elif due is not None and not self._busy(m.gpu):
                        servers.append((m, due))
                        m.restart_due = None
            for m in todo:
                self._restart(m)
            for m, f in servers:
                self._restart_server(m, f)

    def _reattach(self, m: GpuMps) -> None:
        """An attached control daemon its owner started again: watch the new one (call with
        self._lock). Regions while none ran stay flagged."""
        pid = _read_pid(m.pipe)
        if pid is None or pid == m.pid or not _is_control(pid, self._names):
            return
        m.pid, m.start_ticks, m.state = pid, int(lib.krex_pid_start_ticks(pid)), "attached"
        if m.down and m.down[-1][1] is None:
            m.down[-1][1] = time.monotonic_ns()
        log.info("MPS: gpu %d: attached to the control daemon's new pid %d", m.gpu, pid)

    def _restart(self, m: GpuMps) -> None:
        log.info("MPS: gpu %d: no region holds the GPU: starting a new control daemon", m.gpu)
        self._clear_stale(m.pipe)
        try:
            self._start_one(m)
        except (KrexError, OSError) as e:
            with self._lock:
                m.state, m.error, m.next_try = "down", str(e), time.monotonic() + RETRY_S
            log.error("MPS: gpu %d: %s (trying again in %g s)", m.gpu, e, RETRY_S)
            return
        with self._lock:
            m.restarts += 1
            if m.down and m.down[-1][1] is None:
                m.down[-1][1] = time.monotonic_ns()

    def flags(self, gpu: int, since_ns: int) -> list[tuple[str, str]]:
        """[(FLAG, why)] if GPU `gpu`'s control daemon was down at any time since `since_ns`
        (time.monotonic_ns): a region's clients then ran without their MPS server."""
        m = self.gpus.get(gpu)
        if m is None:
            return []
        with self._lock:
            self._check(m)  # a death the watcher has not seen yet
            hit = [d for d in m.down if d[1] is None or d[1] >= since_ns]
            gone = [pid for pid, t in m.server_deaths if t >= since_ns]
            faults = [f for f in m.client_faults if f.until_ns > since_ns]
        out = [(CLIENT_FLAG, f"an MPS client of GPU {gpu} (pid {f.pid}, `{f.command}`) was killed by "
                             f"{f.signame()} during or shortly before the region: the MPS server fails or "
                             "refuses its other clients, the region's own included, until it restarts")
               for f in faults]
        if hit:
            out.append((FLAG, f"the MPS control daemon of GPU {gpu} (pipe {m.pipe}) died or was down during "
                              "the region: its MPS server and clients may have failed or run without MPS"))
        if gone:
            out.append((FLAG, f"the MPS server of GPU {gpu} (pid {', '.join(map(str, gone))}) exited during "
                              "the region: its clients' GPU work, the region's own included, failed"))
        return out

    def command_exit(self, gpu: int, started_ns: int, pid: int, status: int, sig: int,
                     command: str) -> tuple[ClientFault | None, ClientFault | None]:
        """A command admitted on GPU `gpu` at `started_ns` (time.monotonic_ns) ended: its root
        process `pid` with exit status `status`, killed by signal `sig` (0: none). Returns
        (the client fault it made, killed: flags() and the server restart, see _watch; the
        fault of another client to tell it of: it exited non-zero while a fault was fresh,
        or a fault was fresh at some time while it ran, so its first CUDA call or a later
        one may have failed for it). (None, None) without MPS on that GPU."""
        m = self.gpus.get(gpu)
        if m is None:
            return None, None
        made = None
        now = time.monotonic_ns()
        with self._lock:
            self._check_servers(m)
            told = None
            if status != 0:
                told = next((f for f in reversed(m.client_faults)
                             if f.pid != pid and f.until_ns > started_ns), None)
            seen = next((f for f in m.client_faults if f.pid == pid and f.at_ns >= started_ns), None)
            if sig and seen is not None:
                seen.signal = sig  # found killed first (process_killed): now its signal is known
            elif sig:
                made = self._fault(m, pid, command, sig, now)
        return made, told

    def process_killed(self, gpu: int, pid: int, command: str) -> ClientFault | None:
        """A process of a command on GPU `gpu` that had GPU state ended without its exit
        handlers (krex/node/exits.py): killed by a signal or crashed, maybe mid-kernel, like
        a command killed (command_exit), which says which signal. None without MPS there,
        or when that process's fault is known already."""
        m = self.gpus.get(gpu)
        if m is None:
            return None
        now = time.monotonic_ns()
        with self._lock:
            self._check_servers(m)
            if any(f.pid == pid and now - f.at_ns < self.fault_window_ns for f in m.client_faults):
                return None
            return self._fault(m, pid, command, 0, now)

    def _fault(self, m: GpuMps, pid: int, command: str, sig: int, now: int) -> ClientFault:
        """Record a client fault on m's GPU and plan its server's restart (call with _lock)."""
        f = ClientFault(m.gpu, pid, command, sig, time.time(), now, now + self.fault_window_ns,
                        frozenset(m.servers))
        m.client_faults.append(f)
        del m.client_faults[:-32]
        if self.mode == "attach":
            f.restart = "not krexd's: the control daemon is attached"
        else:
            m.restart_due = f
        log.warning("MPS: gpu %d: client pid %d (%s) was killed by %s; regions on this GPU until its "
                    "server restarts (at most %g s) are flagged %s%s", m.gpu, pid, command, f.signame(),
                    self.fault_window_ns / 1e9, CLIENT_FLAG,
                    "; krexd does not restart an attached control daemon's server"
                    if self.mode == "attach" else "")
        return f

    def _restart_server(self, m: GpuMps, f: ClientFault) -> None:
        """Ask m's control daemon to shut its MPS servers down (`shutdown_server PID -f`): it
        starts a new one for the next client. Only while the fault is fresh, and only the
        servers of the fault's time (a newer one was started after it)."""
        with self._lock:
            fresh = f.until_ns > time.monotonic_ns()
            pids = sorted(p for p in m.servers if p in f.servers)
        if not fresh:
            f.restart = "not needed: the server restarted by itself"
            log.info("MPS: gpu %d: no server restart after client pid %d: %s", m.gpu, f.pid, f.restart)
            return
        if not pids:
            f.restart = "none: no MPS server known below the control daemon"
            log.warning("MPS: gpu %d: cannot restart the MPS server after client pid %d was killed: no "
                        "server known below control daemon pid %s", m.gpu, f.pid, m.pid)
            return
        after = " after the region that held the GPU" if f.restart == "deferred" else ""
        for pid in pids:
            log.warning("MPS: gpu %d: client pid %d was killed by %s and no region holds the GPU: asking the "
                        "control daemon to restart MPS server pid %d (shutdown_server %d -f)",
                        m.gpu, f.pid, f.signame(), pid, pid)
            try:
                p = tell_control(self._control, m.pipe, m.log_dir, f"shutdown_server {pid} -f")
            except (OSError, subprocess.TimeoutExpired) as e:
                why = f"failed: {e}"
            else:
                said = (p.stdout + p.stderr).decode(errors="replace").strip()
                why = f"requested{after} (server pid {pid})" if p.returncode == 0 else \
                    f"failed: the control program exited {p.returncode}: {said or 'no output'}"
            if why.startswith("failed"):
                log.error("MPS: gpu %d: the MPS server restart %s", m.gpu, why)
            else:  # its exit ends the fault (_check_servers): seen before the restart reads as done
                deadline = time.monotonic() + QUIT_WAIT_S
                while _alive(pid, m.servers.get(pid, 0)) and time.monotonic() < deadline:
                    time.sleep(0.02)
                with self._lock:
                    self._check_servers(m)
            f.restart = why

    def servers(self) -> set[int]:
        """The processes below the control daemons in use (the MPS servers they start): they
        hold the GPU context of every client, so NVML lists them beside the clients; they
        are KREX's own, not foreign work (a client's own pid is judged as any process's)."""
        with self._lock:
            roots = [m.pid for m in self.gpus.values()
                     if m.pid is not None and m.state in ("on", "attached") and _alive(m.pid, m.start_ticks)]
        out: set[int] = set()
        for r in roots:
            out |= _below(r)
        return out

    # ---------------------------------------------------------------- commands
    def command_env(self, gpu: int) -> dict[str, str]:
        """The MPS variables of a command admitted on GPU `gpu` (none with MPS off)."""
        m = self.gpus.get(gpu)
        if m is None:
            return {}
        out = {"CUDA_MPS_PIPE_DIRECTORY": str(m.pipe)}
        if m.log_dir is not None:
            out["CUDA_MPS_LOG_DIRECTORY"] = str(m.log_dir)
        if m.uuid:
            out["CUDA_VISIBLE_DEVICES"] = m.uuid
        return out

    def status(self) -> dict[str, Any]:
        """For `krex status`: the mode and each GPU's control daemon (its pid only while it
        runs: a control daemon down or restarting has none), and the MPS variables a command
        on that GPU gets (`env`, as `krex run` and `krex env` give them); `left`, when a
        previous krexd's control daemon still runs for its clients (see _left_behind)."""
        with self._lock:
            self.left = [d for d in self.left if _alive(d["pid"], d["ticks"])]
            left = [{k: v for k, v in d.items() if k != "ticks"} for d in self.left]
            extra = {"left": left} if left else {}
            return {
                **extra,
                "mode": self.mode,
                "gpus": [
                    {"gpu": m.gpu, "state": m.state, "pid": m.pid if m.state in ("on", "attached") else None,
                     "pipe_dir": str(m.pipe), "log_dir": str(m.log_dir) if m.log_dir else None,
                     "visible": m.visible, "restarts": m.restarts, "error": m.error,
                     "env": self.command_env(m.gpu),
                     **({"client_faults": [f.as_dict() for f in m.client_faults[-8:]]}
                        if m.client_faults else {})}
                    for m in self.gpus.values()
                ],
            }
