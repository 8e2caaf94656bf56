"""Test victim for tests/integration/test_regions.py: one Python process that
uses the simulated GPU through ctypes (under `krex run` the shim gates it) and
the Python region API.

    cp_worker.py MODE OUT_DIR [options]

Modes (every output file is written atomically into OUT_DIR, named after --name):
  regions  N regions in a loop; each launches --kernels kernels of --us us, then
           synchronises and sleeps --sleep-ms. Records CLOCK_MONOTONIC right after
           the region is granted (t_grant) and right before it is left (t_end),
           the grant, and the thread affinity inside and after the region. --go FILE:
           write NAME.waiting after warming up, start once FILE exists (--prime: after
           one unrecorded region, so the first one asked for is quick). --barrier N:
           write NAME.done at the end and exit once N such files exist. --until FILE:
           stop taking regions once FILE exists.
           Output: NAME.json {"pid", "regions": [...], "errors": [...]}
  hammer   until NAME.stop appears (or --seconds): launch a --us kernel, synchronise,
           burn ~1 ms of CPU, bump a progress counter. The counter and the time of
           the last bump live in NAME.progress (two int64: counter, monotonic ns,
           plus the pid) through a shared mapping, so a test can read it live.
           With --long-us, first queue one kernel that long and write NAME.ready.
           At the end: NAME.json {"pid", "ticks": [monotonic ns of every bump]}
  hold     enter a region (with --child-end, first run `end` as a child process of the
           same command), write NAME.ready ({"pid", "grant", "t_grant"}), then
           sleep inside it until NAME.stop appears (forever if it never does).
           Output: NAME.json {"pid", "t_end", "end": reply or error}
  chaos    N regions like `regions`, for the chaos test (tests/helpers/chaos.py): never
           stops at an error (the daemon may be killed and restarted under it); with
           probability --cut-p a region sleeps --cut-s inside (longer than --max-region).
           Appends one line per region to NAME.regions.jsonl as it goes: {"i", "t_grant",
           "t_end", "long", "clean", "cut", "flags", "end"} or {"i", "error"}.
  forker   until NAME.stop appears (or --seconds): fork a child every --fork-ms that makes
           one GPU call (--us) and exits, at most --max-children alive at once; the parent
           itself never touches the GPU. Output: NAME.json {"pid", "children"}
  life     LIFE calls only, never a kernel: load and unload a module, allocate and free
           device memory, through the simulated driver, in a loop until NAME.stop appears
           (or --calls loops), bumping NAME.progress like `hammer`. Then NAME.ready
           {"pid", "loops"}; with --exit-on FILE it then waits for FILE and exits
           (NAME.json {"pid", "loops", "t_exit"}: the moment it called exit; --hard-exit:
           os._exit).
  end      send {"op": "end"} on a fresh connection (krex.proc.client.Client) without
           ever beginning a region. Output: NAME.json {"pid", "error"|"reply"}; on an
           error it also prints it on stderr and exits 1.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any


class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class Gpu:
    """The three runtime calls we need from the simulated libcudart."""

    def __init__(self) -> None:
        from krex.native import sim_dir

        self.lib = ctypes.CDLL(str(sim_dir() / "libcudart.so.13"))
        vp = ctypes.c_void_p
        self.launch = self.lib.cudaLaunchKernel
        self.launch.argtypes = [vp, Dim3, Dim3, ctypes.POINTER(vp), ctypes.c_size_t, vp]
        self.launch.restype = ctypes.c_int
        self.sync = self.lib.cudaDeviceSynchronize
        self.sync.argtypes = []
        self.sync.restype = ctypes.c_int
        self.func = ctypes.cast(self.sync, vp)
        if os.environ.get("CP_WORKER_MALLOC_FIRST") == "1":
            # As torch starts: the first call allocates, and the runtime makes the context
            # inside it (a LIFE call; the simulator's KREX_SIM_CTX_MS models its length).
            malloc = self.lib.cudaMalloc
            malloc.argtypes = [ctypes.POINTER(vp), ctypes.c_size_t]
            malloc.restype = ctypes.c_int
            ptr = vp()
            rc = malloc(ctypes.byref(ptr), 1 << 20)
            if rc != 0:
                raise RuntimeError(f"cudaMalloc returned {rc}")

    def kernel(self, us: int) -> None:
        rc = self.launch(self.func, Dim3(us, 1, 1), Dim3(1, 1, 1), None, 0, None)
        if rc != 0:
            raise RuntimeError(f"cudaLaunchKernel returned {rc}")

    def synchronize(self) -> None:
        rc = self.sync()
        if rc != 0:
            raise RuntimeError(f"cudaDeviceSynchronize returned {rc}")


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def mode_regions(a: argparse.Namespace, out: Path) -> int:
    import krex
    from krex.errors import KrexError

    if a.affinity:
        os.sched_setaffinity(0, [int(c) for c in a.affinity.split(",")])
    gpu = Gpu()
    gpu.kernel(a.us)  # a context and a helper thread before the first region
    gpu.synchronize()
    if a.go:
        if a.prime:
            with krex.region():
                pass
        write_json(out / f"{a.name}.waiting", {"pid": os.getpid()})
        while not Path(a.go).exists():
            time.sleep(0.001)
    recs: list[dict[str, Any]] = []
    errors: list[str] = []
    for i in range(a.n):
        if a.until and Path(a.until).exists():
            break
        if a.gap_kernels:
            for _ in range(a.gap_kernels):
                gpu.kernel(a.us)
            gpu.synchronize()
        try:
            before = sorted(os.sched_getaffinity(0))
            t_request = time.monotonic_ns()
            with krex.region() as r:
                t_grant = time.monotonic_ns()
                inside = sorted(os.sched_getaffinity(0))
                for _ in range(a.kernels):
                    gpu.kernel(a.us)
                gpu.synchronize()
                if a.sleep_ms:
                    time.sleep(a.sleep_ms / 1000)
                t_end = time.monotonic_ns()
            after = sorted(os.sched_getaffinity(0))
            recs.append(
                {
                    "i": i,
                    "t_request": t_request,
                    "t_grant": t_grant,
                    "t_end": t_end,
                    "grant": r.grant,
                    "summary": r.summary,
                    "aff_before": before,
                    "aff_inside": inside,
                    "aff_after": after,
                    "tid": threading.get_native_id(),
                }
            )
        except KrexError as e:
            errors.append(f"region {i}: {type(e).__name__}: {e}")
            break  # fail fast: a daemon that refused one region may never answer the next
        if a.pause_ms:
            time.sleep(a.pause_ms / 1000)
    write_json(out / f"{a.name}.json", {"pid": os.getpid(), "regions": recs, "errors": errors})
    if a.barrier:
        # Leave together: a command that exits while others still take regions is another test.
        write_json(out / f"{a.name}.done", {})
        deadline = time.monotonic() + 60
        while len(list(out.glob("*.done"))) < a.barrier and time.monotonic() < deadline:
            time.sleep(0.01)
    return 1 if errors else 0


def progress_map(out: Path, name: str) -> mmap.mmap:
    """NAME.progress (counter, monotonic ns of the last bump, pid), mapped so a test reads it live."""
    prog = out / f"{name}.progress"
    tmp = prog.with_name(prog.name + ".tmp")
    tmp.write_bytes(struct.pack("qqq", 0, time.monotonic_ns(), os.getpid()))
    os.replace(tmp, prog)
    with open(prog, "r+b") as f:
        return mmap.mmap(f.fileno(), 24)


def mode_hammer(a: argparse.Namespace, out: Path) -> int:
    gpu = Gpu()
    mem = progress_map(out, a.name)
    stop = out / f"{a.name}.stop"
    if a.long_us:
        if a.trigger:
            while not Path(a.trigger).exists():
                time.sleep(0.001)
        gpu.kernel(a.long_us)  # asynchronous: it returns at once and occupies the GPU long_us
        write_json(out / f"{a.name}.ready", {"pid": os.getpid(), "t": time.monotonic_ns()})
    deadline = time.monotonic() + a.seconds
    ticks: list[int] = []
    n = 0
    while time.monotonic() < deadline and not stop.exists():
        if a.us and not a.long_us:
            gpu.kernel(a.us)
            gpu.synchronize()
        end = time.perf_counter() + 0.001
        while time.perf_counter() < end:
            pass
        n += 1
        t = time.monotonic_ns()
        ticks.append(t)
        struct.pack_into("qq", mem, 0, n, t)
    write_json(out / f"{a.name}.json", {"pid": os.getpid(), "ticks": ticks})
    return 0


def mode_life(a: argparse.Namespace, out: Path) -> int:
    from krex.native import sim_dir

    cu = ctypes.CDLL(str(sim_dir() / "libcuda.so.1"))
    ctx, mod, ptr = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_uint64()

    def ck(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} returned {rc}")

    ck(cu.cuInit(0), "cuInit")
    ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0), "cuDevicePrimaryCtxRetain")
    mem = progress_map(out, a.name)
    stop = out / f"{a.name}.stop"
    n = 0
    while not stop.exists() and (a.calls == 0 or n < a.calls):
        ck(cu.cuModuleLoadData(ctypes.byref(mod), b"sim"), "cuModuleLoadData")
        ck(cu.cuModuleUnload(mod), "cuModuleUnload")
        ck(cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(4096)), "cuMemAlloc_v2")
        ck(cu.cuMemFree_v2(ctypes.c_uint64(ptr.value)), "cuMemFree_v2")
        n += 1
        struct.pack_into("qq", mem, 0, n, time.monotonic_ns())
    write_json(out / f"{a.name}.ready", {"pid": os.getpid(), "loops": n})
    if a.exit_on:
        while not Path(a.exit_on).exists():
            time.sleep(0.001)
    write_json(out / f"{a.name}.json", {"pid": os.getpid(), "loops": n, "t_exit": time.monotonic_ns()})
    if a.hard_exit:
        os._exit(0)  # no atexit handler runs (multiprocessing's children)
    return 0


def mode_hold(a: argparse.Namespace, out: Path) -> int:
    import krex
    from krex.errors import KrexError

    gpu = Gpu()
    gpu.kernel(a.us)
    gpu.synchronize()
    stop = out / f"{a.name}.stop"
    result: dict[str, Any] = {"pid": os.getpid()}
    try:
        with krex.region() as r:
            t_grant = time.monotonic_ns()
            if a.child_end:
                # Another process of the same command (same slot), on a connection of its own.
                import subprocess

                subprocess.run(
                    [sys.executable, __file__, "end", str(out), "--name", f"{a.name}-child"],
                    check=False,
                    timeout=30,
                )
            write_json(out / f"{a.name}.ready", {"pid": os.getpid(), "grant": r.grant, "t_grant": t_grant})
            while not stop.exists():
                time.sleep(0.01)
            result["t_end"] = time.monotonic_ns()
        result["end"] = r.summary
        result["unprotected"] = getattr(r, "unprotected", None)
        result["lost"] = getattr(r, "lost", None)
    except KrexError as e:
        result["error"] = f"{type(e).__name__}: {e}"
    write_json(out / f"{a.name}.json", result)
    return 0


def mode_chaos(a: argparse.Namespace, out: Path) -> int:
    import random

    import krex

    kr = sys.modules["krex.proc.region"]  # the module: `krex.region` is also the class's name
    rng = random.Random(os.getpid())
    gpu = Gpu()
    gpu.kernel(a.us)
    gpu.synchronize()
    log = open(out / f"{a.name}.regions.jsonl", "a", buffering=1)  # noqa: SIM115 - lives as long as we do
    for i in range(a.n):
        long = rng.random() < a.cut_p
        rec: dict[str, Any] = {"i": i, "pid": os.getpid(), "long": long}
        t_grant = t_end = 0
        try:
            with krex.region() as r:
                t_grant = time.monotonic_ns()
                for _ in range(a.kernels):
                    gpu.kernel(a.us)
                gpu.synchronize()
                if long:
                    time.sleep(a.cut_s)
                elif a.sleep_ms:
                    time.sleep(a.sleep_ms / 1000)
                t_end = time.monotonic_ns()
            rec.update(
                t_grant=t_grant,
                t_end=t_end,
                clean=r.clean,
                cut=r.cut,
                flags=r.flags,
                end=(r.summary or {}).get("end"),
            )
        except Exception as e:  # noqa: BLE001 - the daemon may die under us: note it, go on
            rec.update(error=f"{type(e).__name__}: {e}", t_grant=t_grant, t_end=t_end or time.monotonic_ns())
            kr._client = None  # a restarted daemon needs a new connection
            from krex.proc.client import daemon_alive

            # Wait for the test's daemon rather than have the region API start one of its own.
            deadline = time.monotonic() + 20
            while not daemon_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
        log.write(json.dumps(rec) + "\n")
        if a.pause_ms:
            time.sleep(a.pause_ms / 1000)
    log.close()
    return 0


def mode_forker(a: argparse.Namespace, out: Path) -> int:
    gpu = Gpu()  # loaded, never called here: each child registers on its own first call
    stop = out / f"{a.name}.stop"
    deadline = time.monotonic() + a.seconds
    alive: set[int] = set()
    n = 0
    write_json(out / f"{a.name}.ready", {"pid": os.getpid()})
    while time.monotonic() < deadline and not stop.exists():
        while alive:
            pid, _ = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            alive.discard(pid)
        if len(alive) < a.max_children:
            pid = os.fork()
            if pid == 0:
                try:
                    gpu.kernel(a.us)
                finally:
                    os._exit(0)
            alive.add(pid)
            n += 1
        time.sleep(a.fork_ms / 1000)
    for pid in alive:
        os.waitpid(pid, 0)
    write_json(out / f"{a.name}.json", {"pid": os.getpid(), "children": n})
    return 0


def mode_end(a: argparse.Namespace, out: Path) -> int:
    from krex.errors import KrexError
    from krex.proc.client import Client

    c = Client.connect()
    result: dict[str, Any] = {"pid": os.getpid()}
    try:
        result["reply"] = c.request({"op": "end"})
    except KrexError as e:
        result["error"] = str(e)
        result["kind"] = type(e).__name__
        print(f"cp_worker: error: {e}", file=sys.stderr)
    finally:
        c.close()
    write_json(out / f"{a.name}.json", result)
    return 1 if "error" in result else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cp_worker")
    p.add_argument("mode", choices=["regions", "hammer", "hold", "end", "chaos", "forker", "life"])
    p.add_argument("out")
    p.add_argument("--name", default="worker")
    p.add_argument("-n", type=int, default=20, help="regions")
    p.add_argument("--us", type=int, default=50, help="kernel length in microseconds")
    p.add_argument("--kernels", type=int, default=2, help="kernels per region")
    p.add_argument("--gap-kernels", type=int, default=0, help="kernels between regions")
    p.add_argument("--sleep-ms", type=float, default=0.0, help="sleep inside each region")
    p.add_argument("--pause-ms", type=float, default=0.0, help="sleep between regions")
    p.add_argument("--seconds", type=float, default=60.0, help="upper bound on a hammer's life")
    p.add_argument("--long-us", type=int, default=0, help="hammer: queue one kernel this long first")
    p.add_argument("--trigger", default="", help="hammer: queue the long kernel once this file exists")
    p.add_argument("--go", default="", help="regions: start the first region once this file exists")
    p.add_argument("--prime", action="store_true", help="regions: one unrecorded region before --go")
    p.add_argument("--until", default="", help="regions: stop early once this file exists")
    p.add_argument("--barrier", type=int, default=0, help="regions: exit when N *.done exist")
    p.add_argument("--affinity", default="", help="regions: CPU list to run on (comma-separated)")
    p.add_argument("--child-end", action="store_true", help="hold: a child process sends END in the region")
    p.add_argument("--cut-p", type=float, default=0.0, help="chaos: probability of a region that overstays")
    p.add_argument("--cut-s", type=float, default=0.5, help="chaos: how long such a region sleeps inside")
    p.add_argument("--fork-ms", type=float, default=2.0, help="forker: time between forks")
    p.add_argument("--max-children", type=int, default=32, help="forker: children alive at most")
    p.add_argument("--calls", type=int, default=0, help="life: loops to make (0: until NAME.stop)")
    p.add_argument("--exit-on", default="", help="life: then exit once this file exists")
    p.add_argument("--hard-exit", action="store_true", help="life: leave with os._exit")
    a = p.parse_args(argv)
    out = Path(a.out)
    modes = {
        "regions": mode_regions,
        "hammer": mode_hammer,
        "hold": mode_hold,
        "end": mode_end,
        "chaos": mode_chaos,
        "forker": mode_forker,
        "life": mode_life,
    }
    return modes[a.mode](a, out)


if __name__ == "__main__":
    sys.exit(main())
