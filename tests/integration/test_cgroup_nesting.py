"""Commands stay inside the cgroup subtree `krex run` was started in.

A job cgroup is made the way a batch scheduler makes one (`<v2>/job-N/step-0`, and
`<v1 freezer>/job-N/step-0` where the v1 freezer is mounted), `krex run` is started
inside it, and the command must stay below it: its /proc/PID/cgroup, the job's limits
(memory.max where the v2 memory controller is available; elsewhere its ancestry, which
is what the limit follows), the job's kill (cgroup.kill, or killing every pid of its
subtree), a region's freeze of it as a sibling, krexd's recovery of its group after a
restart, and a visible fallback where krexd cannot make a group below the caller.

Each test has a private daemon (the `kx` fixture, helpers/krex_world.py) started from the
test's own cgroup (outside the job), as a node-wide krexd would be.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers.krex_world import CG1, CG2, KREX, WORKER, Cmd, Krex, alive, frozen_reason

pytestmark = [
    pytest.mark.cgroup,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: real nested cgroups"),
    pytest.mark.skipif(CG2 is None, reason="no cgroup v2 hierarchy is mounted"),
]

PY_KREX = [sys.executable, "-m", "krex.cli.main"]  # Python's door (click), which execs the guardian
GUARDIANS = {"native": KREX, "python": PY_KREX}
_jobs = itertools.count()


def _read(p: Path) -> str:
    try:
        return p.read_text()
    except OSError:
        return ""


def cgroup_of(pid: int, v1: bool = False) -> str:
    """The v2 path of `pid` (or, with v1, its path in the v1 freezer hierarchy)."""
    for line in _read(Path(f"/proc/{pid}/cgroup")).splitlines():
        hid, ctrl, path = line.split(":", 2)
        if (v1 and "freezer" in ctrl.split(",")) or (not v1 and hid == "0"):
            return path
    return ""


def _v2_memory() -> bool:
    assert CG2 is not None
    return "memory" in _read(Path(CG2) / "cgroup.subtree_control").split()


@dataclass
class Job:
    """`<mount>/job-<test pid>-<n>/step-0` in the v2 hierarchy and, where mounted, in the
    v1 freezer hierarchy; the caller joins step-0 of both (as a scheduler puts its task)."""

    name: str
    v2_top: Path
    v1_top: Path | None
    memory_max: int | None = None
    extra: list[Path] = field(default_factory=list)

    @property
    def v2(self) -> Path:
        return self.v2_top / "step-0"

    @property
    def v1(self) -> Path | None:
        return self.v1_top / "step-0" if self.v1_top else None

    def rel(self, top: Path, mount: str | None) -> str:
        return "/" + str(top.relative_to(mount or "/"))

    def join(self) -> None:  # a preexec_fn: the child enters the job before it execs
        for d in (self.v2, self.v1):
            if d is not None:
                fd = os.open(d / "cgroup.procs", os.O_WRONLY)
                try:
                    os.write(fd, str(os.getpid()).encode())
                finally:
                    os.close(fd)

    def kill(self) -> None:
        """What `scancel` does to the job: cgroup.kill on v2; SIGKILL to every pid of its v1
        freezer subtree (until none is left) where the v1 freezer is the one in use."""
        (self.v2_top / "cgroup.kill").write_text("1")

    def kill_v1(self) -> None:
        assert self.v1_top is not None
        for _ in range(50):
            pids = self.pids(self.v1_top)
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

    @staticmethod
    def dirs(top: Path) -> list[Path]:
        found = [top]
        for d in found:
            with contextlib.suppress(OSError):
                found += [e for e in d.iterdir() if e.is_dir()]
        return found

    def pids(self, top: Path) -> set[int]:
        return {int(x) for d in self.dirs(top) for x in _read(d / "cgroup.procs").split()}

    def cleanup(self) -> None:
        for top in (self.v2_top, self.v1_top, *self.extra):
            if top is None or not top.exists():
                continue
            for d in self.dirs(top):
                with contextlib.suppress(OSError):
                    (d / "cgroup.freeze").write_text("0")
                with contextlib.suppress(OSError):
                    (d / "freezer.state").write_text("THAWED")
            deadline = time.monotonic() + 10
            while self.pids(top) and time.monotonic() < deadline:
                with contextlib.suppress(OSError):
                    (top / "cgroup.kill").write_text("1")
                for pid in self.pids(top):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.05)
            while time.monotonic() < deadline:
                for d in sorted(self.dirs(top), key=lambda p: -len(p.parts)):
                    with contextlib.suppress(OSError):
                        d.rmdir()
                if not top.exists():
                    break
                time.sleep(0.05)


@pytest.fixture
def job() -> Iterator[Job]:
    assert CG2 is not None
    name = f"job-{os.getpid()}-{next(_jobs)}"
    j = Job(name, Path(CG2) / name, Path(CG1) / name if CG1 else None)
    j.v2.mkdir(parents=True)
    if j.v1 is not None:
        j.v1.mkdir(parents=True)
    if _v2_memory():  # a scheduler's memory limit on the job, enforced for everything below it
        (j.v2_top / "cgroup.subtree_control").write_text("+memory")
        j.memory_max = 96 << 20
        (j.v2_top / "memory.max").write_text(str(j.memory_max))
    try:
        yield j
    finally:
        j.cleanup()


def run_in(kx: Krex, job: Job, name: str, argv: list[str], *opts: str, guardian: str = "native") -> Cmd:
    """`krex run --device sim [OPTS] -- ARGV` started inside the job, its output in NAME.log."""
    log = kx.out / f"{name}.log"
    with open(log, "wb") as f:
        p = subprocess.Popen(
            [*GUARDIANS[guardian], "run", "--device", "sim", *opts, "--", *argv],
            env=kx.env(),
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=job.join,
        )
    kx.popens.append(p)
    c = Cmd(name, p, log, kx)
    kx.cmds[name] = c
    return c


def worker(kx: Krex, name: str, mode: str, *args: str) -> list[str]:
    return [sys.executable, str(WORKER), mode, str(kx.out), "--name", name, *args]


def nested_groups(top: Path) -> list[Path]:
    """KREX's slot groups anywhere below `top`."""
    return [d for d in Job.dirs(top) if d.name.startswith("krex-") and "-slot-" in d.name]


