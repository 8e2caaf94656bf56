"""Shared machinery for the KREX test suite: building the C victims, running
them under the shim against the simulated GPU, and reading the simulator's
trace. conftest.py puts this directory's parent on sys.path."""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from krex.native import LIB_DIR, lib, shim_path
from krex.node.shm import ProcInfo, Segment

REPO = Path(__file__).resolve().parents[2]
INTERPOSE = REPO / "interpose"
C_DIR = REPO / "tests" / "c"
ALL_PATHS = (
    "direct", "dlsym", "dlvsym", "gpa", "gpa_pt", "gpa1", "cudart_ep", "cudart_ep_pt", "hip_gpa", "hip_gpa_pt"
)
CC = os.environ.get("CC", "gcc")
CXX = os.environ.get("CXX", "g++")
sys.path.insert(0, str(REPO))
from krex_build import CORE_SOURCES, SHIM_SOURCES  # noqa: E402 - the build's lists, not copies

# The shim's own files: its headers and its parts (the shared core aside).
SHIM_FILES = ("shim.h", "shim_fastpath.h", *(f for f in SHIM_SOURCES if f not in CORE_SOURCES))


def shim_text() -> str:
    """The shim's source, every part of it, for tests that read what it names."""
    return "\n".join((INTERPOSE / f).read_text() for f in SHIM_FILES)


_counter = itertools.count()


def unique_name(kind: str) -> str:
    """A shared-memory name no other test (or test run) uses."""
    return f"/krex-{kind}-{os.getpid()}-{next(_counter)}"


# --------------------------------------------------------------------- victims

_victims: dict[str, Path] | None = None
_victims_lock = threading.Lock()


def nvtx_include_dir() -> Path | None:
    """A directory holding the NVTX v3 headers (nvtx3/nvToolsExt.h): the CUDA toolkit's."""
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda",
             *sorted(map(str, Path("/usr/local").glob("cuda*")))]
    for r in roots:
        if r and (Path(r) / "include" / "nvtx3" / "nvToolsExt.h").is_file():
            return Path(r) / "include"
    return None


def _compile_cpp(src: Path, out: Path) -> bool:
    """A C++ victim (tests/c/*.cpp: they use the NVTX v3 headers); False when the headers
    are not on this machine (its tests skip)."""
    inc = nvtx_include_dir()
    if inc is None:
        return False
    cmd = [CXX, "-O0", "-g", "-Wall", "-std=c++17", f"-I{INTERPOSE}", f"-I{inc}", "-o", str(out), str(src),
           f"-L{LIB_DIR}", f"-Wl,-rpath,{LIB_DIR}", "-lcudart", "-lpthread", "-ldl"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"compiling {src.name} failed:\n{' '.join(cmd)}\n{r.stderr[-4000:]}")
    return True


def _compile(src: Path, out: Path) -> None:
    text = src.read_text()
    srcs = [str(src)]
    if "krex_now_ns" in text:
        srcs += [str(INTERPOSE / f) for f in CORE_SOURCES]
    # A victim that stands in for libc functions the shim calls must export them.
    extra = ["-rdynamic"] if "KREX_TEST_RDYNAMIC" in text else []
    # lib*.c: a shared library (libNAME.so) for a victim to load.
    # -no-pie: static sample buffers sit at the same address in every run, so
    # argument hashes (which include pointer values) compare across processes.
    shape = ["-shared", "-fPIC"] if src.stem.startswith("lib") else ["-no-pie"]
    # KREX_TEST_NO_CUDART: no libcudart in DT_NEEDED, as a statically linked CUDA runtime
    # has; it reaches the simulated device through libcuda and the device model only.
    gpu = ["-lcudart", "-lcuda", "-l:libamdhip64.so"]
    if "KREX_TEST_NO_CUDART" in text:
        gpu = ["-lcuda", "-lkrexsim"]
    cmd = [
        CC,
        "-O0",
        "-g",
        "-Wall",
        *shape,
        *extra,
        f"-I{INTERPOSE}",
        "-o",
        str(out),
        *srcs,
        f"-L{LIB_DIR}",
        f"-Wl,-rpath,{LIB_DIR}",
        *gpu,
        "-lpthread",
        "-ldl",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"compiling {src.name} failed:\n{' '.join(cmd)}\n{r.stderr[-4000:]}")


def _built_name(src: Path) -> str:
    return src.stem + ".so" if src.stem.startswith("lib") else src.stem


