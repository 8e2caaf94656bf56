"""Which sibling processes krexd counts as held by the gate (krex/node/freezepolicy.py),
and what a region does about the others (krex/node/unheld.py): a real krexd, real
`krex run` guardians and cgroups, the real shim, the simulated GPU.

The siblings are the chaos test's escaping kinds (helpers/chaos.py, tests/c/escape.c,
tests/c/hiddenrt.c), each its own command, plus one with nothing taken away ("held")."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import victims
from helpers.chaos import ESCAPES, escape_argv, open_world
from helpers.krex_world import Krex

from krex.native import LIB_DIR, ffi, lib
from krex.node.shm import Segment

pytestmark = [
    pytest.mark.cgroup,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: real cgroups, setuid, another user"),
]

# What the grant says of each escaping kind: part of its `unheld` reason.
WHY = {
    "inactive-shim": "shim is inactive (KREX_SHM not set)",
    "bad-slot": "KREX_SLOT='x', not its command's slot",
    "other-user": "has not attached krexd's segment",
    "reexec": "exec'd since it registered",
    "dlmopen": "another link-map namespace",
    "static-runtime": "links the CUDA runtime statically and made no hooked call",
    "no-shim": "runs without the KREX shim",
}


def _world(kx: Krex, **settings: str) -> dict[str, Path]:
    v = victims()
    open_world(kx, v)
    kx_env = kx.env
    kx.env = lambda **extra: kx_env(**{**settings, **extra})  # type: ignore[method-assign]
    return v


def _start(kx: Krex, v: dict[str, Path], kind: str, arg: str = "") -> None:
    kx.run_argv(kind, escape_argv(kind, v, 60, 20, 1, arg))


def _pid(kx: Krex, kind: str, lines: int = 1) -> int:
    """The victim's pid, once it printed `lines` pid lines (a re-exec prints one per image)."""

    def got() -> int | None:
        out = [json.loads(x) for x in kx.cmds[kind].output().splitlines() if x.startswith('{"pid"')]
        if kx.cmds[kind].popen.poll() is not None:
            raise AssertionError(f"{kind} exited: {kx.cmds[kind].output()[-1500:]}")
        return int(out[-1]["pid"]) if len(out) >= lines else None

    pid: int = kx.wait(got, 30, f"{kind} to start")
    return pid


def _hold(kx: Krex, name: str) -> dict[str, Any]:
    kx.run(name, "hold")
    ready: dict[str, Any] = kx.result(name, "ready", timeout=30)
    return ready


def _end(kx: Krex, name: str, pid: int) -> dict[str, Any]:
    kx.touch(name)
    assert kx.cmds[name].wait(30) == 0, kx.cmds[name].output()
    kx.wait(lambda: [r for r in kx.journal() if r["owner_pid"] == pid], 10, "the journal record")
    rec: dict[str, Any] = [r for r in kx.journal() if r["owner_pid"] == pid][-1]
    return rec


def _slot_of(kx: Krex, pid: int) -> int:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(e for e in env if e.startswith(b"KREX_SLOT=") and e[10:].isdigit())[10:])


@pytest.mark.parametrize("policy", ["gpu", "all"])
def test_only_proven_siblings_count_as_held(kx: Krex, policy: str) -> None:
    """Every escaping kind is named in the grant's `unheld` with why, and its slot is
    frozen; a sibling with nothing taken away and one that dropped root after its shim
    attached are held (under `gpu` they keep running). The work the unheld ones queued is
    waited for on the simulated GPU: the region is not flagged for it."""
    v = _world(kx, KREX_FREEZE_POLICY=policy)
    kx.start_daemon(slots=len(ESCAPES) + 3)
    kinds = ["held", *ESCAPES]
    for k in kinds:
        _start(kx, v, k, "200")
    pids = {k: _pid(kx, k, 2 if k == "reexec" else 1) for k in kinds}
    slots = {k: _slot_of(kx, pids[k]) for k in kinds if k != "bad-slot"}
    time.sleep(1.0)  # the dlmopen (after 300 ms) and every first kernel are done
    ready = _hold(kx, "a")
    g = ready["grant"]
    for k in slots:
        assert (slots[k] in g["frozen_slots"]) == (k not in ("held", "setuid") or policy == "all"), (k, g)
    unheld = {p: w for p, _slot, w in g.get("unheld", [])}
    for k, why in WHY.items():
        assert pids[k] in unheld and why in unheld[pids[k]], (k, pids[k], g.get("unheld"))
    assert pids["held"] not in unheld and pids["setuid"] not in unheld, g["unheld"]
    rec = _end(kx, "a", ready["pid"])
    assert "unheld-sibling" not in rec["flags"], rec["reasons"]