def below(path: str, top: str) -> bool:
    return path.startswith(top.rstrip("/") + "/")


# ====================================================================== where commands go


@pytest.mark.parametrize("guardian", ["native", "python"])
def test_the_command_stays_below_the_job_cgroup_and_its_group_goes_with_it(
    kx: Krex, job: Job, guardian: str
) -> None:
    kx.start_daemon(slots=2)
    run_in(kx, job, "h", worker(kx, "h", "hammer", "--us", "50"), guardian=guardian)
    pid = kx.wait_running("h")
    guardian_pid = kx.cmds["h"].popen.pid
    step = job.rel(job.v2, CG2)
    path = cgroup_of(pid)
    # The command's own group, below the cgroup `krex run` was started in, and nowhere else.
    assert below(path, step), f"the command runs in {path}, outside the job's {step}"
    assert Path(path).name.startswith("krex-") and "-slot-" in Path(path).name, path
    assert cgroup_of(guardian_pid) == step, "the guardian left the job"
    # The job's memory limit follows the hierarchy: it applies to whatever is below the job.
    if job.memory_max is not None:
        assert _read(job.v2_top / "memory.max").strip() == str(job.memory_max)
    assert Path(CG2 + path).is_dir()
    kx.touch("h")
    assert kx.cmds["h"].wait(30) == 0, kx.cmds["h"].output()
    # Released: its group is gone, so the scheduler can remove the job's cgroup.
    kx.wait(lambda: nested_groups(job.v2_top) == [], 5, "the slot group to be removed on release")


