"""`krex doctor`: is this node ready for KREX, and what is degraded?

Every check returns a `Check` with status ok / warn / fail, a one-line finding,
the fix when it is not ok, and details (``details["lines"]`` are extra lines
meant for people). `run_doctor` runs them all; the node is fine when no check
failed (`DoctorReport.ok`). Warnings are things KREX works around openly (a
degraded CPU partition, the signal freezer, no real GPU, a binary with static
cudart). The library never prints; `progress` gets the name of each check as
it starts.

Checks that must not disturb a running daemon: the freezer probe creates its
parent group only if it is missing and removes it again afterwards; nothing is
frozen; the shim is loaded only into short-lived child processes (loading it
into this process could attach it to a segment named in our environment)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from krex.errors import KrexError, NotFound

__all__ = [
    "FAIL",
    "OK",
    "WARN",
    "Check",
    "DoctorReport",
    "check_binary",
    "check_daemon",
    "check_freezer",
    "check_gpu_coverage",
    "check_gpus",
    "check_mps",
    "check_partition",
    "check_privileges",
    "check_shim",
    "run_doctor",
]

OK, WARN, FAIL = "ok", "warn", "fail"
STATUSES = (OK, WARN, FAIL)


@dataclass
class Check:
    name: str
    status: str  # OK, WARN or FAIL
    finding: str  # one line
    fix: str = ""  # how to make it ok; empty when ok
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class DoctorReport:
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return not any(c.status == FAIL for c in self.checks)

    def count(self, status: str) -> int:
        return sum(1 for c in self.checks if c.status == status)

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "counts": {s: self.count(s) for s in STATUSES},
                "checks": [c.to_json() for c in self.checks]}


def _clean_env() -> dict[str, str]:
    """Our environment without anything that opts a child into KREX or the simulator."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("KREX_", "SIM_")) and k not in ("LD_PRELOAD", "CUDA_VISIBLE_DEVICES")}


# ------------------------------------------------------------------------------- privileges


def check_privileges() -> Check:
    from krex.node import mounts

    euid = os.geteuid()
    try:
        found = mounts.read_mounts()
    except KrexError as e:
        return Check("privileges", FAIL, str(e), e.fix, {"euid": euid})
    writable: list[str] = []
    readonly: list[str] = []
    for m in found:
        if m.fstype == "cgroup2" or (m.fstype == "cgroup" and "freezer" in m.super_options):
            ok = "ro" not in m.options and os.access(m.mount_point, os.W_OK)
            (writable if ok else readonly).append(f"{m.mount_point} ({m.fstype})")
    who = "root (uid 0)" if euid == 0 else f"uid {euid}, not root"
    details: dict[str, Any] = {"euid": euid, "writable_cgroups": writable, "readonly_cgroups": readonly}
    if writable:
        finding = f"running as {who}; can write cgroups: {', '.join(writable)}"
        if euid == 0:
            return Check("privileges", OK, finding, "", details)
        return Check("privileges", WARN, finding + "; without root only your own threads can be pinned",
                     "run krexd as root (or with CAP_SYS_NICE) to pin the threads of every user", details)
    if not readonly:
        where = "no cgroup v2 hierarchy and no v1 freezer are mounted"
    else:
        where = f"cgroups are not writable: {', '.join(readonly)}"
    return Check("privileges", WARN, f"running as {who}; {where}: freezing falls back to SIGSTOP",
                 "run krexd as root with a writable /sys/fs/cgroup (in a container: a private, rw cgroup "
                 "namespace), or delegate a cgroup subtree to its user (systemd: Delegate=yes)", details)


# --------------------------------------------------------------------------------- freezer


