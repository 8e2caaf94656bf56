"""`make sanitize`: the shim (krex_build.SHIM_SOURCES) and the C test programs
(tests/c) built with ThreadSanitizer and then AddressSanitizer, and run against a
real krexd on the simulated GPU: concurrent submitters on all three paths, regions
(gate closes, drains, freezes), graph captures, fork, a failed end of capture, the
whole entry table, and exit with the drain helper running; and the NVTX injection
(libkrex_nvtx.so) with its C++ harness (tests/c/nvtx_ranges.cpp: threads, nesting, a
range ended on another thread), where the NVTX v3 headers are installed.

gcc's own -fsanitize=thread/address are used (libtsan/libasan come with gcc), so CI
needs nothing extra. Exits 1 on any sanitizer report or failed program."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INTERPOSE = ROOT / "interpose"
TESTS_C = ROOT / "tests" / "c"
CC = os.environ.get("CC", "gcc")
CXX = os.environ.get("CXX", "g++")
sys.path.insert(0, str(ROOT))

from krex.native import LIB_DIR  # noqa: E402 - after the path set-up
from krex.node.freezer import remove_leftovers  # noqa: E402
from krex_build import CORE_SOURCES, SHIM_SOURCES  # noqa: E402

SANITIZERS = {
    "thread": ("libtsan.so", "TSAN_OPTIONS", "halt_on_error=1 exitcode=66 second_deadlock_stack=1"),
    "address": ("libasan.so", "ASAN_OPTIONS", "halt_on_error=1 exitcode=66 detect_leaks=1 abort_on_error=0"),
}
REPORT_MARKS = ("WARNING: ThreadSanitizer", "ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:")
STRESS_S = 4.0


def cc(args: list[str]) -> None:
    r = subprocess.run([CC, *args], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"sanitize: {CC} {' '.join(args)} failed:\n{r.stderr[-4000:]}")


def runtime(lib: str) -> str:
    path = subprocess.run([CC, f"-print-file-name={lib}"], capture_output=True, text=True).stdout.strip()
    if not path or not os.path.isabs(path) or not os.path.exists(path):
        sys.exit(f"sanitize: {CC} has no {lib}; install gcc's sanitizer runtimes (libtsan2, libasan8)")
    return os.path.realpath(path)


def build(san: str, out: Path, shim_src: Path = INTERPOSE) -> dict[str, Path]:
    flags = [f"-fsanitize={san}", "-O1", "-g", "-fno-omit-frame-pointer", "-Wall", "-Wextra",
             "-Wno-unused-parameter", "-fPIC"]
    out.mkdir(parents=True, exist_ok=True)
    shim = out / "libkrex_interpose.so"
    # Another checkout (--shim-src) may predate the split: build the parts it has.
    srcs = [str(shim_src / f) for f in SHIM_SOURCES if (shim_src / f).exists()]
    cc([*flags, "-fvisibility=hidden", "-shared", "-o", str(shim), *srcs, "-ldl", "-lpthread"])
    bins = {"shim": shim}
    for name in ("stress", "actor", "table_driver"):
        src = TESTS_C / f"{name}.c"
        core = [str(INTERPOSE / f) for f in CORE_SOURCES] if "krex_now_ns" in src.read_text() else []
        srcs = [str(src), *core]
        exe = out / name
        cc([*flags, f"-I{INTERPOSE}", "-o", str(exe), *srcs,
            f"-L{LIB_DIR}", f"-Wl,-rpath,{LIB_DIR}", "-lcudart", "-lcuda", "-l:libamdhip64.so", "-lpthread",
            "-ldl"])
        bins[name] = exe
    cc([*flags, "-fvisibility=hidden", "-shared", "-o", str(out / "libkrex_nvtx.so"),
        str(INTERPOSE / "nvtx_inject.c"), "-ldl", "-lpthread"])  # next to the shim: the one it names
    inc = nvtx_include_dir()
    if inc is not None:
        exe = out / "nvtx_ranges"
        r = subprocess.run([CXX, *flags, "-std=c++17", f"-I{INTERPOSE}", f"-I{inc}", "-o", str(exe),
                            str(TESTS_C / "nvtx_ranges.cpp"), f"-L{LIB_DIR}", f"-Wl,-rpath,{LIB_DIR}",
                            "-lcudart", "-lpthread", "-ldl"], capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"sanitize: building nvtx_ranges.cpp failed:\n{r.stderr[-4000:]}")
        bins["nvtx_ranges"] = exe
    return bins


def nvtx_include_dir() -> Path | None:
    """The CUDA toolkit's include directory when it has the NVTX v3 headers."""
    for r in [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", *sorted(map(str, Path("/usr/local").glob("cuda*")))]:
        if r and (Path(r) / "include" / "nvtx3" / "nvToolsExt.h").is_file():
            return Path(r) / "include"
    return None


class World:
    """A private krexd (simulated GPU) and the environment of its opt-in processes."""

    def __init__(self, tag: str) -> None:
        self.base = Path(tempfile.mkdtemp(prefix=f"krex-san-{tag}-"))
        self.state = self.base / "state"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("KREX_", "TSAN_", "ASAN_"))}
        self.env.pop("LD_PRELOAD", None)
        self.env.update(
            KREX_STATE_DIR=str(self.state),
            KREX_SHM=f"/krex-san-{tag}-{os.getpid()}",
            KREX_SIM_SHM=f"/krex-sansim-{tag}-{os.getpid()}",
            KREX_SIM_GPUS="1",
        )
        self.sock = self.state / "krexd.sock"
        self.daemon: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.state.mkdir(mode=0o700)
        log = open(self.base / "krexd.log", "wb")  # noqa: SIM115 - handed to the child
        self.daemon = subprocess.Popen(
            [sys.executable, "-m", "krex.node.daemon", "--device", "sim", "--slots-per-gpu", "8"],
            env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(self.sock))
                return
            except OSError:
                if self.daemon.poll() is not None:
                    break
                time.sleep(0.05)
        sys.exit(f"sanitize: krexd did not start: {(self.base / 'krexd.log').read_text()[-2000:]}")

    def opt_in(self, preload: str) -> dict[str, str]:
        e = dict(self.env)
        e.update(LD_PRELOAD=preload, KREX_SOCKET=str(self.sock), LD_LIBRARY_PATH=str(LIB_DIR))
        return e

    def close(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.terminate()
            try:
                self.daemon.wait(30)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
        for n in (self.env["KREX_SHM"], self.env["KREX_SIM_SHM"]):
            Path("/dev/shm" + n).unlink(missing_ok=True)
        remove_leftovers(self.env["KREX_SHM"])
        shutil.rmtree(self.base, ignore_errors=True)


def _stacks(pid: int) -> str:
    """What a hung program and its children wait in (gdb when there is one, else wchan)."""
    r = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    out = []
    for p in [pid, *map(int, r.stdout.split())]:
        gdb = shutil.which("gdb")
        if gdb:
            try:
                bt = subprocess.run([gdb, "-p", str(p), "-batch", "-ex", "thread apply all bt"],
                                    capture_output=True, text=True, timeout=60).stdout
            except subprocess.TimeoutExpired:
                bt = "(gdb timed out)"

            out.append(f"-- pid {p}\n" + "\n".join(ln for ln in bt.splitlines() if ln.startswith(("#", "Thread"))))
        else:
            wchan = Path(f"/proc/{p}/wchan")
            out.append(f"-- pid {p}: wchan {wchan.read_text() if wchan.exists() else '?'}")
    return "\n".join(out)


def check(name: str, procs: list[tuple[str, subprocess.Popen[str]]], timeout: float) -> list[str]:
    failures = []
    for label, p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # The whole group: a forked child that hangs keeps the pipes open, and a
            # plain communicate() would then wait for it forever.
            stacks = _stacks(p.pid)
            os.killpg(p.pid, signal.SIGKILL)
            try:
                out, err = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                out, err = "", "(its pipes stayed open after SIGKILL to its process group)"
            failures.append(f"{name}/{label}: did not finish within {timeout:g} s; stacks:\n{stacks}")
        marks = [m for m in REPORT_MARKS if m in err]
        if p.returncode != 0 or marks:
            failures.append(f"{name}/{label}: exit {p.returncode}, {marks or 'no report'}\n{err[-6000:]}")
        elif name == "stress":
            last = json.loads(out.strip().splitlines()[-1])
            if last["errors"] or not last["regions"] or not last["kernels"]:
                failures.append(f"{name}/{label}: {last}")
            print(f"    {label}: {last}")
    return failures


def run_one(san: str, shim_src: Path) -> list[str]:
    lib, var, opts = SANITIZERS[san]
    bins = build(san, ROOT / "build" / "sanitize" / san, shim_src)
    preload = f"{runtime(lib)} {bins['shim']}"
    w = World(san[0])
    failures: list[str] = []
    try:
        w.start()
        env = w.opt_in(preload)
        env[var] = opts

        def spawn(prog: str, *args: str) -> subprocess.Popen[str]:
            return subprocess.Popen([str(bins[prog]), *args], env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)

        t0 = time.monotonic()
        # Two at once: each one's regions close the gate on, drain and freeze the other.
        failures += check("stress", [(f"#{i}", spawn("stress", str(STRESS_S))) for i in range(2)], 300)
        failures += check("table_driver", [("all paths", spawn("table_driver", "run",
                          "direct,dlsym,gpa,gpa_pt,gpa1,cudart_ep,cudart_ep_pt,hip_gpa,hip_gpa_pt"))], 300)
        failures += check("actor", [("capture+fork+region", spawn(
            "actor", "k:50", "capbegin:0x5000", "rc:900", "capend:0x5000", "rc:0", "fork", "k:50", "begin",
            "k:50", "end", "reap"))], 120)
        if "nvtx_ranges" in bins:
            env["KREX_NVTX_REGION"] = "k-*"
            got = check("nvtx", [("ranges", spawn("nvtx_ranges"))], 120)
            journal = w.state / "journal.jsonl"
            lines = journal.read_text().splitlines() if journal.exists() else []
            n = sum(1 for ln in lines if '"label": "nvtx:' in ln or '"label":"nvtx:' in ln)
            if not got and n < 15:  # tests/c/nvtx_ranges.cpp opens 15 regions under "k-*"
                got.append(f"nvtx/ranges: {n} NVTX region(s) in the journal, expected 15")
            print(f"    nvtx: {n} regions from NVTX ranges")
            failures += got
        else:
            print("  (no NVTX v3 headers: the NVTX injection is not checked)")
        print(f"  {san}: {'ok' if not failures else 'FAILED'} in {time.monotonic() - t0:.1f} s")
        log = (w.base / "krexd.log").read_text(errors="replace")
        if "Traceback" in log:
            failures.append(f"krexd ({san} run) logged a traceback:\n{log[-3000:]}")
    finally:
        w.close()
    return failures


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=list(SANITIZERS), help="run one sanitizer")
    ap.add_argument("--shim-src", type=Path, default=INTERPOSE,
                    help="build the shim from another checkout's interpose/ (to compare before/after)")
    a = ap.parse_args()
    failures: list[str] = []
    for san in [a.only] if a.only else list(SANITIZERS):
        print(f"sanitize: -fsanitize={san}")
        failures += run_one(san, a.shim_src.resolve())
    for f in failures:
        print(f"FAIL {f}", file=sys.stderr)
    print(f"sanitize: {'FAILED' if failures else 'clean'} ({len(failures)} failure(s))")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
