"""The lean `krex run`: the console script's `run` loads neither click nor GPU
discovery when a daemon answers, and the report's regions come from krexd's `release`
reply (equal to what it journaled), also when the command dies inside its region."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.fakes import write_fake_amd_node  # noqa: E402

KREX = [sys.executable, "-m", "krex.cli.main"]
# What the `krex` console script runs (pyproject: krex = "krex.cli.lean:main").
LEAN = [sys.executable, "-c", "import sys; from krex.cli.lean import main; sys.exit(main())"]
LEAN_IMPORTTIME = [sys.executable, "-X", "importtime", *LEAN[1:]]


def run(argv: list[str], env: dict[str, str], timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)


def imported(stderr: str) -> set[str]:
    return {ln.rsplit("|", 1)[1].strip() for ln in stderr.splitlines() if ln.startswith("import time:")}


def journal(env: dict[str, str]) -> list[dict[str, object]]:
    p = run([*KREX, "journal", "-n", "100000", "--json"], env)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)  # type: ignore[no-any-return]


def test_lean_run_loads_neither_click_nor_discovery_with_a_daemon(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    env = krex_env
    assert run([*KREX, "daemon", "start", "--device", "sim"], env).returncode == 0
    rep = tmp_path / "r.json"
    argv = ["run", "--device", "sim", "--report", str(rep), "--", "sh", "-c", "echo hi; exit 3"]
    p = run([*LEAN_IMPORTTIME, *argv], env)
    assert p.returncode == 3 and p.stdout == "hi\n", p.stderr
    mods = imported(p.stderr)
    assert "krex.proc.launcher" in mods and "krex.proc.client" in mods  # the measurement sees the run path
    assert not {m for m in mods if m == "click" or m.startswith("click.")}, sorted(mods)
    assert not {"krex.gpus", "krex.cli.main", "krex.bench", "krex.journal"} & mods, sorted(mods)
    assert "SIMULATED GPU" in p.stderr  # notices as the click path prints them
    r = json.loads(rep.read_text())
    assert r["exit_status"] == 3 and r["simulated"] is True and r["regions"] == []
    # Errors: the same words and statuses as the click path.
    for argv, code, words in [
        (["run", "--device", "sim", "--", "no-such-cmd-krex"], 127, "command not found"),
        (["run", "--device", "sim", "--gpu", "7", "--", "true"], 125, "unknown GPU 7"),
        (["run", "--bogus-option", "--", "true"], 127, "command not found: --bogus-option"),
        (["run", "--device", "cuda", "--", "true"], 125, "Invalid value for '--device'"),
    ]:
        lean, full = run([*LEAN, *argv], env), run([*KREX, *argv], env)
        assert lean.returncode == full.returncode == code, (argv, lean.stderr, full.stderr)
        assert words in lean.stderr and lean.stderr == full.stderr, (lean.stderr, full.stderr)
    bad = tmp_path / "bad.json"
    p = run([*LEAN, "run", "--device", "sim", "--gpu", "7", "--report", str(bad), "--", "true"], env)
    assert p.returncode == 125 and json.loads(bad.read_text())["krex_error"]["kind"] == "NotFound"
    # -q: no notices.
    p = run([*LEAN, "-q", "run", "--device", "sim", "--", "true"], env)
    assert p.returncode == 0 and p.stderr == "", p.stderr


def test_no_nvml_discovery_when_the_daemon_answers(krex_env: dict[str, str], tmp_path: Path) -> None:
    """A fake node whose NVML binding logs every import (then is missing, so discovery goes
    on to a fake amdsmi with two GPUs). With krexd running, `krex run --device gpu|auto`
    takes the device from krexd's admission and never discovers GPUs itself."""
    fake = write_fake_amd_node(tmp_path / "fake")
    log = tmp_path / "nvml-imports.log"
    (fake / "pynvml.py").write_text(
        "import os\n"
        "with open(os.environ['FAKE_NVML_LOG'], 'a') as f:\n"
        "    f.write(f'{os.getpid()}\\n')\n"
        "raise ImportError('no NVIDIA bindings on this fake node')\n"
    )
    env = dict(krex_env, PYTHONPATH=str(fake), FAKE_NVML_LOG=str(log))
    env["KREX_GPU_DEVICE_NODES"] = str(fake / "kfd")
    for k in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        env.pop(k, None)
    # Control: with no daemon, the CLI discovers (and the daemon it starts does too).
    show = "echo HIP=$HIP_VISIBLE_DEVICES CUDA=$CUDA_VISIBLE_DEVICES"
    p = run([*LEAN, "run", "--device", "gpu", "--gpu", "1", "--", "sh", "-c", show], env)
    assert p.returncode == 0 and p.stdout.strip() == "HIP=1 CUDA=1", p.stderr
    assert log.exists() and len(log.read_text().split()) >= 2, "the fake NVML must see discovery"
    log.unlink()
    for argv in (["--device", "gpu", "--gpu", "1"], ["--device", "auto"], ["--gpu", "0"]):
        for front in (LEAN, KREX):
            p = run([*front, "run", *argv, "--", "sh", "-c", show], env)
            assert p.returncode == 0 and "HIP=" in p.stdout, p.stderr
            assert "SIMULATED" not in p.stderr
    assert not log.exists(), f"GPU discovery ran in `krex run` although krexd answered: {log.read_text()}"
    # hello says the device too, for clients that ask before admission.
    hello = run([sys.executable, "-c", "from krex.proc.client import hello; print(hello()['device'])"], env)
    assert hello.returncode == 0 and hello.stdout.strip() == "amd", hello.stderr
    # An unknown GPU is still refused, by krexd's admission.
    p = run([*LEAN, "run", "--device", "gpu", "--gpu", "2", "--", "true"], env)
    assert p.returncode == 125 and "unknown GPU 2" in p.stderr, p.stderr
    assert not log.exists()