def check_freezer() -> Check:
    """Which backend krexd would use (detect() with the daemon's root name)."""
    from krex.node import freezer
    from krex.node.shm import default_name

    try:
        root_name = default_name().strip("/").replace("/", "-") or "krex"
    except KrexError as e:
        return Check("freezer", FAIL, str(e), e.fix)
    existed = {p for p in _candidate_roots(root_name) if os.path.isdir(p)}
    try:
        fz = freezer.detect(None, root_name=root_name)
    except KrexError as e:
        return Check("freezer", FAIL, f"no freezer backend works: {e}", e.fix or freezer._FIX_ROOT)
    desc = fz.describe()
    if fz.root not in existed:  # we made the parent group just to probe it: leave no trace
        with contextlib.suppress(OSError, KrexError):
            fz.remove_root()
    details: dict[str, Any] = {"backend": fz.name, "root": fz.root, "describe": desc,
                               "fallback_reasons": list(fz.fallback_reasons)}
    if fz.name == "cgroup2":
        return Check("freezer", OK, desc, "", details)
    if fz.name == "cgroup1":
        return Check("freezer", OK, desc, "", details)
    return Check("freezer", WARN, desc + ": SIGSTOP cannot stop a process inside a driver call, and "
                 "a process forking at the wrong moment can escape a freeze",
                 "give krexd a writable cgroup hierarchy (run it as root; see the privileges check)", details)


def _candidate_roots(root_name: str) -> list[str]:
    from krex.node import mounts

    try:
        found = mounts.read_mounts()
    except KrexError:
        return []
    points = mounts.cgroup2_mounts(found) + mounts.cgroup1_freezer_mounts(found)
    return [os.path.join(p, root_name) for p in points]


# ------------------------------------------------------------------------------------ cpus


def check_partition(n_gpus: int, gpu_numa: Sequence[int | None] | None = None) -> Check:
    from krex.node import cpus

    try:
        part = cpus.partition(cpus.discover(), n_gpus, list(gpu_numa) if gpu_numa else None)
    except KrexError as e:
        return Check("cpus", FAIL, f"cannot compute the CPU partition: {e}", e.fix)
    lines = part.describe()
    details: dict[str, Any] = {"partition": part.to_json(), "lines": lines, "degraded": part.degraded}
    if part.degraded:
        need = 1 + max(1, n_gpus) * (1 + cpus.MIN_SHARED_CORES)
        return Check("cpus", WARN, f"DEGRADED partition: {part.reason}",
                     f"give KREX at least {need} physical cores for {n_gpus} GPU(s) (a larger machine, or a "
                     "wider cpuset/taskset around krexd); until then timings work but share CPU cores",
                     details)
    return Check("cpus", OK, f"{len(part.cores)} physical cores: housekeeping "
                 f"{cpus.format_cpulist(part.housekeeping)}, one slice per GPU with its own region core(s)",
                 "", details)


# ------------------------------------------------------------------------------------ shim

_PROBE = r"""
import sys
sys.path[:] = [p for p in sys.path if p]  # -c put the current directory first
import ctypes, json
path = sys.argv[1]
maps = open("/proc/self/maps").read()
out = {"mapped": path in maps}
try:
    lib = ctypes.CDLL(path)
    out["exports"] = hasattr(lib, "krex_shim_active")
    if out["exports"]:
        f = lib.krex_shim_active
        f.restype = ctypes.c_int
        out["active"] = int(f())
except OSError as e:
    out["error"] = str(e)
print(json.dumps(out))
"""


