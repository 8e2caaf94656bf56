"""The region protocol end to end: a real krexd, real `krex run` guardians, real
cgroups (or SIGSTOP), the real shim and the simulated GPU.

Every test gets a private daemon (KREX_STATE_DIR, KREX_SHM, KREX_SIM_SHM,
KREX_SIM_TRACE of its own), so tests never meet each other or a real daemon.
The `kx` fixture always cleans up, on failure too: it thaws every group under
the test's freezer root, kills every process that carries the test's KREX_SHM,
removes the groups and unlinks the segments.

The commands are tests/helpers/cp_worker.py processes. A region owner records
CLOCK_MONOTONIC right after its region is granted (t_grant) and right before it
leaves it (t_end); [t_grant, t_end] lies inside the daemon's closed-gate,
frozen-siblings interval, so:
  I1  no sibling operation in the simulator's trace has its submit inside it;
  I3  no sibling progress tick (taken by the sibling itself, so only while it
      runs) falls inside it.

A traceback in the daemon's log is always a bug and may leave requests that are
never answered, so every wait here checks the log and fails at once
(DaemonCrashed). Known product bugs are strict xfails with the exception they
raise, so a test flips when its bug is fixed and still fails for any other reason.
"""

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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers import clean_env, read_jsonl, wait_until

from krex.errors import Busy, KrexError, NotFound, UsageError
from krex.native import lib
from krex.node import freezer, mounts
from krex.node.shm import Segment
from krex.proc.client import Client, daemon_alive

pytestmark = [
    pytest.mark.cgroup,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: real cgroups and freezers"),
]

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "cp_worker.py"
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


# ------------------------------------------------------------------ the fixture


class DaemonCrashed(AssertionError):
    """A krexd thread died with a traceback: always a product bug, and later
    requests may never be answered, so every wait checks for it."""


class GroupVanished(DaemonCrashed):
    """Product bug B2 (see B2_REASON)."""


class NotExclusiveAfterRestart(AssertionError):
    """Product bug B4 (see B4_REASON)."""


B2_REASON = (
    "B2: a sibling's cgroup removed while krexd waits for it to freeze (its command just exited) "
    "makes _Cgroup2Group._wait_events raise OSError(ENODEV), which _run_region does not catch: the "
    "GPU's worker thread dies and every later region on that GPU hangs"
)
B4_REASON = (
    "B4: after a daemon restart, commands that survived it are never adopted (not frozen in new "
    "regions), and the slot of a command whose guardian died is handed to a new command while its "
    "orphans still run in that slot's cgroup with KREX_SLOT of the new owner: they pass its gate"
)


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
            raise GroupVanished(f"krexd crashed (bug B2):\n{tail}")
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


@pytest.fixture
def kx() -> Iterator[Krex]:
    k = Krex()
    try:
        yield k
    finally:
        k.cleanup()


def owner_intervals(*results: dict[str, Any]) -> list[tuple[int, int, int]]:
    return [(r["pid"], x["t_grant"], x["t_end"]) for r in results for x in r["regions"]]


def _backend_or_skip(kx: Krex, backend: str) -> None:
    try:
        freezer.detect(prefer=backend, root_name=kx.root)
    except NotFound as e:
        pytest.skip(f"freezer backend {backend} is not available here: {e}")


# ====================================================================== I1 + I3


@pytest.mark.parametrize("backend", ["cgroup2", "cgroup1", "signal"])
def test_siblings_neither_submit_nor_run_inside_regions(kx: Krex, backend: str) -> None:
    _backend_or_skip(kx, backend)
    kx.start_daemon(freezer_name=backend, slots=3)
    kx.run("h1", "hammer", "--us", "50")
    kx.run("h2", "hammer", "--us", "50")
    hpids = {h: kx.wait_running(h) for h in ("h1", "h2")}
    owner = kx.run(
        "own", "regions", "-n", "20", "--kernels", "3", "--us", "100", "--sleep-ms", "10", "--pause-ms", "20"
    )
    assert owner.wait(90) == 0, owner.output()
    for h in hpids:
        kx.touch(h)
    for h in hpids:
        assert kx.cmds[h].wait(30) == 0, kx.cmds[h].output()

    res = kx.result("own")
    assert res["errors"] == []
    assert len(res["regions"]) == 20
    for r in res["regions"]:
        g = r["grant"]
        assert g["freezer"] == backend
        assert not g["contaminated"], g["reasons"]
        assert len(g["frozen_slots"]) == 2, g
    iv = owner_intervals(res)
    assert intervals_disjoint(iv) == []

    ops = kx.ops(gpu=0)
    # I1: nothing a sibling submitted reached the (simulated) driver inside a region
    assert foreign_ops(iv, ops) == []
    # I3: the siblings did not run at all inside a region
    for h, pid in hpids.items():
        ticks = kx.result(h)["ticks"]
        assert foreign_ticks(iv, pid, ticks) == []
        # Not vacuous: each sibling submitted and ran between the regions, while the owner was there.
        first, last = iv[0][1], iv[-1][2]
        assert any(first < t < last for t in ticks), f"{h} never ran between the regions"
        assert any(o["pid"] == pid and first < o["submit"] < last for o in ops), f"{h} never submitted"
    # (Kernels only: the owner's drain helper may answer the drain request that its own region
    # made, late, inside it: a context retain and release of no duration, the CI saw once.)
    kernels = [o for o in ops if o["cls"] == lib.KREX_CLS_KERNEL]
    own_in = [o for o in kernels if o["pid"] == res["pid"] and inside(iv, -1, o["submit"])]
    assert len(own_in) == 20 * 3  # the owner's own kernels did go through its closed gate

    recs = [r for r in kx.journal() if r["owner_pid"] == res["pid"]]
    assert len(recs) == 20
    assert all(r["end"] == "end" and r["siblings_frozen"] == 2 and r["freezer"] == backend for r in recs)
    assert kx.frozen_groups() == []
    assert kx.gate_open()