def test_nvml_decides_what_an_unheld_siblings_work_means(kx: Krex) -> None:
    """With NVML: an unheld sibling NVML lists on the GPU (it holds a context) flags the
    region, with its pid and why; NVML's attestation does not count it as known. One NVML
    does not list holds no context, so nothing of it is queued: the region is clean."""
    nvml = kx.out / "nvml.json"
    base = {"gpus": [{"name": "fake", "uuid": "GPU-fake", "procs": [], "sm_clock": 1980, "throttle": 1}]}
    nvml.write_text(json.dumps(base))
    v = _world(kx, KREX_FREEZE_POLICY="gpu", KREX_NVML_FAKE=str(nvml))
    kx.start_daemon(slots=3)
    _start(kx, v, "inactive-shim")
    sib = _pid(kx, "inactive-shim")
    ready = _hold(kx, "a")  # NVML lists nobody: clean
    rec = _end(kx, "a", ready["pid"])
    assert not rec["contaminated"], rec["reasons"]
    tmp = nvml.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": [dict(base["gpus"][0], procs=[sib])]}))
    tmp.replace(nvml)
    ready = _hold(kx, "b")
    rec = _end(kx, "b", ready["pid"])
    assert "unheld-sibling" in ready["grant"]["flags"], (ready["grant"]["flags"], rec["reasons"])
    text = " ".join(rec["reasons"])
    assert f"pid {sib}" in text and "KREX_SHM not set" in text and "have a context" in text, rec["reasons"]
    assert [f for f in rec["attest"]["foreign"] if f["pid"] == sib], rec["attest"]  # not counted as known


def test_a_held_sibling_that_execs_without_the_shim_during_a_region_flags_it(kx: Krex) -> None:
    """Under `gpu` a held sibling keeps running through a region. One that re-executes
    itself without LD_PRELOAD inside the region runs its kernels past the gate from then
    on: at the region's end krexd judges the siblings it did not freeze again and flags
    the region."""
    v = _world(kx, KREX_FREEZE_POLICY="gpu")
    kx.start_daemon(slots=3)
    _start(kx, v, "reexec", "2500")
    sib = _pid(kx, "reexec")
    time.sleep(0.5)
    ready = _hold(kx, "a")
    g = ready["grant"]
    assert g["frozen_slots"] == [] and not g.get("unheld"), g  # held as the region began
    kx.wait(lambda: _pid(kx, "reexec", 2) == sib, 10, "the re-exec")
    time.sleep(0.2)
    rec = _end(kx, "a", ready["pid"])
    assert "unheld-sibling" in rec["flags"], rec["reasons"]
    assert any(f"pid {sib}" in r and "exec'd" in r for r in rec["reasons"]), rec["reasons"]


