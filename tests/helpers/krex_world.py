"""A private KREX node for integration tests: its own krexd, `krex run` commands, segments,
simulated GPU, trace and freezer groups (Krex), plus the checks the region tests make on
what it records: which pids are frozen, and whether a sibling ran or submitted GPU work
inside another command's region.

Every Krex has its own KREX_STATE_DIR, KREX_SHM, KREX_SIM_SHM and KREX_SIM_TRACE, so tests
never meet each other or a real daemon. Krex.cleanup always leaves nothing behind: it thaws
every group under the world's freezer root, kills every process that carries its KREX_SHM,
removes the groups and unlinks the segments (the `kx` fixture of tests/integration/conftest.py
calls it, on failure too).

The commands are tests/helpers/cp_worker.py processes. A region owner records
CLOCK_MONOTONIC right after its region is granted (t_grant) and right before it leaves it
(t_end); [t_grant, t_end] lies inside the daemon's closed-gate, frozen-siblings interval.

A traceback in the daemon's log is always a bug and may leave requests that are never
answered, so every wait here checks the log and fails at once (DaemonCrashed)."""

from __future__ import annotations

import bisect
import contextlib
import itertools
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from helpers import clean_env, read_jsonl, wait_until
from krex.errors import NotFound
from krex.native import lib
from krex.node import freezer, mounts
from krex.node.shm import Segment
from krex.proc.client import Client, daemon_alive

WORKER = Path(__file__).resolve().parent / "cp_worker.py"
_KREX = Path(sys.executable).with_name("krex")
KREX = (
    [str(_KREX)]
    if _KREX.exists()
    else [sys.executable, "-c", "import sys; from krex.cli.main import main; sys.exit(main())"]
)
_ids = itertools.count()


# ------------------------------------------------------------------ cgroups, /proc


def _mounts() -> tuple[str | None, str | None]:
    with open("/proc/self/mountinfo") as f:
        m = mounts.parse_mountinfo(f.read())
    v2, v1 = mounts.cgroup2_mounts(m), mounts.cgroup1_freezer_mounts(m)
    return (v2[0] if v2 else None), (v1[0] if v1 else None)


CG2, CG1 = _mounts()


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def proc_state(pid: int) -> str:
    s = _read(f"/proc/{pid}/stat")
    return s.rsplit(")", 1)[1].split()[0] if ")" in s else ""


def frozen_reason(pid: int) -> str | None:
    """Why `pid` cannot run right now (stopped, or in a frozen cgroup), else None."""
    st = proc_state(pid)
    if st in ("T", "t"):
        return f"pid {pid} is stopped (state {st})"
    for line in _read(f"/proc/{pid}/cgroup").splitlines():
        hid, ctrl, path = line.split(":", 2)
        if hid == "0" and CG2 and path != "/":
            d = Path(CG2 + path)
            if _read(d / "cgroup.freeze").strip() == "1" or "frozen 1" in _read(d / "cgroup.events"):
                return f"pid {pid} is in frozen cgroup {d}"
        elif "freezer" in ctrl.split(",") and CG1 and path != "/":
            state = _read(Path(CG1 + path) / "freezer.state").strip()
            if state and state != "THAWED":
                return f"pid {pid} is in cgroup v1 {CG1 + path}: {state}"
    return None


def alive(pid: int) -> bool:
    return proc_state(pid) not in ("", "Z", "X")


# ------------------------------------------------------------------ trace checks


def intervals_disjoint(iv: list[tuple[int, int, int]]) -> list[str]:
    iv = sorted(iv, key=lambda x: x[1])
    return [
        f"regions of pids {a[0]} and {b[0]} overlap: {a[1:]} {b[1:]}"
        for a, b in itertools.pairwise(iv)
        if b[1] < a[2]
    ]


def inside(iv: list[tuple[int, int, int]], pid: int, t: int) -> tuple[int, int, int] | None:
    """The region of another pid whose [t_grant, t_end] holds t (regions of one GPU are disjoint)."""
    starts = [x[1] for x in iv]
    i = bisect.bisect_right(starts, t) - 1
    if i >= 0 and t <= iv[i][2] and iv[i][0] != pid:
        return iv[i]
    return None