# ====================================================================== I2


def test_grant_waits_for_earlier_sibling_work(kx: Krex) -> None:
    kx.start_daemon(slots=3)
    go, trigger = kx.out / "go", kx.out / "trigger"
    owner = kx.run("own", "regions", "-n", "1", "--kernels", "1", "--us", "100", "--go", str(go))
    kx.result("own", "waiting", timeout=30)  # warmed up before any long kernel is queued
    for h in ("h1", "h2"):
        kx.run(h, "hammer", "--long-us", "300000", "--trigger", str(trigger))
    for h in ("h1", "h2"):
        kx.wait_running(h, ticks=0)
    trigger.write_text("")
    for h in ("h1", "h2"):
        kx.result(h, "ready", timeout=10)
    go.write_text("")  # the region request follows the siblings' 2 x 300 ms of queued work at once
    assert owner.wait(60) == 0, owner.output()
    for h in ("h1", "h2"):
        kx.touch(h)

    reg = kx.result("own")["regions"][0]
    hpids = {kx.result(h, "ready")["pid"] for h in ("h1", "h2")}
    sib = [o for o in kx.ops(gpu=0, life=False) if o["pid"] in hpids and o["submit"] < reg["t_grant"]]
    assert len(sib) == 2
    # Not vacuous: sibling work was still queued or running when the owner asked for its region.
    assert max(o["end"] for o in sib) > reg["t_request"]
    g = reg["grant"]
    if g["contaminated"]:
        assert g["reasons"], "a contaminated grant must say why"
    else:
        late = [o for o in sib if o["end"] > reg["t_grant"]]
        assert late == [], f"granted at {reg['t_grant']} while sibling work still ran: {late}"
        assert g["drained"] >= 2


def test_a_sibling_that_has_drained_is_frozen_while_another_still_drains(kx: Krex) -> None:
    """Entry pays the slowest drain plus one freeze: a sibling whose helper acked at once
    is frozen then, not after a slower sibling's queued work has finished."""
    kx.start_daemon(slots=3)
    go, trigger, quick_go = kx.out / "go", kx.out / "trigger", kx.out / "quick_go"
    owner = kx.run("own", "regions", "-n", "1", "--kernels", "1", "--us", "100", "--go", str(go))
    kx.result("own", "waiting", timeout=30)
    kx.run("slow", "hammer", "--long-us", "600000", "--trigger", str(trigger))  # 0.6 s queued
    kx.run("quick", "hammer", "--long-us", "1000", "--trigger", str(quick_go))  # 1 ms, done before
    for h in ("slow", "quick"):
        kx.wait_running(h, ticks=0)
    # The simulated GPU runs kernels one after another: the quick sibling's kernel must
    # end before the slow one's begins, or its drain would wait for both.
    quick_go.write_text("")
    kx.result("quick", "ready", timeout=10)
    time.sleep(0.05)
    trigger.write_text("")
    kx.result("slow", "ready", timeout=10)
    go.write_text("")
    assert owner.wait(60) == 0, owner.output()
    kx.stop_all("slow", "quick")

    reg = kx.result("own")["regions"][0]
    g = reg["grant"]
    assert not g["contaminated"], g["reasons"]
    assert g["drained"] == 2 and len(g["frozen_slots"]) == 2, g
    slow_pid = kx.result("slow", "ready")["pid"]
    (long_op,) = [o for o in kx.ops(gpu=0, life=False) if o["pid"] == slow_pid]
    assert long_op["end"] > reg["t_request"] + 200e6, "the slow sibling's work ended too early to tell"
    quick_ticks = [t for t in kx.result("quick")["ticks"] if t < reg["t_grant"]]
    slow_ticks = [t for t in kx.result("slow")["ticks"] if t < reg["t_grant"]]
    # The quick sibling stopped running long before the slow one's kernel ended; the slow
    # one kept running until its own drain (its helper must ack, so it is not frozen early).
    assert quick_ticks and quick_ticks[-1] < long_op["end"] - 200e6, (
        f"quick sibling stopped only {(long_op['end'] - quick_ticks[-1]) / 1e6:.0f} ms before the slow drain"
    )
    assert slow_ticks and slow_ticks[-1] > quick_ticks[-1] + 100e6
    assert g["frozen_early"] >= 1, g
    assert g["freeze_s"] < g["drain_s"], g
    # The record says what entry waited for: the slow sibling acked last, after its kernel,
    # and it was the one owing an ack 25 ms in; each frozen slot has its freeze time.
    (last_pid, last_ms), *_ = g["drain_slow"]
    assert last_pid == slow_pid and last_ms >= 200, g["drain_slow"]
    assert any(w.startswith(f"pid {slow_pid}:") for w in g["drain_waited_on"]), g["drain_waited_on"]
    assert sorted(map(int, g["freeze_ms"])) == sorted(g["frozen_slots"]), g["freeze_ms"]
    assert all(isinstance(v, float) and v >= 0 for v in g["freeze_ms"].values()), g["freeze_ms"]


