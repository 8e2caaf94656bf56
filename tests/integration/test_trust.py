"""Trust: a region is either really exclusive or flagged, never a silent "clean".

Each test reproduces one way KREX could be made to call a region clean while it was
not (or to keep quiet about it), in a private KREX world (the `kx` fixture of
conftest.py: own daemon, segment, simulated GPU, trace, cgroups), and checks the
simulated device's trace from outside."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import spawn_with_pid, victims
from helpers.krex_world import (
    KREX,
    WORKER,
    Krex,
    alive,
    foreign_ops,
    frozen_reason,
    owner_intervals,
    proc_state,
)

from krex.native import lib
from krex.node.shm import Segment

HELPERS = str(Path(__file__).resolve().parents[1] / "helpers")

pytestmark = [
    pytest.mark.cgroup,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: real cgroups and freezers"),
]



def _run(
    kx: Krex, *argv: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KREX, "run", "--device", "sim", *argv],
        env=env or kx.env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def victim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/sim/victim.c, built against the simulated GPU."""
    from krex.native import LIB_DIR

    out = tmp_path_factory.mktemp("victim") / "victim"
    cc = os.environ.get("CC", "gcc")
    src = REPO / "examples/sim/victim.c"
    libs = [f"-L{LIB_DIR}", f"-Wl,-rpath,{LIB_DIR}", "-lcudart", "-lcuda", "-l:libamdhip64.so", "-ldl"]
    subprocess.run([cc, "-O2", "-I", str(REPO / "interpose"), str(src), *libs, "-o", str(out)], check=True)
    return out