@pytest.mark.skipif(
    CG2 is None or not _v2_memory(), reason="the cgroup v2 memory controller is not enabled here"
)
def test_the_jobs_memory_limit_kills_a_command_that_exceeds_it(kx: Krex, job: Job) -> None:
    kx.start_daemon(slots=2)
    assert job.memory_max is not None
    hog = f"b = bytearray({4 * job.memory_max}); print('survived', flush=True)"
    c = run_in(kx, job, "hog", [sys.executable, "-c", hog])
    rc = c.wait(60)
    assert "survived" not in c.output() and rc == 128 + signal.SIGKILL, (rc, c.output())


def test_killing_the_jobs_cgroup_kills_the_command(kx: Krex, job: Job) -> None:
    kx.start_daemon(slots=2)
    run_in(kx, job, "h", worker(kx, "h", "hammer", "--us", "50"))
    pid = kx.wait_running("h")
    job.kill()
    kx.wait(lambda: not alive(pid), 5, f"the command (pid {pid}) to die with its job")
    assert kx.cmds["h"].popen.wait(10) != 0


@pytest.mark.skipif(CG1 is None, reason="no cgroup v1 freezer hierarchy is mounted")
def test_cgroup1_freezer_nests_under_the_callers_freezer_cgroup(kx: Krex, job: Job) -> None:
    kx.start_daemon(freezer_name="cgroup1", slots=2)
    assert job.v1 is not None and job.v1_top is not None
    run_in(kx, job, "h", worker(kx, "h", "hammer", "--us", "50"))
    pid = kx.wait_running("h")
    path = cgroup_of(pid, v1=True)
    step = job.rel(job.v1, CG1)
    assert below(path, step), f"the command's v1 freezer cgroup is {path}, outside the job's {step}"
    # A scheduler without cgroup.kill kills every pid of the job's freezer subtree.
    job.kill_v1()
    kx.wait(lambda: not alive(pid), 5, f"the command (pid {pid}) to die with its job")
    kx.wait(lambda: nested_groups(job.v1_top) == [], 5, "the slot group to be removed")  # type: ignore[arg-type]


# ====================================================================== the region protocol


@pytest.mark.parametrize("backend", ["cgroup2", "cgroup1"])
def test_a_region_freezes_and_thaws_a_sibling_in_its_nested_group(kx: Krex, job: Job, backend: str) -> None:
    mount = CG2 if backend == "cgroup2" else CG1
    if mount is None:
        pytest.skip(f"no {backend} freezer hierarchy is mounted")
    kx.start_daemon(freezer_name=backend, slots=3)
    run_in(kx, job, "h", worker(kx, "h", "hammer", "--us", "50"))
    pid = kx.wait_running("h")
    path = cgroup_of(pid, v1=backend == "cgroup1")
    top = job.rel(job.v2_top if backend == "cgroup2" else job.v1_top, mount)  # type: ignore[arg-type]
    assert below(path, top), f"the sibling runs in {path}, outside the job's {top}"
    group = Path(mount + path)
    kx.run("own", "hold")  # the owner from outside the job
    ready = kx.result("own", "ready", timeout=30)
    assert not ready["grant"]["contaminated"], ready["grant"]
    assert ready["grant"]["frozen_slots"], ready["grant"]
    assert kx.stands_still("h"), "the sibling ran inside the region"
    if backend == "cgroup2":
        assert "frozen 1" in _read(group / "cgroup.events"), f"{group} is not frozen"
    else:
        assert _read(group / "freezer.state").strip() == "FROZEN", f"{group} is not frozen"
    kx.touch("own")
    assert kx.cmds["own"].wait(30) == 0, kx.cmds["own"].output()
    assert kx.advances("h", timeout=5), "the sibling stayed frozen after the region"
    assert frozen_reason(pid) is None
    recs = [r for r in kx.journal() if r["owner_pid"] == ready["pid"]]
    assert recs and recs[-1]["siblings_frozen"] == 1 and not recs[-1]["contaminated"], recs
    kx.stop_all("h")