def victims() -> dict[str, Path]:
    """Compile every tests/c/*.c once per test session (like memray's test
    victims); returns {stem: executable}."""
    global _victims
    with _victims_lock:
        if _victims is None:
            if not (LIB_DIR / "libcuda.so.1").exists():
                raise RuntimeError(f"{LIB_DIR} has no simulated GPU libraries: run `make install` first")
            outdir = Path(tempfile.mkdtemp(prefix="krex-victims-"))
            atexit.register(shutil.rmtree, outdir, True)
            srcs = sorted(C_DIR.glob("*.c"))
            cpp = sorted(C_DIR.glob("*.cpp"))
            with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as ex:
                list(ex.map(lambda s: _compile(s, outdir / _built_name(s)), srcs))
                built = list(ex.map(lambda s: _compile_cpp(s, outdir / s.stem), cpp))
            _victims = {s.stem: outdir / _built_name(s) for s in srcs}
            _victims.update({s.stem: outdir / s.stem for s, ok in zip(cpp, built, strict=True) if ok})
        return _victims


def driver_list() -> list[dict[str, Any]]:
    """`table_driver list`: every (gated entry, path) pair the tables define."""
    out = subprocess.run(
        [str(victims()["table_driver"]), "list"],
        env=clean_env(),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def spawn_with_pid(pid: int, tries: int = 200) -> subprocess.Popen[bytes] | None:
    """An unrelated process (`sleep 60`) that gets `pid`: a real pid reuse, made by setting
    the next pid through /proc/sys/kernel/ns_last_pid (root). None if another process
    kept taking it first."""
    for _ in range(tries):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        p = subprocess.Popen(["sleep", "60"])
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    return None


# ------------------------------------------------------------------------- env


# The freeze policy of every daemon a test starts, unless the test names another: the tests
# of the freezing mechanics assume `all` (siblings frozen). The default policy (`gpu`) has
# tests of its own (test_freeze_policy.py), which set no policy.
TEST_POLICY = {"KREX_FREEZE_POLICY": "all"}


def clean_env() -> dict[str, str]:
    """os.environ without anything that would put a child under KREX (or the
    simulator) by accident, plus TEST_POLICY."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KREX_", "SIM_"))
        and k not in ("LD_PRELOAD", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")
    }
    env.update(TEST_POLICY)
    return env


def private_world(kind: str) -> dict[str, str]:
    """clean_env() plus a KREX world of its own: a fresh state directory (short path: it
    holds the socket), control segment and one simulated GPU, named after `kind`."""
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    env = clean_env()
    env.update(
        KREX_STATE_DIR=tempfile.mkdtemp(prefix=f"kx{kind}-"),
        KREX_SHM=f"/krex-t{kind}-{tag}",
        KREX_SIM_SHM=f"/krex-t{kind}sim-{tag}",
        KREX_SIM_GPUS="1",
    )
    return env


# ----------------------------------------------------------------------- trace

_BARE_SLOT = re.compile(r'"slot":(?!-?\d+[,}])([^,}]*)')


def read_jsonl(path: Path, strict: bool = False) -> list[dict[str, Any]]:
    """Complete lines only: a writer may be in the middle of the last one.

    The simulator writes $KREX_SLOT into op lines verbatim, so a non-numeric
    value makes the line invalid JSON (see test_passthrough); unless `strict`,
    such a slot is read as a string instead of losing the line."""
    try:
        data = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in data.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if strict:
                raise
            try:
                out.append(json.loads(_BARE_SLOT.sub(r'"slot":"\1"', line)))
            except json.JSONDecodeError:
                continue
    return out


def parse_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def wait_until(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.01) -> Any:
    """Poll `pred` until it returns something truthy; fail with `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


# -------------------------------------------------------------------- children


class Child:
    """A victim process in its own session (so its forked children die with it),
    with its stdout collected line by line in the background."""

    def __init__(self, argv: list[str], env: dict[str, str], stdin: int | None = subprocess.PIPE) -> None:
        self.argv = argv
        self.popen = subprocess.Popen(
            argv,
            env=env,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.pid = self.popen.pid
        self.lines: list[dict[str, Any]] = []
        self._q: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._stderr: list[str] = []
        self._t = threading.Thread(target=self._pump, daemon=True)
        self._t.start()
        self._te = threading.Thread(target=self._pump_err, daemon=True)
        self._te.start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            if line.startswith("{"):
                try:
                    d = json.loads(line)
                except json.JSONDecodeError:
                    continue
                self.lines.append(d)
                self._q.put(d)
        self._q.put(None)

    def _pump_err(self) -> None:
        assert self.popen.stderr is not None
        for line in self.popen.stderr:
            self._stderr.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    def expect(self, pred: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
        """The next output line (in arrival order) that satisfies `pred`."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                d = self._q.get(timeout=max(left, 0.001))
            except queue.Empty:
                d = None
                if time.monotonic() >= deadline:
                    raise AssertionError(
                        f"pid {self.pid}: no line for {what} within {timeout:g}s; "
                        f"got {self.lines[-5:]}, stderr {self.stderr[-500:]!r}"
                    ) from None
                continue
            if d is None:
                raise AssertionError(
                    f"pid {self.pid} closed stdout before {what} "
                    f"(rc={self.popen.poll()}); got {self.lines[-5:]}, "
                    f"stderr {self.stderr[-500:]!r}"
                )
            if pred(d):
                return d

    def send(self, text: str = "\n") -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(text)
        self.popen.stdin.flush()

    def close_stdin(self) -> None:
        if self.popen.stdin and not self.popen.stdin.closed:
            self.popen.stdin.close()

    def wait(self, timeout: float) -> int:
        rc = self.popen.wait(timeout=timeout)
        self._t.join(timeout=5)
        self._te.join(timeout=5)
        return rc

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill_group(self) -> None:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)
        for f in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            try:
                if f:
                    f.close()
            except OSError:
                pass


def stop_process(pid: int, timeout: float = 10) -> None:
    """SIGSTOP `pid` and wait until every one of its threads is really stopped:
    kill() returns before a thread running on another CPU has noticed."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except FileNotFoundError:
                continue
            if stat[stat.rindex(")") + 2] not in "tT":
                return False
        return True

    wait_until(stopped, timeout, f"pid {pid} to stop")


# --------------------------------------------------------------------- harness


class Harness:
    """One KREX segment (1 GPU), one simulated device timeline and one trace
    file, private to a test; tracks every child so teardown can kill them."""

    def __init__(self, tmpdir: Path) -> None:
        self.bins = victims()
        self.name = unique_name("test")
        self.sim_shm = unique_name("sim")
        self.trace_path = tmpdir / "trace.jsonl"
        self.seg = Segment.create(self.name, n_gpus=1, exclusive=True)
        self.children: list[Child] = []

    # environment
    def env(
        self, slot: int | None, *, krex: bool = True, preload: bool = True, rc: int = 0, **extra: str
    ) -> dict[str, str]:
        e = clean_env()
        e.update(
            LD_LIBRARY_PATH=str(LIB_DIR),
            KREX_SIM_TRACE=str(self.trace_path),
            KREX_SIM_SHM=self.sim_shm,
            KREX_SIM_GPUS="1",
            KREX_SIM_RC=str(rc),
        )
        if preload:
            e["LD_PRELOAD"] = str(shim_path())
        if krex:
            assert slot is not None
            e.update(KREX_SHM=self.name, KREX_SLOT=str(slot))
        e.update(extra)
        return e

    def claim(self) -> int:
        return self.seg.claim_slot(0)

    # processes
    def spawn(self, prog: str, args: Iterable[str], env: dict[str, str], **kw: Any) -> Child:
        c = Child([str(self.bins[prog]), *args], env, **kw)
        self.children.append(c)
        return c

    def run(self, prog: str, args: Iterable[str], env: dict[str, str], timeout: float = 60) -> Child:
        c = self.spawn(prog, args, env, stdin=subprocess.DEVNULL)
        try:
            c.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"{prog} {' '.join(args)} did not finish in {timeout}s") from exc
        return c

    # observation
    def events(self) -> list[dict[str, Any]]:
        return read_jsonl(self.trace_path)

    def ops(self, pid: int | None = None, life: bool = True) -> list[dict[str, Any]]:
        """The simulated GPU's ops; life=False leaves out LIFE calls (contexts, modules,
        memory: a drain helper's own context retain and release among them)."""
        return [
            e
            for e in self.events()
            if e.get("ev") == "op"
            and (pid is None or e["pid"] == pid)
            and (life or e["cls"] != lib.KREX_CLS_LIFE)
        ]

    def proc(self, pid: int) -> ProcInfo | None:
        for p in self.seg.snapshot().procs:
            if p.pid == pid:
                return p
        return None

    # teardown
    def close(self) -> None:
        try:
            for g in range(self.seg.n_gpus):
                self.seg.open_gate(g)
        except Exception:
            pass
        for c in self.children:
            c.kill_group()
        self.seg.close()
        Segment.unlink(self.name)
        lib.krex_shm_unlink(self.sim_shm.encode())


# ------------------------------------------------------------------ compare candidates

_candidate: Path | None = None


def sim_candidate() -> Path:
    """examples/compare/sim_candidate.c built once per session: a benchmark of known speed
    and noise on the simulated GPU (krex compare's candidates)."""
    global _candidate
    with _victims_lock:
        if _candidate is None:
            outdir = Path(tempfile.mkdtemp(prefix="krex-candidate-"))
            atexit.register(shutil.rmtree, outdir, True)
            out = outdir / "sim_candidate"
            src = REPO / "examples/compare/sim_candidate.c"
            cmd = [CC, "-O2", f"-I{INTERPOSE}", "-o", str(out), str(src),
                   f"-L{LIB_DIR}", f"-Wl,-rpath,{LIB_DIR}", "-lcudart", "-lm", "-ldl"]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"compiling sim_candidate.c failed:\n{' '.join(cmd)}\n{r.stderr[-4000:]}")
            _candidate = out
        return _candidate
