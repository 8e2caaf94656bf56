"""`krex fleet` on a real multi-node Ray cluster on one machine (ray.cluster_utils.Cluster).

Every Ray node is a raylet of its own with its own (simulated) GPUs and `krex_slot`
resource. The fleet runs with --node-root, so each node has its own KREX world keyed by
its Ray node id (state dir, daemon, segment, simulated GPU, trace): the fake nodes share
this host, so the host name could never tell them apart. The checks are made from outside
each world: its simulated GPU's trace, its segment, its cgroups, the commands' own output.

The commands are Python scripts on the simulated GPU (through ctypes and the shim, like
tests/helpers/cp_worker.py): a few rounds of "noise" kernels outside a region followed by a
region of kernels, so that the regions of one command meet the noise of its siblings.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from glob import glob
from pathlib import Path
from typing import Any

import pytest
from helpers import clean_env, read_jsonl, wait_until
from ray.cluster_utils import Cluster

from krex.fleet import node_world
from krex.node import mounts
from krex.node.shm import Segment

pytestmark = pytest.mark.timeout(420)

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
KREX = [sys.executable, "-m", "krex.cli.main"]

BENCH = f"""\
import json, os, sys, time
sys.path.insert(0, {str(HELPERS)!r})
import krex
from cp_worker import Gpu

index, rounds, done = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
t_begin = time.monotonic_ns()
gpu = Gpu()
gpu.kernel(100)
gpu.synchronize()
regions = []
for _ in range(rounds):
    for _ in range(10):  # noise (~40% of the time): siblings' regions must never see it
        gpu.kernel(2000)
    gpu.synchronize()
    with krex.region() as r:
        t0 = time.monotonic_ns()
        for _ in range(3):
            gpu.kernel(1000)
        gpu.synchronize()
        t1 = time.monotonic_ns()
    regions.append([t0, t1, bool((r.grant or {{}}).get("contaminated"))])
    time.sleep(0.02)
with open(done, "a") as f:
    f.write(f"{{index}} {{os.environ['KREX_SHM']}} {{os.getpid()}}\\n")
print("some output first")
print(json.dumps({{"index": index, "pid": os.getpid(), "shm": os.environ["KREX_SHM"],
                  "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"), "t_begin": t_begin,
                  "t_end": time.monotonic_ns(), "regions": regions}}))