def test_a_restarted_daemon_finds_and_thaws_a_nested_group(kx: Krex, job: Job) -> None:
    """krexd killed mid-region with a sibling whose guardian died too: nobody thaws it but
    the next krexd, which must find its group below the job (not at the hierarchy's root)."""
    d = kx.start_daemon(slots=3)
    run_in(kx, job, "h", worker(kx, "h", "hammer", "--us", "50"))
    pid = kx.wait_running("h")
    group = Path(CG2 + cgroup_of(pid))  # type: ignore[operator]
    assert below(str(group), str(job.v2_top)), group
    kx.run("own", "hold")
    kx.result("own", "ready", timeout=30)
    assert kx.stands_still("h") and frozen_reason(pid) is not None
    kx.cmds["h"].popen.kill()  # its guardian
    d.kill()
    d.wait(5)
    assert "frozen 1" in _read(group / "cgroup.events"), "precondition: the orphan is still frozen"
    kx.start_daemon(slots=3)
    kx.wait(lambda: frozen_reason(pid) is None, 5, "the new daemon to thaw the nested group")
    assert kx.advances("h", timeout=5)
    # Its slot is adopted: a new region freezes it again, in the same group below the job.
    o2 = kx.run("o2", "regions", "-n", "2", "--pause-ms", "10")
    assert o2.wait(60) == 0, o2.output()
    assert all(r["grant"]["frozen_slots"] for r in kx.result("o2")["regions"])
    assert cgroup_of(pid) == "/" + str(group.relative_to(CG2))  # type: ignore[arg-type]
    kx.touch("h")
    kx.wait(lambda: not alive(pid), 20, "the orphan to finish")
    kx.wait(lambda: nested_groups(job.v2_top) == [], 10, "the adopted group to be removed once empty")


def test_leftovers_in_a_nested_group_are_killed_and_the_group_removed(kx: Krex, job: Job) -> None:
    kx.start_daemon(slots=2)
    where = kx.out / "leftover.cgroup"
    pidf = kx.out / "leftover.pid"
    script = f"sh -c 'cat /proc/self/cgroup > {where}; echo $$ > {pidf}; exec sleep 300' & sleep 0.5"
    c = run_in(kx, job, "lo", ["sh", "-c", script])
    assert c.wait(30) == 0, c.output()
    left = int(pidf.read_text())
    v2 = [ln.split(":", 2)[2] for ln in where.read_text().splitlines() if ln.startswith("0::")][0]
    assert below(v2, job.rel(job.v2_top, CG2)), f"the leftover ran in {v2}, outside the job"
    kx.wait(lambda: not alive(left), 5, "the leftover to be killed")
    kx.wait(lambda: nested_groups(job.v2_top) == [], 5, "the slot group to be removed")


# ====================================================================== visible fallback


@pytest.mark.parametrize("guardian", ["native", "python"])
def test_a_caller_cgroup_krexd_cannot_nest_in_falls_back_visibly(
    kx: Krex, job: Job, guardian: str, tmp_path: Path
) -> None:
    """cgroup.max.depth 0 on the caller's cgroup: the kernel refuses any group below it,
    root or not (as for a cgroup krexd may not write). The command runs in krexd's default
    root, and `krex run`'s output, its report, krexd's log and the region record say so."""
    (job.v2 / "cgroup.max.depth").write_text("0")
    kx.start_daemon(slots=2)
    rep = tmp_path / "report.json"
    c = run_in(
        kx,
        job,
        "fb",
        worker(kx, "fb", "regions", "-n", "1"),
        "--report",
        str(rep),
        guardian=guardian,
    )
    assert c.wait(60) == 0, c.output()
    out = c.output()
    step = job.rel(job.v2, CG2)
    assert "krex: warning:" in out and step in out and "outside" in out, out
    r = json.loads(rep.read_text())
    cg = r.get("cgroup")
    assert cg, f"the report has no cgroup note: {sorted(r)}"
    assert cg["caller"] == step and cg["placement"] != "caller" and cg["note"], cg
    assert not below(cg["group"], str(job.v2_top)) and os.path.basename(cg["group"]).startswith("slot-"), cg
    assert "outside" in kx.daemon_log() and step in kx.daemon_log()
    recs = [x for x in kx.journal() if x["owner_slot"] == r["slot"]]
    assert recs and recs[-1].get("cgroup_fallback"), recs


