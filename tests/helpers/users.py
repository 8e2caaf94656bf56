"""Real users and groups for the tests of a daemon shared on a node (created with
useradd/groupadd, so root only), and `krex` run as one of them from this checkout."""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import krex
from helpers import clean_env

# The checkout whose krex is under test (what other users' processes must import).
REPO = Path(krex.__file__).resolve().parents[1]


@dataclass
class User:
    name: str
    uid: int
    gid: int
    groups: list[int]


@dataclass
class Users:
    group: str
    gid: int
    member: User  # in the group as a supplementary group
    primary: User  # the group is its primary group
    outsider: User  # not in the group
    attacker: User  # not in the group either; plants things for the others


@contextlib.contextmanager
def created_users() -> Iterator[Users]:
    """Four users and a group, created with useradd/groupadd and removed after (with what
    their krex left in /tmp); skips when those tools are missing."""
    if not shutil.which("useradd") or not shutil.which("groupadd"):
        pytest.skip("useradd/groupadd are not installed")
    tag = f"{os.getpid() % 100000}"
    group = f"kxg{tag}"
    names = {k: f"kx{k[0]}{tag}" for k in ("member", "primary", "outsider", "attacker")}
    created: list[str] = []
    try:
        subprocess.run(["groupadd", group], check=True, capture_output=True)
        gid = grp.getgrnam(group).gr_gid
        base = ["useradd", "-M", "-N", "-d", "/nonexistent", "-s", "/usr/sbin/nologin"]
        subprocess.run([*base, "-G", group, names["member"]], check=True, capture_output=True)
        created.append(names["member"])
        subprocess.run([*base, "-g", group, names["primary"]], check=True, capture_output=True)
        created.append(names["primary"])
        for k in ("outsider", "attacker"):
            subprocess.run([*base, names[k]], check=True, capture_output=True)
            created.append(names[k])

        def user(n: str) -> User:
            pw = pwd.getpwnam(n)
            return User(n, pw.pw_uid, pw.pw_gid, os.getgrouplist(n, pw.pw_gid))

        yield Users(group, gid, *(user(names[k]) for k in ("member", "primary", "outsider", "attacker")))
    finally:
        for n in created:
            with contextlib.suppress(KeyError):  # what their krex left: state and freezer dirs
                shutil.rmtree(f"/tmp/krex-{pwd.getpwnam(n).pw_uid}", ignore_errors=True)
            subprocess.run(["userdel", n], capture_output=True)
        subprocess.run(["groupdel", group], capture_output=True)


def as_user(
    u: User, args: list[str], env: dict[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run `args` as `u`, with exactly the groups the user database gives it."""
    return subprocess.run(
        args,
        env=env,
        user=u.uid,
        group=u.gid,
        extra_groups=u.groups,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        cwd="/",
    )


def _others_may_run(path: str) -> bool:
    p = Path(os.path.realpath(path))
    if not p.is_file() or not p.stat().st_mode & stat.S_IXOTH:
        return False
    return all(d.stat().st_mode & stat.S_IXOTH for d in p.parents)


def _user_python() -> tuple[str, str]:
    """An interpreter of this Python version that other users may run (the venv's may
    live under root's 0700 home), and the site directory that holds KREX's dependencies."""
    site_dir = sysconfig.get_paths()["purelib"]
    ver = f"{sys.version_info[0]}.{sys.version_info[1]}"
    for c in (
        sys.executable,
        f"/usr/bin/python{ver}",
        f"/usr/local/bin/python{ver}",
        shutil.which(f"python{ver}"),
    ):
        if c and _others_may_run(c):
            return c, site_dir
    pytest.skip(f"no Python {ver} interpreter that other users may run (the test runs KREX as them)")


def user_python() -> str:
    return _user_python()[0]


def krex_argv(*args: str) -> list[str]:
    """`krex ARGS` as another user: the user's interpreter, KREX and its dependencies
    on PYTHONPATH (user_env), and krex.cli mapped to the checkout's cli/ as the
    installed package maps it."""
    boot = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('krex.cli', {str(REPO / 'cli' / '__init__.py')!r}, "
        f"submodule_search_locations=[{str(REPO / 'cli')!r}])\n"
        "mod = importlib.util.module_from_spec(spec); sys.modules['krex.cli'] = mod\n"
        "spec.loader.exec_module(mod)\n"
        "from krex.cli.main import main\n"
        "sys.exit(main())\n"
    )
    return [user_python(), "-c", boot, *args]


def user_env(**extra: str) -> dict[str, str]:
    e = clean_env()
    for k in ("XDG_RUNTIME_DIR", "HOME", "PYTHONPATH"):
        e.pop(k, None)
    # Commands and daemons started from there import krex (and cffi) through PYTHONPATH.
    e.update(
        HOME="/tmp",
        PYTHONUNBUFFERED="1",
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONPATH=f"{REPO}{os.pathsep}{_user_python()[1]}",
    )
    e.update(extra)
    return e


def world_dir() -> Path:
    """A temporary directory every test user may enter (pytest's tmp_path is 0700)."""
    d = Path(tempfile.mkdtemp(prefix="kxsec-"))
    d.chmod(0o755)
    return d