def foreign_ops(iv: list[tuple[int, int, int]], ops: Iterable[dict[str, Any]]) -> list[str]:
    iv = sorted(iv, key=lambda x: x[1])
    out = []
    for o in ops:
        r = inside(iv, o["pid"], o["submit"])
        if r is not None:
            out.append(
                f"pid {o['pid']} submitted {o['api']} at {o['submit']} inside the region of "
                f"pid {r[0]} [{r[1]}, {r[2]}]"
            )
    return out


def foreign_ticks(iv: list[tuple[int, int, int]], pid: int, ticks: Iterable[int]) -> list[str]:
    iv = sorted(iv, key=lambda x: x[1])
    out = []
    for t in ticks:
        r = inside(iv, pid, t)
        if r is not None:
            out.append(f"sibling pid {pid} ran at {t} inside the region of pid {r[0]} [{r[1]}, {r[2]}]")
    return out


# ------------------------------------------------------------------ the world


class DaemonCrashed(AssertionError):
    """A krexd thread died with a traceback: always a product bug, and later
    requests may never be answered, so every wait checks for it."""


class GroupVanished(DaemonCrashed):
    """krexd crashed because a sibling's cgroup was removed while it waited for that group to
    freeze (its command had just exited): the cgroup's events file raises ENODEV, and if the
    region's worker thread does not catch it, every later region on that GPU hangs."""


@dataclass
class Cmd:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    kx: Krex

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.popen.poll() is None:
            self.kx.check_daemon()
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"command {self.name} did not exit within {timeout:g}s; output: {self.output()[-1500:]}"
                )
            time.sleep(0.02)
        self.kx.check_daemon()
        return self.popen.returncode

    def output(self) -> str:
        return _read(self.log)


