"""Freeze policies (krex/node/freezepolicy.py) end to end: a real krexd, real `krex run`
guardians, real cgroups, the real shim and the simulated GPU.

Three siblings of a region owner:
  cpu     a shim-carrying command that only computes on the CPU (ticks as it goes);
  gated   a shim-carrying command that hammers the GPU;
  bare    the same hammer with LD_PRELOAD removed, so the gate cannot hold it.
Under `all` every sibling is frozen. Under `gpu` only `bare` is, with the reason in the
grant; `cpu` keeps running inside the regions and `gated` parks at the gate. In both, no
sibling submission reaches the driver inside a region (I1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from helpers.krex_world import KREX, WORKER, Krex, foreign_ops, inside, intervals_disjoint, owner_intervals
from helpers.sibling_scripts import HELPER_NICE_SIBLING

pytestmark = [
    pytest.mark.cgroup,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: real cgroups and freezers"),
]

TICKER = textwrap.dedent(
    """
    import json, os, sys, time
    out, stop = sys.argv[1], sys.argv[2]
    ticks = []
    while not os.path.exists(stop):
        x = 0
        for i in range(20000):
            x += i
        ticks.append(time.monotonic_ns())
    json.dump({"pid": os.getpid(), "ticks": ticks}, open(out, "w"))
    """
)


def _popen(kx: Krex, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
    return kx.run_argv(name, argv)


@pytest.mark.parametrize("choice", ["all", "gpu", "default"])
def test_freeze_policy_freezes_what_the_gate_cannot_hold(kx: Krex, choice: str) -> None:
    """`default`: no policy set anywhere (the daemon's world without TEST_POLICY, no
    --freeze): the regions are `gpu` regions."""
    policy = "gpu" if choice == "default" else choice
    if choice == "default":
        kx_env = kx.env
        kx.env = lambda **extra: {  # type: ignore[method-assign]
            k: v for k, v in kx_env(**extra).items() if k != "KREX_FREEZE_POLICY"
        }
    kx.start_daemon(slots=4)
    cpu = _popen(
        kx, "cpu", [sys.executable, "-c", TICKER, str(kx.out / "cpu.json"), str(kx.out / "cpu.stop")]
    )
    kx.run("gated", "hammer", "--us", "50")
    bare = _popen(
        kx,
        "bare",
        [
            "env",
            "-u",
            "LD_PRELOAD",
            sys.executable,
            str(WORKER),
            "hammer",
            str(kx.out),
            "--name",
            "bare",
            "--us",
            "50",
        ],
    )
    pids = {h: kx.wait_running(h) for h in ("gated", "bare")}
    owner = subprocess.Popen(
        [
            *KREX,
            "run",
            "--device",
            "sim",
            *([] if choice == "default" else ["--freeze", policy]),
            "--",
            sys.executable,
            str(WORKER),
            "regions",
            str(kx.out),
            "--name",
            "own",
            "-n",
            "12",
            "--kernels",
            "5",
            "--us",
            "1000",
            "--sleep-ms",
            "10",
        ],
        env=kx.env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    kx.popens.append(owner)
    out, _ = owner.communicate(timeout=120)
    assert owner.returncode == 0, out.decode()[-3000:]
    for h in ("gated", "bare"):
        kx.touch(h)
    (kx.out / "cpu.stop").write_text("")
    assert cpu.wait(30) == 0 and bare.wait(30) == 0
    assert kx.cmds["gated"].wait(30) == 0

    res = kx.result("own")
    assert res["errors"] == [] and len(res["regions"]) == 12
    iv = owner_intervals(res)
    assert intervals_disjoint(iv) == []
    # I1 under either policy: no sibling submission reached the driver inside a region.
    ops = kx.ops(gpu=0)
    assert foreign_ops(iv, ops) == []
    assert any(o["pid"] == pids["bare"] for o in ops), "the bare hammer never reached the driver"

    status = kx.status()
    recs = [r for r in kx.journal() if r["owner_pid"] == res["pid"]]
    assert len(recs) == 12
    cpu_ticks = json.loads((kx.out / "cpu.json").read_text())["ticks"]
    ticks_in = sum(1 for t in cpu_ticks if inside(iv, -1, t))
    for r in recs:
        assert r["freeze_policy"] == policy and not r["contaminated"], r
        if policy == "all":
            assert r["siblings_frozen"] == 3 and r["running_slots"] == [], r
        else:
            # Only the command the gate cannot hold is frozen, and the grant says why.
            assert r["siblings_frozen"] == 1 and len(r["running_slots"]) == 2, r
            assert len(r["freeze_why"]) == 1 and "without the KREX shim" in r["freeze_why"][0], r
    if policy == "all":
        assert ticks_in == 0
    else:
        assert ticks_in > 0, "the CPU-only sibling was stopped inside the regions under the gpu policy"
    # The daemon's own setting: TEST_POLICY's `all` (the command chose its own), or the default.
    assert status["daemon"]["freeze_policy"] == ("gpu" if choice == "default" else "all")
    assert kx.frozen_groups() == [] and kx.gate_open()


def test_unknown_freeze_policy_is_a_usage_error(kx: Krex) -> None:
    p = kx.krex("run", "--device", "sim", "--freeze", "some", "--", "true")
    assert p.returncode == 125 and "--freeze" in p.stderr  # krex run's own failures exit 125


def test_inspector_verdicts(tmp_path: Path) -> None:
    """What a process's image shows (its maps, executable, environment), and the verdict
    against a slot whose segment it never attached: the shim mapped but inactive (no
    KREX_SHM) is not held, nor is a process without the shim, nor a static CUDA runtime."""
    from krex.native import shim_path
    from krex.node import freezepolicy

    ins = freezepolicy.Inspector()
    ref = freezepolicy.SlotRef(3, 7, "/krex-no-such-segment", None)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KREX_")}
    wait = [sys.executable, "-c", "import sys; sys.stdin.read()"]
    with_shim = subprocess.Popen(wait, env=dict(env, LD_PRELOAD=str(shim_path())), stdin=subprocess.PIPE)
    without = subprocess.Popen(
        wait, env={k: v for k, v in env.items() if k != "LD_PRELOAD"}, stdin=subprocess.PIPE
    )
    src = tmp_path / "static.c"
    src.write_text(
        "#include <unistd.h>\nvoid __cudaRegisterFatBinary(void) {}\nint main(void) { pause(); return 0; }\n"
    )
    subprocess.run(["gcc", "-o", str(tmp_path / "static"), str(src)], check=True)
    static = subprocess.Popen([str(tmp_path / "static")], env=dict(env, LD_PRELOAD=str(shim_path())))
    try:
        import time

        time.sleep(0.5)  # let the loader map the preloaded shim
        f = ins.facts(with_shim.pid)
        assert f is not None and f.shim and not f.static_cudart and f.env.get(b"KREX_SHM") is None, f
        v = ins.verdict(with_shim.pid, ref)
        assert v is not None and not v.gateable and v.unheld and "shim is inactive" in v.why, v
        v = ins.verdict(without.pid, ref)
        assert v is not None and not v.gateable and v.unheld and "without the KREX shim" in v.why, v
        v = ins.verdict(static.pid, ref)
        assert v is not None and not v.gateable and v.unheld and "statically" in v.why, v
    finally:
        for p in (with_shim, without, static):
            p.kill()
            p.wait()
    assert ins.verdict(with_shim.pid, ref) is None  # gone


# A child that looks like a process of slot 3 (generation 7) whose shim attached the segment
# /krex-fp-test-PID: the environment the shim reads, and that file mapped (as the shim maps
# krexd's). "The shim" is named by the test (a library the child maps).
_ATTACHED = (
    "import mmap, os; fd = os.open('/dev/shm/' + os.environ['KREX_SHM'].lstrip('/'), os.O_RDWR); "
    "_m = mmap.mmap(fd, 4096); "
)


def _attached_ref(name: str) -> tuple[dict[str, str], Any]:
    from krex.node import freezepolicy

    path = Path("/dev/shm") / name.lstrip("/")
    path.write_bytes(b"\0" * 4096)
    st = path.stat()
    env = dict(os.environ, KREX_SHM=name, KREX_SLOT="3", KREX_SLOT_GEN="7")
    env.pop("LD_PRELOAD", None)
    return env, freezepolicy.SlotRef(3, 7, name, (st.st_dev, st.st_ino))


def test_adaptive_resolves_by_launch_rate() -> None:
    from krex.node import freezepolicy

    assert freezepolicy.effective("adaptive", None) == "all"  # first region: be safe
    assert freezepolicy.effective("adaptive", freezepolicy.ADAPTIVE_RATE * 2) == "all"
    assert freezepolicy.effective("adaptive", freezepolicy.ADAPTIVE_RATE / 2) == "gpu"
    assert freezepolicy.effective("gpu", None) == "gpu"
    assert freezepolicy.effective("all", 0.0) == "all"


# A thread that samples the process's affinity every millisecond into `samples`.
SAMPLER = textwrap.dedent(
    """
    import json, os, sys, threading, time
    samples, stop = [], threading.Event()
    def watch():
        while not stop.is_set():
            samples.append((time.monotonic_ns(), sorted(os.sched_getaffinity(0))))
            time.sleep(0.001)
    t = threading.Thread(target=watch); t.start()
    """
)
AUX_OWNER = SAMPLER + textwrap.dedent(
    """
    import krex
    time.sleep(0.05)
    regions = []
    for _ in range(int(sys.argv[2])):
        with krex.region() as r:
            t0 = time.monotonic_ns()
            time.sleep(0.05)
            t1 = time.monotonic_ns()
        regions.append({"t0": t0, "t1": t1, "grant": r.grant})
        time.sleep(0.05)
    stop.set(); t.join()
    json.dump({"start": sorted(os.sched_getaffinity(0)), "samples": samples, "regions": regions},
              open(sys.argv[1], "w"))
    """
)


def _owner_beside_sibling(
    kx: Krex, sib_code: list[str], ready: Path, done: Path, out: Path, regions: int = 3
) -> None:
    """`krex run` a sibling (python -c SIB_CODE...), wait for its READY file, run AUX_OWNER
    (its result in OUT, REGIONS regions) beside it, then make DONE; both must exit 0."""
    import time

    sib = subprocess.Popen(
        [*KREX, "run", "--device", "sim", "--", sys.executable, "-c", *sib_code],
        env=kx.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and sib.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ready.exists(), "the sibling did not start"
        p = subprocess.run(
            [*KREX, "run", "--device", "sim", "--", sys.executable, "-c", AUX_OWNER, str(out), str(regions)],
            env=kx.env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        done.touch()
        sib_log = sib.communicate(timeout=120)[0]
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert sib.returncode == 0, sib_log[-2000:]


# A sibling that runs (the gpu policy freezes it not: it has the shim and queues nothing) and
# samples its own threads' affinity until the file argv[2] exists (argv[3]: made once it samples).
AUX_SIBLING = SAMPLER + textwrap.dedent(
    """
    open(sys.argv[3], "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set(); t.join()
    json.dump({"samples": samples}, open(sys.argv[1], "w"))
    """
)


@pytest.mark.parametrize("lend", ["1", "all"])
def test_region_core_is_the_measuring_threads_alone(
    kx: Krex, monkeypatch: pytest.MonkeyPatch, lend: str
) -> None:
    """With lent cores (KREX_LEND_CORES=1, or all, the default) a command may run on its
    GPU's region core between regions; inside one, every thread but the measuring one, the
    owner's and a running sibling's, is moved off it (while the siblings drain) and put back
    after. (On a machine too small for a partition, every command shares every core, the
    region core included, so the move is what keeps it the measuring thread's there too.)"""
    plain_env = kx.env
    monkeypatch.setattr(
        kx, "env", lambda **extra: plain_env(KREX_LEND_CORES=lend, KREX_FREEZE_POLICY="gpu", **extra)
    )
    kx.start_daemon(slots=2)
    assert kx.status()["daemon"]["lend_cores"] == {"1": "region"}.get(lend, lend)
    out, sib_out, done, ready = (kx.out / n for n in ("aux.json", "sib.json", "sib.done", "sib.ready"))
    _owner_beside_sibling(kx, [AUX_SIBLING, str(sib_out), str(done), str(ready)], ready, done, out)
    res = json.loads(out.read_text())
    reserved = set(res["regions"][0]["grant"]["reserved_cpus"])
    assert reserved and reserved <= set(res["start"]), "the region core is lent to the command"
    for who, samples in (("owner", res["samples"]), ("sibling", json.loads(sib_out.read_text())["samples"])):
        inside_n = outside_n = 0
        for ts, aff in samples:
            # A margin around each region: the move happens before the grant, the restore
            # just after the end.
            if any(r["t0"] + 2_000_000 <= ts <= r["t1"] - 2_000_000 for r in res["regions"]):
                inside_n += 1
                assert not set(aff) & reserved, (who, ts, aff)
            elif all(ts < r["t0"] - 20_000_000 or ts > r["t1"] + 20_000_000 for r in res["regions"]):
                outside_n += 1
                assert reserved <= set(aff), (who, ts, aff)
        assert inside_n > 0 and outside_n > 0, (who, inside_n, outside_n)
    for r in res["regions"]:
        assert r["grant"]["evicted_threads"] >= 3, r["grant"]  # the owner's watcher, the sibling's two
        assert r["grant"]["frozen_slots"] == [] and r["grant"]["freeze_policy"] == "gpu", r["grant"]


def test_a_signal_handler_on_a_thread_parked_at_the_gate_is_held_too(kx: Krex, bins: dict[str, Path]) -> None:
    """Under `gpu` a sibling is not frozen, only held at the gate by its shim. A signal
    handler that runs on a thread parked there, and submits, must wait at the gate as
    well: the thread is not inside a GPU call, so the call is not a nested one (before
    the fix it passed the closed gate uncounted, inside a region reported clean)."""
    import signal
    import time

    from helpers import wait_until

    kx.start_daemon(slots=4)
    _popen(kx, "sig", [str(bins["sigsub"]), "90", "1000"])  # each handler run: a 1 ms kernel
    log = kx.out / "sig.log"
    wait_until(lambda: log.exists() and '"pid"' in log.read_text(), 30, "the signalled sibling to start")
    pid = next(json.loads(x)["pid"] for x in log.read_text().splitlines() if x.startswith('{"pid"'))
    owner = subprocess.Popen(
        [*KREX, "run", "--device", "sim", "--freeze", "gpu", "--", sys.executable, str(WORKER), "regions",
         str(kx.out), "--name", "own", "-n", "12", "--kernels", "5", "--us", "5000", "--sleep-ms", "10"],
        env=kx.env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    kx.popens.append(owner)
    while owner.poll() is None:
        os.kill(pid, signal.SIGUSR1)
        time.sleep(0.013)
    assert owner.wait(120) == 0, owner.stdout.read().decode()[-3000:] if owner.stdout else ""

    res = kx.result("own")
    assert res["errors"] == [] and len(res["regions"]) == 12
    iv = owner_intervals(res)
    handled = [json.loads(x)["handler_ns"] for x in log.read_text().splitlines() if "handler_ns" in x]
    assert [t for t in handled if inside(iv, -1, t)], "no handler ran in a region: the test proves nothing"
    assert foreign_ops(iv, kx.ops(gpu=0)) == []
    assert kx.frozen_groups() == [] and kx.gate_open()


def test_a_region_never_waits_to_inspect_a_new_process() -> None:
    """Asked by a region (inspect=False), a process not inspected yet (and with no record)
    reads as one the gate does not hold (its slot is frozen: the safe side) and is queued;
    the inspector thread's inspect_pending then reads its image, which the next region
    reads from the cache without reading the process's maps again."""
    import time

    from krex.node import freezepolicy

    name = f"/krex-fp-test-{os.getpid()}"
    env, ref = _attached_ref(name)
    code = _ATTACHED + "import time; time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        time.sleep(0.3)
        ins = freezepolicy.Inspector(shim_name="libc.so")  # mapped by every Python process
        v = ins.verdict(proc.pid, ref, inspect=False)
        assert v is not None and not v.gateable and v.unheld and "not inspected yet" in v.why, v
        assert ins.wanted.is_set() and not ins.seen(proc.pid)
        assert freezepolicy.ungateable([proc.pid], ins, ref, [0])  # no inline budget left: frozen
        assert ins.inspect_pending() == 1
        assert ins.seen(proc.pid)
        reads: list[int] = []
        real = ins._inspect
        ins._inspect = lambda pid, exe: reads.append(pid) or real(pid, exe)  # type: ignore[method-assign]
        assert ins.verdict(proc.pid, ref, inspect=False) == freezepolicy.Verdict(True)
        budget = [0]
        assert freezepolicy.ungateable([proc.pid], ins, ref, budget) == [] and budget == [0]
        assert reads == [], "a region's verdict read the maps again"
        # A budget is spent only on processes whose maps are read.
        fresh = subprocess.Popen([sys.executable, "-c", code], env=env)
        try:
            time.sleep(0.3)
            budget = [1]
            assert freezepolicy.ungateable([proc.pid, fresh.pid], ins, ref, budget) == [] and budget == [0]
            assert reads == [fresh.pid]
        finally:
            fresh.kill()
            fresh.wait()
    finally:
        proc.kill()
        proc.wait()
        Path("/dev/shm" + name).unlink(missing_ok=True)


def test_a_process_seen_before_its_loader_mapped_the_shim_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A "runs without the shim" verdict may only mean the process had not mapped it yet
    (inspected right after exec): it goes stale after RECHECK_S, `seen` says so (the
    inspector thread reads it again), and the next verdict sees the shim. A process the
    gate holds is not read again."""
    import time

    from krex.node import freezepolicy

    monkeypatch.setattr(freezepolicy, "RECHECK_S", 0.2)
    name = f"/krex-fp-late-{os.getpid()}"
    env, ref = _attached_ref(name)
    lib = tmp_path / "libkrexlate.so"
    src = tmp_path / "late.c"
    src.write_text("int krex_late(void) { return 1; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    code = (_ATTACHED + f"import ctypes, sys, time; sys.stdin.readline(); ctypes.CDLL({str(lib)!r}); "
            "print('ok', flush=True); time.sleep(30)")
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    try:
        time.sleep(0.3)
        ins = freezepolicy.Inspector(shim_name=lib.name)
        v = ins.verdict(proc.pid, ref)
        assert v is not None and not v.gateable and "without the KREX shim" in v.why
        assert ins.seen(proc.pid)
        assert ins.verdict(proc.pid, ref, inspect=False) == v  # fresh: from the cache
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == b"ok\n"
        time.sleep(0.25)
        assert not ins.seen(proc.pid), "a stale verdict must be read again by the inspector thread"
        v = ins.verdict(proc.pid, ref, inspect=False)  # a region past its budget: queued, slot frozen
        assert v is not None and "not inspected yet" in v.why
        assert ins.inspect_pending() == 1
        assert ins.seen(proc.pid)
        assert ins.verdict(proc.pid, ref, inspect=False) == freezepolicy.Verdict(True)
        time.sleep(0.25)
        assert ins.seen(proc.pid), "a held process's facts do not go stale"
    finally:
        proc.kill()
        proc.wait()
    # A process seen before it exec'd is seen again after (its old image's key is gone),
    # and the stale facts of a process that ended are forgotten.
    execs = subprocess.Popen(["sh", "-c", f"read x; exec {sys.executable} -c \"{code}\""],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        time.sleep(0.3)
        v = ins.verdict(execs.pid, ref)
        assert v is not None and not v.gateable, v
        assert execs.stdin is not None and execs.stdout is not None
        execs.stdin.write(b"exec\ngo\n")
        execs.stdin.flush()
        assert execs.stdout.readline() == b"ok\n"
        assert ins.verdict(execs.pid, ref) == freezepolicy.Verdict(True) and ins.seen(execs.pid)
        without = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        time.sleep(0.3)
        v = ins.verdict(without.pid, ref)
        assert v is not None and not v.gateable and without.pid in ins._recheck
        without.kill()
        without.wait()
        ins.inspect_pending()
        assert without.pid not in ins._recheck, "an ended process's stale facts are forgotten"
    finally:
        execs.kill()
        execs.wait()
        Path("/dev/shm" + name).unlink(missing_ok=True)


# A sibling with one thread that either pins itself to CPU argv[2] alone (what OpenMP's
# OMP_PROC_BIND may do over a lent core) or re-applies its starting mask every 2 ms; it runs
# until the file argv[1] exists, and makes argv[3] once the thread runs.
AUX_CORE_SIBLING = textwrap.dedent(
    """
    import os, sys, threading, time
    done, core, ready, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    start = os.sched_getaffinity(0)
    ev, born = threading.Event(), []
    def work():
        if mode == "pinned":
            os.sched_setaffinity(0, {core})
        open(ready, "w").close()
        while not os.path.exists(done):
            if mode == "rewiden":
                os.sched_setaffinity(0, start)
            if mode == "spawn" and len(born) < 300:
                born.append(threading.Thread(target=ev.wait)); born[-1].start()
            if mode == "children":  # a short-lived child that pins itself to the region core
                pid = os.fork()
                if pid == 0:
                    os.sched_setaffinity(0, {core})
                    t = time.monotonic()
                    while time.monotonic() - t < 0.001:
                        pass
                    os._exit(0)
                os.waitpid(pid, 0)
            time.sleep(0.002)
    t = threading.Thread(target=work); t.start(); t.join()
    time.sleep(0.3)  # the last region's end is over
    masks = [sorted(os.sched_getaffinity(int(x))) for x in os.listdir("/proc/self/task")]
    open(done + ".masks", "w").write(repr((sorted(start), masks)))
    ev.set()
    """
)


@pytest.mark.parametrize("mode", ["pinned", "rewiden", "spawn", "children"])
def test_a_sibling_thread_the_move_cannot_keep_off_the_region_core(
    kx: Krex, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Lent cores: a running sibling's thread pinned to the region core alone cannot be
    moved off it, so its command is frozen for the region (which stays clean); one that
    puts its wide mask back while the region runs is found at the end, and the region is
    flagged `region-core`, never clean; threads a moved thread starts during regions
    inherit the narrowed mask and get the lent core back at the end. Short-lived children
    that pin themselves to the region core and are gone by the region's end (no audit of
    masks can see them) are caught by krexd's count of the time the slot's cgroup ran on
    that core: flagged `region-core` with the slot and the pids seen, never clean."""
    plain_env = kx.env
    monkeypatch.setattr(
        kx, "env", lambda **extra: plain_env(KREX_LEND_CORES="all", KREX_FREEZE_POLICY="gpu", **extra)
    )
    kx.start_daemon(slots=2)
    reserved = kx.status()["partition"]["slices"][0]["reserved"]
    assert reserved, kx.status()["partition"]
    out, done, ready = (kx.out / n for n in ("own.json", "sib.done", "sib.ready"))
    sib_code = [AUX_CORE_SIBLING, str(done), str(reserved[0]), str(ready), mode]
    n = 8 if mode == "children" else 3
    _owner_beside_sibling(kx, sib_code, ready, done, out, n)
    regions = [r for r in kx.journal() if "reserved_cpus" in r]
    assert len(regions) == n, regions
    if mode == "children":  # every region the sibling ran in (a new child may get its slot frozen)
        ran = [r for r in regions if not r["frozen_slots"]]
        assert len(ran) >= 2, [r["freeze_why"] for r in regions]
        assert all("region-core" in r["flags"] for r in ran), [r["reasons"] for r in ran]
    for r in regions:
        if mode == "pinned":
            assert r["frozen_slots"], r  # the sibling: no move could take its thread off
            assert not r["contaminated"], r["reasons"]
        elif mode == "rewiden":
            assert r["frozen_slots"] == [], r
            assert "region-core" in r["flags"], r["reasons"]
        elif mode == "children":
            assert not r["contaminated"] if r["frozen_slots"] else "region-core" in r["flags"], r
            assert r["frozen_slots"] or any("ran on the region core" in x for x in r["reasons"]), r["reasons"]
        else:  # threads its moved thread started during regions: clean, and the lent core back after
            assert r["frozen_slots"] == [] and not r["contaminated"], r["reasons"]
    if mode == "spawn":
        import ast

        start, masks = ast.literal_eval(Path(str(done) + ".masks").read_text())
        assert len(masks) > 50 and all(m == start for m in masks), (start, [m for m in masks if m != start])


INHERITING_OWNER = textwrap.dedent(
    """
    import json, os, sys, threading, time
    import krex
    start = sorted(os.sched_getaffinity(0))
    stop = threading.Event()
    got = []
    for _ in range(2):
        with krex.region() as r:
            t = threading.Thread(target=stop.wait); t.start()  # inherits the measuring thread's pin
            inside = sorted(os.sched_getaffinity(t.native_id))
        time.sleep(0.05)
        got.append({"inside": inside, "after": sorted(os.sched_getaffinity(t.native_id)),
                    "reasons": r.grant.get("reasons"), "reserved": r.grant["reserved_cpus"]})
    stop.set()
    json.dump({"start": start, "regions": got}, open(sys.argv[1], "w"))
    """
)


@pytest.mark.parametrize("lend", ["off", "all"])
def test_a_thread_started_inside_a_region_does_not_keep_the_region_core(
    kx: Krex, monkeypatch: pytest.MonkeyPatch, lend: str
) -> None:
    """A thread the measuring thread starts inside its region inherits its pin to the region
    core; at the end it gets the mask the measuring thread had before (else it would keep
    the region core for good, and share it with the next command's measuring thread), and
    the owner's next region is not flagged for it."""
    plain_env = kx.env
    monkeypatch.setattr(kx, "env", lambda **extra: plain_env(KREX_LEND_CORES=lend, **extra))
    kx.start_daemon(slots=2)
    out = kx.out / "inherit.json"
    p = subprocess.run(
        [*KREX, "run", "--device", "sim", "--", sys.executable, "-c", INHERITING_OWNER, str(out)],
        env=kx.env(), capture_output=True, text=True, timeout=120,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads(out.read_text())
    for g in res["regions"]:
        assert g["inside"] == g["reserved"], g
        assert g["after"] == res["start"], g
    assert res["regions"][1]["reasons"] == [], res["regions"][1]


@pytest.mark.parametrize("setting", ["default", "0", "-3"])
def test_a_siblings_drain_helper_is_reniced_at_its_first_region(
    kx: Krex, monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    """krexd renices a GPU sibling's drain helper thread to helper_nice (default -10) when a
    region first waits for it, and that thread alone: the command's own threads keep their
    nice. KREX_HELPER_NICE=0 leaves the helper alone."""
    extra = {} if setting == "default" else {"KREX_HELPER_NICE": setting}
    plain_env = kx.env
    monkeypatch.setattr(kx, "env", lambda **more: plain_env(**extra, **more))
    kx.start_daemon(slots=2)
    out, sib_out, done, ready = (kx.out / n for n in ("aux.json", "sib.json", "sib.done", "sib.ready"))
    _owner_beside_sibling(kx, [HELPER_NICE_SIBLING, str(sib_out), str(done), str(ready)], ready, done, out)
    nice = json.loads(sib_out.read_text())
    want = -10 if setting == "default" else int(setting)
    assert nice == {"krex-drain": want, "main": 0}, nice
    assert all(r["grant"]["drained"] >= 1 for r in json.loads(out.read_text())["regions"])
