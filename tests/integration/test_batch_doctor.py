"""`krex batch` and `krex doctor`, end to end through the CLI.

Batch tests run real `krex run` guardians against the simulated GPU, under a
daemon of their own (private KREX_STATE_DIR, KREX_SHM and KREX_SIM_SHM; the
daemon is stopped at teardown). Doctor tests look at this machine as it is,
and assert only what the machine allows (root, cores, nvcc, a GPU)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from glob import glob
from pathlib import Path
from typing import Any

import pytest
from helpers import private_world

from krex.batch import BatchCommand, CommandResult, _dist, parse_commands, summarize
from krex.bench.metrics import percentile
from krex.errors import UsageError
from krex.runner import native_guardian

pytestmark = pytest.mark.timeout(180)

# Until cli/main.py calls register(), run the CLI with the commands added the same way.
_WRAPPER = (
    "import sys; from krex.cli.main import cli, main; "
    "from krex.cli.commands_extra import register; register(cli); main(sys.argv[1:])"
)


def krex_cmd() -> list[str]:
    from krex.cli.main import cli

    if "batch" in cli.commands and "doctor" in cli.commands:
        return [sys.executable, "-m", "krex.cli.main"]
    return [sys.executable, "-c", _WRAPPER]


BENCH = """\
import json, os, sys, time
import krex

n = int(sys.argv[1])
code = int(sys.argv[2]) if len(sys.argv) > 2 else 0
time.sleep(0.05)  # the untimed part: imports, inputs
grants = []
for _ in range(n):
    with krex.region() as r:
        time.sleep(0.05)  # the timed loop
    grants.append(r.grant)
print(json.dumps({"pid": os.getpid(), "regions": len(grants)}))
print("bench stderr line", file=sys.stderr)
sys.exit(code)
"""


# ------------------------------------------------------------------------------- fixtures


def _cgroup_mounts() -> list[str]:
    from krex.node import mounts

    found = mounts.read_mounts()
    return mounts.cgroup2_mounts(found) + mounts.cgroup1_freezer_mounts(found)


@pytest.fixture
def krex_env() -> Iterator[dict[str, str]]:
    """A private daemon world: state dir (short path: it holds the socket), control
    segment and simulated device. Stops the daemon and removes what it left."""
    env = private_world("bd")
    try:
        yield env
    finally:
        subprocess.run([*krex_cmd(), "daemon", "stop"], env=env, capture_output=True, timeout=60)
        for name in (env["KREX_SHM"], env["KREX_SIM_SHM"]):
            Path("/dev/shm", name.lstrip("/")).unlink(missing_ok=True)
        for mount in _cgroup_mounts():  # the daemon's groups, if it left them (empty) behind
            root = os.path.join(mount, env["KREX_SHM"].lstrip("/"))
            for group in [*glob(os.path.join(root, "*/")), root]:
                with contextlib.suppress(OSError):  # rmdir never touches a populated cgroup
                    os.rmdir(group)
        shutil.rmtree(env["KREX_STATE_DIR"], ignore_errors=True)


def krex(
    args: list[str],
    env: dict[str, str],
    cwd: Path | None = None,
    timeout: float = 120,
    stdin: str | None = None,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*krex_cmd(), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, input=stdin
    )


def krex_or_daemon_log(
    args: list[str], env: dict[str, str], timeout: float = 90, **kw: Any
) -> subprocess.CompletedProcess[str]:
    """krex(), but a hang fails with the daemon's log (a batch waits on the daemon)."""
    try:
        return krex(args, env, timeout=timeout, **kw)
    except subprocess.TimeoutExpired:
        log = Path(env["KREX_STATE_DIR"], "krexd.log")
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else "(no krexd.log)"
        raise AssertionError(f"krex {' '.join(args)} hung for {timeout}s; krexd.log:\n{tail}") from None