class Krex:
    """One private KREX node: daemon, commands, segments, freezer groups."""

    def __init__(self) -> None:
        self.id = f"cp{os.getpid()}-{next(_ids)}"
        # A short base: the socket path must stay under 100 bytes.
        self.base = Path(tempfile.mkdtemp(prefix=f"krex-{self.id}-"))
        self.state = self.base / "state"
        self.out = self.base / "out"
        self.out.mkdir()
        self.sock = self.state / "krexd.sock"
        self.shm = f"/krex-{self.id}"
        self.sim_shm = f"/krex-{self.id}-sim"
        self.root = self.shm.strip("/")
        self.trace = self.out / "trace.jsonl"
        self.gpus = 1
        self.daemon: subprocess.Popen[bytes] | None = None
        self.cmds: dict[str, Cmd] = {}
        self.popens: list[subprocess.Popen[bytes]] = []

    # ---------------------------------------------------------------- env
    def env(self, **extra: str) -> dict[str, str]:
        e = clean_env()
        e.update(
            KREX_STATE_DIR=str(self.state),
            KREX_SHM=self.shm,
            KREX_SIM_SHM=self.sim_shm,
            KREX_SIM_TRACE=str(self.trace),
            KREX_SIM_GPUS=str(self.gpus),
        )
        e.update(extra)
        return e

    # ------------------------------------------------------------- daemon
    def start_daemon(
        self,
        *,
        freezer_name: str | None = None,
        max_region: float | None = None,
        slots: int = 8,
        env_extra: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        args = [sys.executable, "-m", "krex.node.daemon", "--device", "sim", "--slots-per-gpu", str(slots)]
        if freezer_name:
            args += ["--freezer", freezer_name]
        if max_region is not None:
            args += ["--max-region", str(max_region)]
        self.state.mkdir(exist_ok=True)
        log = open(self.state / "test-daemon.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            p = subprocess.Popen(
                args,
                env=self.env(**(env_extra or {})),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        finally:
            log.close()
        self.popens.append(p)
        self.daemon = p
        deadline = time.monotonic() + 20
        while not daemon_alive(self.sock):
            if p.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"daemon did not start: {_read(self.state / 'test-daemon.log')[-2000:]}")
            time.sleep(0.02)
        return p

    def daemon_log(self) -> str:
        return _read(self.state / "test-daemon.log") + _read(self.state / "krexd.log")

    def check_daemon(self) -> None:
        if "Traceback" not in self.daemon_log():
            return
        time.sleep(0.5)  # let the daemon finish writing the traceback
        log = self.daemon_log()
        tail = log[log.index("Traceback") :][:3000]
        if "[Errno 19] No such device" in log and "_wait_events" in log:
            raise GroupVanished(f"krexd crashed: a sibling's cgroup vanished while it froze:\n{tail}")
        raise DaemonCrashed(f"a krexd thread crashed:\n{tail}")

    def wait(self, pred: Any, timeout: float, what: str) -> Any:
        """wait_until that gives up at once when the daemon has crashed."""

        def check() -> Any:
            self.check_daemon()
            return pred()

        return wait_until(check, timeout, what)

    def client(self) -> Client:
        return Client.connect(path=self.sock)

    def status(self) -> dict[str, Any]:
        c = self.client()
        try:
            return c.request({"op": "status"})
        finally:
            c.close()

    def snapshot(self) -> Any:
        with Segment.attach(self.shm) as s:
            return s.snapshot()

    def gate_open(self, gpu: int = 0) -> bool:
        return not self.snapshot().gates[gpu].closed

    def journal(self) -> list[dict[str, Any]]:
        return read_jsonl(self.state / "journal.jsonl")

    # ------------------------------------------------------------ commands
    def krex(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*KREX, *args],
            env=env or self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def run(
        self, name: str, mode: str, *args: str, gpu: int | None = None, env: dict[str, str] | None = None
    ) -> Cmd:
        """`krex run --device sim [--gpu G] -- python cp_worker.py MODE OUT --name NAME ARGS`."""
        argv = [*KREX, "run", "--device", "sim"]
        if gpu is not None:
            argv += ["--gpu", str(gpu)]
        argv += ["--", sys.executable, str(WORKER), mode, str(self.out), "--name", name, *args]
        log = self.out / f"{name}.log"
        with open(log, "wb") as f:
            p = subprocess.Popen(
                argv,
                env=env or self.env(),
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.popens.append(p)
        c = Cmd(name, p, log, self)
        self.cmds[name] = c
        return c

    def run_argv(
        self, name: str, argv: list[str], *opts: str, env_extra: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """`krex run --device sim [OPTS] -- ARGV`, its output in NAME.log."""
        log = self.out / f"{name}.log"
        with open(log, "wb") as f:
            p = subprocess.Popen(
                [*KREX, "run", "--device", "sim", *opts, "--", *argv],
                env=self.env(**(env_extra or {})),
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.popens.append(p)
        self.cmds[name] = Cmd(name, p, log, self)
        return p

    def result(self, name: str, suffix: str = "json", timeout: float = 0.0, pid: int = 0) -> Any:
        """The JSON a victim wrote. With `timeout`, wait for it until the command's `krex run` exits,
        or, when `pid` names the victim itself, until that process is gone (its `krex run` may have
        been killed on purpose while the victim lives on)."""
        path = self.out / f"{name}.{suffix}"
        if timeout:
            cmd = self.cmds.get(name)

            def finished() -> bool:
                if pid:
                    try:
                        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
                    except psutil.NoSuchProcess:
                        return True
                return cmd is not None and cmd.popen.poll() is not None

            self.wait(
                lambda: path.exists() or finished(),
                timeout,
                f"{path.name}",
            )
            if not path.exists():
                raise AssertionError(
                    f"{name} exited ({cmd.popen.returncode if cmd else '?'}) without "
                    f"writing {path.name}: {cmd.output()[-1500:] if cmd else ''}"
                )
        return json.loads(path.read_text())

    def regions_across_an_end(self, start_sibling: Any) -> tuple[dict[str, Any], int]:
        """An owner ("own") takes regions back to back while a sibling command ends.
        `start_sibling(go)` starts the sibling as "sib", a cp_worker `life` run with
        `--exit-on go`; its frees are let grow older than a settle time first, so only its
        end can flag. Returns the owner's result and the newest slot-free stamp at or after
        the sibling's exit (0: none)."""
        from krex.native import lib
        from krex.node.shm import Segment

        settle_s = int(lib.KREX_FREE_SETTLE_NS) / 1e9
        until = self.out / "own.until"
        self.run("own", "regions", "-n", "2000", "--kernels", "1", "--us", "200", "--until", str(until))
        self.wait(lambda: (self.out / "own.log").exists(), 10, "the owner")
        time.sleep(0.5)
        go = self.out / "exit-now"
        start_sibling(go)
        self.result("sib", "ready", timeout=30)
        time.sleep(settle_s + 0.1)  # its frees are old now: only its end counts
        go.touch()
        t_exit = self.result("sib", timeout=30)["t_exit"]
        assert self.cmds["sib"].wait(30) == 0, self.cmds["sib"].output()
        time.sleep(0.3)
        until.touch()
        res = self.result("own", timeout=60)
        assert res["errors"] == [], res["errors"]
        with Segment.attach(self.shm) as seg:
            stamps = [int(t) for t in seg.raw.gpus[0].slot_free_ns]
        return res, max((t for t in stamps if t >= t_exit), default=0)

    def touch(self, name: str, suffix: str = "stop") -> None:
        (self.out / f"{name}.{suffix}").write_text("")

    def stop_all(self, *names: str) -> None:
        """Ask these commands to stop, then wait for each to exit cleanly."""
        for h in names:
            self.touch(h)
        for h in names:
            assert self.cmds[h].wait(30) == 0, self.cmds[h].output()

    def progress(self, name: str) -> tuple[int, int, int]:
        """(counter, monotonic ns of the last bump, pid) of a hammer."""
        data = (self.out / f"{name}.progress").read_bytes()
        return struct.unpack("qqq", data[:24])

    def wait_running(self, name: str, ticks: int = 20, timeout: float = 30) -> int:
        cmd = self.cmds[name]

        def ok() -> bool:
            if cmd.popen.poll() is not None:
                raise AssertionError(f"{name} exited early: {cmd.output()[-1500:]}")
            p = self.out / f"{name}.progress"
            return p.exists() and self.progress(name)[0] >= ticks

        self.wait(ok, timeout, f"{name} to make progress")
        return self.progress(name)[2]

    def advances(self, name: str, timeout: float, by: int = 5) -> bool:
        c0 = self.progress(name)[0]
        try:
            self.wait(lambda: self.progress(name)[0] >= c0 + by, timeout, f"{name} progress")
        except DaemonCrashed:
            raise
        except AssertionError:
            return False
        return True

    def stands_still(self, name: str, seconds: float = 0.3) -> bool:
        c0 = self.progress(name)[0]
        time.sleep(seconds)
        return self.progress(name)[0] == c0

    def ops(self, gpu: int | None = None, life: bool = True) -> list[dict[str, Any]]:
        """The simulated GPU's ops; life=False leaves out LIFE calls (contexts, modules,
        memory: a drain helper's own context retain and release among them)."""
        return [
            e
            for e in read_jsonl(self.trace)
            if e.get("ev") == "op"
            and (gpu is None or e.get("gpu") == gpu)
            and (life or e.get("cls") != lib.KREX_CLS_LIFE)
        ]

    # ------------------------------------------------------------ leftovers
    def group_dirs(self) -> list[Path]:
        out: list[Path] = []
        for mount in (CG2, CG1):
            root = Path(mount) / self.root if mount else None
            if root is None or not root.is_dir():
                continue
            found: list[Path] = []
            for root_dir, dirs, _files in os.walk(root):  # tolerates groups krexd removes meanwhile
                found += [Path(root_dir) / d for d in dirs]
            out += sorted(found, key=lambda p: -len(p.parts))
        return out

    def signal_dir(self) -> Path:
        return Path("/run") / self.root

    def frozen_groups(self) -> list[str]:
        bad = []
        for d in self.group_dirs():
            if _read(d / "cgroup.freeze").strip() == "1" or "frozen 1" in _read(d / "cgroup.events"):
                bad.append(str(d))
            st = _read(d / "freezer.state").strip()
            if st and st != "THAWED":
                bad.append(f"{d}: {st}")
        for f in self.signal_dir().glob("signal/*.json"):
            with contextlib.suppress(ValueError):
                if json.loads(_read(f) or "{}").get("frozen"):
                    bad.append(str(f))
        return bad

    def our_pids(self) -> list[int]:
        """Every process started with this test's KREX_SHM or KREX_SIM_SHM (not this one)."""
        keys = (f"KREX_SHM={self.shm}\0".encode(), f"KREX_SIM_SHM={self.sim_shm}\0".encode())
        pids = []
        for d in os.listdir("/proc"):
            if not d.isdigit() or int(d) == os.getpid():
                continue
            try:
                env = Path(f"/proc/{d}/environ").read_bytes() + b"\0"
            except OSError:
                continue
            if any(k in env for k in keys) and alive(int(d)):
                pids.append(int(d))
        return pids

    def cleanup(self) -> None:
        # 1. thaw everything, so that SIGKILL can land (cgroup v1 delays it for frozen tasks)
        members: set[int] = set()
        for d in self.group_dirs():
            with contextlib.suppress(OSError):
                (d / "cgroup.freeze").write_text("0")
            with contextlib.suppress(OSError):
                (d / "freezer.state").write_text("THAWED")
            members.update(int(x) for x in _read(d / "cgroup.procs").split())
        for f in self.signal_dir().glob("signal/*.json"):
            with contextlib.suppress(ValueError):
                data = json.loads(_read(f) or "{}")
                members.update(int(p) for p, _ in [*data.get("roots", []), *data.get("known", [])])
        for p in self.popens:
            members.add(p.pid)
        # 2. kill every process of this test, daemon included; guardians first are fine too
        for _ in range(3):
            pids = (members | set(self.our_pids())) - {os.getpid()}
            for pid in pids:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    with contextlib.suppress(OSError):
                        os.kill(pid, sig)
            for p in self.popens:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=5)

            def all_dead(pids: set[int] = pids) -> bool:
                return not [q for q in pids if alive(q)]

            with contextlib.suppress(AssertionError):
                wait_until(all_dead, 5, "test processes to die")
            members = set()
            if not self.our_pids():
                break
        # 3. groups (a dying process keeps its cgroup busy for a moment), segments, files
        roots = [Path(m) / self.root for m in (CG2, CG1) if m]
        deadline = time.monotonic() + 5
        while True:
            for d in [*self.group_dirs(), *roots]:
                with contextlib.suppress(OSError):
                    d.rmdir()
            if not any(r.exists() for r in roots) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        shutil.rmtree(self.signal_dir(), ignore_errors=True)
        for pin in Path("/dev/shm").glob(self.shm.strip("/") + ".krex*"):  # krexd's pin links
            pin.unlink(missing_ok=True)
        Segment.unlink(self.shm)
        lib.krex_shm_unlink(self.sim_shm.encode())
        shutil.rmtree(self.base, ignore_errors=True)



def owner_intervals(*results: dict[str, Any]) -> list[tuple[int, int, int]]:
    return [(r["pid"], x["t_grant"], x["t_end"]) for r in results for x in r["regions"]]


def backend_or_skip(kx: Krex, backend: str) -> None:
    try:
        freezer.detect(prefer=backend, root_name=kx.root)
    except NotFound as e:
        pytest.skip(f"freezer backend {backend} is not available here: {e}")


def hold_with_siblings(kx: Krex, *hammers: str) -> dict[str, Any]:
    """Start `hammers` (busy siblings), then a command `own` that holds a region; returns
    its ready record once the hammers are checked to be frozen and the gate is closed."""
    for h in hammers:
        kx.run(h, "hammer", "--us", "50")
    for h in hammers:
        kx.wait_running(h)
    kx.run("own", "hold")
    ready: dict[str, Any] = kx.result("own", "ready", timeout=30)
    assert not ready["grant"]["contaminated"], ready["grant"]
    for h in hammers:  # the precondition: the siblings really are frozen
        assert kx.stands_still(h), f"{h} ran inside the region"
        assert frozen_reason(kx.progress(h)[2]) is not None
    assert not kx.gate_open()
    return ready