def check_shim(timeout: float = 30.0) -> Check:
    """The shim preloads cleanly (into /bin/true, and into python, where ctypes finds
    krex_shim_active) and stays a silent pass-through outside KREX."""
    from krex.native import shim_path

    try:
        shim = str(shim_path())
    except NotFound as e:
        return Check("shim", FAIL, str(e), e.fix)
    env = _clean_env()
    env["LD_PRELOAD"] = shim
    details: dict[str, Any] = {"path": shim}
    fix = "rebuild and reinstall the shim: make install (or pip install .)"
    true = shutil.which("true") or "/bin/true"
    try:
        p = subprocess.run([true], env=env, capture_output=True, text=True, timeout=timeout)
        q = subprocess.run([sys.executable, "-c", _PROBE, shim], env=env, capture_output=True, text=True,
                           timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Check("shim", FAIL, f"could not run a process with LD_PRELOAD={shim}: {e}", fix, details)
    details.update(true_rc=p.returncode, true_stderr=p.stderr.strip())
    if p.returncode != 0 or p.stderr.strip():
        msg = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}"
        return Check("shim", FAIL, f"{true} with LD_PRELOAD={shim} failed: {msg}", fix, details)
    try:
        probe = json.loads(q.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (q.stderr.strip().splitlines() or [f"exit {q.returncode}"])[-1]
        return Check("shim", FAIL, f"python with the shim preloaded failed: {tail}", fix, details)
    details["probe"] = probe
    if not probe.get("mapped"):
        return Check("shim", FAIL, f"LD_PRELOAD={shim} was ignored: the library is not mapped "
                     "(ld.so rejected it?)", fix, details)
    if not probe.get("exports"):
        why = probe.get("error", "not a KREX shim")
        return Check("shim", FAIL, f"{shim} does not export krex_shim_active: {why}", fix, details)
    if probe.get("active"):
        return Check("shim", FAIL, "the shim is active in a process without any KREX_* variable",
                     "the shim must pass through outside KREX: rebuild it (make install)", details)
    if q.stderr.strip():
        return Check("shim", FAIL, f"the shim printed outside KREX: {q.stderr.strip().splitlines()[-1]}",
                     "the shim must be silent outside KREX: rebuild it (make install)", details)
    return Check("shim", OK, f"{shim} preloads cleanly, exports krex_shim_active, "
                 "passes through outside KREX", "", details)


# ------------------------------------------------------------------------------------ GPUs


def check_gpus() -> tuple[Check, int, list[int | None]]:
    """GPUs as `--device auto` finds them (NVML, cuda-python, amdsmi, hip-python). Returns
    the check, the GPU count KREX would partition for, and their NUMA nodes."""
    from krex.device.gpus import discover

    have_nvml_py = importlib.util.find_spec("pynvml") is not None
    try:
        info = discover("auto")
    except KrexError as e:
        return Check("gpus", FAIL, str(e), e.fix), 0, []
    details: dict[str, Any] = {"kind": info.kind, "count": info.count, "names": info.names,
                               "physical": info.physical, "numa": info.numa, "nvidia_ml_py": have_nvml_py,
                               "api": info.api, "tried": info.tried}
    if info.kind in ("nvidia", "amd"):
        names = ", ".join(f"{i}: {n}" for i, n in zip(info.physical, info.names, strict=False))
        return Check("gpus", OK, f"{info.count} {info.vendor} GPU(s) through {info.api}: {names}", "",
                     details), info.count, list(info.numa)
    why = "nvidia-ml-py is not installed" if not have_nvml_py else "NVML found no visible GPU"
    if have_nvml_py and os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        why += f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r})"
    if len(info.tried) > 1:
        why += "; also tried " + "; ".join(t for t in info.tried if not t.startswith("nvml:"))
    fix = ("install the NVIDIA driver and nvidia-ml-py (a dependency of krex-gpu: `pip install krex-gpu`; "
           "'krex-gpu[cuda]' where NVML is missing), or on a ROCm node 'krex-gpu[amd]' (amdsmi)"
           if not have_nvml_py
           else "check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES")
    return Check("gpus", WARN, f"no NVIDIA GPU: {why}; --device auto uses the simulated GPU ({info.count})",
                 fix + "; or use --device sim on purpose", details), info.count, list(info.numa)


def check_mps() -> Check:
    """Only a report: whether MPS is installed, and whether a control daemon's pipe dir exists."""
    ctl = shutil.which("nvidia-cuda-mps-control")
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    has_pipe = os.path.isdir(pipe)
    details: dict[str, Any] = {"control": ctl, "pipe_dir": pipe, "pipe_dir_exists": has_pipe}
    parts = [f"nvidia-cuda-mps-control {'at ' + ctl if ctl else 'not on PATH'}",
             f"MPS pipe dir {pipe} {'exists (an MPS daemon may be running)' if has_pipe else 'absent'}"]
    return Check("mps", OK, "; ".join(parts), "", details)