# ====================================================================== pin


def test_measuring_thread_is_pinned_inside_and_restored_after(kx: Krex) -> None:
    kx.start_daemon(slots=2)
    kx.run("h1", "hammer", "--us", "50")
    kx.wait_running("h1")
    # A non-default affinity before the region, so "restored" is not the same as "reset to all".
    owner = kx.run("own", "regions", "-n", "3", "--affinity", "0", "--pause-ms", "10")
    assert owner.wait(60) == 0, owner.output()
    res = kx.result("own")
    assert res["errors"] == []
    for r in res["regions"]:
        assert r["tid"] == res["pid"]  # the measuring thread is the main thread
        assert r["aff_inside"] == sorted(r["grant"]["reserved_cpus"])
        assert r["aff_before"] == [0]
        assert r["aff_after"] == r["aff_before"]
    recs = [r for r in kx.journal() if r["owner_pid"] == res["pid"]]
    assert [r["tid"] for r in recs] == [res["pid"]] * 3


# ====================================================================== I4


def _hold_with_siblings(kx: Krex, *hammers: str) -> dict[str, Any]:
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


def test_owner_killed_inside_region_frees_everything(kx: Krex) -> None:
    kx.start_daemon(slots=3)
    ready = _hold_with_siblings(kx, "h1", "h2")
    os.kill(ready["pid"], signal.SIGKILL)
    for h in ("h1", "h2"):
        assert kx.advances(h, timeout=1.0), f"{h} did not run again within 1 s of the owner's death"
    kx.wait(lambda: kx.gate_open(), 1.0, "the gate to open")
    for h in ("h1", "h2"):
        assert frozen_reason(kx.progress(h)[2]) is None
    assert kx.cmds["own"].wait(10) == 128 + signal.SIGKILL
    kx.wait(lambda: [r for r in kx.journal() if r["owner_pid"] == ready["pid"]], 5, "the journal record")
    rec = [r for r in kx.journal() if r["owner_pid"] == ready["pid"]][-1]
    assert rec["end"] in ("owner-died", "owner-exit", "command-exit", "owner-gone"), rec
    kx.wait(lambda: not kx.status()["regions"], 2, "no region in the daemon")
    assert kx.frozen_groups() == []


def test_max_region_ends_a_region_that_never_ends(kx: Krex) -> None:
    kx.start_daemon(slots=2, max_region=1)
    ready = _hold_with_siblings(kx, "h1")
    kx.wait(
        lambda: [r for r in kx.journal() if r["owner_pid"] == ready["pid"]],
        5,
        "the region to be ended by --max-region",
    )
    rec = [r for r in kx.journal() if r["owner_pid"] == ready["pid"]][-1]
    assert rec["end"].startswith("max-region"), rec
    assert kx.advances("h1", timeout=2.0), "h1 stayed frozen after the forced end"
    assert frozen_reason(kx.progress("h1")[2]) is None
    assert kx.gate_open()
    assert kx.frozen_groups() == []
    # The owner, still "inside", leaves later and is told how its region ended.
    kx.touch("own")
    assert kx.cmds["own"].wait(20) == 0
    res = kx.result("own")
    assert "error" not in res, res
    assert res["end"]["end"].startswith("max-region")


# ====================================================================== I5


