"""Clients talk only to a daemon run by themselves or by root, and a guardian gives its
command only its own installation's code, whatever a daemon answers.

A fake krexd (tests/helpers/fake_daemon.py) answers every admission with a library of
its own in LD_PRELOAD, its own PYTHONPATH, LD_LIBRARY_PATH and LD_AUDIT, a
KREX_DAEMON_CMD and BASH_ENV. Run as another user B, with the victim's KREX_STATE_DIR
naming B's directory, it ran its library inside the victim's commands, as the victim,
through both guardians; the shim registered with it and `krex status` believed it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import clean_env, wait_until
from helpers.krex_world import KREX
from helpers.users import REPO, User, Users, krex_argv, user_env, user_python, world_dir

from krex.native import LIB_DIR, shim_path
from krex.node.optin import hook_dir

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates users and runs as them")


FAKE = REPO / "tests" / "helpers" / "fake_daemon.py"
EVIL_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
__attribute__((constructor)) static void pwn(void) {
    char p[512];
    snprintf(p, sizeof p, "%s/pwned-%d-%d", OUT, (int)getuid(), (int)getpid());
    int fd = open(p, O_WRONLY | O_CREAT, 0666);
    if (fd >= 0) close(fd);
}
"""


@dataclass
class Fake:
    root: Path  # world-readable base
    state: Path  # the fake daemon's directory (KREX_STATE_DIR for the victim)
    out: Path  # markers and the fake's log, writable by everyone
    proc: subprocess.Popen[bytes]

    @property
    def sock(self) -> Path:
        return self.state / "krexd.sock"

    def frames(self) -> list[dict[str, object]]:
        p = self.out / "fake.log"
        lines = p.read_text().splitlines() if p.exists() else []
        return [json.loads(x) for x in lines]

    def frames_from(self, uid: int) -> list[str]:
        return [str(f["op"]) for f in self.frames() if f["uid"] == uid and f["op"] != "listening"]

    def pwned(self) -> list[str]:
        return sorted(p.name for p in self.out.glob("pwned-*"))


def _start_fake(owner: User | None) -> Fake:
    """The fake daemon, its library and its Python directory, all owned by `owner` (None: us)."""
    root = world_dir()
    state, out = root / "state", root / "out"
    state.mkdir(mode=0o755)
    out.mkdir()
    out.chmod(0o777)
    evil_py = state / "evilpy"
    evil_py.mkdir()
    (evil_py / "sitecustomize.py").write_text(
        f"import os\nopen(f'{out}/pwned-py-{{os.getuid()}}-{{os.getpid()}}', 'w').close()\n"
    )
    src = state / "evil.c"
    src.write_text(EVIL_C)
    cc = os.environ.get("CC", "gcc")
    subprocess.run(
        [cc, "-shared", "-fPIC", f'-DOUT="{out}"', "-o", str(state / "evil.so"), str(src)], check=True
    )
    grp = state / "grp"
    grp.mkdir()
    (grp / "cgroup.procs").write_text("")
    (grp / "cgroup.procs").chmod(0o666)
    for p in [state, *state.rglob("*")]:
        if owner is not None:
            os.chown(p, owner.uid, owner.gid)
        if p.is_dir():
            p.chmod(0o755)
    (grp / "cgroup.procs").chmod(0o666)
    args = [str(state / "krexd.sock"), str(out / "fake.log"), str(state / "evil.so"), str(evil_py), str(grp)]
    if owner is None:
        env = clean_env()
        env["PYTHONPATH"] = str(REPO)
        proc = subprocess.Popen([sys.executable, str(FAKE), *args], env=env, stdin=subprocess.DEVNULL)
    else:
        proc = subprocess.Popen(
            [user_python(), str(FAKE), *args],
            env=user_env(),
            user=owner.uid,
            group=owner.gid,
            extra_groups=owner.groups,
            stdin=subprocess.DEVNULL,
            cwd="/",
        )
    fake = Fake(root, state, out, proc)
    wait_until(lambda: fake.sock.exists() or proc.poll() is not None, 20, "the fake daemon")
    assert proc.poll() is None, "the fake daemon did not start"
    return fake


@pytest.fixture
def fake_b(users: Users) -> Iterator[Fake]:
    f = _start_fake(users.attacker)
    try:
        yield f
    finally:
        f.proc.kill()
        f.proc.wait()
        subprocess.run(["rm", "-rf", str(f.root)], check=False)


@pytest.fixture
def fake_ours() -> Iterator[Fake]:
    f = _start_fake(None)
    try:
        yield f
    finally:
        f.proc.kill()
        f.proc.wait()
        subprocess.run(["rm", "-rf", str(f.root)], check=False)


def _boot_dir() -> Path:
    """A PYTHONPATH entry that maps krex.cli to the checkout's cli/ (as the installed
    package does) for the Python the native guardian hands over to, run as another user."""
    d = Path(tempfile.mkdtemp(prefix="kxboot-"))
    d.chmod(0o755)
    (d / "sitecustomize.py").write_text(
        textwrap.dedent(
            f"""
            import importlib.util, sys
            spec = importlib.util.spec_from_file_location(
                'krex.cli', {str(REPO / 'cli' / '__init__.py')!r},
                submodule_search_locations=[{str(REPO / 'cli')!r}])
            mod = importlib.util.module_from_spec(spec)
            sys.modules['krex.cli'] = mod
            spec.loader.exec_module(mod)
            """
        )
    )
    return d