def socket_exists(env: dict[str, str]) -> bool:
    return Path(env["KREX_STATE_DIR"], "krexd.sock").exists()


# ---------------------------------------------------------------------------------- batch

RESULT_KEYS = {
    "index",
    "command",
    "argv",
    "shell",
    "exit_status",
    "ok",
    "not_run",
    "wall_s",
    "started_at",
    "ended_at",
    "stdout",
    "stderr",
    "regions",
    "region_s",
    "contaminated_regions",
    "warnings",
    "error",
    "report",
}
SUMMARY_KEYS = {
    "commands",
    "ran",
    "succeeded",
    "failures",
    "failed",
    "not_run",
    "interrupted",
    "jobs",
    "device",
    "dir",
    "total_wall_s",
    "command_wall_s",
    "throughput_per_min",
    "regions",
    "region_s",
    "region_share",
    "region_waits",
    "admission_waits",
    "contaminated_regions",
    "contaminated",
    "gate_blocks",
    "fail_opens",
    "partition_degraded",
}


def test_batch_sim_end_to_end(krex_env: dict[str, str], tmp_path: Path) -> None:
    bench = tmp_path / "bench.py"
    bench.write_text(BENCH)
    py = sys.executable
    # (regions, exit status) per command; the last one fails after its region.
    plan = [(1, 0), (1, 0), (2, 0), (1, 0), (0, 0), (1, 3)]
    lines = ["# six benchmarks", ""] + [f"{py} {bench} {n} {code}" for n, code in plan]
    lines.insert(4, "   # an indented comment")
    batch_file = tmp_path / "cmds.txt"
    batch_file.write_text("\n".join(lines) + "\n")
    out = tmp_path / "results"

    p = krex_or_daemon_log(
        ["batch", str(batch_file), "-j", "3", "--device", "sim", "--out", str(out)], krex_env, cwd=tmp_path
    )
    assert p.returncode == 1, p.stdout + p.stderr
    assert "1 of 6 command(s) failed" in p.stderr
    assert "fix:" in p.stderr and "Traceback" not in p.stderr
    # stderr is not a TTY here: plain progress lines, one per finished command, no bar.
    assert "\r" not in p.stderr
    assert sum(1 for ln in p.stderr.splitlines() if ln.startswith("krex batch: [")) == 6
    assert "[6/6]" in p.stderr
    assert "6 commands: 5 ok, 1 failed" in p.stdout

    names = sorted(x.name for x in out.iterdir())
    assert names == sorted(
        ["summary.json"] + [f"cmd-{i:03d}.{ext}" for i in range(1, 7) for ext in ("json", "stdout", "stderr")]
    )
    results = [json.loads((out / f"cmd-{i:03d}.json").read_text()) for i in range(1, 7)]
    for i, (r, (n, code)) in enumerate(zip(results, plan, strict=True), 1):
        assert set(r) >= RESULT_KEYS, RESULT_KEYS - set(r)
        assert r["index"] == i and r["shell"] is True and r["argv"][:2] == ["/bin/sh", "-c"]
        assert r["command"] == f"{py} {bench} {n} {code}"
        assert r["exit_status"] == code and r["ok"] is (code == 0) and r["not_run"] is False
        assert r["wall_s"] > 0 and r["ended_at"] >= r["started_at"]
        stdout = json.loads(Path(r["stdout"]).read_text().strip().splitlines()[-1])
        assert stdout["regions"] == n
        assert "bench stderr line" in Path(r["stderr"]).read_text()
        rep = r["report"]
        assert rep is not None and rep["exit_status"] == code
        assert {
            "slot",
            "gpu",
            "admission_wait_s",
            "gate_blocks",
            "regions",
            "contaminated_regions",
            "region_wait_s",
        } <= set(rep)
        assert r["regions"] == n == len(rep["regions"])
        for reg in rep["regions"]:
            assert reg["owner_slot"] == rep["slot"]
            assert reg["region_s"] >= 0.04 and reg["queue_wait_s"] >= 0
            assert "contaminated" in reg and "freezer" in reg
        assert r["contaminated_regions"] == sum(1 for reg in rep["regions"] if reg["contaminated"])

    # At most -j commands at once, and really concurrent.
    spans = [(r["started_at"], r["ended_at"]) for r in results]
    overlap = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert 2 <= overlap <= 3

    # One region per GPU at a time: the regions of all commands never overlap.
    regs = sorted((reg for r in results for reg in r["report"]["regions"]), key=lambda g: g["ts"])
    for a, b in zip(regs, regs[1:], strict=False):
        assert b["ts"] - b["region_s"] - b.get("thaw_s", 0) >= a["ts"] - 1e-3, (a, b)

    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) >= SUMMARY_KEYS, SUMMARY_KEYS - set(summary)
    assert summary["commands"] == 6 and summary["ran"] == 6
    assert summary["failures"] == 1 and summary["succeeded"] == 5
    assert [f["index"] for f in summary["failed"]] == [6] and summary["failed"][0]["exit_status"] == 3
    assert summary["not_run"] == [] and summary["interrupted"] is False
    assert summary["jobs"] == 3 and summary["device"] == "sim" and summary["dir"] == str(out)
    assert summary["regions"] == sum(n for n, _ in plan) == 6
    assert summary["region_waits"]["count"] == 6
    w = summary["region_waits"]
    assert 0 <= w["p50_s"] <= w["p95_s"] <= w["max_s"] <= w["total_s"] + 1e-9
    assert summary["total_wall_s"] > 0 and summary["throughput_per_min"] > 0
    assert summary["command_wall_s"] == pytest.approx(sum(r["wall_s"] for r in results), abs=1e-5)
    region_s = sum(reg["region_s"] for reg in regs)
    assert summary["region_s"] == pytest.approx(region_s, abs=1e-5)
    assert summary["region_share"] == pytest.approx(region_s / summary["command_wall_s"], abs=1e-5)
    assert 0 < summary["region_share"] < 1
    assert summary["contaminated_regions"] == sum(r["contaminated_regions"] for r in results)

    # The batch started the (private) daemon; doctor sees it and does not call that a problem.
    assert socket_exists(krex_env)
    d = krex(["doctor", "--json"], krex_env)
    daemon = next(c for c in json.loads(d.stdout)["checks"] if c["name"] == "daemon")
    assert daemon["status"] == "ok" and daemon["details"]["running"] is True