def _kill_daemon_mid_region(kx: Krex) -> dict[str, int]:
    """Siblings h1, h2, h3 frozen by the region of `own`; then SIGKILL the daemon, and h3's guardian
    with it. I5 for h1 and h2, whose guardians live: thawed, failed open and running again within 3 s.
    h3 has nobody left to thaw it: it is the leftover frozen group a new daemon must recover.
    Returns the hammers' pids."""
    d = kx.start_daemon(slots=8)
    _hold_with_siblings(kx, "h1", "h2", "h3")
    hp = {h: kx.progress(h)[2] for h in ("h1", "h2", "h3")}
    # krexd is stopped first: a live one would end h3's command as its guardian died.
    os.kill(d.pid, signal.SIGSTOP)
    kx.cmds["h3"].popen.kill()
    kx.cmds["h3"].popen.wait(5)
    d.kill()
    d.wait(5)
    t_kill = time.monotonic()
    for h in ("h1", "h2"):  # their guardians are alive and thaw them
        kx.wait(lambda h=h: frozen_reason(hp[h]) is None, 3, f"{h} to be thawed by its guardian")
        left = 3 - (time.monotonic() - t_kill)
        assert kx.advances(h, timeout=max(left, 0.05)), f"{h} made no progress within 3 s of the daemon's end"
    procs = {p.pid: p for p in kx.snapshot().procs}
    for h in ("h1", "h2"):
        assert procs[hp[h]].fail_opens > 0, procs[hp[h]]
    assert not kx.gate_open()  # nobody reopened it: the shims failed open on their own
    return hp


def test_daemon_killed_mid_region_commands_fail_open_and_new_daemon_recovers(kx: Krex) -> None:
    hp = _kill_daemon_mid_region(kx)
    kx.start_daemon(slots=8)
    kx.wait(lambda: kx.gate_open(), 5, "the new daemon to reopen the gate")
    kx.wait(lambda: kx.frozen_groups() == [], 5, "the new daemon to thaw leftover groups")
    assert frozen_reason(hp["h3"]) is None
    assert kx.advances("h3", timeout=5), "h3 (orphaned, frozen) was not thawed by the new daemon"
    # New regions work.
    o2 = kx.run("o2", "regions", "-n", "3", "--pause-ms", "10")
    assert o2.wait(60) == 0, o2.output()
    res = kx.result("o2")
    assert res["errors"] == [] and len(res["regions"]) == 3
    assert all(not r["grant"]["contaminated"] for r in res["regions"])
    assert kx.gate_open()
    assert kx.frozen_groups() == []


def test_regions_after_a_daemon_restart_are_exclusive(kx: Krex) -> None:
    hp = _kill_daemon_mid_region(kx)
    kx.start_daemon(slots=8)
    kx.wait(lambda: kx.gate_open(), 5, "the new daemon to reopen the gate")
    o2 = kx.run("o2", "regions", "-n", "3", "--pause-ms", "10", "--sleep-ms", "20")
    assert o2.wait(60) == 0, o2.output()
    res = kx.result("o2")
    assert res["errors"] == [] and len(res["regions"]) == 3
    iv = owner_intervals(res)
    for h in hp:
        kx.touch(h)
    ticks = {h: kx.result(h, timeout=20, pid=hp[h])["ticks"] for h in hp}
    # The commands that outlived the old daemon are siblings of the new owner like any other.
    bad = foreign_ops(iv, kx.ops(gpu=0))
    for h in hp:
        bad += foreign_ticks(iv, hp[h], ticks[h])
    grants = [r["grant"] for r in res["regions"] if not r["grant"]["contaminated"]]
    if bad and grants:
        per_pid = {h: sum(f"pid {hp[h]} " in b for b in bad) for h in hp}
        raise NotExclusiveAfterRestart(
            f"clean grants to slot {grants[0]['slot']} (frozen slots {[g['frozen_slots'] for g in grants]}), "
            f"yet siblings ran or submitted inside: {per_pid}; e.g. {bad[:2]}"
        )


# ====================================================================== I6


