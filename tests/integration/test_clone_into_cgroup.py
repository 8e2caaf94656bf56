"""krex run forks its command straight into the slot's cgroup v2 (clone3 CLONE_INTO_CGROUP):
the child is in the group from its first instruction, exec errors come back as KREX's
errors, and nothing is started when the guardian has another thread (the child could then
wait forever for the GIL), so the caller falls back to joining in preexec."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from krex.errors import CommandNotFound, NotExecutable
from krex.proc.spawn import Launch, _clone_into_cgroup, spawn_and_wait


def _cgroup2_mount() -> Path | None:
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if parts[2] == "cgroup2":
                return Path(parts[1])
    return None


@pytest.fixture
def group() -> Iterator[Path]:
    mount = _cgroup2_mount()
    if mount is None or os.geteuid() != 0:
        pytest.skip("needs root and a cgroup v2 mount")
    g = mount / f"krex-clone-test-{os.getpid()}"
    try:
        g.mkdir()
    except OSError as e:
        pytest.skip(f"cannot create a cgroup here: {e}")
    try:
        yield g
    finally:
        for _ in range(100):
            try:
                g.rmdir()
                break
            except OSError:
                threading.Event().wait(0.05)


def test_child_is_born_in_the_group_and_in_its_own_process_group(group: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    script = f"cat /proc/self/cgroup > {out}; ps -o pgid= -p $$ >> {out}; echo $$ >> {out}; exit 7"
    started: list[int] = []
    rc = spawn_and_wait(
        Launch(["/bin/sh", "-c", script], dict(os.environ), 0, 0, [], cgroup=str(group)),
        on_start=started.append,
    )
    assert rc == 7
    lines = out.read_text().split("\n")
    rel = "/" + str(group.relative_to(_cgroup2_mount() or "/"))
    assert f"0::{rel}" in lines, lines
    assert lines[-3].strip() == lines[-2].strip() == str(started[0])  # pgid == pid
    # That was the clone path (not the preexec fallback): it starts the child itself.
    born: list[int] = []
    pid = _clone_into_cgroup(Launch(["/bin/true"], dict(os.environ), 0, 0, cgroup=str(group)), born)
    assert pid is not None and born == [pid]
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def test_exec_errors_are_krex_errors(group: Path, tmp_path: Path) -> None:
    junk = tmp_path / "junk"
    junk.write_text("not a program\0\n")
    junk.chmod(0o755)
    with pytest.raises(NotExecutable, match="cannot execute"):
        _clone_into_cgroup(Launch([str(junk)], dict(os.environ), 0, 0, cgroup=str(group)), [])
    with pytest.raises(CommandNotFound):
        missing = Launch([str(tmp_path / "missing")], dict(os.environ), 0, 0, cgroup=str(group))
        _clone_into_cgroup(missing, [])


def test_another_thread_means_no_clone(group: Path) -> None:
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        born: list[int] = []
        true = Launch(["/bin/true"], dict(os.environ), 0, 0, cgroup=str(group))
        assert _clone_into_cgroup(true, born) is None
        assert born == []
        # spawn_and_wait then joins in preexec: the command still runs in the group.
        check = ["/bin/sh", "-c", f"grep -q '^0::.*{group.name}$' /proc/self/cgroup"]
        rc = spawn_and_wait(Launch(check, dict(os.environ), 0, 0, cgroup=str(group)))
        assert rc == 0
    finally:
        stop.set()
        t.join()