def test_a_record_proves_a_process_held_only_under_its_slot_generation_and_live_helper() -> None:
    """krex_proc_trust, on a record of a live process: each way it falls short."""
    name = f"/krex-trust-{os.getpid()}"
    child = subprocess.Popen(["sleep", "30"])
    try:
        with Segment.create(name, n_gpus=1) as seg:
            raw = seg.raw
            start = int(lib.krex_pid_start_ticks(child.pid))

            def code(slot: int = 2, gen: int = 5) -> int:
                return int(lib.krex_proc_trust(raw, child.pid, start, slot, gen))

            assert code() == lib.KREX_TRUST_NONE
            i = int(lib.krex_proc_register(raw, 2, 0, child.pid))
            p = raw.procs[i]
            assert code() == lib.KREX_TRUST_STALE  # no generation stored yet
            p.slot_gen = 5
            assert code() == lib.KREX_TRUST_NO_HELPER
            p.helper_tid = child.pid  # its main thread: a thread of it
            assert code() == lib.KREX_TRUST_HELD
            assert code(slot=3) == lib.KREX_TRUST_OTHER_SLOT
            assert code(gen=6) == lib.KREX_TRUST_STALE
            assert (
                int(lib.krex_proc_trust(raw, child.pid, start + 1, 2, 5)) == lib.KREX_TRUST_NONE
            )  # pid reused
            p.flags |= lib.KREX_PF_FOREIGN_NS
            assert code() == lib.KREX_TRUST_FOREIGN_NS
            p.flags &= ~lib.KREX_PF_FOREIGN_NS
            p.flags |= lib.KREX_PF_UNSEEN  # a CUDA runtime of its own: frozen, drained
            assert code() == lib.KREX_TRUST_UNSEEN
            p.flags &= ~lib.KREX_PF_UNSEEN
            p.helper_tid = 0
            p.flags |= lib.KREX_PF_IN_EXIT  # its exit handler stopped the helper: still held
            assert code() == lib.KREX_TRUST_HELD
            p.flags &= ~lib.KREX_PF_IN_EXIT
            p.helper_tid = os.getpid()  # a thread, but not of that process: the helper is gone
            assert code() == lib.KREX_TRUST_EXECD
            p.helper_tid = child.pid
            p.slot = lib.KREX_PROC_STALE
            p.check = lib.krex_proc_check(ffi.addressof(raw.procs, i))
            assert code() == lib.KREX_TRUST_STALE
            p.gpu = 7  # sealed, yet not a GPU of this segment
            p.check = lib.krex_proc_check(ffi.addressof(raw.procs, i))
            assert code() == lib.KREX_TRUST_DAMAGED
            p.check = 0
            assert code() == lib.KREX_TRUST_FILLING
    finally:
        child.kill()
        child.wait()
        Segment.unlink(name)


def test_the_shim_attaches_at_load_and_flags_a_gpu_library_in_another_namespace(kx: Krex) -> None:
    """A command's process maps krexd's segment before its first GPU call (krexd's proof
    that its shim is active); one that loads the CUDA runtime with dlmopen registers at
    once, flagged KREX_PF_FOREIGN_NS."""
    v = _world(kx, KREX_FREEZE_POLICY="gpu")
    kx.start_daemon(slots=3)
    kx.run_argv("idle", ["sleep", "60"])

    def sleeping() -> int | None:
        return next(
            (p for p in kx.our_pids() if Path(f"/proc/{p}/comm").read_text().strip() == "sleep"), None
        )

    pid = kx.wait(sleeping, 30, "sleep to start")
    seg = "/dev/shm/" + kx.shm.lstrip("/")
    kx.wait(lambda: seg in Path(f"/proc/{pid}/maps").read_text(), 10, "the shim to attach")
    _start(kx, v, "dlmopen")
    sib = _pid(kx, "dlmopen")

    def flagged() -> bool:
        with Segment.attach(kx.shm) as s:
            return any(int(r.pid) == sib and int(r.flags) & lib.KREX_PF_FOREIGN_NS for r in s.raw.procs)

    kx.wait(flagged, 10, "the dlmopen'd process's record, flagged")


def test_the_drain_helper_flags_a_namespace_made_past_the_dlmopen_hook(kx: Krex) -> None:
    """A registered process that loads the CUDA runtime into a namespace of its own through
    libc's dlmopen, looked up past the shim's hook: its drain helper finds the library in
    the loader's namespace list between drains, and the record gets KREX_PF_FOREIGN_NS."""
    v = _world(kx, KREX_FREEZE_POLICY="gpu")
    kx.start_daemon(slots=3)
    kx.run_argv("raw", [str(v["escape"]), "dlmopen", "60", "20", "1", str(v["libnsgpu"]), "raw"])
    sib = _pid(kx, "raw")

    def flags() -> int:
        with Segment.attach(kx.shm) as s:
            return next((int(r.flags) for r in s.raw.procs if int(r.pid) == sib), 0)

    kx.wait(lambda: flags() & lib.KREX_PF_FOREIGN_NS, 10, "the helper to flag the namespace")