def test_end_from_another_slot_or_connection_is_refused(kx: Krex) -> None:
    # B runs on GPU 1: a newcomer on A's GPU would (rightly) start frozen until A's region ends.
    kx.gpus = 2
    kx.start_daemon(slots=3)
    kx.run("a", "hold", "--child-end", gpu=0)
    ready = kx.result("a", "ready", timeout=30)
    a_slot = ready["grant"]["slot"]
    # A process of A's own command, on a connection of its own: refused.
    child = kx.result("a-child")
    assert "reply" not in child, child
    assert child["kind"] == "Busy" and "another connection" in child["error"]
    # Command B (another slot): refused, and told why.
    b = kx.run("b", "end", gpu=1)
    assert b.wait(30) != 0
    res_b = kx.result("b")
    assert "reply" not in res_b
    assert "END without BEGIN" in res_b["error"]
    assert "END without BEGIN" in b.output()
    # The test process itself (no slot at all): refused.
    c = kx.client()
    try:
        with pytest.raises(UsageError, match="END without BEGIN"):
            c.request({"op": "end"})
    finally:
        c.close()
    # A's region is untouched.
    st = kx.status()
    assert [(r["pid"], r["slot"], r["granted"]) for r in st["regions"]] == [(ready["pid"], a_slot, True)]
    gate = kx.snapshot().gates[0]
    assert gate.closed and gate.owner_slot == a_slot
    kx.touch("a")
    assert kx.cmds["a"].wait(20) == 0
    res_a = kx.result("a")
    assert res_a["end"]["end"] == "end", res_a
    assert kx.gate_open()


# ====================================================================== soak


def test_soak_1000_regions_from_8_commands(kx: Krex) -> None:
    kx.start_daemon(slots=8)
    t0 = time.monotonic()
    names = [f"s{i}" for i in range(8)]
    for n in names:
        kx.run(
            n, "regions", "-n", "125", "--kernels", "2", "--us", "20", "--gap-kernels", "1", "--barrier", "8"
        )
    deadline = t0 + 120
    for n in names:
        rc = kx.cmds[n].wait(max(deadline - time.monotonic(), 0.1))
        assert rc == 0, f"{n}: {kx.cmds[n].output()[-1500:]}"
    elapsed = time.monotonic() - t0
    results = [kx.result(n) for n in names]
    assert all(r["errors"] == [] and len(r["regions"]) == 125 for r in results)
    iv = owner_intervals(*results)
    assert len(iv) == 1000
    assert intervals_disjoint(iv) == []
    ops = kx.ops(gpu=0)
    assert foreign_ops(iv, ops) == []
    pids = {r["pid"] for r in results}
    assert {o["pid"] for o in ops} == pids
    assert len(ops) >= 8 * (1 + 125 * 3)
    recs = [r for r in kx.journal() if r["owner_pid"] in pids]
    assert len(recs) == 1000 and all(r["end"] == "end" for r in recs)
    assert kx.status()["slots"] == []
    assert kx.frozen_groups() == [] and kx.gate_open()
    print(f"soak: 1000 regions from 8 commands in {elapsed:.1f} s")


def test_siblings_leaving_while_regions_start_never_wedge_the_gpu(kx: Krex) -> None:
    kx.start_daemon(slots=8)
    until = kx.out / "until"
    owner = kx.run("own", "regions", "-n", "100000", "--kernels", "1", "--us", "20", "--until", str(until))
    kx.wait(lambda: kx.journal(), 30, "the owner's first region")
    n = 0
    for wave in range(WAVES):
        names = [f"w{wave}-{i}" for i in range(3)]
        for name in names:
            kx.run(name, "hammer", "--us", "50", "--seconds", "0.4")
        for name in names:
            assert kx.cmds[name].wait(30) == 0, kx.cmds[name].output()
            n += 1
    until.write_text("")
    assert owner.wait(30) == 0, owner.output()
    res = kx.result("own")
    assert res["errors"] == []
    assert len(res["regions"]) > n  # regions kept coming while siblings came and went
    assert kx.status()["slots"] == [] and kx.gate_open() and kx.frozen_groups() == []


WAVES = 6


# ====================================================================== several GPUs


def test_region_on_gpu0_never_blocks_gpu1(kx: Krex) -> None:
    kx.gpus = 2
    kx.start_daemon(slots=4)
    kx.run("g1", "hammer", "--us", "50", gpu=1)
    kx.run("g0", "hammer", "--us", "50", gpu=0)
    pid1, pid0 = kx.wait_running("g1"), kx.wait_running("g0")
    owner = kx.run("own", "regions", "-n", "10", "--sleep-ms", "30", "--pause-ms", "20", gpu=0)
    assert owner.wait(60) == 0, owner.output()
    for h in ("g0", "g1"):
        kx.touch(h)
        assert kx.cmds[h].wait(30) == 0
    res = kx.result("own")
    assert res["errors"] == [] and all(r["grant"]["gpu"] == 0 for r in res["regions"])
    iv = owner_intervals(res)
    ops1 = [o for o in kx.ops(gpu=1)]
    assert ops1 and {o["pid"] for o in ops1} == {pid1}
    in_regions = [o for o in ops1 if inside(iv, -1, o["submit"])]
    assert in_regions, "the GPU 1 hammer never submitted during a GPU 0 region"
    assert [t for t in kx.result("g1")["ticks"] if inside(iv, -1, t)], "the GPU 1 hammer was stopped"
    # ...while GPU 0's sibling was kept out.
    assert foreign_ops(iv, kx.ops(gpu=0)) == []
    assert foreign_ticks(iv, pid0, kx.result("g0")["ticks"]) == []
    assert all(len(r["grant"]["frozen_slots"]) == 1 for r in res["regions"])

    p = kx.krex("daemon", "status", "--json")
    assert p.returncode == 0, p.stderr
    st = json.loads(p.stdout)
    assert st["daemon"]["gpus"] == 2
    part = st["partition"]
    assert sorted(s["gpu"] for s in part["slices"]) == [0, 1]
    if part["degraded"]:
        assert part["reason"].strip()
    else:
        a, b = (set(s["shared"]) | set(s["reserved"]) for s in part["slices"])
        assert not a & b