def _as(u: User, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        env=env,
        user=u.uid,
        group=u.gid,
        extra_groups=u.groups,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        cwd="/",
    )


CMD = ["--", "/bin/sh", "-c", "echo ran"]


@pytest.mark.parametrize("guardian", ["native", "python"])
def test_krex_run_refuses_another_users_daemon(users: Users, fake_b: Fake, guardian: str) -> None:
    victim = users.outsider
    boot = _boot_dir()
    env = user_env(KREX_STATE_DIR=str(fake_b.state), KREX_PYTHON=user_python())
    env["PYTHONPATH"] = f"{boot}{os.pathsep}{env['PYTHONPATH']}"
    argv = krex_argv("run", "--device", "sim", *CMD)
    if guardian == "native":
        argv = [KREX[0], "run", "--device", "sim", *CMD]
    if guardian == "native" and not Path(KREX[0]).is_file():
        pytest.skip("no native krex built")
    p = _as(victim, argv, env)
    # Before: rc 0, "ran", and the fake's library wrote pwned-<victim uid>-<pid>.
    assert not fake_b.pwned(), f"another user's library ran in the command: {fake_b.pwned()}"
    assert p.returncode == 125, (p.returncode, p.stdout, p.stderr)
    assert "ran" not in p.stdout
    assert f"runs as uid {users.attacker.uid}" in p.stderr and "refusing to talk to it" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    assert not fake_b.frames_from(victim.uid), fake_b.frames()


def test_daemon_status_refuses_another_users_daemon(users: Users, fake_b: Fake) -> None:
    victim = users.outsider
    p = _as(victim, krex_argv("daemon", "status"), user_env(KREX_STATE_DIR=str(fake_b.state)))
    # Before: the fake's frames got answers ("status" from the victim's uid in its log).
    assert p.returncode == 4, (p.returncode, p.stdout, p.stderr)
    assert "refusing to talk to it" in p.stderr, p.stderr
    assert not fake_b.frames_from(victim.uid), fake_b.frames()


def test_the_shim_never_registers_with_another_users_daemon(users: Users, fake_b: Fake) -> None:
    victim = users.outsider
    env = user_env(
        LD_PRELOAD=str(shim_path()),
        LD_LIBRARY_PATH=str(LIB_DIR),
        KREX_SHM=f"/krex-kxid-{os.getpid()}-none",
        KREX_SOCKET=str(fake_b.sock),
        KREX_SIM_SHM=f"/krex-kxid-{os.getpid()}-sim",
        KREX_SIM_TRACE=str(fake_b.out / "trace.jsonl"),
        KREX_LOG="1",
    )
    code = "import ctypes; ctypes.CDLL('libcudart.so.13').cudaFree(None); print('done')"
    try:
        p = _as(victim, [user_python(), "-c", code], env)
    finally:  # the simulated GPU's segment the victim's process made
        Path("/dev/shm" + env["KREX_SIM_SHM"]).unlink(missing_ok=True)
    assert p.returncode == 0 and "done" in p.stdout, (p.stdout, p.stderr)
    # Before: ['register'] (the shim asked the fake for a slot).
    assert not fake_b.frames_from(victim.uid), fake_b.frames()
    assert "refusing the daemon" in p.stderr, p.stderr[-2000:]


@pytest.mark.parametrize("guardian", ["native", "python"])
def test_a_guardian_gives_its_command_only_its_own_installations_code(fake_ours: Fake, guardian: str) -> None:
    """A daemon the caller trusts (its own uid) that answers with paths of its own choosing:
    the command still loads this installation's shim, hook and simulated GPU, and nothing
    else the daemon named."""
    dump = fake_ours.out / f"env-{guardian}.txt"
    env = clean_env()
    env.update(KREX_STATE_DIR=str(fake_ours.state))
    door = [*KREX] if guardian == "native" else [sys.executable, "-m", "krex.cli.main"]  # Python's door
    subprocess.run(
        [*door, "run", "--device", "sim", "--", "/bin/sh", "-c", f"env > {dump}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert dump.exists(), "the command did not run"
    got = dict(line.split("=", 1) for line in dump.read_text().splitlines() if "=" in line)
    # Before: LD_PRELOAD began with the fake's evil.so, and pwned-0-<pid> was written.
    assert not fake_ours.pwned(), fake_ours.pwned()
    assert got["LD_PRELOAD"].split(":")[0] == str(shim_path()), got["LD_PRELOAD"]
    assert "evil" not in got["LD_PRELOAD"]
    assert got["PYTHONPATH"].split(":")[0] == str(hook_dir()), got["PYTHONPATH"]
    assert "evil" not in got.get("PYTHONPATH", "") + got.get("LD_LIBRARY_PATH", "")
    assert got["LD_LIBRARY_PATH"].split(":")[0] == str(LIB_DIR), got["LD_LIBRARY_PATH"]
    for k in ("LD_AUDIT", "BASH_ENV", "KREX_PYTHON", "KREX_DAEMON_CMD"):
        assert k not in got, (k, got.get(k))
    assert got["KREX_SLOT"] == "0" and got["KREX_SLOT_GEN"] == "1"  # its data is taken