def check_daemon() -> Check:
    """Whether krexd answers; not running is fine (krex run starts it on demand)."""
    from krex import paths
    from krex.proc.client import Client, daemon_alive

    try:
        sock = paths.socket_path()
    except KrexError as e:
        return Check("daemon", FAIL, str(e), e.fix)
    if not daemon_alive(sock):
        holder = paths.lock_holder(sock.with_suffix(".lock"))
        if holder is not None:
            return Check("daemon", WARN, f"krexd pid {holder} holds its lock but does not answer at {sock} "
                         "(its socket is missing or it is hung)",
                         "krexd re-creates a removed socket within a second; else `krex daemon stop`",
                         {"socket": str(sock), "running": True, "pid": holder})
        return Check("daemon", OK, f"krexd is not running at {sock}; `krex run` starts it on demand", "",
                     {"socket": str(sock), "running": False})
    try:
        c = Client.connect(sock)
        try:
            st = c.request({"op": "status"})
        finally:
            c.close()
    except (KrexError, OSError) as e:
        return Check("daemon", WARN, f"krexd at {sock} accepts connections but did not answer status: {e}",
                     "see krexd.log in the state directory, or restart it: "
                     "krex daemon stop; krex daemon start",
                     {"socket": str(sock), "running": True})
    d = st.get("daemon", {})
    details: dict[str, Any] = {"socket": str(sock), "running": True, "status": st}
    n_slots = len(st.get("slots", []))
    return Check("daemon", OK, f"krexd pid {d.get('pid')} answers at {sock}: device {d.get('device')} "
                 f"x{d.get('gpus')}, freezer {d.get('freezer')}, {n_slots} slot(s) in use", "", details)


def check_segment() -> Check:
    """The shared segment: present, intact, and the one krexd gates with (trust issue, case 3)."""
    from krex.node.shm import Segment, default_name
    from krex.proc.client import Client, daemon_alive

    name = default_name()
    seg_state: dict[str, Any] = {}
    if daemon_alive():
        try:
            c = Client.connect()
            try:
                seg_state = c.request({"op": "status"}).get("segment") or {}
            finally:
                c.close()
        except (KrexError, OSError):
            seg_state = {}
    try:
        with Segment.attach(name) as seg:
            snap = seg.snapshot()
        attach_err = ""
    except KrexError as e:
        attach_err, snap = str(e), None
    details: dict[str, Any] = {"name": name, "daemon_view": seg_state, "attach_error": attach_err or None}
    if seg_state.get("lost"):
        return Check("segment", FAIL, f"krexd lost its segment: {seg_state['lost']}",
                     "stop the commands, then `krex daemon stop` and start again", details)
    incidents = seg_state.get("incidents") or []
    if attach_err and seg_state:
        return Check("segment", FAIL, f"krexd runs but {name} cannot be attached: {attach_err}",
                     "`krex daemon stop` and start again", details)
    if incidents:
        last = incidents[-1]
        tainted = seg_state.get("tainted_alive") or []
        what = f"{'; '.join(last['problems'])} -> {'; '.join(last['actions'])}"
        return Check("segment", WARN, f"{len(incidents)} segment incident(s), last: {what}; {len(tainted)} "
                     "process(es) that lived through it still run (regions with them as siblings are "
                     "flagged)",
                     "find what writes or removes /dev/shm" + name + "; regions are clean again once those "
                     "processes end", details)
    if attach_err:
        if "nothing has run" in attach_err:
            return Check("segment", OK, f"{name} does not exist yet (krexd creates it on demand)", "",
                         details)
        return Check("segment", FAIL, attach_err, "remove it and let krexd create it again", details)
    assert snap is not None
    return Check("segment", OK, f"{name}: intact ({snap.n_gpus} GPU(s), {len(snap.procs)} process "
                 "record(s))", "", details)


# -------------------------------------------------------------------------------- binaries


def check_binary(name: str) -> Check:
    """A benchmark binary: statically linked cudart cannot be gated (DESIGN.md consequence 5)."""
    from krex.device.elfcheck import inspect

    label = f"binary {name}"
    path = name if "/" in name else (shutil.which(name) or name)
    p = Path(path)
    if not p.exists():
        return Check(label, FAIL, f"{name}: no such file" + ("" if "/" in name else " (nor on PATH)"),
                     "check the path")
    if p.is_dir():
        return Check(label, FAIL, f"{name} is a directory", "give the benchmark's executable")
    if not os.access(p, os.R_OK):
        return Check(label, FAIL, f"{name} is not readable",
                     "check its permissions (or run doctor as its owner)")
    info = inspect(str(p))
    details: dict[str, Any] = {"path": str(p), "elf": info.is_elf, "needed": info.needed,
                               "defines___cudaRegisterFatBinary": info.defines_fatbin_register,
                               "static_cudart": info.static_cudart}
    if not info.is_elf:
        return Check(label, OK, f"{path} is not a 64-bit ELF executable (a script?): nothing to check", "",
                     details)
    if info.static_cudart:
        return Check(label, WARN, f"{path} links the CUDA runtime statically: KREX cannot gate its launches "
                     "(freezing still protects its siblings)",
                     "rebuild it with `nvcc -cudart shared` "
                     "(CMake: set_target_properties(T PROPERTIES CUDA_RUNTIME_LIBRARY Shared))",
                     details)
    cudart = [n for n in info.needed if "libcudart" in n]
    if cudart:
        return Check(label, OK, f"{path} links {', '.join(cudart)} dynamically: its launches are gated", "",
                     details)
    return Check(label, OK, f"{path} links no CUDA runtime (work it launches through libraries loaded at "
                 "run time, e.g. torch's, is gated)", "", details)