def test_partition_is_reported_degraded_on_a_small_box(kx: Krex) -> None:
    if len(os.sched_getaffinity(0)) > 3:
        pytest.skip("enough cores for a real partition")
    kx.start_daemon(slots=2)
    st = json.loads(kx.krex("daemon", "status", "--json").stdout)
    assert st["partition"]["degraded"] is True and st["partition"]["reason"]
    p = kx.krex("daemon", "status")
    assert "DEGRADED" in p.stdout


# ====================================================================== bad input


def _nothing_left(kx: Krex, daemon_expected: bool) -> None:
    assert kx.frozen_groups() == []
    if not daemon_expected:
        assert not daemon_alive(kx.sock), "a daemon was left running"
        assert kx.our_pids() == [], f"processes left behind: {kx.our_pids()}"
        return
    st = kx.status()
    assert st["slots"] == [] and st["regions"] == [], st
    snap = kx.snapshot()
    assert snap.slots == [] and all(not g.closed for g in snap.gates)


def _clear_error(p: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert p.returncode != 0, p
    assert "Traceback" not in p.stderr, p.stderr
    assert "error" in p.stderr.lower(), p.stderr
    for n in needles:
        assert n in p.stderr, p.stderr


@pytest.mark.parametrize("gpus", ["same", "other"])
def test_a_second_daemon_on_the_same_segment_is_refused(kx: Krex, tmp_path: Path, gpus: str) -> None:
    """Another state directory (its own lock and socket) but the same segment: the same user
    without KREX_STATE_DIR in one shell, or one KREX_SHM for two. Two krexd would hand out
    the same slots and close each other's gates; the second refuses to start, and says why,
    also when it sees another GPU count (it would have remade the first one's segment) and
    when several commands start it at once (each says why, at once)."""
    first = kx.start_daemon(slots=2)
    other = tmp_path / "other-state"
    other.mkdir()
    env = kx.env(KREX_STATE_DIR=str(other), **({"KREX_SIM_GPUS": "2"} if gpus == "other" else {}))
    p = kx.krex("daemon", "start", "--device", "sim", env=env, timeout=60)
    _clear_error(p, "in use by another krexd", f"pid {first.pid}", "KREX_SHM")
    t0 = time.monotonic()
    runs = [
        subprocess.Popen(
            [*KREX, "run", "--device", "sim", "--", "true"], env=env, stderr=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    for r in runs:
        _, err = r.communicate(timeout=60)
        assert r.returncode != 0 and "in use by another krexd" in err, (r.returncode, err)
    assert time.monotonic() - t0 < 10
    assert first.poll() is None and kx.status()["daemon"]["pid"] == first.pid
    assert kx.status()["segment"]["state"] == "ok", kx.status()["segment"]
    assert kx.krex("run", "--device", "sim", "--", "true").returncode == 0  # the first one serves
    assert not daemon_alive(other / "krexd.sock")


def test_unknown_gpu_with_a_daemon(kx: Krex) -> None:
    kx.start_daemon(slots=2)
    p = kx.krex("run", "--device", "sim", "--gpu", "7", "--", "true")
    _clear_error(p, "unknown GPU 7")
    _nothing_left(kx, daemon_expected=True)


def test_unknown_gpu_without_a_daemon_starts_none(kx: Krex) -> None:
    p = kx.krex("run", "--device", "sim", "--gpu", "7", "--", "true")
    _clear_error(p, "unknown GPU 7")
    _nothing_left(kx, daemon_expected=False)


@pytest.mark.parametrize(
    ("argv", "needle", "code"),
    [
        (["--"], "no command given", 125),  # krex run's own failures exit 125
        (["--", "/nonexistent/cp_cmd"], "command not found", 127),
        (["--", "cp_no_such_command_xyz"], "command not found", 127),
    ],
    ids=["empty", "missing-path", "missing-on-path"],
)
def test_bad_command(kx: Krex, argv: list[str], needle: str, code: int) -> None:
    p = kx.krex("run", "--device", "sim", *argv)
    _clear_error(p, needle)
    assert p.returncode == code
    _nothing_left(kx, daemon_expected=False)


def test_end_without_begin(kx: Krex) -> None:
    kx.start_daemon(slots=2)
    c = kx.client()
    try:
        with pytest.raises(UsageError, match="END without BEGIN"):
            c.request({"op": "end"})
    finally:
        c.close()
    b = kx.run("b", "end")
    assert b.wait(30) != 0
    assert "END without BEGIN" in b.output()
    kx.wait(lambda: kx.status()["slots"] == [], 5, "b's slot to be released")
    _nothing_left(kx, daemon_expected=True)


@pytest.mark.parametrize(
    ("var", "value", "needle"),
    [
        ("KREX_SIM_GPUS", "abc", "KREX_SIM_GPUS"),
        ("KREX_SIM_GPUS", "0", "KREX_SIM_GPUS"),
        ("KREX_SHM", "bad name", "KREX_SHM"),
        ("KREX_SHM", "/a/b", "KREX_SHM"),
    ],
)
@pytest.mark.parametrize("what", ["run", "daemon-start"])
def test_malformed_variable(kx: Krex, var: str, value: str, needle: str, what: str) -> None:
    env = kx.env(**{var: value})
    if what == "run":
        p = kx.krex("run", "--device", "sim", "--", "true", env=env)
    else:
        p = kx.krex("daemon", "start", "--device", "sim", env=env)
    _clear_error(p, needle)
    _nothing_left(kx, daemon_expected=False)


def test_unwritable_socket_path(kx: Krex) -> None:
    env = kx.env(KREX_SOCKET="/proc/nope/krexd.sock")
    p = kx.krex("daemon", "start", "--device", "sim", "--foreground", env=env, timeout=30)
    _clear_error(p, "/proc/nope")
    _nothing_left(kx, daemon_expected=False)


def test_second_daemon_start_is_refused(kx: Krex) -> None:
    first = kx.start_daemon(slots=2)
    p = kx.krex("daemon", "start", "--device", "sim")
    _clear_error(p, "already running")
    assert p.returncode == Busy.exit_code
    # The first daemon is unharmed, and no second one runs.
    assert first.poll() is None and daemon_alive(kx.sock)
    assert kx.status()["daemon"]["pid"] == first.pid
    daemons = [
        pid for pid in kx.our_pids() if b"krex.node.daemon" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert daemons == [first.pid]
    # The same through the daemon's own lock, bypassing the CLI's socket check.
    q = subprocess.run(
        [sys.executable, "-m", "krex.node.daemon", "--device", "sim"],
        env=kx.env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert q.returncode != 0 and "already running" in q.stderr, q.stderr
    assert first.poll() is None and daemon_alive(kx.sock)
    _nothing_left(kx, daemon_expected=True)


def test_krex_error_kinds_reach_the_client(kx: Krex) -> None:
    """Refused requests come back as typed errors (NotFound for an unknown GPU), not as a dead connection."""
    kx.start_daemon(slots=2)
    c = kx.client()
    try:
        with pytest.raises(NotFound, match="unknown GPU"):
            c.request({"op": "admit", "gpu": 7})
        with pytest.raises(KrexError, match="unknown operation"):
            c.request({"op": "bogus"})
    finally:
        c.close()
    _nothing_left(kx, daemon_expected=True)


def test_a_slot_number_handed_to_a_new_command_mid_drain_is_frozen_too(kx: Krex) -> None:
    """A sibling frozen early (it had nothing to drain) is killed while another sibling
    still drains, and its slot number goes at once to a queued command: the region must
    freeze the newcomer too, not take it for the sibling it froze at the drain's start."""
    kx.start_daemon(slots=3)
    go, t_slow = kx.out / "go", kx.out / "t_slow"
    owner = kx.run(
        "own", "regions", "-n", "1", "--kernels", "1", "--us", "100", "--sleep-ms", "500", "--go", str(go)
    )
    kx.result("own", "waiting", timeout=30)
    kx.run("short", "hammer", "--us", "0")  # CPU only: frozen as soon as the drain starts
    kx.run("slow", "hammer", "--long-us", "1500000", "--trigger", str(t_slow))
    short_pid = kx.wait_running("short")
    kx.wait_running("slow", ticks=0)
    kx.run("new", "hammer", "--us", "0")  # every slot is taken: it queues for the short one's
    t_slow.write_text("")
    kx.result("slow", "ready", timeout=10)
    go.write_text("")
    kx.wait(lambda: kx.stands_still("short", 0.05), 10, "the short sibling to be frozen")
    os.kill(short_pid, signal.SIGKILL)  # a runner's timeout, the OOM killer
    assert kx.cmds["short"].wait(30) != 0
    new_pid = kx.wait_running("new", ticks=5)
    assert owner.wait(60) == 0, owner.output()
    kx.stop_all("slow", "new")
    reg = kx.result("own")["regions"][0]
    g = reg["grant"]
    # Admitted before the drain ended: the region froze the short sibling, the slow one and
    # the newcomer under the short one's number (a newcomer after the grant makes it 2).
    assert len(g["frozen_slots"]) == 3, ("the newcomer came too late", g)
    assert not g["contaminated"], g["reasons"]
    iv = owner_intervals(kx.result("own"))
    assert foreign_ticks(iv, new_pid, kx.result("new")["ticks"])[:2] == [], g
    # It started frozen (the gate was closed): it did not run before the region ended either.
    assert kx.result("new")["ticks"][0] > reg["t_end"], g
    assert kx.frozen_groups() == []


@pytest.mark.parametrize("backend", ["cgroup2", "signal"])
def test_a_command_admitted_while_a_region_enters_starts_frozen(kx: Krex, backend: str) -> None:
    """Once a region has closed the gate, a newly admitted command starts frozen, as it
    does during a granted region: it never runs between its admission and the grant
    (before, it ran until the entry's last freeze pass, and one admitted after that pass
    ran through the whole region). With SIGSTOP freezing the command waits before exec
    until krexd has it (before, it ran from exec until krexd handled `started`)."""
    _backend_or_skip(kx, backend)
    kx.start_daemon(slots=3, freezer_name=backend)
    go, trig = kx.out / "go", kx.out / "trig"
    owner = kx.run("own", "regions", "-n", "1", "--kernels", "1", "--us", "100", "--go", str(go))
    kx.result("own", "waiting", timeout=30)
    kx.run("slow", "hammer", "--long-us", "3000000", "--trigger", str(trig))  # a 3 s drain
    kx.wait_running("slow", ticks=0)
    trig.write_text("")
    kx.result("slow", "ready", timeout=10)
    go.write_text("")
    time.sleep(0.2)  # the region's request is on its way: its drain lasts 3 s
    kx.run("new", "hammer", "--us", "0")  # admitted while the region drains
    assert owner.wait(60) == 0, owner.output()
    kx.wait(lambda: (kx.out / "new.progress").exists(), 30, "the newcomer to start")
    kx.stop_all("slow", "new")
    reg = kx.result("own")["regions"][0]
    g = reg["grant"]
    assert not g["contaminated"], g["reasons"]
    assert len(g["frozen_slots"]) == 2, ("the newcomer was not admitted before the drain ended", g)
    early = [t for t in kx.result("new")["ticks"] if t < reg["t_end"]]
    assert early == [], f"the newcomer ran {len(early)} ticks before the region ended"
    assert kx.frozen_groups() == []


def test_a_sibling_whose_new_processes_register_mid_drain_never_stalls_the_entry(kx: Krex) -> None:
    """A sibling forks processes that make their first GPU call while another sibling
    still drains: each registers (owing the drain an ack) at the closed gate. Freezing
    that sibling early must not freeze one before its helper acked and then wait for
    that ack until the drain timeout (a false drain-timeout and a 5 s entry)."""
    kx.start_daemon(slots=3)
    kx.run("fork", "forker", "--us", "10", "--fork-ms", "1", "--max-children", "64")
    kx.result("fork", "ready", timeout=30)
    bad = []
    for i in range(6):
        go, trig = kx.out / f"go{i}", kx.out / f"trig{i}"
        owner = kx.run(f"own{i}", "regions", "-n", "1", "--kernels", "1", "--us", "100", "--go", str(go))
        kx.result(f"own{i}", "waiting", timeout=30)
        kx.run(f"slow{i}", "hammer", "--long-us", "400000", "--trigger", str(trig))
        kx.wait_running(f"slow{i}", ticks=0)
        trig.write_text("")
        kx.result(f"slow{i}", "ready", timeout=10)
        go.write_text("")
        assert owner.wait(60) == 0, owner.output()
        kx.touch(f"slow{i}")
        assert kx.cmds[f"slow{i}"].wait(30) == 0
        g = kx.result(f"own{i}")["regions"][0]["grant"]
        # Only the drain is judged here: this fork pattern also trips the process audit
        # now and then (an in-flight counter out of range), a separate matter.
        if "drain-timeout" in g["flags"] or g["drain_s"] > 2:
            bad.append({k: g[k] for k in ("drain_s", "reasons", "frozen_early", "drained")})
    kx.touch("fork")
    assert kx.cmds["fork"].wait(30) == 0, kx.cmds["fork"].output()
    assert kx.result("fork")["children"] > 100
    assert bad == []
    assert kx.frozen_groups() == []
