"""Freezer backends against real process trees and real cgroups (region protocol step 5, I3/I4).

Every backend available on this machine runs the same tests. A cgroup backend is skipped only
when detect(prefer=...) says NotFound; as root the cgroup tests must run. Nothing here asserts
speed: only whether progress counters move.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from krex.errors import KrexError, NotFound, Timeout, UsageError
from krex.node import freezer, mounts, procfs

BURNER = Path(__file__).resolve().parent.parent / "helpers" / "burner.py"
LEVELS = 2  # a child and its grandchild
FROZEN_WINDOW = 0.3
PR_SET_CHILD_SUBREAPER = 36

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="cgroup freezing needs root")


class Tree:
    """A burner child plus grandchild, each publishing (pid, counter) in a shared file."""

    def __init__(self, out: Path, preexec: Callable[[], None] | None = None) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        self.proc = subprocess.Popen(
            [sys.executable, str(BURNER), str(out), "0", str(LEVELS)],
            stdin=subprocess.DEVNULL,
            preexec_fn=preexec,
        )
        self.seen: set[int] = {self.proc.pid}

    def _read(self) -> list[tuple[int, int]]:
        rows = []
        for level in range(LEVELS):
            try:
                data = (self.out / f"level{level}").read_bytes()
            except FileNotFoundError:
                continue
            if len(data) == 16:
                rows.append(struct.unpack("qq", data))
        self.seen.update(pid for pid, _ in rows)
        return rows

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = self._read()
            if len(rows) == LEVELS and all(counter > 0 for _, counter in rows):
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"burner exited early with {self.proc.returncode}")
            time.sleep(0.01)
        raise AssertionError("burner tree did not start")

    @property
    def root(self) -> int:
        return self.proc.pid

    def pids(self) -> list[int]:
        return [pid for pid, _ in self._read()]

    def counters(self) -> list[int]:
        return [counter for _, counter in self._read()]

    def assert_advances(self, within: float = 10.0) -> None:
        before = self.counters()
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            time.sleep(0.02)
            now = self.counters()
            if all(b > a for a, b in zip(before, now, strict=True)):
                return
        raise AssertionError(f"counters did not advance: {before} -> {self.counters()}")

    def assert_stalled(self) -> None:
        before = self.counters()
        time.sleep(FROZEN_WINDOW)
        after = self.counters()
        assert after == before, f"a frozen process made progress: {before} -> {after}"

    def alive(self) -> list[int]:
        alive = []
        for pid in self.pids():
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state not in "ZX":
                alive.append(pid)
        return alive

    def kill(self) -> None:
        self._read()
        # Grandchild first, so nothing is orphaned while still running.
        for pid in sorted(self.seen - {self.proc.pid}) + [self.proc.pid]:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        # We are the subreaper during a test: reap the orphaned grandchildren too.
        for pid in self.seen - {self.proc.pid}:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, 0)


def _set_subreaper(on: bool) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)


class Env:
    def __init__(self, backend: str, fz: freezer.Freezer, root_name: str, tmp: Path) -> None:
        self.backend = backend
        self.freezer = fz
        self.root_name = root_name
        self.tmp = tmp
        self.groups: list[freezer.Group] = []
        self.trees: list[Tree] = []

    def group(self, suffix: str) -> freezer.Group:
        g = self.freezer.group(f"t{os.getpid()}-{suffix}")
        self.groups.append(g)
        return g

    def tree(self, preexec: Callable[[], None] | None = None) -> Tree:
        t = Tree(self.tmp / f"tree{len(self.trees)}", preexec)
        self.trees.append(t)
        t.wait_ready()
        return t

    def cleanup(self) -> None:
        # Thaw before killing: a v1-frozen process cannot even die until it is thawed.
        for g in self.groups:
            with contextlib.suppress(KrexError, OSError):
                g.thaw()
        for t in self.trees:
            t.kill()
        for g in self.groups:
            with contextlib.suppress(KrexError, OSError):
                g.remove()
        # Whatever a test's second "daemon" left behind goes through recover().
        with contextlib.suppress(KrexError, OSError):
            fz = freezer.detect(prefer=self.backend, root_name=self.root_name)
            fz.recover()
            fz.remove_root()


@contextlib.contextmanager
def _env(backend: str, tmp_path: Path) -> Iterator[Env]:
    root_name = f"krex-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        fz = freezer.detect(prefer=backend, root_name=root_name)
    except NotFound as exc:
        pytest.skip(f"{backend} freezer not available here: {exc}")
    assert fz.name == backend
    e = Env(backend, fz, root_name, tmp_path)
    _set_subreaper(True)
    try:
        yield e
    finally:
        try:
            e.cleanup()
        finally:
            _set_subreaper(False)


@pytest.fixture(
    params=[
        pytest.param("cgroup2", marks=needs_root),
        pytest.param("cgroup1", marks=needs_root),
        "signal",
    ]
)
def env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Env]:
    with _env(request.param, tmp_path) as e:
        yield e


@pytest.fixture
def signal_env(tmp_path: Path) -> Iterator[Env]:
    with _env("signal", tmp_path) as e:
        yield e


@pytest.fixture
def cgroup2_env(tmp_path: Path) -> Iterator[Env]:
    if os.geteuid() != 0:
        pytest.skip("cgroup freezing needs root")
    with _env("cgroup2", tmp_path) as e:
        yield e


def _proc_states(pids: list[int]) -> list[str]:
    return [Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] for p in pids]


# ---------------------------------------------------------------------------------------------
# freezing real process trees


def test_freeze_and_thaw_whole_tree(env: Env) -> None:
    tree = env.tree()
    g = env.group("freeze")
    assert g.backend == env.backend
    g.add(tree.root)
    # add() takes the descendants the process already has, on every backend.
    assert set(tree.pids()) <= set(g.pids())
    tree.assert_advances()
    assert not g.is_frozen()

    took = g.freeze()
    assert took >= 0
    assert g.is_frozen()
    tree.assert_stalled()
    if env.backend == "signal":
        assert set(_proc_states(tree.pids())) == {"T"}

    took = g.thaw()
    assert took >= 0
    assert not g.is_frozen()
    tree.assert_advances()

    # A second cycle works the same way (the daemon freezes a slot once per foreign region).
    g.freeze()
    tree.assert_stalled()
    g.thaw()
    tree.assert_advances()


def _cgroup_tree(env: Env, name: str) -> tuple[Any, freezer.Group]:
    """A running process tree in a new group; cgroup backends only (the freeze snapshots read
    the freezer's wait channel)."""
    if env.backend == "signal":
        pytest.skip("cgroup backends only: the snapshot reads the freezer's wait channel")
    tree = env.tree()
    g = env.group(name)
    g.add(tree.root)
    return tree, g


def test_unfrozen_threads_lists_running_threads_and_no_frozen_one(env: Env) -> None:
    """What a slow freeze's record names: threads not yet stopped in the freezer's trap."""
    tree, g = _cgroup_tree(env, "snap")
    tree.assert_advances()
    running = procfs.unfrozen_threads(tree.pids(), limit=100)
    assert running and all(int(x.split("/", 1)[0]) in tree.pids() for x in running), running
    g.freeze()
    assert procfs.unfrozen_threads(tree.pids(), limit=100) == []
    g.thaw()


def test_a_slow_freeze_records_what_it_waited_for(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past _SLOW_FREEZE_S, the group keeps a snapshot of the threads not stopped yet; a
    quick freeze keeps none. The kernel's answer is held back 50 ms to make this one slow."""
    tree, g = _cgroup_tree(env, "slow")
    g.freeze()
    assert g.slow == []  # quick: nothing recorded
    g.thaw()
    tree.assert_advances()
    real_keyed, real_state = procfs.keyed, getattr(g, "_state", None)
    t_hold = time.monotonic() + 0.05
    # Both backends' "is it frozen yet" reads: cgroup.events (v2), freezer.state (v1).
    monkeypatch.setattr(
        procfs, "keyed", lambda text, key: "0" if time.monotonic() < t_hold else real_keyed(text, key)
    )
    if real_state is not None:
        monkeypatch.setattr(g, "_state", lambda: "FREEZING" if time.monotonic() < t_hold else real_state())
    t_hold = time.monotonic() + 0.05
    took = g.freeze()
    assert took >= 0.05
    assert g.slow and all(isinstance(x, str) for x in g.slow), g.slow
    g.thaw()


def test_recover_after_daemon_crash(env: Env) -> None:
    tree = env.tree()
    g = env.group("crash")
    g.add(tree.root)
    g.freeze()
    tree.assert_stalled()

    # The "daemon" dies without thawing; a new one starts from scratch on the same root.
    successor = freezer.detect(prefer=env.backend, root_name=env.root_name)
    assert g.name in successor.leftovers()
    assert successor.recover() == 1
    tree.assert_advances()
    assert not g.is_frozen()
    # A group that still has processes is thawed but kept; nothing was killed.
    assert sorted(tree.alive()) == sorted(tree.pids())
    assert g.name in successor.leftovers()
    assert set(tree.pids()) <= set(g.pids())


def test_preexec_join_places_child_before_exec(env: Env) -> None:
    g = env.group("preexec")
    join = freezer.preexec_join(g.path)
    tree = env.tree(preexec=join)
    if env.backend == "signal":
        # No cgroup to join: the helper is a no-op, and the launcher registers the pid instead.
        join()  # must not touch this (pytest's) process
        assert g.pids() == []
        g.add(tree.root)
    else:
        relative = os.path.relpath(g.path, g.path.rsplit(f"/{env.root_name}/", 1)[0])
        cgroup_lines = Path(f"/proc/{tree.root}/cgroup").read_text().splitlines()
        assert any(line.endswith("/" + relative) for line in cgroup_lines), cgroup_lines
        # Nobody called add(): the grandchild is in the group because its parent was from the start.
    assert set(tree.pids()) <= set(g.pids())
    g.freeze()
    tree.assert_stalled()
    g.thaw()
    tree.assert_advances()


def test_remove_never_kills(env: Env) -> None:
    tree = env.tree()
    g = env.group("remove")
    g.add(tree.root)
    g.freeze()
    tree.assert_stalled()

    g.remove()
    assert sorted(tree.alive()) == sorted(tree.pids())
    tree.assert_advances()
    if env.backend != "signal":
        # A populated cgroup is left in place, thawed, for a later recover().
        assert os.path.isdir(g.path)
        assert set(tree.pids()) <= set(g.pids())

    tree.kill()
    _remove_once_empty(g)


def _remove_once_empty(g: freezer.Group) -> None:
    """Wait (10 s at most) for the group's killed processes to leave it, then remove it."""
    deadline = time.monotonic() + 10
    while g.pids() and time.monotonic() < deadline:
        time.sleep(0.02)
    g.remove()
    assert not os.path.exists(g.path)


def test_remove_empty_group(env: Env) -> None:
    g = env.group("empty")
    assert os.path.exists(g.path)
    assert g.pids() == []
    g.freeze()  # an empty group freezes at once
    g.remove()
    assert not os.path.exists(g.path)
    assert g.name not in env.freezer.leftovers()


def test_nested_groups_are_listed_and_removed_children_first(env: Env) -> None:
    """pids() and remove() cover groups below a slot's group (a command may make its own),
    never anything beside it; remove() still keeps a populated one."""
    if env.backend == "signal":
        pytest.skip("cgroup backends only: the signal backend has no directories")
    g = env.group("nested")
    beside = env.group("beside")
    inner = os.path.join(g.path, "a", "b")
    os.makedirs(inner)
    os.makedirs(os.path.join(g.path, "c"))
    tree = env.tree()
    beside.add(tree.root)
    p = subprocess.Popen(["sleep", "30"])
    try:
        procfs.write(os.path.join(inner, "cgroup.procs"), str(p.pid))
        assert g.pids() == [p.pid]
        g.remove()  # populated below: kept, never killed
        assert os.path.isdir(inner) and p.poll() is None
    finally:
        p.kill()
        p.wait()
    _remove_once_empty(g)
    assert os.path.isdir(beside.path) and set(tree.pids()) <= set(beside.pids())


def test_group_is_reused_and_own_groups_are_not_leftovers(env: Env) -> None:
    g = env.group("reuse")
    again = env.freezer.group(g.name)
    assert again.path == g.path
    assert env.freezer.leftovers() == []
    assert env.backend in env.freezer.describe()


def test_refuses_to_freeze_itself(env: Env) -> None:
    g = env.group("self")
    with pytest.raises(UsageError):
        g.add(os.getpid())
    with pytest.raises(UsageError):
        g.add(os.getppid())


def test_add_missing_process(env: Env) -> None:
    p = subprocess.Popen(["true"])
    p.wait()
    g = env.group("missing")
    with pytest.raises(NotFound):
        g.add(p.pid)


def test_signal_freeze_timeout_lists_stragglers(signal_env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    # A cgroup straggler needs a process stuck in the kernel; only the signal backend can fake one.
    env = signal_env
    tree = env.tree()
    g = env.group("timeout")
    g.add(tree.root)
    # Pretend the kernel never reports the tree stopped.
    monkeypatch.setattr(procfs, "stopped", lambda pid: False)
    with pytest.raises(Timeout) as info:
        g.freeze(timeout=0.2)
    assert sorted(info.value.stragglers) == sorted(tree.pids())
    assert info.value.fix
    monkeypatch.undo()
    g.thaw()
    tree.assert_advances()


def test_signal_backend_without_proc_children(signal_env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    # Kernels without CONFIG_PROC_CHILDREN: the tree comes from a full /proc scan instead.
    monkeypatch.setattr(procfs, "children", lambda pid: None)
    tree = signal_env.tree()
    g = signal_env.group("scan")
    g.add(tree.root)
    assert set(tree.pids()) <= set(g.pids())
    g.freeze()
    tree.assert_stalled()
    g.thaw()
    tree.assert_advances()


def test_cgroup2_parent_holds_no_processes(cgroup2_env: Env) -> None:
    env = cgroup2_env
    tree = env.tree()
    g = env.group("internal")
    g.add(tree.root)
    assert Path(env.freezer.root, "cgroup.procs").read_text().split() == []
    assert os.path.dirname(g.path) == env.freezer.root


# ---------------------------------------------------------------------------------------------
# detection


PURE_V2 = """\
25 30 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
28 25 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate
"""

HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""


def test_mountinfo_pure_v2() -> None:
    found = mounts.parse_mountinfo(PURE_V2)
    assert mounts.cgroup2_mounts(found) == ["/sys/fs/cgroup"]
    assert mounts.cgroup1_freezer_mounts(found) == []


def test_mountinfo_hybrid() -> None:
    found = mounts.parse_mountinfo(HYBRID)
    assert mounts.cgroup2_mounts(found) == ["/sys/fs/cgroup/unified"]
    assert mounts.cgroup1_freezer_mounts(found) == ["/sys/fs/cgroup/freezer"]


def test_mountinfo_escapes_and_order() -> None:
    text = (
        "50 1 0:40 / /mnt/my\\040cg rw - cgroup2 none rw\n"
        "51 1 0:41 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
        "52 1 0:42 / /sys/fs/cgroup rw shared:1 master:2 - cgroup2 cgroup2 rw\n"
    )
    assert mounts.cgroup2_mounts(mounts.parse_mountinfo(text)) == [
        "/sys/fs/cgroup",
        "/sys/fs/cgroup/unified",
        "/mnt/my cg",
    ]


def test_forced_backend_unavailable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "mountinfo"
    fake.write_text("22 1 0:5 / /proc rw - proc proc rw\n")
    monkeypatch.setattr(mounts, "MOUNTINFO", str(fake))
    for backend in ("cgroup2", "cgroup1"):
        with pytest.raises(NotFound) as info:
            freezer.detect(prefer=backend, root_name=f"krex-test-{os.getpid()}-none")
        assert info.value.fix
    fz = freezer.detect(root_name=f"krex-test-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        assert fz.name == "signal"
        assert len(fz.fallback_reasons) == 2
        assert "cgroup2" in fz.describe()
    finally:
        fz.remove_root()


def test_bad_arguments() -> None:
    with pytest.raises(UsageError):
        freezer.detect(prefer="bogus")
    with pytest.raises(UsageError):
        freezer.detect(prefer="signal", root_name="../escape")
    fz = freezer.detect(prefer="signal", root_name=f"krex-test-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        for bad in ("", "..", "a/b", ".hidden", "cgroup.procs", "x\ny"):
            with pytest.raises(UsageError):
                fz.group(bad)
    finally:
        fz.remove_root()


@needs_root
def test_auto_detect_prefers_cgroup2() -> None:
    root_name = f"krex-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        freezer.detect(prefer="cgroup2", root_name=root_name).remove_root()
    except NotFound:
        pytest.skip("no cgroup v2 freezer here")
    fz = freezer.detect(root_name=root_name)
    try:
        assert fz.name == "cgroup2"
        assert fz.fallback_reasons == []
    finally:
        fz.remove_root()


@needs_root
def test_remove_leftovers_removes_a_killed_daemons_groups_and_keeps_a_live_one(tmp_path: Path) -> None:
    shm = f"/krex-t-leftovers-{uuid.uuid4().hex[:8]}"
    fz = freezer.detect(root_name=freezer.root_name_for(shm))
    if fz.name == "signal":
        pytest.skip("no cgroup backend on this machine")
    fz.group("slot-0")
    fz.group("slot-1").freeze()  # left frozen, as by a krexd killed mid-region
    live = fz.group("slot-2")
    tree = Tree(tmp_path / "t", preexec=live.preexec())
    try:
        tree.wait_ready()
        freezer.remove_leftovers(shm)
        root = Path(fz.root)
        assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["slot-2"]  # never kills
        tree.assert_advances()
    finally:
        tree.kill()
    tree.proc.wait(10)
    # The tree's other processes leave the group a moment after its leader is reaped; a
    # group with a process in it cannot be removed (EBUSY), which is what remove_leftovers keeps.
    deadline = time.monotonic() + 10
    while live.pids() and time.monotonic() < deadline:
        time.sleep(0.02)
    freezer.remove_leftovers(shm)
    assert not Path(fz.root).exists()