def test_report_regions_come_from_the_release_reply_and_equal_the_journal(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    env = dict(krex_env)
    assert run([*KREX, "daemon", "start", "--device", "sim"], env).returncode == 0
    code = "import krex\nfor i in range(3):\n    with krex.region():\n        pass\n"
    # Older regions of another command (and of this slot number, before) stay out of the report.
    assert run([*LEAN, "run", "--device", "sim", "--", sys.executable, "-c", code], env).returncode == 0
    rep = tmp_path / "r.json"
    argv = ["run", "--device", "sim", "--report", str(rep), "--", sys.executable, "-c", code]
    p = run([*LEAN_IMPORTTIME, *argv], env)
    assert p.returncode == 0, p.stderr
    assert "krex.journal" not in imported(p.stderr)  # the guardian did not read the journal
    r = json.loads(rep.read_text())
    mine = journal(env)[3:]
    assert len(r["regions"]) == 3 and r["regions"] == mine, (r["regions"], mine)
    assert all(g["owner_slot"] == r["slot"] for g in mine)


def test_region_of_a_command_killed_inside_it_is_in_the_report(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    """The owner dies in its region: krexd ends and journals the region after the guardian's
    `release` has started; the reply waits for that record, so the report has it."""
    env = dict(krex_env)
    code = "import krex, os, signal\nwith krex.region():\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    rep = tmp_path / "r.json"
    p = run([*LEAN, "run", "--device", "sim", "--report", str(rep), "--", sys.executable, "-c", code], env)
    assert p.returncode == 137, p.stderr
    r = json.loads(rep.read_text())
    assert r["region_count"] == 1 and r["regions"] == journal(env), r
    assert r["regions"][0]["end"] != "end"


def test_more_regions_than_one_reply_holds_are_counted_and_the_rest_said(
    krex_env: dict[str, str], tmp_path: Path
) -> None:
    """More records than one reply carries: the report lists the first ones (those the journal
    has too, identical), counts every region and says how many it does not list; the guardian
    never reads the journal."""
    env = dict(krex_env, KREX_JOURNAL_MAX_BYTES=str(64 << 20))
    code = "import krex\nfor i in range(1001):\n    with krex.region():\n        pass\n"
    rep = tmp_path / "r.json"
    argv = ["run", "--device", "sim", "--report", str(rep), "--", sys.executable, "-c", code]
    p = run([*LEAN_IMPORTTIME, *argv], env, 300)
    assert p.returncode == 0, p.stderr
    assert "krex.journal" not in imported(p.stderr)
    r = json.loads(rep.read_text())
    n = len(r["regions"])
    assert r["region_count"] == 1001 and 0 < n < 1001, n
    assert r["regions_dropped"] == 1001 - n, (n, r["regions_dropped"])
    assert r["regions"] == journal(env)[:n]


# Modules `krex run` must not load (each would cost every command milliseconds at its start):
# the CLI and GPU discovery, psutil, krexd's argparse, shutil (which, rmtree), tempfile, glob;
# with the command cloned into its cgroup v2 slot also the Popen fallback (subprocess) and the
# freezer's preexec join.
NEVER = {"click", "psutil", "krex.cli.main", "krex.device.gpus", "argparse", "shutil", "tempfile", "glob"}
CLONED = {"subprocess", "krex.node.freezer"}

# Python's door with its connections and requests counted, as `krex run --device sim -- CMD`,
# up to the exec of the native guardian (shown instead of made).
COUNTED = r"""
import json, os, sys
from krex.proc import client, launcher
seen = {"connects": 0, "ops": []}
real_connect, real_send = client._connect, client.Client.send
def connect(p):
    seen["connects"] += 1
    return real_connect(p)
def send(self, msg):
    seen["ops"].append(msg["op"])
    return real_send(self, msg)
def execve(path, argv, env):
    print(json.dumps({**seen, "argv": argv, "prepared": env["KREX_GUARDIAN_PREPARED"].split("\n")}))
    sys.stdout.flush()
    os._exit(0)
client._connect, client.Client.send, os.execve = connect, send, execve
launcher.run_command(sys.argv[1:], "sim")
"""


def test_run_path_imports_and_messages(krex_env: dict[str, str]) -> None:
    env = krex_env
    assert run([*KREX, "daemon", "start", "--device", "sim"], env).returncode == 0
    p = run([*LEAN_IMPORTTIME, "-q", "run", "--device", "sim", "--", "true"], env)
    assert p.returncode == 0, p.stderr
    mods = imported(p.stderr)
    assert "krex.proc.launcher" in mods  # the measurement sees the run path
    assert not NEVER & mods, sorted(NEVER & mods)
    st = json.loads(run([*KREX, "daemon", "status", "--json"], env).stdout)
    kernel = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    if st["daemon"]["freezer"] == "cgroup2" and kernel >= (5, 7):
        assert not CLONED & mods, sorted(CLONED & mods)
    # Python's door: one connection (krexd answers), no request, then the native guardian for
    # the run (its own connection and requests: admit, started, release), told this Python,
    # its krex/_lib and the report's extra members.
    p = run([sys.executable, "-c", COUNTED, "sh", "-c", "exit 4"], env)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert (got["connects"], got["ops"]) == (1, []), got
    assert got["argv"][0].endswith("/_lib/krex"), got
    assert got["argv"][1:] == ["run", "--device", "sim", "--", "sh", "-c", "exit 4"], got
    assert got["prepared"][1:] == [os.path.dirname(got["argv"][0]), "{}"], got
    # and the run itself: the command's status, through the native guardian
    assert run([*LEAN, "-q", "run", "--device", "sim", "--", "sh", "-c", "exit 4"], env).returncode == 4