"""


# ------------------------------------------------------------------------------ the cluster


class Fleet:
    """A Ray cluster of KREX nodes on this host, a --node-root for their worlds, and cleanup."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.root = Path(tempfile.mkdtemp(prefix="kxfl-"))  # short: it holds the sockets
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        self.nodes: dict[str, Any] = {}  # node id -> Ray node handle
        self.spec: dict[str, tuple[int, int]] = {}  # node id -> (GPUs, krex slots)
        self.done = tmp / "done.txt"
        self.bench = tmp / "bench.py"
        self.bench.write_text(BENCH)
        self.procs: list[subprocess.Popen[str]] = []

    def add(self, gpus: int, slots: int) -> str:
        n = self.cluster.add_node(num_cpus=2, num_gpus=gpus, resources={"krex_slot": slots})
        self.nodes[n.node_id] = n
        self.spec[n.node_id] = (gpus, slots)
        return str(n.node_id)

    def wait_for_nodes(self) -> None:
        self.cluster.wait_for_nodes()

    def env(self) -> dict[str, str]:
        env = clean_env()
        env.pop("RAY_ADDRESS", None)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def world(self, node_id: str) -> dict[str, str]:
        return node_world(node_id, self.root)

    def batch_file(self, n: int, rounds: int) -> Path:
        f = self.tmp / "cmds.txt"
        f.write_text(
            "".join(f"{sys.executable} {self.bench} {i} {rounds} {self.done}\n" for i in range(1, n + 1))
        )
        return f

    def fleet(self, args: list[str], out: Path) -> subprocess.Popen[str]:
        p = subprocess.Popen(
            [
                *KREX,
                "fleet",
                *args,
                "--address",
                self.cluster.address,
                "--device",
                "sim",
                "--node-root",
                str(self.root),
                "--out",
                str(out),
            ],
            env=self.env(),
            cwd=self.tmp,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.procs.append(p)
        return p

    def finish(self, p: subprocess.Popen[str], timeout: float) -> tuple[int, str, str]:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            logs = {n: self.daemon_log(n)[-1500:] for n in self.nodes}
            raise AssertionError(
                f"krex fleet hung for {timeout}s\nstdout:\n{out}\nstderr:\n{err[-4000:]}\ndaemon logs: {logs}"
            ) from None
        return p.returncode, out, err

    def daemon_log(self, node_id: str) -> str:
        p = Path(self.world(node_id)["KREX_STATE_DIR"], "krexd.log")
        return p.read_text(errors="replace") if p.exists() else ""

    # ---------------------------------------------------------------- per-world checks
    def trace_ops(self, node_id: str) -> list[dict[str, Any]]:
        return [e for e in read_jsonl(Path(self.world(node_id)["KREX_SIM_TRACE"])) if e.get("ev") == "op"]

    def snapshot(self, node_id: str) -> Any:
        with Segment.attach(self.world(node_id)["KREX_SHM"]) as seg:
            return seg.snapshot()

    def frozen(self, node_id: str) -> list[str]:
        """Frozen cgroups of the world's freezer root, and stopped processes of its segment."""
        name = self.world(node_id)["KREX_SHM"].strip("/")
        bad = []
        for mount in _cgroup_mounts():
            for d in glob(os.path.join(mount, name, "**/"), recursive=True):
                if _read(Path(d, "cgroup.freeze")).strip() == "1" or _read(
                    Path(d, "freezer.state")
                ).strip() not in ("", "THAWED"):
                    bad.append(d)
        with contextlib.suppress(Exception):
            for p in self.snapshot(node_id).procs:
                if p.alive and _proc_state(p.pid) in ("T", "t"):
                    bad.append(f"pid {p.pid} stopped")
        return bad

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        env = self.env()
        for nid in self.nodes:
            w = self.world(nid)
            subprocess.run([*KREX, "daemon", "stop"], env={**env, **w}, capture_output=True, timeout=60)
            for mount in _cgroup_mounts():
                root = os.path.join(mount, w["KREX_SHM"].strip("/"))
                for group in [*glob(os.path.join(root, "*/")), root]:
                    with contextlib.suppress(OSError):
                        os.rmdir(group)
            for n in (w["KREX_SHM"], w["KREX_SIM_SHM"]):
                Path("/dev/shm" + n).unlink(missing_ok=True)
        with contextlib.suppress(Exception):
            self.cluster.shutdown()
        shutil.rmtree(self.root, ignore_errors=True)


def _cgroup_mounts() -> list[str]:
    found = mounts.read_mounts()
    return mounts.cgroup2_mounts(found) + mounts.cgroup1_freezer_mounts(found)


def _read(p: Path) -> str:
    try:
        return p.read_text()
    except OSError:
        return ""


def _proc_state(pid: int) -> str:
    s = _read(Path(f"/proc/{pid}/stat"))
    return s.rsplit(")", 1)[1].split()[0] if ")" in s else ""


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path)
    try:
        yield f
    finally:
        f.close()


# ----------------------------------------------------------------------------- the checks


def load_results(out: Path, n: int) -> list[dict[str, Any]]:
    files = sorted(out.glob("cmd-*.json"))
    assert len(files) == n, [f.name for f in files]
    return [json.loads(f.read_text()) for f in files]


def foreign_work(ops: list[dict[str, Any]], regions: list[tuple[int, int, int, int]]) -> list[str]:
    """Operations of another pid on a region's GPU that were submitted or ran inside the region.
    regions: (pid, gpu, t_grant, t_end)."""
    bad = []
    for o in ops:
        for pid, gpu, t0, t1 in regions:
            ran_inside = o["start"] < t1 and o["end"] > t0
            if o["pid"] != pid and o["gpu"] == gpu and (t0 <= o["submit"] <= t1 or ran_inside):
                bad.append(
                    f"pid {o['pid']} {o['api']} [{o['submit']}, {o['start']}, {o['end']}] inside the "
                    f"region of pid {pid} on gpu {gpu} [{t0}, {t1}]"
                )
    return bad


def max_overlap(spans: list[tuple[float, float]]) -> int:
    return max((sum(1 for s, e in spans if s <= t < e) for t, _ in spans), default=0)