def _spawn_at(kx: Krex, name: str, child: str, *, shim: bool = True) -> Path:
    """A sibling command whose shell, held by its shim, starts `child` without the shim's
    segment (KREX_SHM unset: unheld; shim=False: without the shim at all) once the fifo it
    returns is written (_go), and prints the child's pid. It waits in the shell itself: a
    polling loop's short-lived processes, caught before krexd inspected them, would freeze
    its slot."""
    go = kx.out / f"{name}.go"
    os.mkfifo(go)
    strip = "-u KREX_SHM" if shim else "-u KREX_SHM -u LD_PRELOAD"
    kx.run_argv(name, ["sh", "-c", f"read x < {go}; env {strip} {child} & echo pid=$!; wait"])
    return go


def _go(fifo: Path) -> None:
    """Let the shell waiting on `fifo` go."""
    with open(fifo, "w") as f:
        f.write("go\n")


def _child_pid(kx: Krex, name: str) -> int:
    def got() -> int | None:
        lines = [x for x in kx.cmds[name].output().splitlines() if x.startswith("pid=")]
        return int(lines[0][4:]) if lines else None

    pid: int = kx.wait(got, 30, f"{name}'s child")
    return pid


def test_a_sibling_process_that_cannot_reach_the_gpu_does_not_flag_a_region(kx: Krex) -> None:
    """Under `gpu` a sibling command keeps running through a region. A process it starts
    inside the region without the shim (as a JIT compile's cc1, ptxas or ld) is unheld;
    at the region's end one that maps no GPU library and has no GPU device file open
    cannot have run GPU work, so the region stays clean. One that maps the (simulated)
    driver library flags it, with its pid."""
    _world(kx, KREX_FREEZE_POLICY="gpu")
    kx.start_daemon(slots=4)
    go_compiler = _spawn_at(kx, "compiler", "sleep 30")
    loader = "import ctypes, time; ctypes.CDLL('libcuda.so.1'); print('loaded', flush=True); time.sleep(30)"
    go_loader = _spawn_at(kx, "loader", f"{shlex.quote(sys.executable)} -c {shlex.quote(loader)}")
    time.sleep(0.5)
    ready = _hold(kx, "a")
    assert ready["grant"]["frozen_slots"] == [], ready["grant"]
    _go(go_compiler)
    _go(go_loader)
    compiler, loader_pid = _child_pid(kx, "compiler"), _child_pid(kx, "loader")
    kx.wait(lambda: "loaded" in kx.cmds["loader"].output(), 30, "the loader's library")
    rec = _end(kx, "a", ready["pid"])
    assert "unheld-sibling" in rec["flags"], rec["reasons"]
    text = " ".join(rec["reasons"])
    assert f"pid {loader_pid}" in text and f"pid {compiler}" not in text, rec["reasons"]
    # The library's process gone, the next region has only the GPU-less one beside it: clean.
    os.kill(loader_pid, 9)
    kx.wait(lambda: not Path(f"/proc/{loader_pid}").exists(), 10, "the loader's end")
    ready = _hold(kx, "b")
    rec = _end(kx, "b", ready["pid"])
    assert "unheld-sibling" not in rec["flags"], rec["reasons"]
    assert Path(f"/proc/{compiler}").exists()  # it was there, unheld, all along


def _ran_inside(kx: Krex, pid: int, ready: dict[str, Any], end_ns: int) -> list[dict[str, Any]]:
    """The simulated GPU's ops of `pid` that overlap the region (grant to end)."""
    t0 = ready["grant"].get("t_grant") or 0
    return [o for o in kx.ops(gpu=0) if o["pid"] == pid and o["end"] > t0 and o["start"] < end_ns]


