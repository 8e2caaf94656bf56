"""A `krex/` folder in the current directory (a clone of KREX, a user's project) never
shadows the installed package: every Python that KREX starts (the native entry's hand-over
to the Python CLI, krexd started on demand, its watchdog, Python's door to `krex run`, the guardians
of `krex batch`, the daemon a self-registering shim starts) keeps the current directory off
sys.path. Each test runs from a directory that holds a dummy `krex/` package."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.krex_world import KREX, Krex

from krex import pystart
from krex.proc.client import daemon_alive


@pytest.fixture
def shadow(tmp_path: Path) -> Path:
    d = tmp_path / "project"
    (d / "krex").mkdir(parents=True)
    (d / "krex" / "__init__.py").write_text("")
    return d


def _run(
    kx: Krex, cwd: Path, *argv: str, timeout: float = 90, **extra: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KREX, *argv], cwd=cwd, env=kx.env(**extra), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _ok(p: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert p.returncode == 0, f"exit {p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}"
    assert "No module named" not in p.stderr and "cannot import name" not in p.stderr, p.stderr
    return p


def _daemon_pids(kx: Krex) -> tuple[int, list[int]]:
    """krexd's pid and its watchdog's (a process whose argv names krex.node.watchdog and our segment)."""
    from krex.proc.client import hello

    pid = int(hello(kx.sock)["pid"])
    dogs = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                argv = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"krex.node.watchdog" in argv and kx.shm.encode() in argv:
                dogs.append(int(d.name))
    return pid, dogs


def test_cli_and_on_demand_daemon_from_a_directory_with_a_krex_folder(
    kx: Krex, shadow: Path, bins: dict[str, Path]
) -> None:
    assert re.match(r"krex, version \d", _ok(_run(kx, shadow, "--version")).stdout)
    # No daemon: the native entry hands over to the Python CLI, which starts krexd (which
    # starts its watchdog) from this directory.
    p = _ok(_run(kx, shadow, "run", "--device", "sim", "--", str(bins["quickregion"])))
    assert json.loads(p.stdout.splitlines()[-1])["begin"] == 0, p.stdout  # a region, journaled
    assert daemon_alive(kx.sock)
    pid, dogs = _daemon_pids(kx)
    assert dogs, "krexd started from the shadowing directory has no watchdog"
    # Through Python's door (-v: the native one hands the line to it), and the native one.
    for lead in (["-v"], []):
        assert _ok(_run(kx, shadow, *lead, "run", "--device", "sim", "--", "true")).returncode == 0
    _ok(_run(kx, shadow, "status"))
    _ok(_run(kx, shadow, "journal", "-n", "1"))
    _ok(_run(kx, shadow, "daemon", "stop"))
    assert not daemon_alive(kx.sock)


def test_batch_guardians_from_a_directory_with_a_krex_folder(kx: Krex, shadow: Path) -> None:
    cmds = shadow / "cmds.txt"
    cmds.write_text("true\necho two\n")
    for extra in ({},):  # the native guardian (krex.runner.guardian_argv)
        out = shadow / f"out{len(extra)}"
        _ok(_run(kx, shadow, "batch", "-j", "2", "--device", "sim", "--out", str(out), str(cmds), **extra))
        assert json.loads((out / "summary.json").read_text())["succeeded"] == 2


def test_a_self_registering_process_starts_krexd_from_a_directory_with_a_krex_folder(
    kx: Krex, shadow: Path, bins: dict[str, Path]
) -> None:
    """`eval "$(krex env --export)"`: the shim starts krexd through KREX_DAEMON_CMD."""
    env = _ok(_run(kx, shadow, "env", "--device", "sim", "--export")).stdout
    script = f"{env}\n{bins['quickregion']}\n"
    p = subprocess.run(["bash", "-c", script], cwd=shadow, env=kx.env(), capture_output=True, text=True,
                       timeout=90, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr
    log = kx.state / "krexd.log"
    assert daemon_alive(kx.sock), f"no krexd from the shim: {log.read_text()[-2000:] if log.exists() else ''}"
    assert json.loads(p.stdout.splitlines()[-1])["begin"] == 0, (p.stdout, p.stderr)  # its region was granted


def test_boot_runs_a_module_as_dash_m_without_the_current_directory(shadow: Path) -> None:
    """The bootstrap used where -P is unavailable (Python 3.10, or an interpreter of unknown
    version, and always by interpose/guardian.c): sys.argv as under -m, cwd off the path."""
    (shadow / "probe_mod.py").write_text("")  # would be importable if the cwd were on the path
    code = "import sys, json; print(json.dumps([sys.argv, __name__, sys.path[0]]))"
    mod = shadow / "elsewhere" / "showargs.py"
    mod.parent.mkdir()
    mod.write_text(code + "\nimport importlib.util as u; assert u.find_spec('probe_mod') is None\n")
    env = dict(os.environ, PYTHONPATH=str(mod.parent))
    p = subprocess.run([sys.executable, "-c", pystart.BOOT, "showargs", "a", "-b"], cwd=shadow, env=env,
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    argv, name, first = json.loads(p.stdout)
    assert argv == [str(mod), "a", "-b"] and name == "__main__" and first == str(mod.parent)


def test_guardian_c_uses_the_same_boot_text() -> None:
    src = (Path(__file__).resolve().parents[2] / "interpose" / "guardian.c").read_text()
    m = re.search(r"#define PY_BOOT((?:.*\\\n)*.*)", src)
    assert m, "interpose/guardian.c defines no PY_BOOT"
    text = "".join(json.loads(f'"{s}"') for s in re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(1)))
    assert text == pystart.BOOT, "interpose/guardian.c's PY_BOOT differs from krex.pystart.BOOT"


def test_module_argv_never_uses_plain_dash_m() -> None:
    for python in (sys.executable, "/opt/other/python3"):
        argv = pystart.module_argv("krex.node.daemon", python)
        assert argv[0] == python
        assert argv[1:3] == ["-P", "-m"] or argv[1:3] == ["-c", pystart.BOOT]