def _krexd_in(kx: Krex, cg: Path, *prefix: str, **env: str) -> subprocess.Popen[bytes]:
    """krexd started inside cgroup `cg` (its argv after `prefix`, its environment plus `env`)."""
    args = [*prefix, sys.executable, "-m", "krex.node.daemon", "--device", "sim", "--slots-per-gpu", "2"]
    kx.state.mkdir(exist_ok=True)

    def enter() -> None:
        fd = os.open(cg / "cgroup.procs", os.O_WRONLY)
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)

    log = open(kx.state / "test-daemon.log", "ab")  # noqa: SIM115 - handed to the child
    try:
        p = subprocess.Popen(
            args,
            env=kx.env(**env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            preexec_fn=enter,
        )
    finally:
        log.close()
    kx.popens.append(p)
    kx.daemon = p
    from krex.proc.client import daemon_alive

    deadline = time.monotonic() + 20
    while not daemon_alive(kx.sock):
        assert p.poll() is None and time.monotonic() < deadline, kx.daemon_log()[-2000:]
        time.sleep(0.02)
    return p


def test_under_systemd_the_fallback_is_krexds_own_delegated_subtree(
    kx: Krex, job: Job, tmp_path: Path
) -> None:
    assert CG2 is not None
    svc = Path(CG2) / f"krexd-{job.name}.service"
    svc.mkdir()
    job.extra.append(svc)
    (job.v2 / "cgroup.max.depth").write_text("0")
    # As systemd starts a service with Delegate=yes: in `<name>.service`, INVOCATION_ID set.
    _krexd_in(kx, svc, INVOCATION_ID="0123456789abcdef0123456789abcdef")
    rep = tmp_path / "report.json"
    c = run_in(kx, job, "s", ["true"], "--report", str(rep))
    assert c.wait(60) == 0, c.output()
    cg = json.loads(rep.read_text())["cgroup"]
    assert cg["placement"] == "daemon" and below(cg["group"], str(svc)), cg
    assert "krex: warning:" in c.output() and "krexd" in c.output(), c.output()
    kx.wait(lambda: nested_groups(svc) == [], 5, "the slot group to be removed on release")


def test_a_krexd_in_its_own_cgroup_namespace_still_nests_below_the_caller(kx: Krex, job: Job) -> None:
    """krexd in a container (the DaemonSet) sees the host's cgroup tree through a mount whose
    root is above its cgroup namespace ("/../.." in mountinfo), and the callers' cgroups as
    "/../..." paths: the command must still go below the caller's cgroup (the pod's). Here
    krexd's pod and the caller share an ancestor (as pods share /kubepods): the caller is
    "/../step-0" to krexd, which only krexd's own place in the tree resolves."""
    pod = job.v2_top / "krexd-pod"
    pod.mkdir()
    _krexd_in(kx, pod, "unshare", "--cgroup")
    assert cgroup_of(kx.daemon.pid if kx.daemon else 0) == job.rel(pod, CG2)  # precondition
    run_in(kx, job, "h", worker(kx, "h", "hammer", "--us", "50"))
    pid = kx.wait_running("h")
    path = cgroup_of(pid)
    assert below(path, job.rel(job.v2, CG2)), f"the command runs in {path}, outside the job"
    kx.run("own", "hold")  # from outside the job: the group is found, frozen and thawed
    kx.result("own", "ready", timeout=30)
    assert kx.stands_still("h") and "frozen 1" in _read(Path(CG2 + path) / "cgroup.events")
    kx.touch("own")
    assert kx.cmds["own"].wait(30) == 0
    assert kx.advances("h", timeout=5)
    kx.stop_all("h")
    kx.wait(lambda: nested_groups(job.v2_top) == [], 5, "the slot group to be removed on release")


@pytest.mark.parametrize("backend", ["cgroup2", "cgroup1"])
def test_a_new_freezer_finds_thaws_and_removes_a_nested_group(job: Job, backend: str, tmp_path: Path) -> None:
    """What a restarted krexd (recover) and the watchdog (thaw_all) see: the groups made below
    callers' cgroups, listed in the state directory."""
    from krex.node import freezer

    step = job.v2 if backend == "cgroup2" else job.v1
    if step is None:
        pytest.skip(f"no {backend} freezer hierarchy is mounted")
    os.environ["KREX_STATE_DIR"] = str(tmp_path / "state")  # the registry's place
    root = f"krex-nest-{job.name}"
    job.extra.append(Path(CG2 if backend == "cgroup2" else CG1 or "") / root)  # its default root
    try:
        first = freezer.detect(backend, root_name=root)
        g = first.group("slot-3", str(step))
        assert Path(g.path).parent == step and Path(g.path).name == f"krex-{root}-slot-3"
        sleeper = subprocess.Popen(["sleep", "60"], preexec_fn=freezer.preexec_join(g.path))
        try:
            g.freeze()
            assert g.is_frozen()
            again = freezer.detect(backend, root_name=root)  # the watchdog's, the next krexd's
            assert [x.path for x in again.leftover_groups()] == [g.path]
            assert again.thaw_all() == 1 and not g.is_frozen()
            g.freeze()
            assert again.recover() == 1 and not g.is_frozen()
            assert os.path.isdir(g.path), "a group that holds a process is kept"
        finally:
            sleeper.kill()
            sleeper.wait()
        deadline = time.monotonic() + 5
        while os.path.isdir(g.path) and time.monotonic() < deadline:
            freezer.detect(backend, root_name=root).recover()
            time.sleep(0.05)
        assert not os.path.isdir(g.path), "the empty nested group was not removed"
        last = freezer.detect(backend, root_name=root)
        assert last.leftover_groups() == []
        # One group per slot: placed elsewhere (another caller, or the default root), the
        # slot's empty group below the first caller goes, and is never handed out again.
        nested = last.group("slot-4", str(step))
        moved = last.group("slot-4", last.root)
        assert moved.path == os.path.join(last.root, "slot-4") and not os.path.isdir(nested.path)
        moved.remove()
        assert last.leftover_groups() == [] and last.remove_root()
    finally:
        del os.environ["KREX_STATE_DIR"]


def test_krexd_started_inside_a_nested_slot_group_leaves_it_for_the_callers_cgroup(job: Job) -> None:
    """A krexd started on demand by a command's process is born in its slot group: it leaves
    it for the cgroup that group was made below (the job's), not for the hierarchy's root."""
    from krex.node import freezer

    slot = job.v2 / "krex-someseg-slot-3"
    slot.mkdir()
    p = subprocess.Popen(["sleep", "60"], preexec_fn=freezer.preexec_join(str(slot)))
    try:
        assert cgroup_of(p.pid) == job.rel(slot, CG2)
        left = freezer.leave_slot_groups(p.pid)
        assert left == [str(slot)] and cgroup_of(p.pid) == job.rel(job.v2, CG2), cgroup_of(p.pid)
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("guardian", ["native", "python"])
def test_a_guardian_whose_krexd_is_gone_removes_the_empty_group(kx: Krex, job: Job, guardian: str) -> None:
    """No krexd is left to remove the command's group when it ends: its guardian does, so no
    empty group keeps the scheduler from removing the job's cgroup."""
    d = kx.start_daemon(slots=2)
    go = kx.out / "go"
    c = run_in(kx, job, "g", ["sh", "-c", f"while [ ! -e {go} ]; do sleep 0.05; done"], guardian=guardian)
    kx.wait(lambda: nested_groups(job.v2_top), 10, "the command's group below the job")
    kx.wait(lambda: Job.pids(job, nested_groups(job.v2_top)[0]), 10, "the command in its group")
    d.kill()
    d.wait(5)
    go.write_text("")
    assert c.wait(30) == 0, c.output()
    assert nested_groups(job.v2_top) == [], "the guardian left its command's empty group behind"