@pytest.mark.parametrize("disguise", ["leader-exited", "renamed-libraries"])
def test_a_sibling_process_that_hides_its_gpu_use_still_flags_the_region(kx: Krex, disguise: str) -> None:
    """Processes the end-of-region check must not take for GPU-less, each started inside the
    region by a sibling command without the shim and running kernels there: one whose main
    thread exited while another thread launches (its leader's maps and files read empty), and
    one whose driver, runtime and device libraries are copies under other names (its maps name
    no GPU library, but it maps the simulated device's shared memory, as a real one maps
    /dev/nvidia*). Either flags the region."""
    v = _world(kx, KREX_FREEZE_POLICY="gpu")
    kx.start_daemon(slots=4)
    if disguise == "leader-exited":
        child = f"{v['zleader']} {kx.out} z 400000"
    else:
        libs = kx.out / "libs"
        libs.mkdir()
        names = (("libcudart.so.13", "rt.bin"), ("libcuda.so.1", "drv.bin"), ("libkrexsim.so", "dev.bin"))
        for name, copy in names:
            (libs / copy).write_bytes((Path(LIB_DIR) / name).read_bytes())
            (libs / name).symlink_to(libs / copy)
        child = f"env LD_LIBRARY_PATH={shlex.quote(str(libs))} {v['escape']} plain 2.5 20000 4"
    go = _spawn_at(kx, "sib", child, shim=False)
    time.sleep(1.0)
    ready = _hold(kx, "a")
    assert ready["grant"]["frozen_slots"] == [], ready["grant"]
    _go(go)
    pid = _child_pid(kx, "sib")
    if disguise == "leader-exited":
        kx.wait(lambda: (kx.out / "z.ready").exists(), 30, "the child's threads")
        (kx.out / "z.go").touch()
        kx.wait(lambda: (kx.out / "z.launched").exists(), 30, "the child's kernel")
        assert Path(f"/proc/{pid}/maps").read_bytes() == b"", "the leader has not exited"
    else:
        time.sleep(1.0)
        assert "libcuda" not in Path(f"/proc/{pid}/maps").read_text()
    time.sleep(0.1)
    rec = _end(kx, "a", ready["pid"])
    if disguise == "leader-exited":
        (kx.out / "z.stop").touch()
    end_ns = int(rec.get("t_end_ns") or time.monotonic_ns())
    assert _ran_inside(kx, pid, ready, end_ns), "the child's kernels did not run inside the region"
    assert "unheld-sibling" in rec["flags"] and f"pid {pid}" in " ".join(rec["reasons"]), rec["reasons"]


def test_a_sibling_frozen_inside_its_launch_queues_its_kernel_after_the_region(kx: Krex) -> None:
    """A sibling whose launches the gate cannot hold (a static runtime) stops inside its first
    launch, after the simulated device read the clock and before the kernel is queued
    (KREX_SIM_STALL_MS), and another command's region, its kernels and its end pass while it
    is stopped and frozen. Its kernel is queued once it runs again, after the region: the
    region is clean, and so is the device's trace of it (the chaos test's verdict,
    helpers/chaos.py), never a kernel dated back into the region."""
    v = _world(kx, KREX_FREEZE_POLICY="all")
    kx.start_daemon(slots=3)
    go = kx.out / "a.go"
    kx.run("a", "regions", "-n", "1", "--kernels", "2", "--us", "100", "--sleep-ms", "300", "--go", str(go))
    kx.wait(lambda: (kx.out / "a.waiting").exists(), 30, "the owner's first kernel")
    kx.run_argv("sib", escape_argv("static-runtime", v, 0.5, 200, 1), env_extra={"KREX_SIM_STALL_MS": "900"})
    sib = _pid(kx, "sib")
    time.sleep(0.1)  # inside its first launch's stop
    go.touch()
    res = kx.result("a", timeout=30)
    assert not res["errors"] and len(res["regions"]) == 1, res
    kx.wait(lambda: [r for r in kx.journal() if r["owner_pid"] == res["pid"]], 10, "the journal record")
    rec = [r for r in kx.journal() if r["owner_pid"] == res["pid"]][-1]
    assert not rec["contaminated"], rec["reasons"]
    assert sib in {p for p, _slot, _why in rec["unheld"]}, rec["unheld"]  # frozen in the region
    assert kx.cmds["sib"].wait(30) == 0, kx.cmds["sib"].output()
    ops = [o for o in kx.ops(gpu=0) if o["pid"] == sib]
    assert len(ops) == 1, ops
    assert ops[0]["start"] >= rec["t_end_ns"], (ops[0], rec["t_grant_ns"], rec["t_end_ns"])