def _report(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


# ====================================================================== case 4: --max-region cuts


CUT_PY = textwrap.dedent(
    """
    import json, sys, time, warnings
    import krex
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        with krex.region() as r:
            time.sleep(1.5)
    print(json.dumps({"cut": getattr(r, "cut", None), "clean": getattr(r, "clean", None),
                      "warnings": [str(w.message) for w in caught]}))
    """
)


def test_a_cut_region_is_visible_in_python_report_and_journal(kx: Krex) -> None:
    kx.start_daemon(slots=2, max_region=0.5)
    rep = kx.out / "cut.json"
    p = _run(kx, "--report", str(rep), "--", sys.executable, "-c", CUT_PY)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["cut"] is True, out
    assert out["clean"] is False, out
    assert any("max-region" in w for w in out["warnings"]), out
    r = _report(rep)
    assert r["cut_regions"] == 1 and r["regions"][0]["cut"] is True, r
    assert "cut" in r["regions"][0]["flags"] and r["regions"][0]["contaminated"] is True
    recs = kx.journal()
    assert recs[-1]["cut"] is True and "cut" in recs[-1]["flags"]


def test_a_cut_region_makes_the_c_marker_return_non_zero(kx: Krex, victim: Path) -> None:
    kx.start_daemon(slots=2, max_region=0.3)
    p = _run(kx, "--", str(victim), "--region", "--us", "2000", "--iters", "400")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["region_rc"] != 0, out  # 0 would mean "clean"
    # And a region that ends in time says 0.
    q = _run(kx, "--", str(victim), "--region", "--us", "100", "--iters", "10")
    assert json.loads(q.stdout.strip().splitlines()[-1])["region_rc"] == 0, q.stdout


# ====================================================================== case 1: leftovers


def _leftover_then_owner(kx: Krex, *run_args: str) -> tuple[dict[str, Any], dict[str, Any], int]:
    """Command A starts a background hammer and exits; command B then takes 30 regions.
    Returns (A's report, B's worker result, the leftover's pid)."""
    rep_a = kx.out / "a.json"
    hammer = f"{sys.executable} {WORKER} hammer {kx.out} --name lo --us 200 --seconds 20"
    # The hammer must not hold our pipes open, or waiting for A would wait for it too.
    script = f"{hammer} >/dev/null 2>&1 & sleep 1.5"
    p = _run(kx, "--report", str(rep_a), *run_args, "--", "sh", "-c", script)
    assert p.returncode == 0, p.stderr
    lo_pid = kx.progress("lo")[2]
    before = [o for o in kx.ops() if o["pid"] == lo_pid]
    assert before, "the leftover never submitted while its command ran (test is vacuous)"
    own = kx.run("own", "regions", "-n", "30", "--kernels", "3", "--us", "100", "--sleep-ms", "5")
    assert own.wait(120) == 0, own.output()
    return _report(rep_a), kx.result("own"), lo_pid


def test_a_leftover_is_killed_reported_and_never_passes_the_next_owners_gate(kx: Krex) -> None:

    kx.start_daemon(slots=2)
    rep_a, res, lo_pid = _leftover_then_owner(kx)
    iv = owner_intervals(res)
    assert len(iv) == 30 and res["errors"] == []
    assert foreign_ops(iv, kx.ops()) == []
    assert [x["pid"] for x in rep_a["leftovers"]] == [lo_pid], rep_a
    assert rep_a["leftovers_action"] == "killed"

    kx.wait(lambda: not alive(lo_pid), 10, "the leftover to die")
    assert all(r["grant"]["contaminated"] is False for r in res["regions"])


def test_a_kept_leftover_is_a_frozen_sibling_and_keeps_its_slot(kx: Krex) -> None:

    kx.start_daemon(slots=3)
    rep_a, res, lo_pid = _leftover_then_owner(kx, "--keep-leftovers")
    assert [x["pid"] for x in rep_a["leftovers"]] == [lo_pid] and rep_a["leftovers_action"] == "kept"
    iv = owner_intervals(res)
    assert foreign_ops(iv, kx.ops()) == []
    # Not vacuous: the leftover ran on between B's regions.
    first, last = iv[0][1], iv[-1][2]
    assert any(o["pid"] == lo_pid and first < o["submit"] < last for o in kx.ops())
    # It kept its slot (A's), so B got another one, and its slot was frozen in B's regions.
    a_slot = rep_a["slot"]
    assert all(r["grant"]["slot"] != a_slot and a_slot in r["grant"]["frozen_slots"] for r in res["regions"])
    kx.touch("lo")
    kx.wait(lambda: kx.status()["slots"] == [], 30, "the lingering slot to be freed once the leftover ends")



ESCAPE_PY = textwrap.dedent(
    """
    import os, sys, time
    to, flag = sys.argv[1], sys.argv[2]
    if os.fork() == 0:
        null = os.open(os.devnull, os.O_RDWR)  # never hold krex run's pipes open
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        with open(to, "w") as f:  # leave the slot's cgroup, as a process may
            f.write(str(os.getpid()))
        line = [ln for ln in open("/proc/self/cgroup") if ln.startswith("0::")][0].strip()
        with open(flag + ".tmp", "w") as f:
            f.write(f"{os.getpid()} {line}")
        os.rename(flag + ".tmp", flag)
        time.sleep(60)
        os._exit(0)
    while not os.path.exists(flag):
        time.sleep(0.01)
    """
)


def test_a_leftover_that_left_the_slots_cgroup_is_found_by_its_environment(kx: Krex) -> None:
    """Neither in the slot's group, nor a root, nor registered (no GPU call): only the
    deep scan of every process's environment finds it. It must be killed and reported."""
    from krex.node import mounts

    own = [ln for ln in Path("/proc/self/cgroup").read_text().splitlines() if ln.startswith("0::")]
    v2 = mounts.cgroup2_mounts(mounts.read_mounts())
    if not own or not v2:
        pytest.skip("needs the cgroup v2 hierarchy")
    kx.start_daemon(slots=2)
    if kx.status()["daemon"]["freezer"] != "cgroup2":
        pytest.skip("the daemon did not pick the cgroup2 freezer")
    to = os.path.join(v2[0], own[0][3:].lstrip("/"), "cgroup.procs")
    flag, rep = kx.out / "escaped", kx.out / "rep.json"
    p = _run(kx, "--report", str(rep), "--", sys.executable, "-c", ESCAPE_PY, to, str(flag))
    assert p.returncode == 0, p.stderr
    pid_s, line = flag.read_text().split(" ", 1)
    pid = int(pid_s)
    assert kx.root not in line, f"the child never left the slot's cgroup ({line}): the test proves nothing"
    report = _report(rep)
    assert [x["pid"] for x in report["leftovers"]] == [pid], report
    assert report["leftovers_action"] == "killed"

    kx.wait(lambda: not alive(pid), 10, "the escaped leftover to die")

# ====================================================================== case 3: the segment


def _journal_after(kx: Krex, t: float) -> list[dict[str, Any]]:
    return [r for r in kx.journal() if float(r.get("ts", 0)) >= t]


def test_an_unlinked_segment_is_detected_relinked_and_flagged(kx: Krex, victim: Path) -> None:
    import time

    kx.start_daemon(slots=3)
    kx.run("h1", "hammer", "--us", "50")
    kx.wait_running("h1")
    t0 = time.time()
    Path("/dev/shm" + kx.shm).unlink()
    # A C benchmark right after: its KREX_REGION_BEGIN/END may say 0 only for a region krexd ran.
    v = _run(kx, "--", str(victim), "--region", "--us", "100", "--iters", "20")
    assert v.returncode == 0, v.stderr
    out = json.loads(v.stdout.strip().splitlines()[-1])
    journaled = [r for r in kx.journal() if r["owner_pid"] == out["pid"]]
    assert out["region_rc"] != 0 or journaled, f"region_rc 0 for a region krexd never ran: {out}"
    # A command that starts now must be gated by the same segment, never run ungated.
    own = kx.run("own", "regions", "-n", "10", "--kernels", "2", "--us", "100", "--sleep-ms", "5")
    assert own.wait(120) == 0, own.output()
    res = kx.result("own")

    iv = owner_intervals(res)
    bad = foreign_ops(iv, kx.ops())
    clean = [r for r in res["regions"] if r["summary"]["clean"]]
    assert not (bad and clean), f"{len(bad)} foreign submissions inside {len(clean)} clean regions"
    assert Path("/dev/shm" + kx.shm).exists(), "the daemon did not restore the segment's name"
    st = kx.status()
    assert st["segment"]["incidents"], st["segment"]
    assert any("unlinked" in i["problems"][0] for i in st["segment"]["incidents"])
    p = kx.krex("status")
    assert p.returncode == 0 and "unlinked" in p.stdout, p.stdout + p.stderr
    d = kx.krex("doctor", "--json")
    seg = [c for c in json.loads(d.stdout)["checks"] if c["name"] == "segment"][0]
    assert seg["status"] == "warn" and "unlinked" in seg["finding"], seg
    recs = _journal_after(kx, t0)
    assert recs and any("segment" in r["flags"] for r in recs), recs[:2]
    kx.touch("h1")


def test_random_bytes_over_the_segment_are_detected_repaired_and_flagged(kx: Krex) -> None:
    import random
    import time

    kx.start_daemon(slots=3)
    kx.run("h1", "hammer", "--us", "50")
    kx.wait_running("h1")
    t0 = time.time()
    size = Path("/dev/shm" + kx.shm).stat().st_size
    rng = random.Random(7)
    with open("/dev/shm" + kx.shm, "r+b") as f:
        f.write(bytes(rng.getrandbits(8) for _ in range(min(size, 1 << 16))))
    own = kx.run("own", "regions", "-n", "10", "--kernels", "2", "--us", "100", "--sleep-ms", "5")
    rc = own.wait(120)
    assert rc == 0, own.output()[-2000:]
    res = kx.result("own")
    clean = [r for r in res["regions"] if r["summary"] and r["summary"].get("clean")]

    bad = foreign_ops(owner_intervals(res), kx.ops())
    assert not (bad and clean), f"{len(bad)} foreign submissions inside {len(clean)} clean regions"
    st = kx.status()
    assert st["segment"]["incidents"], st["segment"]
    recs = _journal_after(kx, t0)
    assert recs and all("segment" in r["flags"] for r in recs if r["owner_pid"] == res.get("pid")), recs[:2]
    kx.touch("h1")
    # The daemon survives the damage and stops cleanly (it crashed with IndexError before).
    p = kx.krex("daemon", "stop")
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in kx.daemon_log()


def test_an_admission_right_after_random_bytes_claims_from_the_repaired_slot_table(kx: Krex) -> None:
    """Random slot records read as taken. An admission that came before krexd's next
    heartbeat check claimed from them and failed with "all 64 slots are taken" (seen as a
    flake of the test above under CPU load): krexd must check the segment before a claim."""
    import random

    kx.start_daemon(slots=3)
    c = kx.client()  # connected before the damage, so the admit follows it within a few ms
    try:
        size = Path("/dev/shm" + kx.shm).stat().st_size
        rng = random.Random(7)
        data = bytes(rng.getrandbits(8) for _ in range(min(size, 1 << 16)))
        with open("/dev/shm" + kx.shm, "r+b") as f:
            f.write(data)
        adm = c.request({"op": "admit", "gpu": 0})
        assert adm["ok"] is True and 0 <= adm["slot"] < 3, adm
        st = kx.status()
        assert st["segment"]["incidents"], st["segment"]
        assert [s["slot"] for s in st["slots"]] == [adm["slot"]], st["slots"]
        actions = [a for i in st["segment"]["incidents"] for a in i["actions"]]
        assert any("slot record" in a for a in actions), st["segment"]
    finally:
        c.close()
    assert "Traceback" not in kx.daemon_log()


# ====================================================================== case 5: automatic regions


def _mybench(kx: Krex) -> Path:
    d = kx.out / "mod"
    d.mkdir(exist_ok=True)
    (d / "mybench.py").write_text("import time\n\ndef run_trial():\n    time.sleep(0.01)\n    return 1\n")
    return d


def test_an_auto_region_target_that_never_fires_is_reported_and_warned_about(kx: Krex) -> None:
    kx.start_daemon(slots=2)
    mod = _mybench(kx)
    rep = kx.out / "typo.json"
    env = kx.env(KREX_AUTO_REGION="mybench:run_trail", PYTHONPATH=str(mod))
    code = "import mybench; mybench.run_trial()"
    p = _run(kx, "--report", str(rep), "--", sys.executable, "-c", code, env=env)
    assert p.returncode == 0, p.stderr
    assert "KREX_AUTO_REGION" in p.stderr and "no region" in p.stderr, p.stderr
    r = _report(rep)
    assert r["region_count"] == 0
    t = r["auto_region"]["targets"]
    assert [x["target"] for x in t] == ["mybench:run_trail"] and t[0]["state"] == "missing", t


def test_auto_regions_are_counted_per_target_in_report_and_journal(kx: Krex) -> None:
    kx.start_daemon(slots=2)
    mod = _mybench(kx)
    rep = kx.out / "ok.json"
    env = kx.env(KREX_AUTO_REGION="mybench:run_trial", PYTHONPATH=str(mod))
    code = "import mybench\nfor _ in range(3): mybench.run_trial()"
    p = _run(kx, "--report", str(rep), "--", sys.executable, "-c", code, env=env)
    assert p.returncode == 0, p.stderr
    assert "no region" not in p.stderr
    r = _report(rep)
    assert r["region_count"] == 3 and r["auto_region"]["wrapped"] == ["mybench:run_trial"], r["auto_region"]
    assert r["auto_region"]["targets"][0]["regions"] == 3
    assert r["auto_region"]["whole_call_regions"] == 3  # a module:function target is a whole-call region
    assert all(x["label"] == "auto:mybench:run_trial:whole" for x in kx.journal())


def test_batch_summary_shows_regions_and_auto_targets_per_command(kx: Krex) -> None:
    kx.start_daemon(slots=2)
    mod = _mybench(kx)
    cmds = kx.out / "cmds.txt"
    call = f"{sys.executable} -c 'import mybench; mybench.run_trial()'"
    cmds.write_text(f"KREX_AUTO_REGION=mybench:run_trial {call}\nKREX_AUTO_REGION=mybench:run_trail {call}\n")
    out = kx.out / "batch"
    p = subprocess.run(
        [*KREX, "batch", str(cmds), "-j", "1", "--device", "sim", "--out", str(out)],
        env=kx.env(PYTHONPATH=str(mod)),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == 0, p.stderr
    s = json.loads((out / "summary.json").read_text())
    per = {c["index"]: c for c in s["per_command"]}
    first, second = sorted(per)
    assert per[first]["regions"] == 1 and per[first]["auto_wrapped"] == ["mybench:run_trial"]
    assert per[second]["regions"] == 0 and per[second]["auto_wrapped"] == []
    assert per[second]["auto_targets"][0]["state"] == "missing"
    assert s["no_region_commands"] == [second] and s["simulated"] is True
    assert f"#{second}: 0 region(s); KREX_AUTO_REGION=mybench:run_trail: wrapped none" in p.stdout, p.stdout


# ====================================================================== case 7: attestation


def _hold_region(kx: Krex, name: str) -> dict[str, Any]:
    kx.run(name, "hold")
    ready: dict[str, Any] = kx.result(name, "ready", timeout=30)
    return ready


def _end_hold(kx: Krex, name: str, pid: int) -> dict[str, Any]:
    kx.touch(name)
    assert kx.cmds[name].wait(30) == 0
    kx.wait(lambda: [r for r in kx.journal() if r["owner_pid"] == pid], 10, "the journal record")
    rec: dict[str, Any] = [r for r in kx.journal() if r["owner_pid"] == pid][-1]
    return rec


def test_attestation_flags_foreign_gpu_processes_and_throttling(kx: Krex) -> None:
    nvml = kx.out / "nvml.json"
    base = {"gpus": [{"name": "fake", "uuid": "GPU-fake", "procs": [], "sm_clock": 1980, "throttle": 1}]}
    _write_atomic(nvml, json.dumps(base))
    kx_env = kx.env
    kx.env = lambda **extra: kx_env(KREX_NVML_FAKE=str(nvml), **extra)  # type: ignore[method-assign]
    kx.start_daemon(slots=2)
    # A clean region: clocks recorded, nothing flagged (GPU idle is not a slowdown).
    ready = _hold_region(kx, "a")
    rec = _end_hold(kx, "a", ready["pid"])
    assert rec["contaminated"] is False, rec["reasons"]
    assert rec["attest"]["nvml"] == "ok" and rec["attest"]["sm_clock_mhz"] == [1980, 1980]
    # A process outside KREX starts computing on the GPU, and the GPU hits its power cap.
    outsider = subprocess.Popen(["sleep", "60"])
    try:
        ready = _hold_region(kx, "b")
        own = {kx.progress("b")[2]} if (kx.out / "b.progress").exists() else set()
        # krexd takes its entry sample right after the grant's reply: let it, so that what
        # follows is seen at the end only (on a loaded machine the test once wrote first).
        time.sleep(0.5)
        _write_atomic(
            nvml,
            json.dumps(
                {
                    "gpus": [
                        dict(
                            base["gpus"][0],
                            procs=[outsider.pid, ready["pid"], *own],
                            sm_clock=1410,
                            throttle=0x4,
                        )
                    ]
                }
            )
        )
        rec = _end_hold(kx, "b", ready["pid"])
    finally:
        outsider.kill()
    assert rec["contaminated"] is True
    assert {"foreign-process", "throttle"} <= set(rec["flags"]), rec["flags"]
    assert [f["pid"] for f in rec["attest"]["foreign"]] == [outsider.pid]
    assert rec["attest"]["sm_clock_mhz"] == [1980, 1410]
    assert rec["attest"]["throttle"][1] == ["sw_power_cap"]


def test_a_region_waits_while_nvml_lists_a_process_that_has_ended(kx: Krex) -> None:
    """A process reaped just before a region may still be torn down by the driver, which
    NVML shows by listing it: entry waits until it is no longer listed (clean), and flags
    it `foreign-process` when it is still listed at the bound (freeze_timeout)."""
    import threading

    nvml, base = _fake_nvml_gpu_policy(kx, KREX_FREEZE_TIMEOUT="2")

    def listing(*pids: int) -> None:
        _write_atomic(nvml, json.dumps({"gpus": [dict(base["gpus"][0], procs=list(pids))]}))

    # First region: NVML lists its owner, a process KREX knows, so NVML's pids are krexd's.
    ready = _hold_region(kx, "a")
    listing(ready["pid"])
    assert not _end_hold(kx, "a", ready["pid"])["contaminated"]
    gone = subprocess.Popen(["true"])
    gone.wait()
    listing(gone.pid)  # ended and reaped, still listed
    threading.Timer(0.8, listing).start()  # the driver's teardown ends (the command starts meanwhile)
    ready = _hold_region(kx, "b")
    assert ready["grant"]["teardown_wait_s"] >= 0.3 and not ready["grant"]["contaminated"], ready["grant"]
    rec = _end_hold(kx, "b", ready["pid"])
    assert not rec["contaminated"], rec["reasons"]
    # Still listed at the bound: entry goes on, and the attestation flags it.
    listing(gone.pid)
    ready = _hold_region(kx, "c")
    assert 1.9 <= ready["grant"]["teardown_wait_s"] < 4, ready["grant"]
    rec = _end_hold(kx, "c", ready["pid"])
    assert "foreign-process" in rec["flags"], rec["reasons"]
    assert [f["pid"] for f in rec["attest"]["foreign"]] == [gone.pid]


def _write_atomic(path: Path, text: str) -> None:
    """krexd's fake NVML re-reads the file on every call, maybe while the test rewrites it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _fake_nvml_gpu_policy(kx: Krex, **settings: str) -> tuple[Path, dict[str, Any]]:
    """A daemon (2 slots) under the `gpu` freeze policy (and `settings`) whose NVML is a
    file the test writes: (that file, its idle content)."""
    nvml = kx.out / "nvml.json"
    base = {"gpus": [{"name": "fake", "uuid": "GPU-fake", "procs": [], "sm_clock": 1980, "throttle": 1}]}
    _write_atomic(nvml, json.dumps(base))
    kx_env = kx.env
    conf = {"KREX_FREEZE_POLICY": "gpu", **settings}
    kx.env = lambda **extra: kx_env(  # type: ignore[method-assign]
        KREX_NVML_FAKE=str(nvml), **{**conf, **extra}
    )
    kx.start_daemon(slots=2)
    return nvml, base


def test_a_sibling_that_ends_during_a_gpu_policy_region_is_not_foreign(kx: Krex) -> None:
    """Under the gpu policy a sibling is not frozen and may end inside a region while NVML
    still lists its pid: it was under KREX when the region began, so nothing is flagged.
    A process outside KREX in the same sample still is."""
    nvml, base = _fake_nvml_gpu_policy(kx)
    kx.run("sib", "hammer", "--us", "0", "--seconds", "60")  # CPU only: never held at the gate
    sib = kx.wait_running("sib")
    _write_atomic(nvml, json.dumps({"gpus": [dict(base["gpus"][0], procs=[sib])]}))
    ready = _hold_region(kx, "a")
    assert ready["grant"]["freeze_policy"] == "gpu" and ready["grant"]["frozen_slots"] == [], ready["grant"]
    kx.touch("sib")  # it ends inside the region
    assert kx.cmds["sib"].wait(30) == 0, kx.cmds["sib"].output()
    assert not os.path.exists(f"/proc/{sib}"), "the sibling must be gone before the region ends"
    rec = _end_hold(kx, "a", ready["pid"])
    assert "foreign-process" not in rec["flags"], rec["reasons"]
    assert rec["attest"]["foreign"] == [] and rec["attest"]["gpu_processes"] == 1
    # The same region shape with an outsider in the sample is flagged (the check still bites).
    _write_atomic(nvml, json.dumps(base))
    outsider = subprocess.Popen(["sleep", "60"])
    try:
        ready = _hold_region(kx, "b")
        _write_atomic(nvml, json.dumps({"gpus": [dict(base["gpus"][0], procs=[outsider.pid])]}))
        rec = _end_hold(kx, "b", ready["pid"])
    finally:
        outsider.kill()
    assert [f["pid"] for f in rec["attest"]["foreign"]] == [outsider.pid], rec["attest"]


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_a_sibling_whose_gpu_process_ends_during_a_gpu_policy_region(kx: Krex, how: str) -> None:
    """Under the gpu policy a sibling keeps running. One that used the GPU and ends inside
    the region would tear its GPU context down meanwhile, on the GPU, outside the gate: on
    the H200 such regions read clean while kernels over 10 ms ran up to 16% slower. An exit
    waits for the region to end (its last drain, like the exit hold); a process killed
    cannot wait, and its region is flagged."""
    _fake_nvml_gpu_policy(kx)
    kx.run("sib", "hammer", "--us", "0", "--long-us", "1")  # one GPU call (it registers), then CPU only
    kx.wait(lambda: (kx.out / "sib.ready").exists(), 30, "the sibling's GPU call")
    sib = json.loads((kx.out / "sib.ready").read_text())
    ready = _hold_region(kx, "a")
    assert ready["grant"]["frozen_slots"] == [] and not ready["grant"]["contaminated"], ready["grant"]
    if how == "exit":
        kx.touch("sib")  # it begins its exit inside the region
        time.sleep(1.0)
        assert kx.cmds["sib"].popen.poll() is None, "the sibling's exit did not wait for the region"
        rec = _end_hold(kx, "a", ready["pid"])
        assert kx.cmds["sib"].wait(30) == 0, kx.cmds["sib"].output()
        assert not rec["contaminated"], rec["reasons"]
    else:
        os.kill(sib["pid"], signal.SIGKILL)  # it ends inside the region
        kx.wait(lambda: not os.path.exists(f"/proc/{sib['pid']}"), 30, "the sibling to be gone")
        rec = _end_hold(kx, "a", ready["pid"])
        assert "sibling-context" in rec["flags"] and rec["contaminated"], rec["reasons"]
        assert f"ended pid {sib['pid']}" in " ".join(rec["reasons"]), rec["reasons"]


EXECER = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, sys.argv[1])
    from cp_worker import Gpu
    out, trigger = sys.argv[2], sys.argv[3]
    g = Gpu(); g.kernel(1); g.synchronize()  # a GPU image: it registers
    if len(sys.argv) > 4:  # the second image: that one call, then done
        open(out + ".2", "w").close()
        sys.exit(0)
    open(out, "w").write(str(os.getpid()))
    while not os.path.exists(trigger):
        time.sleep(0.005)
    os.execv(sys.executable, [sys.executable, __file__, *sys.argv[1:], "again"])
    """
)


def _helper_tid(kx: Krex, pid: int) -> int:
    from krex.node.shm import Segment

    with Segment.attach(kx.env()["KREX_SHM"]) as seg:
        return max((int(r.helper_tid) for r in seg.raw.procs if int(r.pid) == pid), default=0)


def test_a_sibling_that_execs_into_a_new_gpu_image_during_a_gpu_policy_region_flags_it(kx: Krex) -> None:
    """exec keeps the pid and its start time, but ends one GPU image (teardown) and starts
    another (set-up): the record's drain-helper thread tells the two images apart."""
    _fake_nvml_gpu_policy(kx)
    script, out, trigger = kx.out / "execer.py", kx.out / "execer", kx.out / "exec-now"
    script.write_text(EXECER)
    kx.run_argv("sib", [sys.executable, str(script), str(WORKER.parent), str(out), str(trigger)])
    # (written, not just created: the file exists a moment before its pid is in it)
    kx.wait(lambda: out.exists() and out.read_text().strip(), 30, "the sibling's first image")
    pid = int(out.read_text())
    first = kx.wait(lambda: _helper_tid(kx, pid), 15, "its drain helper")
    ready = _hold_region(kx, "a")
    trigger.touch()  # it execs inside the region; the new image's first call waits at the gate
    kx.wait(lambda: _helper_tid(kx, pid) not in (0, first), 15, "the new image to register")
    rec = _end_hold(kx, "a", ready["pid"])
    assert "sibling-context" in rec["flags"], rec["reasons"]
    text = " ".join(rec["reasons"])
    assert f"started pid {pid}" in text and f"ended pid {pid}" in text, rec["reasons"]
    kx.wait(lambda: Path(str(out) + ".2").exists(), 15, "the new image's call after the region")


def test_a_sibling_process_killed_while_frozen_and_left_a_zombie_flags_the_region(kx: Krex) -> None:
    """Under the default policy a sibling is frozen; one of its processes killed meanwhile
    tears its context down all the same. Its frozen parent cannot reap it: a zombie, whose
    pid and start time are unchanged, still counts as ended."""
    kx.start_daemon(slots=2)
    worker = f"{sys.executable} {WORKER} hammer {kx.out} --name sib --us 0 --long-us 1 --seconds 60"
    kx.run_argv("sib", ["sh", "-c", f"{worker} & wait"])
    kx.wait(lambda: (kx.out / "sib.ready").exists(), 30, "the sibling's GPU call")
    child = json.loads((kx.out / "sib.ready").read_text())["pid"]
    ready = _hold_region(kx, "a")
    assert ready["grant"]["frozen_slots"], ready["grant"]
    os.kill(child, signal.SIGKILL)
    stat = Path(f"/proc/{child}/stat")
    # A zombie leader counts as ended once its other threads are gone too (under load the
    # frozen process's other threads can take a moment longer to exit than its leader).
    kx.wait(
        lambda: stat.read_text().rsplit(")", 1)[1].split()[0] == "Z" and not lib.krex_pid_alive(child, 0),
        10,
        "a zombie with no thread left",
    )
    rec = _end_hold(kx, "a", ready["pid"])
    assert "sibling-context" in rec["flags"], rec["reasons"]
    assert f"ended pid {child}" in " ".join(rec["reasons"]), rec["reasons"]


def test_a_sibling_context_nvml_saw_end_during_a_region_flags_it(kx: Krex) -> None:
    """A sibling with a GPU context but no gated call (so no process record) that ends
    inside the region: only NVML sees it, listed at the grant and gone at the end."""
    nvml, base = _fake_nvml_gpu_policy(kx)
    kx.run("sib", "hammer", "--us", "0", "--seconds", "60")  # CPU only: never registers
    sib = kx.wait_running("sib")
    _write_atomic(nvml, json.dumps({"gpus": [dict(base["gpus"][0], procs=[sib])]}))
    ready = _hold_region(kx, "a")
    kx.touch("sib")
    assert kx.cmds["sib"].wait(30) == 0, kx.cmds["sib"].output()
    _write_atomic(nvml, json.dumps(base))
    rec = _end_hold(kx, "a", ready["pid"])
    assert "sibling-context" in rec["flags"] and "foreign-process" not in rec["flags"], rec["reasons"]
    assert f"ended pid {sib}" in " ".join(rec["reasons"]), rec["reasons"]


@pytest.mark.parametrize("policy", ["gpu", "gpu-context", "all"])
def test_a_sibling_that_starts_its_gpu_work_during_a_region_is_held_or_flagged(kx: Krex, policy: str) -> None:
    """A running sibling's first GPU call inside the region registers it and waits at the
    closed gate: under gpu it ran nothing on the GPU, and NVML, which does not list it at the
    end, confirms it had no context, so the region is clean. If NVML lists it (a context set
    up through an ungated path before that call), the start is flagged. Under all the sibling
    is frozen and cannot start."""
    nvml = None
    if policy.startswith("gpu"):
        nvml, base = _fake_nvml_gpu_policy(kx)
    else:
        kx.start_daemon(slots=2)
    trigger = kx.out / "trigger"
    kx.run("sib", "hammer", "--us", "0", "--long-us", "1", "--trigger", str(trigger), "--seconds", "30")
    kx.wait(lambda: (kx.out / "sib.progress").exists(), 30, "the sibling to start")
    sib = kx.progress("sib")[2]
    ready = _hold_region(kx, "a")
    trigger.touch()
    if nvml is not None:  # its first call registers it, then it waits at the closed gate
        kx.wait(lambda: any(p.pid == sib for p in kx.snapshot().procs), 15, "the sibling to register")
        if policy == "gpu-context":
            _write_atomic(nvml, json.dumps({"gpus": [dict(base["gpus"][0], procs=[sib])]}))
    else:
        time.sleep(1.0)  # frozen: it cannot see the trigger before the region ends
        assert not any(p.pid == sib for p in kx.snapshot().procs)
    time.sleep(0.3)
    assert not (kx.out / "sib.ready").exists(), "the sibling's GPU call passed a closed gate"
    rec = _end_hold(kx, "a", ready["pid"])
    if policy == "gpu-context":
        assert "sibling-context" in rec["flags"], rec["reasons"]
        assert f"started pid {sib}" in " ".join(rec["reasons"]), rec["reasons"]
    elif policy == "gpu":
        assert rec["siblings_frozen"] == 0 and not rec["contaminated"], rec
    else:
        assert rec["siblings_frozen"] == 1 and not rec["contaminated"], rec
    kx.wait(lambda: (kx.out / "sib.ready").exists(), 30, "the sibling's call after the region")
    kx.touch("sib")


def test_a_sibling_that_fails_open_during_a_region_flags_it(kx: Krex) -> None:
    import signal
    import time

    d = kx.start_daemon(slots=2)
    ready = _hold_region(kx, "own")
    # A command gated through the segment but not frozen by krexd (claimed with --no-daemon).
    sib = subprocess.Popen(
        [
            *KREX,
            "run",
            "--device",
            "sim",
            "--no-daemon",
            "--",
            sys.executable,
            str(WORKER),
            "hammer",
            str(kx.out),
            "--name",
            "sib",
            "--us",
            "50",
            "--seconds",
            "20",
        ],
        env=kx.env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    kx.popens.append(sib)
    kx.wait(lambda: (kx.out / "sib.progress").exists(), 30, "the sibling to start")
    time.sleep(0.5)  # it is blocked at the closed gate now
    os.kill(d.pid, signal.SIGSTOP)  # the daemon hangs: its heartbeat goes stale
    try:
        kx.wait(lambda: kx.progress("sib")[0] > 0, 15, "the sibling to fail open")
    finally:
        os.kill(d.pid, signal.SIGCONT)
    rec = _end_hold(kx, "own", ready["pid"])
    assert "fail-open" in rec["flags"], rec
    kx.touch("sib")


# ========================================================= siblings around a region: LIFE calls, exits, frees


def test_a_daemon_started_from_inside_a_command_does_not_live_in_its_slot_group(kx: Krex) -> None:
    """The region API starts krexd on demand. Started by a process of a command, the daemon
    was born in that command's slot cgroup, and froze itself in the next region of another
    command: every client then hung (seen by the chaos test after a daemon restart)."""
    d = kx.start_daemon(slots=2)
    go = kx.out / "go"
    ready = kx.out / "ready"
    code = (
        "import os, time, krex\n"
        f"open({str(ready)!r}, 'w').close()\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
        "with krex.region():\n    pass\n"
    )
    p = subprocess.Popen(
        [*KREX, "run", "--device", "sim", "--", sys.executable, "-c", code],
        env=kx.env(),
        stdout=subprocess.DEVNULL,
        stderr=open(kx.out / "cmd.err", "wb"),  # noqa: SIM115 - handed to the child
        start_new_session=True,
    )
    kx.popens.append(p)
    kx.wait(lambda: ready.exists(), 30, "the command to run")
    d.kill()
    d.wait(10)
    go.write_text("")  # its region now starts a daemon of its own, from inside the slot
    assert p.wait(60) == 0, (kx.out / "cmd.err").read_text()
    lock = kx.sock.with_suffix(".lock")
    pid = int(lock.read_text().strip())
    assert pid != d.pid
    cg = Path(f"/proc/{pid}/cgroup").read_text()
    assert "/slot-" not in cg, f"the on-demand daemon lives in a slot group: {cg}"


def test_an_outsider_reusing_the_pid_of_a_sibling_that_ended_in_the_region_is_foreign(kx: Krex) -> None:
    """Pids KREX knew at the region's start are not foreign, but only as the processes they
    were then: an outsider that gets the pid of a sibling that ended inside the region
    and uses the GPU is flagged."""
    nvml, base = _fake_nvml_gpu_policy(kx)
    kx.run("sib", "hammer", "--us", "0", "--seconds", "60")
    sib = kx.wait_running("sib")
    ready = _hold_region(kx, "a")
    assert ready["grant"]["frozen_slots"] == [], ready["grant"]
    time.sleep(0.3)  # krexd has taken its entry sample (and its known pids)
    kx.touch("sib")
    assert kx.cmds["sib"].wait(30) == 0, kx.cmds["sib"].output()
    outsider = spawn_with_pid(sib)
    if outsider is None:
        pytest.skip(f"could not get pid {sib} for an outsider")
    try:
        _write_atomic(nvml, json.dumps({"gpus": [dict(base["gpus"][0], procs=[sib])]}))
        rec = _end_hold(kx, "a", ready["pid"])
    finally:
        outsider.kill()
        outsider.wait()
    assert "foreign-process" in rec["flags"], rec
    assert [f["pid"] for f in rec["attest"]["foreign"]] == [sib], rec["attest"]


# ------------------------------------------------- LIFE calls: contexts, modules, memory
# On an H200 a sibling that only loads modules made a 5.7 ms GEMM 42% slower, and one that
# allocates and frees 4 GB a bandwidth-bound kernel 13% slower (docs/results/lifecycle-calls/),
# through no submission: under `--freeze gpu` such calls park at the gate like submissions;
# one already under way when the gate closes gets its process frozen; an exit after one
# (the teardown of its contexts) waits for the region to end.


def test_gpu_policy_siblings_make_no_life_call_inside_a_region(kx: Krex) -> None:
    """A sibling that loads modules and allocates device memory in a loop, never a kernel:
    none of its calls reaches the (simulated) driver inside the owner's regions."""
    _fake_nvml_gpu_policy(kx)
    kx.run("sib", "life")
    kx.wait(lambda: (kx.out / "sib.progress").exists() and kx.progress("sib")[0] > 20, 30, "its LIFE calls")
    kx.run("own", "regions", "-n", "15", "--kernels", "3", "--us", "2000")
    res = kx.result("own", timeout=90)
    assert kx.cmds["own"].wait(30) == 0 and res["errors"] == [], res["errors"]
    n_between = kx.progress("sib")[0]
    kx.touch("sib")
    assert kx.cmds["sib"].wait(30) == 0, kx.cmds["sib"].output()
    sib = kx.progress("sib")[2]
    iv = owner_intervals(res)
    ops = [o for o in kx.ops(gpu=0) if o["pid"] == sib]
    assert sum(o["api"] == "cuModuleLoadData" for o in ops) > 20, "the sibling's calls were not recorded"
    assert foreign_ops(iv, ops) == []
    assert n_between > 20
    recs = [r for r in kx.journal() if r["owner_pid"] == res["pid"]]
    # Its frees are gated too, and the driver clears freed memory after the call returned:
    # a region right after one waits for that to settle, and is clean.
    assert len(recs) == 15 and not [r["reasons"] for r in recs if r["contaminated"]]
    # It kept running between regions (not frozen for them), and waited at the gate inside them.
    assert any(not r["frozen_slots"] for r in recs), [r["freeze_why"] for r in recs]
    held = [p for p in kx.snapshot().procs if p.pid == sib] or [None]
    assert held[0] is None or held[0].blocked > 0


def test_a_gpu_policy_sibling_inside_a_slow_life_call_is_frozen_not_waited_for(kx: Krex) -> None:
    """A call the gate cannot stop midway (a module's PTX JIT: 3 s here): krexd freezes its
    process instead of waiting for it, and says why."""
    _fake_nvml_gpu_policy(kx)
    kx.run("sib", "life", env=kx.env(KREX_SIM_LIFE_MS="3000"))
    kx.wait(lambda: (kx.out / "sib.progress").exists(), 30, "the sibling's first call")
    sib = kx.progress("sib")[2]
    time.sleep(0.5)  # now inside its 3 s cuModuleLoadData
    ready = _hold_region(kx, "a")
    g = ready["grant"]
    assert len(g["frozen_slots"]) == 1 and not g["contaminated"], g
    assert "context, module or device memory call" in " ".join(g["freeze_why"]), g["freeze_why"]
    assert g["entry_s"] < 2.0, g  # frozen at once, not waited for

    assert kx.wait(lambda: proc_state(sib) in ("S", "D") and _frozen(sib), 5, "the frozen sibling")
    rec = _end_hold(kx, "a", ready["pid"])
    assert not rec["contaminated"] and rec["siblings_frozen"] == 1, rec["reasons"]
    kx.touch("sib")
    assert kx.cmds["sib"].wait(60) == 0, kx.cmds["sib"].output()


@pytest.mark.parametrize("nice", ["default", "0"])
def test_a_region_lends_priority_to_the_thread_inside_a_siblings_life_call(kx: Krex, nice: str) -> None:
    """On a real driver a sibling's drain waits behind its context, module or memory call
    (the helper's sync needs the driver lock that call holds; 100-700 ms for a context on a
    loaded H200): krexd renices the thread inside it to helper_nice (default -10) while the
    drain runs, names it in the grant, and gives it its nice back after. helper_nice 0: never."""
    _fake_nvml_gpu_policy(kx, **({} if nice == "default" else {"KREX_HELPER_NICE": nice}))
    kx.run("sib", "life", env=kx.env(KREX_SIM_LIFE_MS="3000"))
    kx.wait(lambda: (kx.out / "sib.progress").exists(), 30, "the sibling's first call")
    sib = kx.progress("sib")[2]
    time.sleep(0.5)  # now inside its 3 s cuModuleLoadData, on its main thread
    ready = _hold_region(kx, "a")
    g = ready["grant"]
    if nice == "default":
        assert g["lent_priority"] == [[sib, sib]], g
    else:
        assert g["lent_priority"] == [], g
    # The drain is over: its own nice and policy again, though still inside the call.
    assert os.getpriority(os.PRIO_PROCESS, sib) == 0
    assert os.sched_getscheduler(sib) == os.SCHED_OTHER
    rec = _end_hold(kx, "a", ready["pid"])
    assert not rec["contaminated"], rec["reasons"]
    kx.touch("sib")
    assert kx.cmds["sib"].wait(60) == 0, kx.cmds["sib"].output()


# Thread A sits in one module load (KREX_SIM_LIFE_MS); meanwhile the main thread makes a
# quick allocation and free, then spins on the CPU until argv[2] exists. argv[1]: the tids.
TWO_LIFE_THREADS = """
import ctypes, json, os, sys, threading, time
cu = ctypes.CDLL("libcuda.so.1")
ctx, mod, ptr = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_uint64()
assert cu.cuInit(0) == 0 and cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
tids = {}
def load():
    tids["in_call"] = threading.get_native_id()
    assert cu.cuModuleLoadData(ctypes.byref(mod), b"sim") == 0
a = threading.Thread(target=load)
a.start()
time.sleep(0.2)
assert cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(4096)) == 0
assert cu.cuMemFree_v2(ctypes.c_uint64(ptr.value)) == 0
tids["spinner"] = threading.get_native_id()
json.dump(tids, open(sys.argv[1], "w"))
while not os.path.exists(sys.argv[2]):
    pass
a.join()
"""


def test_priority_is_lent_to_no_thread_that_has_left_its_life_call(kx: Krex) -> None:
    """The record names a thread only while it is inside its LIFE call: a thread that made a
    quick allocation after another began a long load, and then computes, is never the one
    lent priority (before, the last to begin one stayed named and got it)."""
    _fake_nvml_gpu_policy(kx)
    tids_f, stop = kx.out / "tids.json", kx.out / "spin.stop"
    sib = kx.run_argv("sib", [sys.executable, "-c", TWO_LIFE_THREADS, str(tids_f), str(stop)],
                      env_extra={"KREX_SIM_LIFE_MS": "3000"})
    try:
        kx.wait(tids_f.exists, 30, "the sibling's two threads")
        tids = json.loads(tids_f.read_text())
        ready = _hold_region(kx, "a")
        lent = ready["grant"]["lent_priority"]
        assert all(t == tids["in_call"] for _pid, t in lent), (lent, tids)
        assert os.getpriority(os.PRIO_PROCESS, tids["spinner"]) == 0
        _end_hold(kx, "a", ready["pid"])
    finally:
        stop.touch()
    assert sib.wait(60) == 0, (kx.out / "sib.log").read_text()


def _frozen(pid: int) -> bool:

    return frozen_reason(pid) is not None


@pytest.mark.parametrize("how", ["exit", "_exit"])
def test_a_gpu_policy_sibling_exiting_inside_a_region_waits_for_its_end(kx: Krex, how: str) -> None:
    """Its contexts are torn down at exit through no call the gate sees: the shim's exit
    hold (an atexit handler; a wrapper of _exit for os._exit) parks it at the closed gate,
    so the region stays clean and the teardown comes after it."""
    _fake_nvml_gpu_policy(kx)
    go = kx.out / "exit-now"
    hard = ["--hard-exit"] if how == "_exit" else []
    kx.run("sib", "life", "--calls", "3", "--exit-on", str(go), *hard)
    sib = kx.result("sib", "ready", timeout=30)["pid"]
    time.sleep(lib_settle_s())  # its last free (recent-free is another test)
    ready = _hold_region(kx, "a")
    assert ready["grant"]["frozen_slots"] == [] and not ready["grant"]["contaminated"], ready["grant"]
    go.touch()
    kx.result("sib", timeout=30)  # it called exit
    time.sleep(0.5)
    assert alive(sib), "the sibling finished its exit inside the region"
    assert kx.cmds["sib"].popen.poll() is None
    rec = _end_hold(kx, "a", ready["pid"])
    assert kx.cmds["sib"].wait(30) == 0, kx.cmds["sib"].output()
    assert not rec["contaminated"], rec["reasons"]


@pytest.mark.parametrize("policy", ["all", "gpu"])
def test_a_region_right_after_a_siblings_memory_free_waits_for_it_to_settle(kx: Krex, policy: str) -> None:
    """The driver clears freed GPU memory after the freeing call has returned, under every
    policy (a frozen process's memory is still being cleared): a region asked for within
    KREX_FREE_SETTLE_NS of a sibling's free waits out the rest of that time before its
    grant (at most one settle time), and is clean; once the sibling has stopped freeing for
    longer than that, a region does not wait at all."""
    if policy == "gpu":
        _fake_nvml_gpu_policy(kx)
    else:
        kx.start_daemon(slots=3)
    go = kx.out / "exit-now"
    kx.run("sib", "life", "--exit-on", str(go))  # frees in a loop until sib.stop
    kx.wait(lambda: (kx.out / "sib.progress").exists() and kx.progress("sib")[0] > 20, 30, "its LIFE calls")
    ready = _hold_region(kx, "a")
    g = ready["grant"]
    assert 0 < g["settle_s"] <= lib_settle_s() + 0.05 and not g["contaminated"], g
    rec = _end_hold(kx, "a", ready["pid"])
    assert not rec["contaminated"], rec["reasons"]
    kx.touch("sib")  # it stops calling, and idles until `go`
    kx.result("sib", "ready", timeout=30)
    time.sleep(lib_settle_s() + 0.2)
    ready = _hold_region(kx, "b")
    assert ready["grant"]["settle_s"] < 0.005, ready["grant"]
    rec = _end_hold(kx, "b", ready["pid"])
    assert not rec["contaminated"], rec["reasons"]
    go.touch()
    assert kx.cmds["sib"].wait(30) == 0, kx.cmds["sib"].output()


def test_a_free_during_the_settle_wait_flags_the_region(kx: Krex) -> None:
    """A free krexd could not have held (here: stamps written straight into the segment, as
    a path the gate does not see would leave them) keeps coming while the region waits for
    the earlier ones to settle: the region is flagged `recent-free`, never granted clean."""
    import threading

    kx.start_daemon(slots=3)
    kx.run("sib", "life")
    kx.wait(lambda: (kx.out / "sib.progress").exists() and kx.progress("sib")[0] > 20, 30, "its LIFE calls")
    stop = threading.Event()
    with Segment.attach(kx.shm) as seg:

        def stamp() -> None:
            while not stop.is_set():
                seg.raw.gpus[0].slot_free_ns[40] = time.monotonic_ns()  # CLOCK_MONOTONIC
                time.sleep(0.005)

        th = threading.Thread(target=stamp)
        th.start()
        try:
            ready = _hold_region(kx, "a")
        finally:
            stop.set()
            th.join()
    rec = _end_hold(kx, "a", ready["pid"])
    assert "recent-free" in rec["flags"] and "slot 40 " in " ".join(rec["reasons"]), rec["reasons"]
    kx.touch("sib")
    assert kx.cmds["sib"].wait(30) == 0, kx.cmds["sib"].output()


def lib_settle_s() -> float:
    from krex.native import lib

    return float(lib.KREX_FREE_SETTLE_NS) / 1e9


def _overlapping(ops: list[dict[str, Any]], pid: int, t0: int, t1: int) -> list[dict[str, Any]]:
    return [o for o in ops if o["pid"] == pid and o["end"] > t0 and o["start"] < t1]


@pytest.mark.parametrize("policy", ["all", "gpu"])
def test_gpu_calls_of_exit_handlers_that_run_after_the_exit_hold_stay_gated(kx: Krex, policy: str) -> None:
    """atexit runs last-registered first: a handler registered before the first LIFE call
    runs after the exit hold. Its kernels (30 ms each, in a loop) must still wait at the
    closed gate; before, the hold left the thread's depth raised and they passed as nested
    calls, running inside regions reported clean."""
    if policy == "gpu":
        _fake_nvml_gpu_policy(kx)
    else:
        kx.start_daemon(slots=2)
    kx.run_argv("sib", [str(victims()["exitwork"]), str(kx.out), "sib", "30000"])
    sib = kx.result("sib", "ready", timeout=30)["pid"]
    (kx.out / "sib.go").touch()
    kx.wait(lambda: (kx.out / "sib.exiting").exists(), 10, "the sibling's exit handler")
    time.sleep(0.3)
    ready = _hold_region(kx, "a")
    time.sleep(0.5)
    rec = _end_hold(kx, "a", ready["pid"])
    t1 = kx.result("a")["t_end"]
    (kx.out / "sib.stop").touch()
    assert kx.cmds["sib"].wait(30) == 0, kx.cmds["sib"].output()
    assert kx.result("sib")["launches"] > 5, "the exit handler did not loop: this proves nothing"
    inside = _overlapping(kx.ops(gpu=0), sib, ready["t_grant"], t1)
    assert inside == [], f"{len(inside)} sibling ops ran inside the region: {inside[:2]}"
    assert not rec["contaminated"], rec["reasons"]
    assert ready["grant"]["frozen_slots"], ready["grant"]  # exiting after a LIFE call: frozen


def _region_during_the_siblings_teardown_owes_no_drain(kx: Krex) -> None:
    """A region while sibling `sib` (exitwork) tears down: no drain wait, clean."""
    ready = _hold_region(kx, "a")
    g = ready["grant"]
    rec = _end_hold(kx, "a", ready["pid"])
    (kx.out / "sib.stop").touch()
    assert kx.cmds["sib"].wait(30) == 0, kx.cmds["sib"].output()
    assert g["drain_s"] < 1.0 and "drain-timeout" not in g["flags"], g
    assert not rec["contaminated"], rec["reasons"]


@pytest.mark.parametrize("policy", ["all", "gpu"])
def test_a_sibling_tearing_down_after_its_helper_stopped_owes_no_drain(kx: Krex, policy: str) -> None:
    """At exit the drain helper stops before the vendor libraries tear down (their exit
    handlers run after ours); the teardown's own calls are LIFE calls, gated. The helper
    drains one last time and the record says so (drained_at): a region during the
    teardown waits for no ack. Before, every such region waited the whole drain timeout
    (5 s) for a helper that was gone and was flagged drain-timeout (H200, quick corpus:
    one region in five)."""
    if policy == "gpu":
        _fake_nvml_gpu_policy(kx)
    else:
        kx.start_daemon(slots=2)
    kx.run_argv("sib", [str(victims()["exitwork"]), str(kx.out), "sib", "100", "free", "early"])
    kx.result("sib", "ready", timeout=30)
    (kx.out / "sib.go").touch()
    kx.wait(lambda: (kx.out / "sib.exiting").exists(), 10, "the sibling's teardown")
    time.sleep(0.3)
    _region_during_the_siblings_teardown_owes_no_drain(kx)


def test_a_sibling_that_begins_its_exit_at_a_closed_gate_owes_no_drain(kx: Krex) -> None:
    """A sibling whose exit handlers run while another command's region holds the gate (its
    exit hold, if any, had passed just before): the drain helper stops there all the same,
    so it drains one last time then too. Before, it skipped that drain at a closed gate,
    and the next region during its teardown waited the whole drain timeout for an ack that
    could not come, with the sibling frozen inside its exit (H200: 2 regions in 80). That
    last drain waits for a granted region to end (as the exit hold does), so nothing of it
    runs inside; a drain asked of it meanwhile it answers at once. Staged under `gpu`, which
    leaves the sibling running during a region; under `all` the window is the one between a
    gate's closing and the sibling's freeze."""
    _fake_nvml_gpu_policy(kx)
    # No LIFE call before its exit (no exit hold): its helper's stop handler runs at once.
    kx.run_argv("sib", [str(victims()["exitwork"]), str(kx.out), "sib", "100", "free", "early", "nolife"])
    sib = kx.result("sib", "ready", timeout=30)["pid"]
    first = _hold_region(kx, "z")
    (kx.out / "sib.go").touch()
    time.sleep(0.5)  # its exit began: its last drain waits for z to end
    assert not (kx.out / "sib.exiting").exists(), "its teardown ran inside z"
    _end_hold(kx, "z", first["pid"])
    kx.wait(lambda: (kx.out / "sib.exiting").exists(), 10, "the sibling's teardown")
    # Nothing of its exit (the last drain's reference count, its teardown) ran inside z.
    inside = _overlapping(kx.ops(gpu=0), sib, first["t_grant"], kx.result("z")["t_end"])
    assert inside == [], f"{len(inside)} sibling ops ran inside the region: {inside[:2]}"
    time.sleep(0.3)  # now its teardown runs
    _region_during_the_siblings_teardown_owes_no_drain(kx)


def test_an_exit_is_not_starved_by_other_commands_back_to_back_regions(kx: Krex) -> None:
    """Two other commands take 30 ms regions one after another, so the gate may never be
    seen open: a sibling's exit waits out the region it meets, then at most
    KREX_EXIT_WAIT_NS (0.25 s) more, and goes on, never waiting for the regions to stop (an
    exit held for seconds). A region that the exit's last steps fall in is
    flagged, never clean."""
    nvml = kx.out / "nvml.json"
    _write_atomic(nvml, json.dumps({"gpus": [{"name": "fake", "uuid": "GPU-fake", "procs": [],
                                              "sm_clock": 1980, "throttle": 1}]}))
    kx_env = kx.env
    kx.env = lambda **extra: kx_env(  # type: ignore[method-assign]
        KREX_NVML_FAKE=str(nvml), KREX_FREEZE_POLICY="gpu", **extra
    )
    kx.start_daemon(slots=3)
    kx.run_argv("sib", [str(victims()["exitwork"]), str(kx.out), "sib", "100", "free", "early", "nolife"])
    sib = kx.result("sib", "ready", timeout=30)["pid"]
    go, until = kx.out / "z.go", kx.out / "z.until"
    for z in ("z1", "z2"):
        kx.run(z, "regions", "-n", "100000", "--kernels", "1", "--sleep-ms", "30", "--go", str(go),
               "--until", str(until))
    kx.wait(lambda: all((kx.out / f"{z}.waiting").exists() for z in ("z1", "z2")), 30, "the region takers")
    go.touch()
    time.sleep(0.5)  # regions now follow one another
    t0 = time.monotonic()
    (kx.out / "sib.go").touch()
    kx.wait(lambda: (kx.out / "sib.exiting").exists(), 10, "the sibling's exit")
    waited = time.monotonic() - t0
    (kx.out / "sib.stop").touch()
    time.sleep(0.5)
    until.touch()
    for z in ("z1", "z2"):
        assert kx.cmds[z].wait(60) == 0, kx.cmds[z].output()[-2000:]
    assert kx.cmds["sib"].wait(30) == 0
    assert waited < 1.5, f"the exit waited {waited:.2f} s behind back-to-back regions"
    regions = [r for z in ("z1", "z2") for r in kx.result(z)["regions"]]
    assert len(regions) >= 20
    ops = kx.ops(gpu=0)
    for r in regions:
        rec = r["summary"]["region"]
        inside = _overlapping(ops, sib, r["t_grant"], r["t_end"])
        assert rec["contaminated"] or not inside, f"a clean region held the sibling's exit ops: {inside[:2]}"


FORK_IN_REGION = textwrap.dedent(
    """
    import json, os, sys, time, warnings
    import krex
    warnings.simplefilter("ignore")
    with krex.region() as outer:
        pid = os.fork()
        if pid == 0:  # a forked worker running a function marked with krex.region()
            with krex.region() as r:
                nested = r.grant is None and not r.unprotected
            os._exit(0 if nested else 3)
        deadline, done = time.monotonic() + 10, (0, 0)
        while time.monotonic() < deadline and not done[0]:
            done = os.waitpid(pid, os.WNOHANG)
            time.sleep(0.02)
        if not done[0]:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    # After the parent's region, a child's region is a real one of its own.
    pid = os.fork()
    if pid == 0:
        with krex.region() as r:
            own = r.grant is not None and r.clean is not False
        os._exit(0 if own else 4)
    late = os.waitpid(pid, 0)[1]
    print(json.dumps({"child_done": bool(done[0]), "status": done[1], "late": late}))
    """
)


def test_an_exit_waiting_out_a_region_goes_on_when_krexd_hangs(kx: Krex) -> None:
    """A sibling's exit waits for another command's region to end; krexd is SIGSTOPped
    meanwhile (the region would never end): the exit goes on once krexd's heartbeat is
    stale, and the command is not held."""
    _fake_nvml_gpu_policy(kx)
    d = kx.daemon
    assert d is not None
    kx.run_argv("sib", [str(victims()["exitwork"]), str(kx.out), "sib", "100", "free", "early", "nolife"])
    kx.result("sib", "ready", timeout=30)
    held = _hold_region(kx, "z")
    (kx.out / "sib.go").touch()
    time.sleep(0.5)
    assert not (kx.out / "sib.exiting").exists(), "the exit did not wait for the region"
    t0 = time.monotonic()
    os.kill(d.pid, signal.SIGSTOP)
    try:
        kx.wait(lambda: (kx.out / "sib.exiting").exists(), 15, "the exit to go on")
        waited = time.monotonic() - t0
    finally:
        os.kill(d.pid, signal.SIGCONT)
    (kx.out / "sib.stop").touch()
    _end_hold(kx, "z", held["pid"])  # its exit handler's kernels park at z's gate till then
    assert kx.cmds["sib"].wait(30) == 0
    assert waited < 2.0 + 3.0, f"the exit went on {waited:.1f} s after krexd stopped"


def test_a_region_in_a_child_forked_inside_a_region_runs_inside_it(kx: Krex) -> None:
    """A child forked inside a region, whose own region would queue behind its parent's
    while the parent waits for it (a deadlock), runs its
    region inside the parent's as a nested one while its command holds the gate; once the
    parent's region is over, a child's region is its own."""
    kx.start_daemon(slots=2)
    p = _run(kx, "--", sys.executable, "-c", FORK_IN_REGION, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out == {"child_done": True, "status": 0, "late": 0}, out


# A pool of fork workers created (lazily, on first use) inside a region; the parent's
# region ends; later each worker benchmarks in a region of its own. Worker a first, worker
# b 0.3 s later while a's region runs. krexd serialises regions per GPU (FIFO), so b's
# region must start after a's ends, or one of them must be flagged.
POOL = textwrap.dedent(
    """
    import json, os, sys, time, warnings
    sys.path.insert(0, sys.argv[1])
    out = sys.argv[2]
    import krex
    from cp_worker import Gpu
    warnings.simplefilter("ignore")

    def worker(name, delay, hold):
        g = Gpu()
        g.kernel(10); g.synchronize()
        time.sleep(delay)
        with krex.region() as r:
            t0 = time.monotonic()
            for _ in range(20):
                g.kernel(100)
            time.sleep(hold)
            g.synchronize()
            t1 = time.monotonic()
        with open(os.path.join(out, name + ".json"), "w") as f:
            json.dump({"t0": t0, "t1": t1, "granted": r.grant is not None, "clean": r.clean,
                       "unprotected": r.unprotected, "flags": r.flags}, f)

    pids = []
    with (krex.region() if sys.argv[3] == "inside" else open(os.devnull)):
        for name, delay, hold in (("a", 0.5, 1.0), ("b", 0.8, 0.3)):
            pid = os.fork()
            if pid == 0:
                try:
                    worker(name, delay, hold)
                finally:
                    os._exit(0)
            pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    print("done")
    """
)


@pytest.mark.parametrize("made", ["outside", "inside"])
def test_fork_workers_made_inside_a_region_later_take_regions_of_their_own(
    kx: Krex, tmp_path: Path, made: str
) -> None:
    """Workers forked inside a region run their regions inside it only while it lasts; once
    it is over, their regions are their own and queue behind each other (a
    worker's region must never run inside another worker's, unflagged)."""
    kx.start_daemon(slots=2)
    p = _run(kx, "--", sys.executable, "-c", POOL, HELPERS, str(tmp_path), made, timeout=60)
    assert p.returncode == 0 and "done" in p.stdout, p.stderr[-2000:]
    a = json.loads((tmp_path / "a.json").read_text())
    b = json.loads((tmp_path / "b.json").read_text())
    assert a["granted"] and b["granted"], (a, b)
    overlap = b["t0"] < a["t1"] and a["t0"] < b["t1"]
    assert not overlap, f"worker b's timed region ran inside worker a's: a={a} b={b}"


# Command 1: the parent holds R1 [0, 1.0] and R2 [1.8, 3.0]; its child (forked before any
# region: a pytest-xdist worker, an autotune subprocess) runs a soft region (Inductor's
# autotuning benchmark) over [0.3, 2.5], entered inside R1. Command 2 takes a region at 1.1,
# granted once R1 ends, before R2. The soft region ran across command 2's region.
CMD1 = textwrap.dedent(
    """
    import json, os, sys, time, warnings
    import krex
    warnings.simplefilter("ignore")
    T0, out = float(sys.argv[1]), sys.argv[2]
    def at(t):
        time.sleep(max(0.0, T0 + t - time.monotonic()))
    pid = os.fork()
    if pid == 0:
        at(0.3)
        with krex.region(soft=True) as r:
            t0 = time.monotonic()
            at(2.5)
            t1 = time.monotonic()
        with open(os.path.join(out, "soft.json"), "w") as f:
            json.dump({"t0": t0, "t1": t1, "grant": r.grant, "flags": r.flags,
                       "unprotected": r.unprotected}, f)
        os._exit(0)
    at(0.0)
    with krex.region():
        at(1.0)
    at(1.8)
    with krex.region():
        at(3.0)
    os.waitpid(pid, 0)
    print("done")
    """
)
CMD2 = textwrap.dedent(
    """
    import json, os, sys, time, warnings
    import krex
    warnings.simplefilter("ignore")
    T0, out = float(sys.argv[1]), sys.argv[2]
    time.sleep(max(0.0, T0 + 1.1 - time.monotonic()))
    with krex.region():
        t0 = time.monotonic()
        time.sleep(0.4)
        t1 = time.monotonic()
    with open(os.path.join(out, "other.json"), "w") as f:
        json.dump({"t0": t0, "t1": t1}, f)
    print("done")
    """
)


def test_a_soft_region_across_another_commands_region_is_flagged(kx: Krex, tmp_path: Path) -> None:
    """A soft region that ran inside its command's region R1, across another command's
    region and into its command's next region R2, is flagged `outlived` (the
    gate is its command's at both ends, so that alone would read as fine)."""
    kx.start_daemon(slots=3)
    t0 = str(time.monotonic() + 4.0)
    procs = [
        subprocess.Popen(
            [*KREX, "run", "--device", "sim", "--", sys.executable, "-c", code, t0, str(tmp_path)],
            env=kx.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            stdin=subprocess.DEVNULL,
        )
        for code in (CMD1, CMD2)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    soft = json.loads((tmp_path / "soft.json").read_text())
    other = json.loads((tmp_path / "other.json").read_text())
    assert soft["grant"] is None  # it ran inside its command's region R1
    assert soft["t0"] < other["t0"] and other["t1"] < soft["t1"], (soft, other)  # the staging held
    assert soft["unprotected"] and soft["flags"] == ["outlived"], (soft, other)


def test_a_child_forked_without_fork_handlers_does_not_take_its_parents_exit_hold(kx: Krex) -> None:
    """A raw fork (syscall(SYS_fork), glibc's _Fork, clone) runs no fork handler, so the
    child keeps its parent's fork generation: its exit must not hold the parent's record
    (the parent would read as inside a LIFE call for good, frozen in every gpu region)."""
    _fake_nvml_gpu_policy(kx)
    kx.run_argv("par", [str(victims()["rawfork"]), "30"])
    log = kx.out / "par.log"
    kx.wait(lambda: '"status"' in log.read_text(), 30, "the child's exit")
    out = json.loads(next(x for x in log.read_text().splitlines() if x.startswith("{")))
    assert out["status"] == 0, out
    rec = [p for p in kx.snapshot().procs if p.pid == out["pid"]]
    assert rec and rec[0].life_inflight == 0, rec
    ready = _hold_region(kx, "a")
    _end_hold(kx, "a", ready["pid"])
    assert ready["grant"]["frozen_slots"] == [], ready["grant"]["freeze_why"]


NULL_FREER = textwrap.dedent(
    """
    import ctypes, os, sys, time
    from krex.native import sim_dir
    rt = ctypes.CDLL(str(sim_dir() / "libcudart.so.13"))
    stop, ready = sys.argv[1], sys.argv[2]
    n = 0
    while not os.path.exists(stop):
        assert rt.cudaFree(None) == 0  # frees nothing: the idiom that makes a context
        n += 1
        if n == 20:
            open(ready, "w").close()
    """
)


def test_cudafree_of_null_is_no_recent_free(kx: Krex) -> None:
    """cudaFree(NULL) frees nothing (PyTorch-like code calls it to make a context): a sibling
    calling it in a loop does not flag regions `recent-free`."""
    kx.start_daemon(slots=2)
    stop, ready = kx.out / "nf.stop", kx.out / "nf.ready"
    kx.run_argv("nf", [sys.executable, "-c", NULL_FREER, str(stop), str(ready)])
    kx.wait(ready.exists, 30, "the sibling's cudaFree(NULL) calls")
    hold = _hold_region(kx, "a")
    rec = _end_hold(kx, "a", hold["pid"])
    stop.touch()
    assert kx.cmds["nf"].wait(30) == 0, kx.cmds["nf"].output()
    assert "recent-free" not in rec["flags"], rec["reasons"]


@pytest.mark.parametrize("how", ["exit", "_exit"])
def test_regions_right_after_a_sibling_command_ended_wait_for_its_memory(kx: Krex, how: str) -> None:
    """Its record and its slot are freed with it, and its teardown frees all its GPU memory:
    the stamp lives per slot in the GPU's record, and the exit hold stamps it (else regions
    granted a few ms after such an end would read clean). A region
    asked for right after waits for it to settle, and is clean."""
    kx.start_daemon(slots=3)
    hard = ["--hard-exit"] if how == "_exit" else []
    # Its frees were older than the window when it began to exit: only its end can flag.
    # (A region granted before its exit hold ran is not flagged: its teardown waits for it.)
    # The window starts at the exit hold's stamp, not at exit(): under load the hold can wait
    # for a gap between the owner's back-to-back regions longer than a settle time.
    res, t_stamp = kx.regions_across_an_end(
        lambda go: kx.run("sib", "life", "--calls", "30", "--exit-on", str(go), *hard)
    )
    assert t_stamp, "the sibling's exit left no stamp"
    window = [r for r in res["regions"] if t_stamp < r["t_grant"] < t_stamp + 1.5 * lib_settle_s() * 1e9]
    assert window, "no region was granted right after the sibling ended: this proves nothing"
    assert max(r["grant"]["settle_s"] for r in window) > 0.5 * lib_settle_s(), [r["grant"] for r in window]
    assert not any(r["grant"]["contaminated"] for r in res["regions"]), [
        r["grant"]["reasons"] for r in res["regions"] if r["grant"]["contaminated"]
    ]


@pytest.mark.parametrize("policy", ["all", "gpu"])
def test_a_stale_process_inside_a_life_call_flags_the_region(kx: Krex, policy: str) -> None:
    """A process of a slot handed on (KREX_PROC_STALE: an outlived command's, registered with
    an old slot generation) is inside a 4 s module load as a region's gate closes: it belongs
    to no command krexd can freeze, so the region is flagged `life-running`, under every
    policy, with or without other siblings (not only under `gpu` with a running sibling)."""
    from krex.native import LIB_DIR, shim_path

    if policy == "gpu":
        _fake_nvml_gpu_policy(kx)
    else:
        kx.start_daemon(slots=3)
    env = kx.env(
        LD_PRELOAD=str(shim_path()), LD_LIBRARY_PATH=str(LIB_DIR), KREX_SLOT="1", KREX_SLOT_GEN="0",
        KREX_GPU="0", KREX_SIM_LIFE_MS="4000",
    )  # fmt: skip
    with open(kx.out / "st.log", "wb") as log:
        st = subprocess.Popen(
            [sys.executable, str(WORKER), "life", str(kx.out), "--name", "st", "--calls", "1"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    kx.popens.append(st)
    kx.wait(lambda: (kx.out / "st.progress").exists(), 30, "the stale process's first call")
    time.sleep(0.5)  # now inside its 4 s cuModuleLoadData
    rec = [p for p in kx.snapshot().procs if p.pid == st.pid]
    assert rec and rec[0].slot == -2 and rec[0].life_inflight == 1, rec
    ready = _hold_region(kx, "a")
    _end_hold(kx, "a", ready["pid"])
    assert "life-running" in ready["grant"]["flags"], ready["grant"]
    assert st.wait(30) == 0


# ---------------------------------------------- the exit drain and the settle


def _owner_regions_after_sibling_acts(kx: Krex, start_file: str) -> tuple[dict[str, Any], list[Any]]:
    """The sibling `sib` (already started) acts on sib.go; the owner takes 3 regions once
    START_FILE exists. Returns the owner's result and its journal records."""
    kx.run("own", "regions", "-n", "3", "--kernels", "2", "--us", "2000", "--go", str(kx.out / start_file))
    kx.wait(lambda: (kx.out / "own.waiting").exists(), 30, "the owner")
    (kx.out / "sib.go").touch()
    res = kx.result("own", timeout=60)
    (kx.out / "sib.stop").touch()
    kx.cmds["sib"].wait(30)
    return res, [j for j in kx.journal() if j["owner_pid"] == res["pid"]]


def _policy(kx: Krex, policy: str) -> None:
    if policy == "gpu":
        _fake_nvml_gpu_policy(kx)
    else:
        kx.start_daemon(slots=2)


def _sibling_ops_inside(kx: Krex, pid: int, r: dict[str, Any]) -> list[dict[str, Any]]:
    ops = kx.ops(gpu=0)
    return [o for o in ops if o["pid"] == pid and o["end"] > r["t_grant"] and o["start"] < r["t_end"]]


@pytest.mark.parametrize("policy", ["all", "gpu"])
@pytest.mark.parametrize("life", ["life", "nolife"])
def test_a_copy_counted_before_the_last_exit_drain_but_queued_after_it_is_never_clean(
    kx: Krex, policy: str, life: str
) -> None:
    """A submission is counted before the driver queues it. A thread inside such a call
    (a 512 MiB copy whose bytes move on the host first) while the main thread exits: the
    last drain at exit must not mark the record drained while that call is in flight, or
    the copy runs inside a region reported clean."""
    _policy(kx, policy)
    argv = [str(victims()["exitrace"]), str(kx.out), "sib", str(512 << 20)]
    argv += ["nolife"] if life == "nolife" else []
    kx.run_argv("sib", argv, env_extra={"KREX_SIM_MOVE_BYTES": "1", "KREX_COPY_CHUNK_BYTES": "0"})
    sib = kx.result("sib", "ready", timeout=60)["pid"]
    res, js = _owner_regions_after_sibling_acts(kx, "sib.copy")
    copy = [o for o in kx.ops(gpu=0) if o["pid"] == sib and o["api"] == "cuMemcpyHtoDAsync_v2"]
    # The owner asked once the copy call had returned; the copy still ran on the GPU then:
    # a grant without waiting for it would overlap it.
    assert copy and copy[-1]["end"] > kx.result("sib", "copy")["t_ret"], copy
    inside = [r["i"] for r in res["regions"] if _sibling_ops_inside(kx, sib, r)]
    bad = [i for i in inside if not (res["regions"][i]["grant"].get("contaminated") or js[i]["contaminated"])]
    assert not bad, f"regions {bad}: the sibling's copy ran inside regions reported clean"


@pytest.mark.parametrize("policy", ["all", "gpu"])
def test_a_sibling_whose_main_thread_left_is_still_drained(kx: Krex, policy: str) -> None:
    """pthread_exit in main leaves the thread-group leader a zombie while the other threads
    use the GPU: such a process is alive (its queued kernel drained, its slot frozen), not
    dead."""
    _policy(kx, policy)
    kx.run_argv("sib", [str(victims()["zleader"]), str(kx.out), "sib", "500000"])
    sib = kx.result("sib", "ready", timeout=60)["pid"]
    time.sleep(0.3)
    res, js = _owner_regions_after_sibling_acts(kx, "sib.launched")
    inside = [r["i"] for r in res["regions"] if _sibling_ops_inside(kx, sib, r)]
    bad = [i for i in inside if not js[i]["contaminated"]]
    assert not bad, f"regions {bad}: the sibling's kernel ran inside regions reported clean"


@pytest.mark.parametrize("how", ["exit", "_exit"])
def test_the_next_command_in_a_slot_number_waits_for_the_previous_ones_end(kx: Krex, how: str) -> None:
    """krexd hands a freed slot number to the next command in its queue: the end stamp of
    the command before it is another command's, and its region waits for it to settle
    (the stamps carry their command's slot generation)."""
    kx.start_daemon(slots=1)
    go = kx.out / "exit-now"
    hard = ["--hard-exit"] if how == "_exit" else []
    kx.run("sib", "life", "--calls", "30", "--exit-on", str(go), *hard)
    kx.result("sib", "ready", timeout=30)
    time.sleep(lib_settle_s() + 0.1)  # its frees are old now: only its end counts
    kx.run_argv("y", [str(victims()["quickregion"])])  # queued: the only slot is taken
    time.sleep(1.5)
    go.touch()
    t_exit = kx.result("sib", timeout=30)["t_exit"]
    assert kx.cmds["sib"].wait(30) == 0
    assert kx.cmds["y"].wait(30) == 0, kx.cmds["y"].output()
    out = json.loads(next(x for x in kx.cmds["y"].output().splitlines() if x.startswith("{")))
    rec = [r for r in kx.journal() if r["owner_pid"] == out["pid"]][-1]
    assert out["t_begin"] - t_exit < 2 * lib_settle_s() * 1e9, "y's region came too late to prove anything"
    assert rec["contaminated"] or rec["settle_s"] > 0.3 * lib_settle_s(), rec


@pytest.mark.parametrize("end", ["exit", "kill"])
def test_a_region_right_after_a_siblings_end_waits_for_its_memory_by_what_it_held(kx: Krex, end: str) -> None:
    """A sibling's end frees all its GPU memory, which the driver clears once the process is
    gone: a region asked for right after waits from when krexd found it gone, for the time
    NVML's figure of its memory takes (2 GB here: a few ms), not the fixed settle time from
    the start of its exit; a sibling SIGKILLed (no exit handler ran) is waited for the same."""
    nvml, base = _fake_nvml_gpu_policy(kx, KREX_FREEZE_POLICY="all")
    go = kx.out / "exit-now"
    kx.run("sib", "life", "--calls", "30", "--exit-on", str(go))
    sib = kx.result("sib", "ready", timeout=30)["pid"]
    _write_atomic(nvml, json.dumps({"gpus": [dict(base["gpus"][0], procs=[sib], mem={str(sib): 8 << 30})]}))
    rec = _end_hold(kx, "a", _hold_region(kx, "a")["pid"])  # NVML's pids are krexd's: it lists sib
    assert not rec["contaminated"], rec["reasons"]
    time.sleep(lib_settle_s() + 0.1)  # its frees are old now: only its end counts
    kx.run("own", "regions", "-n", "1", "--kernels", "1", "--us", "500", "--prime", "--go",
           str(kx.out / "own.go"))
    kx.wait(lambda: (kx.out / "own.waiting").exists(), 30, "the owner")
    if end == "kill":
        os.kill(sib, signal.SIGKILL)
    else:
        go.touch()
    deadline = time.monotonic() + 30
    while alive(sib):
        assert time.monotonic() < deadline, "the sibling did not end"
        time.sleep(0.001)
    _write_atomic(nvml, json.dumps(base))  # the driver's teardown is over
    (kx.out / "own.go").touch()
    g = kx.result("own", timeout=60)["regions"][0]["grant"]
    sized = max(int(lib.KREX_SETTLE_MIN_NS), 8 * int(lib.KREX_SETTLE_NS_PER_GB)) / 1e9
    # Waited for, from when krexd found it gone (at most REAP_EVERY_S after, or at this
    # region's settle step): some of the sized time, never the fixed time from its exit.
    assert 0.005 <= g["settle_s"] < sized + 0.01 < lib_settle_s() / 2, g
    assert not g["contaminated"], g
    ended = [r for r in kx.journal() if r.get("event") == "mps-client-fault"]
    assert not ended, ended  # no MPS here: a kill is only waited for
    assert kx.cmds["sib"].wait(30) == (128 + signal.SIGKILL if end == "kill" else 0)


def test_krexd_inspects_new_processes_before_a_region_asks(kx: Krex) -> None:
    """A region inspects at most INSPECT_INLINE new processes itself; krexd's inspector
    thread looks at every slot's new processes every INSPECT_EVERY_S. A sibling of more
    processes than that budget, started half a second before a region, is known by then:
    under `gpu` it keeps running (none of it reads as not inspected yet)."""
    from krex.node import freezepolicy

    _fake_nvml_gpu_policy(kx)
    n = freezepolicy.INSPECT_INLINE + 4
    worker = f"{sys.executable} {WORKER} hammer {kx.out} --name sib --us 0 --long-us 1 --seconds 60"
    kx.run_argv("sib", ["sh", "-c", f"for i in $(seq {n}); do sleep 60 & done; {worker} & wait"])
    kx.wait(lambda: (kx.out / "sib.ready").exists(), 30, "the sibling's GPU call")
    time.sleep(0.6)
    ready = _hold_region(kx, "a")
    rec = _end_hold(kx, "a", ready["pid"])
    g = ready["grant"]
    assert g["freeze_policy"] == "gpu" and g["frozen_slots"] == [], g
    assert not any("not inspected" in w for w in g["freeze_why"]), g["freeze_why"]
    assert not rec["contaminated"], rec["reasons"]