def check_node_worlds(fleet: Fleet, results: list[dict[str, Any]], nodes: list[str]) -> None:
    """Per-node exclusivity in each node's own trace, and nothing left frozen or closed."""
    for nid in nodes:
        mine = [r for r in results if r["node_id"] == nid]
        regions = [
            (r["result"]["pid"], r["report"]["gpu"], t0, t1)
            for r in mine
            for t0, t1, _ in r["result"]["regions"]
        ]
        ops = fleet.trace_ops(nid)
        assert ops, f"node {nid[:12]}: its simulated GPU saw nothing"
        assert foreign_work(ops, regions) == []
        pids = {r["result"]["pid"] for r in mine}
        # Every op of this node's trace came from a command that ran on this node.
        assert {o["pid"] for o in ops} <= pids, f"node {nid[:12]}: foreign pids in its trace"
    for nid in nodes:
        assert fleet.frozen(nid) == []
        snap = fleet.snapshot(nid)
        assert not any(g.closed for g in snap.gates), snap.gates
        assert [s for s in snap.slots if s.owner_alive] == []


# ------------------------------------------------------------------------------------ tests


def test_fleet_runs_every_command_once_per_node_exclusive(fleet: Fleet, tmp_path: Path) -> None:
    a = fleet.add(gpus=2, slots=2)  # two GPUs, one slot each: per-GPU placement by the node's daemon
    b = fleet.add(gpus=1, slots=2)  # one GPU, two slots: regions meet a sibling's noise
    fleet.wait_for_nodes()
    n, rounds = 8, 6
    out = tmp_path / "out"
    rc, stdout, stderr = fleet.finish(fleet.fleet([str(fleet.batch_file(n, rounds))], out), timeout=300)
    assert rc == 0, stdout + stderr[-4000:]
    assert "Traceback" not in stderr
    assert sum(1 for ln in stderr.splitlines() if ln.startswith("krex fleet: [")) == n
    assert f"{n} commands: {n} ok, 0 failed" in stdout
    table = stdout[stdout.index("node ") :]
    assert a[:12] in table and b[:12] in table

    # Every command completed exactly once, on the node (world) that returned its result.
    done = [ln.split() for ln in fleet.done.read_text().splitlines()]
    assert sorted(int(i) for i, _, _ in done) == list(range(1, n + 1))
    results = load_results(out, n)
    for r in results:
        assert r["exit_status"] == 0 and r["attempt"] == 1 and r["lost_attempts"] == []
        assert r["node_id"] in (a, b)
        assert r["result_line"] == json.dumps(r["result"])  # the last stdout line, parsed
        assert r["result"]["index"] == r["index"]
        assert r["result"]["shm"] == fleet.world(r["node_id"])["KREX_SHM"]
        assert r["result"]["gpu"] == str(r["report"]["gpu"])
        assert "some output first" in Path(r["stdout"]).read_text()
        assert len(r["report"]["regions"]) == rounds and r["regions"] == rounds
        assert not any(c for _, _, c in r["result"]["regions"])

    # Admission: never more commands on a node than its krex_slot, never more on a GPU than
    # its slots per GPU (node a: 1, node b: 2), judged by the commands' own lifetimes.
    for nid, per_gpu in ((a, 1), (b, 2)):
        mine = [r for r in results if r["node_id"] == nid]
        assert max_overlap([(r["started_at"], r["ended_at"]) for r in mine]) <= 2
        for g in {r["report"]["gpu"] for r in mine}:
            spans = [(r["result"]["t_begin"], r["result"]["t_end"]) for r in mine if r["report"]["gpu"] == g]
            assert max_overlap(spans) <= per_gpu, (nid[:12], g, spans)
    assert {r["report"]["gpu"] for r in results if r["node_id"] == a} == {0, 1}  # both GPUs of node a

    check_node_worlds(fleet, results, [a, b])
    # Not vacuous: on node b (two commands per GPU) regions had a sibling to keep out, frozen
    # (`all`) or held at the gate (`gpu`, the default: its slot in running_slots).
    on_b = [r for r in results if r["node_id"] == b]
    assert any(
        reg.get("siblings_frozen") or reg.get("running_slots") for r in on_b for reg in r["report"]["regions"]
    )

    # The summary's counts.
    s = json.loads((out / "summary.json").read_text())
    assert (s["commands"], s["ran"], s["succeeded"], s["failures"]) == (n, n, n, 0)
    # Clean, but for a sibling that ended during a region (`sibling-context`): a command
    # that made no LIFE call has no exit hold, and a process already exiting in the kernel
    # cannot be frozen. Flagged, never silently clean; anything else is a failure.
    flagged = [reg for r in results for reg in r["report"]["regions"] if reg.get("contaminated")]
    assert all(set(reg.get("flags") or ["?"]) == {"sibling-context"} for reg in flagged), [
        (reg.get("flags"), reg.get("reasons")) for reg in flagged
    ]
    assert s["regions"] == n * rounds and s["contaminated_regions"] == len(flagged) <= 2, flagged
    assert s["reruns"] == 0 and s["lost_nodes"] == [] and s["jobs"] == 4
    rows = {row["node_id"]: row for row in s["nodes"]}
    assert set(rows) == {a, b}
    for nid, row in rows.items():
        mine = [r for r in results if r["node_id"] == nid]
        assert row["commands"] == len(mine) > 0
        assert row["regions"] == rounds * len(mine) == row["journal_regions"]
        flagged_here = sum(1 for r in mine for reg in r["report"]["regions"] if reg.get("contaminated"))
        assert row["state"] == "alive" and row["failures"] == 0
        assert row["contaminated_regions"] == flagged_here, (row, flagged_here)  # those allowed above
        assert row["region_waits"]["count"] == row["regions"]
        assert (row["gpus"], row["slots"]) == fleet.spec[nid]
    assert sum(row["commands"] for row in rows.values()) == n
    journal = read_jsonl(out / "journal.jsonl")
    assert len(journal) == n * rounds
    owners = {(r["node_id"], r["result"]["pid"]) for r in results}
    assert {(j["node_id"], j["owner_pid"]) for j in journal} == owners

    # `krex journal --fleet` gathers the same regions from every node.
    p = subprocess.run(
        [
            *KREX,
            "journal",
            "--fleet",
            "--address",
            fleet.cluster.address,
            "--node-root",
            str(fleet.root),
            "-n",
            "1000",
            "--json",
        ],
        env=fleet.env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == 0, p.stderr
    per_node = {j["node_id"]: len(j["records"]) for j in json.loads(p.stdout)}
    assert per_node == {nid: row["regions"] for nid, row in rows.items()}

    # The `krex bench` corpus runs the same way (its scripts and the node's Python).
    out2 = tmp_path / "corpus"
    corpus = ["--corpus", "default", "--quick", "--only", "sim-a"]
    rc, stdout, stderr = fleet.finish(fleet.fleet(corpus, out2), timeout=300)
    assert rc == 0, stdout + stderr[-3000:]
    results = load_results(out2, 5)
    assert all(r["exit_status"] == 0 and "ms" in r["result"] and r["regions"] >= 1 for r in results)
    assert all(r["argv"][0] == "{python}" for r in results)  # the node's own Python ran it


def test_fleet_lost_node_reruns_its_commands_elsewhere(fleet: Fleet, tmp_path: Path) -> None:
    a, b, c = (fleet.add(gpus=1, slots=2) for _ in range(3))
    fleet.wait_for_nodes()
    n, rounds = 12, 10
    out = tmp_path / "out"
    proc = fleet.fleet([str(fleet.batch_file(n, rounds))], out)

    def b_busy() -> bool:
        try:
            return any(s.owner_alive for s in fleet.snapshot(b).slots) and bool(fleet.trace_ops(b))
        except Exception:
            return False

    wait_until(lambda: b_busy() or proc.poll() is not None, 240, "node b running a command", interval=0.1)
    assert proc.poll() is None, "the fleet ended before node b took a command"
    b_pids = {p.pid for p in fleet.snapshot(b).procs if p.alive}
    fleet.cluster.remove_node(fleet.nodes[b], allow_graceful=False)
    rc, stdout, stderr = fleet.finish(proc, timeout=300)
    assert rc == 0, stdout + stderr[-4000:]
    assert "Traceback" not in stderr
    assert f"lost with node {b[:12]}" in stderr

    results = load_results(out, n)
    s = json.loads((out / "summary.json").read_text())
    assert (s["commands"], s["ran"], s["succeeded"], s["failures"], s["not_run"]) == (n, n, n, 0, [])
    assert s["lost_nodes"] == [b]
    lost = s["lost_attempts"]
    assert lost and all(x["node_id"] == b for x in lost), lost
    assert s["reruns"] == len(lost)
    rows = {row["node_id"]: row for row in s["nodes"]}
    assert rows[b]["state"] == "lost" and rows[b]["lost_attempts"] == len(lost)
    assert rows[a]["state"] == rows[c]["state"] == "alive"

    # Nothing lost, nothing counted twice: one result per command; a re-run command's result
    # comes from a survivor; a command completes on a survivor exactly once unless its result
    # came back from b before b died.
    rerun = {x["index"] for x in lost}
    survivors = {fleet.world(x)["KREX_SHM"] for x in (a, c)}
    done = [ln.split() for ln in fleet.done.read_text().splitlines()]
    for r in results:
        assert r["exit_status"] == 0 and r["result"]["index"] == r["index"]
        on_survivors = [d for d in done if int(d[0]) == r["index"] and d[1] in survivors]
        if r["node_id"] == b:
            assert r["index"] not in rerun and on_survivors == []
        else:
            assert len(on_survivors) == 1 and r["result"]["pid"] == int(on_survivors[0][2])
        if r["index"] in rerun:
            assert r["node_id"] in (a, c) and r["attempt"] == 1 + len(r["lost_attempts"]) >= 2
            assert {x["node_id"] for x in r["lost_attempts"]} == {b}
    assert sum(row["commands"] for row in rows.values()) == n
    assert s["regions"] == sum(row["regions"] for row in rows.values()) == n * rounds
    assert rows[b]["commands"] == sum(1 for r in results if r["node_id"] == b)

    # Nothing frozen on the survivors, whose regions stayed exclusive; and b's commands did
    # not outlive their node (their guardians died with b's Ray workers and thawed them).
    check_node_worlds(fleet, results, [a, c])

    def b_gone() -> bool:
        return not any(_proc_state(pid) not in ("", "Z", "X") for pid in b_pids)

    wait_until(b_gone, 60, "node b's commands to end", interval=0.1)
    assert fleet.frozen(b) == []
    assert not any(g.closed for g in fleet.snapshot(b).gates)


def test_fleet_on_a_local_cluster_by_default(tmp_path: Path) -> None:
    """No --address: a local one-node Ray cluster with this machine's slots (and its KREX world)."""
    tag = f"{os.getpid()}-{tmp_path.name[-8:]}"
    state = tempfile.mkdtemp(prefix="kxfd-")
    env = clean_env()
    env.pop("RAY_ADDRESS", None)
    env.update(
        KREX_STATE_DIR=state,
        KREX_SHM=f"/krex-tfd-{tag}",
        KREX_SIM_SHM=f"/krex-tfdsim-{tag}",
        KREX_SIM_GPUS="1",
        PYTHONUNBUFFERED="1",
    )
    cmds = tmp_path / "cmds.json"
    cmds.write_text(
        json.dumps(
            [["sh", "-c", "echo one; exit 0"], ["sh", "-c", "echo two >&2; exit 4"], "echo '{\"ms\": 1.5}'"]
        )
    )
    try:
        p = subprocess.run(
            [*KREX, "fleet", "--node-resources", "--device", "sim", "--slots-per-gpu", "3"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 0 and json.loads(p.stdout) == {"krex_slot": 3}, p.stderr
        out = tmp_path / "out"
        p = subprocess.run(
            [*KREX, "fleet", str(cmds), "--device", "sim", "--slots-per-gpu", "2", "--out", str(out)],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert p.returncode == 1, p.stdout + p.stderr
        assert "1 of 3 command(s) failed or did not run" in p.stderr and "fix:" in p.stderr
        s = json.loads((out / "summary.json").read_text())
        assert (s["commands"], s["succeeded"], s["failures"], s["jobs"]) == (3, 2, 1, 2)
        assert len(s["nodes"]) == 1 and s["nodes"][0]["slots"] == 2 and s["nodes"][0]["commands"] == 3
        r = [json.loads(f.read_text()) for f in sorted(out.glob("cmd-*.json"))]
        assert [x["exit_status"] for x in r] == [0, 4, 0]
        assert r[0]["result_line"] == "one" and r[0]["result"] is None
        assert "two" in Path(r[1]["stderr"]).read_text() and r[1]["result_line"] is None
        assert r[2]["result"] == {"ms": 1.5}
        assert all(x["report"]["slot"] >= 0 for x in r)  # under krex run, in this world's daemon
        assert Path(state, "krexd.sock").exists()
    finally:
        subprocess.run([*KREX, "daemon", "stop"], env=env, capture_output=True, timeout=60)
        for name in (env["KREX_SHM"], env["KREX_SIM_SHM"]):
            Path("/dev/shm" + name).unlink(missing_ok=True)
        shutil.rmtree(state, ignore_errors=True)


BLOCK_RAY = "import sys; sys.modules['ray'] = None; from krex.cli.main import main; main(sys.argv[1:])"


@pytest.mark.parametrize("args", [["fleet", "CMDS"], ["journal", "--fleet"]])
def test_fleet_without_ray_says_how_to_install_it(tmp_path: Path, args: list[str]) -> None:
    cmds = tmp_path / "cmds.txt"
    cmds.write_text("echo hi\n")
    argv = [str(cmds) if a == "CMDS" else a for a in args]
    p = subprocess.run(
        [sys.executable, "-c", BLOCK_RAY, *argv],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert p.returncode == 3, p.stdout + p.stderr
    assert "krex fleet needs Ray, which is not installed" in p.stderr
    assert "pip install 'krex-gpu[fleet]'" in p.stderr
    assert "Traceback" not in p.stderr
    assert not list(tmp_path.glob("krex-fleet-*"))  # nothing written before the check


def test_fleet_usage_errors(tmp_path: Path) -> None:
    p = subprocess.run([*KREX, "fleet"], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "give either a batch FILE or --corpus" in p.stderr and "fix:" in p.stderr
    p = subprocess.run(
        [*KREX, "fleet", str(tmp_path / "nope.txt")],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 3 and "does not exist" in p.stderr


def test_guardian_dies_with_its_task(tmp_path: Path) -> None:
    """The PR_SET_PDEATHSIG hook: when the process that started a guardian dies, the guardian
    gets SIGTERM (a lost Ray worker takes its command along). Ray runs tasks with signals
    blocked, and a blocked mask survives exec: the parent here blocks SIGINT and SIGTERM."""
    marker = tmp_path / "child.pid"
    child_code = f"import os, time; open({str(marker)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    code = f"""
import signal, subprocess, sys, time
from krex.fleet import _die_with_parent
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT, signal.SIGTERM])
p = subprocess.Popen([sys.executable, "-c", {child_code!r}], preexec_fn=_die_with_parent())
time.sleep(60)
"""
    parent = subprocess.Popen([sys.executable, "-c", code], env=clean_env())
    try:
        wait_until(lambda: marker.exists() and marker.read_text().strip(), 30, "the child to start")
        child = int(marker.read_text())
        assert _proc_state(child) not in ("", "Z", "X")
        blocked = int(
            next(
                ln.split()[1]
                for ln in _read(Path(f"/proc/{child}/status")).splitlines()
                if ln.startswith("SigBlk:")
            ),
            16,
        )
        assert blocked == 0
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        wait_until(lambda: _proc_state(child) in ("", "Z", "X"), 30, "the child to die with its parent")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_fleet_interrupted_stops_its_commands_and_writes_everything(fleet: Fleet, tmp_path: Path) -> None:
    a = fleet.add(gpus=1, slots=2)
    fleet.wait_for_nodes()
    started = tmp_path / "started"
    started.mkdir()
    cmds = tmp_path / "long.json"
    body = (
        f"import os, time; open(os.path.join({str(started)!r}, str(os.getpid())), 'w').close(); "
        "time.sleep(120)"
    )
    cmds.write_text(json.dumps([[sys.executable, "-c", body]] * 4))
    out = tmp_path / "out"
    proc = fleet.fleet([str(cmds)], out)
    wait_until(
        lambda: len(list(started.iterdir())) >= 2 or proc.poll() is not None,
        240,
        "two commands running",
        interval=0.1,
    )
    assert proc.poll() is None
    pids = [int(p.name) for p in started.iterdir()]
    proc.send_signal(signal.SIGINT)
    rc, stdout, stderr = fleet.finish(proc, timeout=120)
    assert rc == 130, stdout + stderr[-3000:]
    assert "fleet run interrupted: 2 of 4 command(s) not run" in stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["interrupted"] is True and len(s["not_run"]) == 2 and s["ran"] == 2
    results = load_results(out, 4)
    ran = [r for r in results if not r["not_run"]]
    # The running commands got the SIGINT (Python exits by the signal: 128+2), not a kill.
    assert [r["exit_status"] for r in ran] == [130, 130], [r.get("error") for r in ran]
    assert all(r["cancelled"] for r in ran)
    wait_until(lambda: all(_proc_state(p) in ("", "Z", "X") for p in pids), 30, "the commands to end")
    assert fleet.frozen(a) == []
    snap = fleet.snapshot(a)
    assert not any(g.closed for g in snap.gates) and not any(x.owner_alive for x in snap.slots)