# ---------------------------------------------------------------------------- GPU coverage


def check_gpu_coverage(
    run_all: Callable[..., Sequence[Any]] | None = None, progress: Callable[[str], None] | None = None
) -> Check:
    """Interposition coverage against CUPTI on the real GPU (krex.doctor.coverage.run_all);
    `progress` gets the name of each workload as it starts (they take a minute or more)."""
    from krex.device.gpus import discover

    try:
        info = discover("gpu")
        if info.kind != "nvidia":
            raise NotFound(f"no NVIDIA GPU: the coverage check uses CUPTI; this node has {info.vendor} GPUs",
                           "run `krex doctor --gpu` on an NVIDIA node")
    except NotFound as e:
        return Check("gpu coverage", FAIL, f"cannot check coverage: {e}",
                     "run it on a machine with an NVIDIA GPU, its driver and nvidia-ml-py "
                     "(a dependency of krex-gpu); check CUDA_VISIBLE_DEVICES",
                     {"error": type(e).__name__})
    if run_all is None:
        from krex.doctor import coverage

        run_all = coverage.run_all
    try:
        rows = list(run_all(progress=progress))
    except KrexError as e:
        return Check("gpu coverage", FAIL, f"coverage run failed: {e}", e.fix, {"error": type(e).__name__})
    table = [asdict(r) for r in rows]
    bad = [r["workload"] for r in table if not r.get("ok")]
    details: dict[str, Any] = {"rows": table}
    if bad:
        return Check("gpu coverage", FAIL, f"{len(bad)} of {len(table)} workloads launched work the shim did "
                     f"not see (or failed): {', '.join(bad)}",
                     "see the table; a failed workload needs torch (and triton) with CUDA; a missed launch "
                     "is a hook to add to interpose/api_*.def", details)
    return Check("gpu coverage", OK, f"all {len(table)} workloads: every kernel and copy CUPTI saw "
                 "passed the gate", "", details)


# ------------------------------------------------------------------------------------- all


def run_doctor(binaries: Sequence[str] = (), gpu: bool = False,
               progress: Callable[[str], None] | None = None) -> DoctorReport:
    """Run every check (plus one per binary, plus GPU coverage with `gpu`)."""
    note = progress or (lambda _name: None)
    checks: list[Check] = []

    def add(name: str, fn: Callable[[], Check]) -> None:
        note(name)
        try:
            checks.append(fn())
        except KrexError as e:  # a check that cannot even run is a failed check, not a crash
            checks.append(Check(name, FAIL, f"the check itself failed: {e}", e.fix))

    add("privileges", check_privileges)
    add("freezer", check_freezer)
    note("gpus")
    gpu_check, n_gpus, numa = check_gpus()
    add("cpus", lambda: check_partition(max(n_gpus, 1), numa if n_gpus else None))
    add("shim", check_shim)
    checks.append(gpu_check)
    add("mps", check_mps)
    add("daemon", check_daemon)
    add("segment", check_segment)
    for b in binaries:
        add(f"binary {b}", functools.partial(check_binary, b))
    if gpu:
        from krex.doctor.coverage import WORKLOADS

        n = len(WORKLOADS)
        step = iter(range(1, n + 1))
        add("gpu coverage", functools.partial(
            check_gpu_coverage, progress=lambda w: note(f"gpu coverage: workload {w} ({next(step, n)}/{n})")))
    return DoctorReport(checks)
