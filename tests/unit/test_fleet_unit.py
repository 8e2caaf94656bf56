"""krex.fleet's pure parts: node worlds, the command environment, result lines, the summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from krex.batch import BatchCommand, CommandResult
from krex.errors import UsageError
from krex.fleet import FleetConfig, _result_line, _worker_env, fleet_summary, node_world

N1 = "a1" * 28
N2 = "b2" * 28
N3 = "c3" * 28


def test_node_worlds_are_keyed_by_node_id(tmp_path: Path) -> None:
    w1, w2 = node_world(N1, tmp_path), node_world(N2, tmp_path)
    names = {"KREX_STATE_DIR", "KREX_SHM", "KREX_SIM_SHM", "KREX_SIM_TRACE", "KREX_THROWAWAY"}
    assert set(w1) == set(w2) == names
    assert w1["KREX_THROWAWAY"] == "1"  # its daemon's clean stop removes its /dev/shm segments
    for k in set(w1) - {"KREX_THROWAWAY"}:
        assert w1[k] != w2[k], k  # two Ray nodes on one host never share anything
    assert node_world(N1, tmp_path) == w1  # a test (or the driver) computes the same world
    assert Path(w1["KREX_STATE_DIR"]).parent == tmp_path
    assert node_world(N1, tmp_path / "other")["KREX_SHM"] != w1["KREX_SHM"]  # two roots, two worlds
    assert node_world(N1, None) == {}  # a node's own defaults


def test_node_world_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not a Ray node id"):
        node_world("node-1", tmp_path)
    with pytest.raises(UsageError, match="too long for a Unix socket") as e:
        node_world(N1, tmp_path / ("x" * 100))
    assert "mktemp" in e.value.fix


def test_command_env_drops_rays_worker_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for k, v in {
        "OMP_NUM_THREADS": "1",
        "RAY_JOB_ID": "01000000",
        "RAY_RAYLET_PID": "7",
        "PYTHONBREAKPOINT": "ray.util.rpdb.set_trace",
        "RAY_AUTH_TOKEN": "the-cluster-secret",
        "CUDA_VISIBLE_DEVICES": "",
        "KREX_SHM": "/krex-host",
        "KREX_SOCKET": "/run/krex/krexd.sock",
        "KREX_SLOT": "3",
        "MY_VAR": "kept",
    }.items():
        monkeypatch.setenv(k, v)
    world = node_world(N1, tmp_path)
    env = _worker_env(world, sim_gpus=2)
    for k in (
        "OMP_NUM_THREADS",
        "RAY_JOB_ID",
        "RAY_RAYLET_PID",
        "PYTHONBREAKPOINT",
        "RAY_AUTH_TOKEN",
        "CUDA_VISIBLE_DEVICES",
        "KREX_SOCKET",
        "KREX_SLOT",
    ):
        assert k not in env, k
    assert env["KREX_SHM"] == world["KREX_SHM"] and env["KREX_SIM_GPUS"] == "2" and env["MY_VAR"] == "kept"
    host = _worker_env({}, sim_gpus=None)  # a node's own world: its KREX variables stay
    assert host["KREX_SHM"] == "/krex-host" and "KREX_SIM_GPUS" not in host
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2")
    assert _worker_env({}, None)["CUDA_VISIBLE_DEVICES"] == "1,2"


def test_result_line() -> None:
    assert _result_line('compiling\n{"ms": 1.25}\n\n') == ('{"ms": 1.25}', {"ms": 1.25})
    assert _result_line("a\nlast line  \n") == ("last line", None)
    assert _result_line("{not json\n") == ("{not json", None)
    assert _result_line("[1, 2]\n") == ("[1, 2]", None)
    assert _result_line("\n \n") == (None, None)


def _res(
    index: int, status: int | None, wall: float, regions: list[dict[str, object]] | None = None, gpu: int = 0
) -> CommandResult:
    report = (
        None
        if status is None
        else {
            "slot": 0,
            "gpu": gpu,
            "admission_wait_s": 0.01,
            "regions": regions or [],
            "gate_blocks": 1,
            "fail_opens": 0,
        }
    )
    return CommandResult(BatchCommand(index, ["true"]), status, wall, 1.0, 1.0 + wall, "", "", report)


def test_summary_counts_each_command_once_on_its_final_node() -> None:
    reg = {"region_s": 0.1, "queue_wait_s": 0.02, "contaminated": False}
    bad = {"region_s": 0.1, "queue_wait_s": 0.5, "contaminated": True, "reasons": ["drain timeout"]}
    results = [
        _res(1, 0, 1.0, [reg, reg]),
        _res(2, 3, 2.0, [bad], gpu=1),
        _res(3, 0, 1.0, [reg]),
        _res(4, None, 0.0),
    ]
    lost = [
        {"index": 3, "attempt": 1, "node_id": N3, "error": "NodeDiedError", "message": "gone"},
        {"index": 3, "attempt": 2, "node_id": N3, "error": "GuardianKilled", "message": "x"},
    ]
    extra = {
        1: {"node_id": N1, "round_trip_s": 1.5, "lost_attempts": []},
        2: {"node_id": N1, "round_trip_s": 2.25, "lost_attempts": []},
        3: {"node_id": N2, "round_trip_s": 1.75, "lost_attempts": lost},
        4: {"node_id": None, "lost_attempts": []},
    }
    nodes = {
        N1: {"ip": "10.0.0.1", "slots": 4, "gpus": 2},
        N2: {"ip": "10.0.0.2", "slots": 2, "gpus": 1},
        N3: {"ip": "10.0.0.3", "slots": 2, "gpus": 1},
    }
    s = fleet_summary(
        results, extra, nodes, {N1, N2}, lost, 10.0, FleetConfig(address="h:1", device="sim"), "/out"
    )
    assert (s["commands"], s["ran"], s["succeeded"], s["failures"], s["not_run"]) == (4, 3, 2, 1, [4])
    assert s["regions"] == 4 and s["contaminated_regions"] == 1
    assert s["jobs"] == 6  # the live nodes' slots
    assert s["reruns"] == 2 and s["lost_nodes"] == [N3] and s["lost_attempts"] == lost
    rows = {r["node_id"]: r for r in s["nodes"]}
    r1 = rows[N1]
    assert (r1["commands"], r1["failures"], r1["regions"], r1["contaminated_regions"]) == (2, 1, 3, 1)
    assert rows[N1]["gpus_used"] == [0, 1] and rows[N1]["region_waits"]["max_s"] == 0.5
    assert (rows[N2]["commands"], rows[N2]["regions"], rows[N2]["lost_attempts"]) == (1, 1, 0)
    assert (rows[N3]["state"], rows[N3]["commands"], rows[N3]["lost_attempts"]) == ("lost", 0, 2)
    assert rows[N1]["state"] == rows[N2]["state"] == "alive"
    assert sum(r["commands"] for r in rows.values()) == s["ran"]
    assert sum(r["regions"] for r in rows.values()) == s["regions"]
    assert s["dispatch_s"]["count"] == 3 and s["dispatch_s"]["max_s"] == pytest.approx(0.75)


# ----------------------------------------------------------------- bad cluster addresses and roots

def _krex(*args: str, tmp_path: Path, timeout: float = 90) -> tuple[int, str, float]:
    import os
    import subprocess
    import sys
    import time

    cmd = [sys.executable, "-c", "import sys; from krex.cli.main import main; sys.exit(main())", *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KREX_", "RAY_"))}
    env["KREX_STATE_DIR"] = str(tmp_path / "state")
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    return p.returncode, p.stderr, time.monotonic() - t0


@pytest.mark.parametrize("what", ["fleet", "journal"])
def test_an_address_where_no_ray_cluster_answers_fails_soon_saying_how_to_fix_it(
    tmp_path: Path, what: str
) -> None:
    """Once Ray retried for over 400 s without a word; now a bounded wait (CONNECT_TIMEOUT_S)
    and an error that names the address and the fix."""
    pytest.importorskip("ray")
    from krex.fleet import CONNECT_TIMEOUT_S

    (tmp_path / "cmds.txt").write_text("true\n")
    args = (
        ["fleet", "--address", "127.0.0.1:1", "--out", str(tmp_path / "out"), str(tmp_path / "cmds.txt")]
        if what == "fleet"
        else ["journal", "--fleet", "--address", "127.0.0.1:1"]
    )
    rc, err, took = _krex(*args, tmp_path=tmp_path)
    assert rc == 3, err[-2000:]
    assert "cannot reach the Ray cluster at 127.0.0.1:1" in err and "fix:" in err, err
    assert "ray start --head" in err, err
    assert "Traceback" not in err and took < CONNECT_TIMEOUT_S + 30, took


@pytest.mark.parametrize("what", ["fleet", "journal"])
def test_a_node_root_that_cannot_be_a_directory_is_a_clear_usage_error(tmp_path: Path, what: str) -> None:
    (tmp_path / "cmds.txt").write_text("true\n")
    args = (
        ["fleet", "--node-root", "/proc/x", "--out", str(tmp_path / "out"), str(tmp_path / "cmds.txt")]
        if what == "fleet"
        else ["journal", "--fleet", "--node-root", "/proc/x"]
    )
    rc, err, _ = _krex(*args, tmp_path=tmp_path)
    assert rc == 2, err[-2000:]
    assert "--node-root /proc/x" in err and "fix:" in err and "Traceback" not in err, err


def test_a_node_that_lost_attempts_is_given_time_to_be_seen_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Attempts lost with a worker crash that names node b, while the GCS still lists b as
    alive (its health checks have not noticed yet): the summary waits for the GCS rather
    than calling b alive. A node that lost nothing is not waited for."""
    from krex import fleet

    monkeypatch.setattr(fleet.time, "sleep", lambda _s: None)

    class FakeRay:
        calls = 0

        def nodes(self) -> list[dict[str, object]]:
            FakeRay.calls += 1
            res = {fleet.RESOURCE: 2, "GPU": 1}
            return [{"NodeID": "a" * 16, "Alive": True, "Resources": res},
                    {"NodeID": "b" * 16, "Alive": FakeRay.calls < 4, "Resources": res}]

    lost = [{"index": 3, "attempt": 1, "node_id": "b" * 16, "error": "WorkerCrashedError", "message": ""}]
    assert set(fleet._final_nodes(FakeRay(), set(), lost)) == {"a" * 16}
    FakeRay.calls = 0
    assert set(fleet._final_nodes(FakeRay(), set(), [])) == {"a" * 16, "b" * 16}