def test_batch_json_argv_lists(krex_env: dict[str, str], tmp_path: Path) -> None:
    bench = tmp_path / "bench.py"
    bench.write_text(BENCH)
    cmds = [[sys.executable, str(bench), "1"], ["krex-no-such-command-xyz", "--flag"]]
    f = tmp_path / "cmds.json"
    f.write_text(json.dumps(cmds))
    out = tmp_path / "o"
    p = krex_or_daemon_log(["batch", str(f), "-j", "2", "--device", "sim", "--out", str(out)], krex_env)
    assert p.returncode == 1 and "1 of 2 command(s) failed" in p.stderr
    ok, bad = (json.loads((out / f"cmd-{i:03d}.json").read_text()) for i in (1, 2))
    assert ok["argv"] == cmds[0] and ok["shell"] is False and ok["exit_status"] == 0 and ok["regions"] == 1
    # krex run could not start it: its report holds the KREX error, and so does the result.
    assert bad["argv"] == cmds[1] and bad["exit_status"] == 127
    assert bad["report"]["krex_error"]["kind"] == "CommandNotFound"
    assert "command not found" in bad["error"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["regions"] == 1 and summary["failures"] == 1


def test_batch_default_out_dir_and_stdin(krex_env: dict[str, str], tmp_path: Path) -> None:
    p = krex_or_daemon_log(
        ["batch", "-", "-j", "1", "--device", "sim"], krex_env, cwd=tmp_path, stdin="true\n# c\necho hi\n"
    )
    assert p.returncode == 0, p.stderr
    dirs = glob(str(tmp_path / "krex-batch-*"))
    assert len(dirs) == 1
    summary = json.loads(Path(dirs[0], "summary.json").read_text())
    assert summary["commands"] == 2 and summary["failures"] == 0 and summary["regions"] == 0
    assert Path(dirs[0], "cmd-002.stdout").read_text() == "hi\n"


def test_batch_spawns_the_guardian_entry_not_the_cli(krex_env: dict[str, str], tmp_path: Path) -> None:
    """Each command's parent is its guardian: the native one (`krex/_lib/krex --entry`,
    handing over to `python -m krex.proc.launcher`) or that entry, never `krex.cli`."""
    out = tmp_path / "o"
    p = krex_or_daemon_log(
        ["batch", "-", "-j", "2", "--device", "sim", "--out", str(out)],
        krex_env,
        stdin="tr '\\0' ' ' < /proc/$PPID/cmdline\n" * 2,
    )
    assert p.returncode == 0, p.stderr
    for i in (1, 2):
        parent = (out / f"cmd-00{i}.stdout").read_text()
        native = native_guardian()
        entry = f"{native} --entry " if native else " -m krex.proc.launcher "
        assert entry in parent and "krex.cli" not in parent, parent
        assert f"--report {out}/cmd-00{i}.report.json" in parent


def _status(env: dict[str, str]) -> dict[str, Any]:
    st = krex(["daemon", "status", "--json"], env, timeout=60)
    assert st.returncode == 0, st.stderr
    return dict(json.loads(st.stdout))


def test_batch_never_runs_more_at_once_than_the_daemon_admits(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    """-j N beyond the running daemon's slots would queue the extra commands at admission:
    refused, naming the daemon and the fix. Without -j, a batch runs as many at once as the
    daemon admits (the node's slots)."""
    started = krex(["daemon", "start", "--device", "sim", "--slots-per-gpu", "1"], krex_env, timeout=60)
    assert started.returncode == 0, started.stderr
    pid = _status(krex_env)["daemon"]["pid"]
    cmds = tmp_path / "cmds.txt"
    cmds.write_text("true\ntrue\ntrue\n")
    bad = krex(["batch", str(cmds), "-j", "2", "--device", "sim", "--out", str(tmp_path / "two")], krex_env)
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert f"pid {pid}" in bad.stderr and "-j 1" in bad.stderr, bad.stderr
    assert "krex daemon stop" in bad.stderr, bad.stderr
    assert not (tmp_path / "two").exists()
    sim = ["--device", "sim"]
    ok = krex_or_daemon_log(["batch", str(cmds), *sim, "--out", str(tmp_path / "auto")], krex_env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert json.loads((tmp_path / "auto" / "summary.json").read_text())["jobs"] == 1
    assert _status(krex_env)["daemon"]["pid"] == pid  # the running daemon served it, untouched


def test_batch_starts_a_daemon_with_the_slots_it_needs(krex_env: dict[str, str], tmp_path: Path) -> None:
    """No daemon: `krex batch -j 3` starts one that admits 3 commands at once, whatever the
    node's default; without -j it runs as many at once as the node's default slots."""
    cmds = tmp_path / "cmds.txt"
    cmds.write_text("true\n" * 3)
    env = dict(krex_env, KREX_SLOTS_PER_GPU="1")  # the node's default, below -j
    sim = ["--device", "sim"]
    p = krex_or_daemon_log(["batch", str(cmds), "-j", "3", *sim, "--out", str(tmp_path / "a")], env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert _status(env)["slots_per_gpu"] == [3]
    krex(["daemon", "stop"], env, timeout=60)
    q = krex_or_daemon_log(["batch", str(cmds), "--device", "sim", "--out", str(tmp_path / "b")], env)
    assert q.returncode == 0, q.stdout + q.stderr
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["jobs"] == 1
    assert _status(env)["slots_per_gpu"] == [1]


@pytest.mark.parametrize(
    "case", ["missing", "empty", "jobs0", "device", "badjson", "notlist", "outbusy", "outproc", "outfile"]
)
def test_batch_bad_input(krex_env: dict[str, str], tmp_path: Path, case: str) -> None:
    good = tmp_path / "good.txt"
    good.write_text("true\n")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("")
    args, rc, msg = {
        "missing": ([str(tmp_path / "nope.txt"), "-j", "2"], 3, "does not exist"),
        "empty": (["EMPTY", "-j", "2"], 2, "holds no command"),
        "jobs0": ([str(good), "-j", "0"], 2, "-j 0"),
        "device": ([str(good), "-j", "2", "--device", "tpu"], 2, "unknown device 'tpu'"),
        "badjson": (["BAD.json", "-j", "1"], 2, "is not valid JSON"),
        "notlist": (["NOTLIST.json", "-j", "1"], 2, "is not an argv list"),
        "outbusy": ([str(good), "-j", "1", "--device", "sim", "--out", str(busy)], 2, "is not empty"),
        # A directory nobody can make there: the path and why, a usage error (once 4, "not found").
        "outproc": ([str(good), "-j", "1", "--device", "sim", "--out", "/proc/x"], 2,
                    "--out /proc/x: cannot make the directory (No such file or directory)"),
        "outfile": ([str(good), "-j", "1", "--device", "sim", "--out", str(good / "sub")], 2,
                    f"--out {good / 'sub'}: cannot make the directory (Not a directory)"),
    }[case]
    (tmp_path / "EMPTY").write_text("# nothing but comments\n\n   \n")
    (tmp_path / "BAD.json").write_text('[["a", ')
    (tmp_path / "NOTLIST.json").write_text('[["ok"], "x", 3]')
    p = krex(["batch", *args], krex_env, cwd=tmp_path)
    assert p.returncode == rc, p.stderr
    assert msg in p.stderr and "fix:" in p.stderr and "Traceback" not in p.stderr
    assert not glob(str(tmp_path / "krex-batch-*"))  # nothing written
    assert not socket_exists(krex_env)  # and no daemon started for nothing


# ------------------------------------------------------------------- batch library (pure)


def test_parse_commands() -> None:
    cmds = parse_commands("# c\n\n  echo a  \n#x\nls -l | wc\n", "f")
    assert [c.line for c in cmds] == ["echo a", "ls -l | wc"] and [c.index for c in cmds] == [1, 2]
    assert cmds[0].argv == ["/bin/sh", "-c", "echo a"] and cmds[0].source_line == 3
    cmds = parse_commands('[["python", "b.py"], "echo x"]', "f")
    assert cmds[0].argv == ["python", "b.py"] and cmds[0].line is None and cmds[1].line == "echo x"
    # A shell line that merely starts with '[' is not JSON.
    assert parse_commands("[ -f x ] && echo y\n", "f")[0].line == "[ -f x ] && echo y"
    for bad in ("", "# only\n", "[]"):
        with pytest.raises(UsageError):
            parse_commands(bad, "f")
    with pytest.raises(UsageError):
        parse_commands('[["a"], []]', "f")
    with pytest.raises(UsageError):
        parse_commands("not json", "f.json", force_json=True)
    # A UTF-8 byte order mark (as some editors save) is not part of the first command.
    cmds = parse_commands("\ufeffecho a\necho b\n", "f")
    assert [c.line for c in cmds] == ["echo a", "echo b"], cmds
    cmds = parse_commands('\ufeff[["python", "b.py"]]', "f.json", force_json=True)
    assert cmds[0].argv == ["python", "b.py"]


def test_percentile_and_summarize() -> None:
    # One percentile (krex.bench.metrics, NaN for no values); batch's distributions say None.
    assert math.isnan(percentile([], 50))
    assert _dist([])["p50_s"] is None and _dist([])["p95_s"] is None and _dist([])["count"] == 0
    assert percentile([3.0], 95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([float(i) for i in range(101)], 95) == pytest.approx(95.0)

    def res(i: int, status: int | None, wall: float, regs: list[dict[str, Any]]) -> CommandResult:
        report = None if status is None else {"regions": regs, "admission_wait_s": 0.01, "gate_blocks": 2}
        return CommandResult(BatchCommand(i, ["x"]), status, wall, 0.0, wall, "o", "e", report)

    rs = [
        res(1, 0, 2.0, [{"region_s": 0.5, "queue_wait_s": 0.1}]),
        res(2, 1, 2.0, [{"region_s": 0.5, "queue_wait_s": 0.3, "contaminated": True, "reasons": ["r"]}]),
        res(3, None, 0.0, []),
    ]
    s = summarize(rs, total_wall_s=3.0, jobs=2, device="sim", out_dir="/d", interrupted=True)
    assert s["commands"] == 3 and s["ran"] == 2 and s["failures"] == 1 and s["not_run"] == [3]
    assert s["regions"] == 2 and s["region_share"] == pytest.approx(0.25)
    assert s["region_waits"]["total_s"] == pytest.approx(0.4)
    assert s["region_waits"]["p50_s"] == pytest.approx(0.2)
    assert s["contaminated_regions"] == 1 and s["contaminated"] == [{"index": 2, "reasons": ["r"]}]
    assert s["throughput_per_min"] == pytest.approx(40.0) and s["gate_blocks"] == 4


# --------------------------------------------------------------------------------- doctor


def _checks(stdout: str) -> dict[str, dict[str, Any]]:
    data = json.loads(stdout)
    assert set(data) == {"ok", "counts", "checks"}
    out: dict[str, dict[str, Any]] = {}
    for c in data["checks"]:
        assert set(c) == {"name", "status", "finding", "fix", "details"}
        assert c["status"] in ("ok", "warn", "fail")
        assert c["finding"] and "\n" not in c["finding"]
        assert bool(c["fix"]) == (c["status"] != "ok"), c  # a fix exactly when something is not ok
        out[c["name"]] = c
    assert data["ok"] == all(c["status"] != "fail" for c in out.values())
    assert sum(data["counts"].values()) == len(out)
    return out


def _cgroup2_writable() -> bool:
    from krex.node import mounts

    return any(
        m.fstype == "cgroup2" and "ro" not in m.options and os.access(m.mount_point, os.W_OK)
        for m in mounts.read_mounts()
    )


def test_doctor_json_on_this_machine(krex_env: dict[str, str]) -> None:
    from krex.node import cpus

    roots = [os.path.join(m, krex_env["KREX_SHM"].lstrip("/")) for m in _cgroup_mounts()]
    p = krex(["doctor", "--json"], krex_env)
    checks = _checks(p.stdout)
    assert list(checks)[:7] == ["privileges", "freezer", "cpus", "shim", "gpus", "mps", "daemon"]
    assert p.returncode == (0 if all(c["status"] != "fail" for c in checks.values()) else 1)

    if os.geteuid() == 0 and _cgroup2_writable():
        assert checks["privileges"]["status"] == "ok"
        assert checks["freezer"]["status"] == "ok"
        assert checks["freezer"]["details"]["backend"] == "cgroup2"
        assert checks["freezer"]["finding"].startswith("cgroup2:")
    # The probe leaves no parent group behind.
    assert not any(os.path.isdir(r) for r in roots)

    part = checks["cpus"]
    n_cores = len(cpus.discover().cores)
    if n_cores < 4:  # CI's 2 cores: degraded is a warning, never a failure
        assert part["status"] == "warn" and part["details"]["degraded"] is True
        assert "DEGRADED" in part["finding"] and "cores" in part["fix"]
    assert part["details"]["lines"] and part["details"]["partition"]["slices"]

    shim = checks["shim"]
    assert shim["status"] == "ok", shim
    assert shim["details"]["probe"] == {"mapped": True, "exports": True, "active": 0}

    assert checks["gpus"]["status"] in ("ok", "warn")
    assert checks["mps"]["status"] == "ok" and "pipe_dir" in checks["mps"]["details"]
    # No daemon in this private world: reported, not a failure, and doctor starts none.
    assert checks["daemon"]["status"] == "ok" and checks["daemon"]["details"]["running"] is False
    assert not socket_exists(krex_env)

    # Human output: one line per check, the verdict last.
    h = krex(["doctor"], krex_env)
    assert h.returncode == p.returncode
    assert h.stdout.strip().splitlines()[-1].startswith("krex doctor: ")
    for name in ("privileges", "freezer", "cpus", "shim", "gpus", "mps", "daemon"):
        assert name in h.stdout


def _nvcc() -> str | None:
    found = sorted(glob("/usr/local/cuda*/bin/nvcc"))
    return found[-1] if found else shutil.which("nvcc")


@pytest.fixture(scope="module")
def cuda_bins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    d = tmp_path_factory.mktemp("cuda")
    src = d / "st.cu"
    src.write_text(
        "__global__ void k(int *p) { if (p) *p = 1; }\nint main() { k<<<1, 1>>>(nullptr); return 0; }\n"
    )
    out = {"static": d / "st", "shared": d / "sh"}
    subprocess.run([nvcc, "-o", str(out["static"]), str(src)], check=True, capture_output=True, timeout=300)
    subprocess.run(
        [nvcc, "-cudart", "shared", "-o", str(out["shared"]), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


def test_doctor_static_cudart_binary(krex_env: dict[str, str], cuda_bins: dict[str, Path]) -> None:
    st, sh = str(cuda_bins["static"]), str(cuda_bins["shared"])
    p = krex(["doctor", "--json", st, sh], krex_env)
    checks = _checks(p.stdout)
    c = checks[f"binary {st}"]
    assert c["status"] == "warn" and "statically" in c["finding"]
    assert "nvcc -cudart shared" in c["fix"]
    assert c["details"]["static_cudart"] is True
    ok = checks[f"binary {sh}"]
    assert ok["status"] == "ok" and any("libcudart" in n for n in ok["details"]["needed"])
    # A warning is not a failure.
    assert p.returncode == (0 if all(x["status"] != "fail" for x in checks.values()) else 1)
    h = krex(["doctor", st], krex_env)
    assert "WARN" in h.stdout and "nvcc -cudart shared" in h.stdout


def test_doctor_missing_binary_fails(krex_env: dict[str, str], tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-bench")
    p = krex(["doctor", "--json", missing], krex_env)
    assert p.returncode == 1
    c = _checks(p.stdout)[f"binary {missing}"]
    assert c["status"] == "fail" and "no such file" in c["finding"] and c["fix"]


def test_doctor_gpu_without_gpu(krex_env: dict[str, str]) -> None:
    from krex.device.gpus import discover
    from krex.errors import NotFound

    try:
        discover("gpu")
    except NotFound:
        pass
    else:
        pytest.skip("this machine has an NVIDIA GPU")
    p = krex(["doctor", "--gpu"], krex_env)
    assert p.returncode == 1
    assert "Traceback" not in p.stderr
    line = next(ln for ln in p.stdout.splitlines() if "gpu coverage" in ln)
    assert line.startswith("FAIL") and "no NVIDIA GPU" in line
    j = krex(["doctor", "--gpu", "--json"], krex_env)
    cov = _checks(j.stdout)["gpu coverage"]
    assert j.returncode == 1 and cov["status"] == "fail" and cov["details"]["error"] == "NotFound"
