"""CPU topology discovery (fake sysfs trees), the per-GPU partition, and real thread pinning."""

from __future__ import annotations

import errno
import itertools
import json
import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from krex.errors import KrexError, NotFound, PermissionDenied, UsageError
from krex.node import cpus
from krex.node.cpus import Partition, Topology

# --------------------------------------------------------------------------- fake sysfs


def cpu_id(s: int, c: int, t: int, sockets: int, cores: int, ht: int, interleaved: bool) -> int:
    """Linux's usual numbering puts all first hyperthreads before the second ones
    (cpu0 and cpuN are siblings); some firmware numbers siblings adjacently."""
    if interleaved:
        return (s * cores + c) * ht + t
    return t * sockets * cores + s * cores + c


def make_sysfs(
    root: Path, sockets: int, cores: int, ht: int = 1, interleaved: bool = False, numa: bool = True
) -> list[int]:
    """Write a fake /sys with `sockets` packages (one NUMA node each) of `cores` cores of `ht`
    threads. Returns all CPU ids."""
    cpu_dir = root / "devices" / "system" / "cpu"
    node_dir = root / "devices" / "system" / "node"
    per_node: dict[int, list[int]] = {}
    all_ids: list[int] = []
    for s in range(sockets):
        for c in range(cores):
            sib = [cpu_id(s, c, t, sockets, cores, ht, interleaved) for t in range(ht)]
            for t in range(ht):
                cid = sib[t]
                all_ids.append(cid)
                per_node.setdefault(s, []).append(cid)
                topo = cpu_dir / f"cpu{cid}" / "topology"
                topo.mkdir(parents=True)
                (topo / "core_id").write_text(f"{c}\n")
                (topo / "physical_package_id").write_text(f"{s}\n")
                (topo / "thread_siblings_list").write_text(cpus.format_cpulist(sib) + "\n")
    # Files that real sysfs has and discover() must ignore.
    (cpu_dir / "online").write_text(f"0-{len(all_ids) - 1}\n")
    (cpu_dir / "cpufreq").mkdir()
    if numa:
        for s, ids in per_node.items():
            (node_dir / f"node{s}").mkdir(parents=True)
            (node_dir / f"node{s}" / "cpulist").write_text(cpus.format_cpulist(ids) + "\n")
        (node_dir / "online").write_text(f"0-{sockets - 1}\n")
    return sorted(all_ids)


def fake_topology(
    root: Path, sockets: int, cores: int, ht: int = 1, interleaved: bool = False
) -> tuple[Topology, list[int]]:
    ids = make_sysfs(root, sockets, cores, ht, interleaved)
    return cpus.discover(str(root), allowed=ids), ids


# --------------------------------------------------------------------------- invariants


def core_count(topo: Topology, ids: list[int]) -> int:
    return len({topo.core_of(c).cpus for c in ids})


def check_invariants(topo: Topology, part: Partition, n_gpus: int, reserved_per_gpu: int = 1) -> None:
    allowed = set(topo.cpus)
    assert len(part.slices) == n_gpus
    assert [s.gpu for s in part.slices] == list(range(n_gpus))
    json.dumps(part.to_json())  # serialisable as is
    assert all(isinstance(line, str) and line for line in part.describe())
    if part.degraded:
        assert part.reason
        assert any("DEGRADED" in line for line in part.describe())
        assert part.housekeeping and set(part.housekeeping) <= allowed
        for s in part.slices:
            # Usable for affinity: non-empty, only allowed CPUs, the region core also runs commands.
            assert s.shared and s.reserved
            assert set(s.shared) <= allowed and set(s.reserved) <= set(s.shared)
        return
    assert part.reason == ""
    sets = [set(part.housekeeping)]
    for s in part.slices:
        assert s.shared, "a real partition gives every GPU shared cores"
        assert s.reserved
        assert not set(s.shared) & set(s.reserved), "reserved cores never run commands"
        assert core_count(topo, s.reserved) == reserved_per_gpu
        assert core_count(topo, s.shared) >= cpus.MIN_SHARED_CORES
        sets += [set(s.shared), set(s.reserved)]
    union: set[int] = set()
    for a in sets:
        assert not union & a, "housekeeping, shared and reserved sets are pairwise disjoint"
        union |= a
    assert union == allowed, "every usable CPU is used, no other CPU is"
    # Hyperthread siblings are never split: each physical core lies in exactly one set.
    for core in topo.cores:
        assert sum(1 for a in sets if set(core.cpus) <= a) == 1
        assert all(not (set(core.cpus) & a) or set(core.cpus) <= a for a in sets)
    assert core_count(topo, part.housekeeping) == 1
    sizes = [core_count(topo, s.cpus) for s in part.slices]
    assert max(sizes) - min(sizes) <= 1, sizes


# --------------------------------------------------------------------------- helpers


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        ("0", [0]),
        ("0-3", [0, 1, 2, 3]),
        ("0-2,5,7-8\n", [0, 1, 2, 5, 7, 8]),
        ("", []),
        ("0-6:2", [0, 2, 4, 6]),
    ],
)
def test_cpulist_roundtrip(text: str, ids: list[int]) -> None:
    assert cpus.parse_cpulist(text) == ids
    assert cpus.parse_cpulist(cpus.format_cpulist(ids)) == ids


def test_cpulist_malformed() -> None:
    with pytest.raises(UsageError):
        cpus.parse_cpulist("0-x")
    with pytest.raises(UsageError):
        cpus.parse_cpulist("5-2")


# --------------------------------------------------------------------------- discovery


def test_discover_fake_ht_two_sockets(tmp_path: Path) -> None:
    topo, ids = fake_topology(tmp_path, sockets=2, cores=8, ht=2)
    assert topo.cpus == ids == list(range(32))
    assert len(topo.cores) == 16
    assert topo.numa_nodes == [0, 1] and topo.packages == [0, 1]
    assert topo.cores[0] == cpus.Core((0, 16), package=0, numa=0)
    assert topo.core_of(24) == cpus.Core((8, 24), package=1, numa=1)


def test_discover_respects_allowed_cpus(tmp_path: Path) -> None:
    make_sysfs(tmp_path, sockets=1, cores=4, ht=2)
    # cpuset that takes one hyperthread of core 1 (cpu 5) away and core 3 entirely.
    topo = cpus.discover(str(tmp_path), allowed=[0, 1, 2, 4, 6])
    assert topo.cpus == [0, 1, 2, 4, 6]
    assert [c.cpus for c in topo.cores] == [(0, 4), (1,), (2, 6)]


def test_discover_without_sibling_lists_or_numa(tmp_path: Path) -> None:
    make_sysfs(tmp_path, sockets=1, cores=2, ht=2, numa=False)
    for f in (tmp_path / "devices/system/cpu").glob("cpu*/topology/thread_siblings_list"):
        f.unlink()
    topo = cpus.discover(str(tmp_path), allowed=[0, 1, 2, 3])
    # Falls back to (package, core_id): cpu0/cpu2 are core 0, cpu1/cpu3 core 1.
    assert [c.cpus for c in topo.cores] == [(0, 2), (1, 3)]
    assert topo.numa_nodes == []
    # CPUs sysfs does not know at all are single cores with unknown node.
    topo = cpus.discover(str(tmp_path / "nowhere"), allowed=[3, 1])
    assert [c.cpus for c in topo.cores] == [(1,), (3,)] and topo.cores[0].numa is None


def test_discover_real_sys() -> None:
    topo = cpus.discover()
    assert topo.cpus == sorted(os.sched_getaffinity(0))
    assert all(core.cpus for core in topo.cores)
    part = cpus.partition(topo, 1)
    check_invariants(topo, part, 1)
    if len(topo.cores) < 4:  # e.g. CI's 2 cores: openly degraded, never an error
        assert part.degraded and "physical cores" in part.reason


# --------------------------------------------------------------------------- partition


def test_design_example_16_cores_1_gpu(tmp_path: Path) -> None:
    topo, _ = fake_topology(tmp_path, sockets=1, cores=16)
    part = cpus.partition(topo, 1)
    assert not part.degraded and part.reason == ""
    assert part.housekeeping == [0]
    assert part.slices == [cpus.Slice(gpu=0, shared=list(range(1, 15)), reserved=[15], numa=0)]
    check_invariants(topo, part, 1)
    assert cpus.default_slots_per_gpu(part, 0) == 14
    assert "cpus: gpu 0 numa 0: shared 1-14, reserved for regions 15" in part.describe()
    # Lent cores: the region core, then the housekeeping core too; never a core twice.
    assert part.command_cpus(0) == list(range(1, 15))
    assert part.command_cpus(0, "region") == list(range(1, 16))
    assert sorted(part.command_cpus(0, "all")) == list(range(16))


def test_two_sockets_ht_four_gpus_numa(tmp_path: Path) -> None:
    topo, _ = fake_topology(tmp_path, sockets=2, cores=8, ht=2)
    gpu_numa: list[int | None] = [0, 0, 1, 1]
    part = cpus.partition(topo, 4, gpu_numa=gpu_numa)
    check_invariants(topo, part, 4)
    node_of = {c: core.numa for core in topo.cores for c in core.cpus}
    assert part.housekeeping == [0, 16]
    for s, node in zip(part.slices, gpu_numa, strict=True):
        assert s.numa == node
        assert {node_of[c] for c in s.cpus} == {node}, f"gpu {s.gpu} left its NUMA node"
        assert not set(s.cpus) & set(part.housekeeping)
        assert not set(s.reserved) & set(s.shared)
    assert part.notes == []
    # Node 0 lost a core to housekeeping, so its GPUs got 3+4 cores and node 1's 4+4.
    assert sorted(core_count(topo, s.cpus) for s in part.slices) == [3, 4, 4, 4]


def test_numa_reversed_and_interleaved_numbering(tmp_path: Path) -> None:
    topo, _ = fake_topology(tmp_path, sockets=2, cores=8, ht=2, interleaved=True)
    part = cpus.partition(topo, 2, gpu_numa=[1, 0])
    check_invariants(topo, part, 2)
    node_of = {c: core.numa for core in topo.cores for c in core.cpus}
    assert {node_of[c] for c in part.slices[0].cpus} == {1}
    assert {node_of[c] for c in part.slices[1].cpus} == {0}
    assert part.housekeeping == [0, 1]


def test_numa_spill_is_noted(tmp_path: Path) -> None:
    topo, _ = fake_topology(tmp_path, sockets=2, cores=4)
    part = cpus.partition(topo, 2, gpu_numa=[0, 0])  # node 0 has only 3 free cores for two GPUs
    check_invariants(topo, part, 2)
    assert part.notes and "another node" in part.notes[0]


@pytest.mark.parametrize(("n_cpus", "n_gpus"), [(128, 8), (32, 2)])
def test_many_gpus_equal_disjoint(tmp_path: Path, n_cpus: int, n_gpus: int) -> None:
    topo, _ = fake_topology(tmp_path, sockets=2, cores=n_cpus // 4, ht=2)
    for gpu_numa in (None, [g * 2 // n_gpus for g in range(n_gpus)]):
        part = cpus.partition(topo, n_gpus, gpu_numa=gpu_numa)
        check_invariants(topo, part, n_gpus)
        all_slice_cpus = [c for s in part.slices for c in s.cpus]
        assert len(all_slice_cpus) == len(set(all_slice_cpus))
        for g in range(n_gpus):
            assert 1 <= cpus.default_slots_per_gpu(part, g) <= cpus.MAX_DEFAULT_SLOTS
        # The node-wide slot table must hold the defaults of all GPUs together.
        assert sum(cpus.default_slots_per_gpu(part, g) for g in range(n_gpus)) <= 64


def test_two_cores_one_gpu_degrades_openly(tmp_path: Path) -> None:
    topo, _ = fake_topology(tmp_path, sockets=1, cores=2)
    part = cpus.partition(topo, 1)
    assert part.degraded and "2 physical cores" in part.reason
    assert part.housekeeping == [0]
    assert part.slices == [cpus.Slice(gpu=0, shared=[0, 1], reserved=[1], numa=None)]
    check_invariants(topo, part, 1)
    assert cpus.default_slots_per_gpu(part, 0) == 2
    assert part.to_json()["degraded"] is True


def test_degraded_gpus_get_distinct_region_cores(tmp_path: Path) -> None:
    topo, _ = fake_topology(tmp_path, sockets=1, cores=4)
    part = cpus.partition(topo, 2, gpu_numa=[0, 0])
    assert part.degraded
    assert [s.reserved for s in part.slices] == [[3], [2]]
    assert [s.numa for s in part.slices] == [0, 0]
    check_invariants(topo, part, 2)


def test_single_cpu_and_zero_gpus(tmp_path: Path) -> None:
    topo, _ = fake_topology(tmp_path, sockets=1, cores=1)
    part = cpus.partition(topo, 3)
    assert part.degraded
    assert all(s.shared == [0] and s.reserved == [0] for s in part.slices)
    part = cpus.partition(topo, 0)
    assert not part.degraded and part.housekeeping == [0] and part.slices == []
    empty = cpus.partition(Topology(()), 1)
    assert empty.degraded and empty.reason == "no usable CPUs"


def test_partition_bad_arguments(tmp_path: Path) -> None:
    topo, _ = fake_topology(tmp_path, sockets=1, cores=8)
    with pytest.raises(UsageError):
        cpus.partition(topo, -1)
    with pytest.raises(UsageError):
        cpus.partition(topo, 2, gpu_numa=[0])
    with pytest.raises(UsageError):
        cpus.partition(topo, 1, reserved_per_gpu=0)
    with pytest.raises(NotFound):
        cpus.partition(topo, 1).slice_for(5)


def combos() -> Iterator[tuple[int, int, int, bool, int, int]]:
    for sockets, cores, ht, interleaved in itertools.product(
        (1, 2, 3), (1, 2, 3, 4, 5, 7, 8, 13, 16), (1, 2, 4), (False, True)
    ):
        for n_gpus in (1, 2, 3, 4, 8):
            for reserved in (1, 2):
                yield sockets, cores, ht, interleaved, n_gpus, reserved


def test_property_invariants_over_many_shapes(tmp_path: Path) -> None:
    rng = random.Random(1234)
    checked = degraded = 0
    trees: dict[tuple[int, int, int, bool], tuple[Topology, list[int]]] = {}
    for sockets, cores, ht, interleaved, n_gpus, reserved in combos():
        key = (sockets, cores, ht, interleaved)
        if key not in trees:
            trees[key] = fake_topology(tmp_path / "-".join(map(str, key)), sockets, cores, ht, interleaved)
        topo, ids = trees[key]
        # A random cpuset (sometimes cutting through a core's hyperthreads) restricts the topology.
        if rng.random() < 0.3 and len(ids) > 1:
            allowed = sorted(rng.sample(ids, rng.randint(1, len(ids))))
            topo = cpus.discover(str(tmp_path / "-".join(map(str, key))), allowed=allowed)
        choices: list[list[int | None] | None] = [
            None,
            [rng.randrange(sockets) for _ in range(n_gpus)],
            [None] * n_gpus,
        ]
        gpu_numa = rng.choice(choices)
        part = cpus.partition(topo, n_gpus, gpu_numa=gpu_numa, reserved_per_gpu=reserved)
        check_invariants(topo, part, n_gpus, reserved)
        # Degraded exactly when there are too few physical cores.
        assert part.degraded == (len(topo.cores) < 1 + n_gpus * (reserved + cpus.MIN_SHARED_CORES))
        for g in range(n_gpus):
            assert 1 <= cpus.default_slots_per_gpu(part, g) <= cpus.MAX_DEFAULT_SLOTS
        checked += 1
        degraded += part.degraded
    assert checked > 1000 and 0 < degraded < checked


# --------------------------------------------------------------------------- pinning


class Parked:
    """A thread that waits until released, so it has a live kernel tid."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.started.wait(10)
        assert self.thread.native_id is not None
        self.tid: int = self.thread.native_id

    def _run(self) -> None:
        self.started.set()
        self.release.wait(30)

    def stop(self) -> None:
        self.release.set()
        self.thread.join(10)


def test_pin_and_restore_real_thread() -> None:
    parked = Parked()
    try:
        before = sorted(os.sched_getaffinity(parked.tid))
        process_before = os.sched_getaffinity(0)
        target = max(before)
        old = cpus.pin_thread(parked.tid, [target])
        assert old == before
        assert os.sched_getaffinity(parked.tid) == {target}
        assert cpus.thread_affinity(parked.tid) == [target]
        # Per-thread: the calling thread keeps its affinity.
        assert os.sched_getaffinity(0) == process_before
        cpus.restore_thread(parked.tid, old)
        assert sorted(os.sched_getaffinity(parked.tid)) == before
    finally:
        parked.stop()


def test_pin_gone_thread_is_not_found() -> None:
    parked = Parked()
    tid = parked.tid
    parked.stop()
    assert not parked.thread.is_alive()
    if Path(f"/proc/self/task/{tid}").exists():  # pragma: no cover - tid already reused
        pytest.skip("tid was reused")
    with pytest.raises(NotFound) as info:
        cpus.pin_thread(tid, [0])
    assert info.value.fix and str(tid) in str(info.value)
    with pytest.raises(NotFound):
        cpus.restore_thread(tid, [0])


def test_pin_invalid_cpus_is_usage_error() -> None:
    parked = Parked()
    try:
        before = cpus.thread_affinity(parked.tid)
        with pytest.raises(UsageError):
            cpus.pin_thread(parked.tid, [])
        with pytest.raises(UsageError):
            cpus.pin_thread(parked.tid, [1000])  # not an online CPU
        assert cpus.thread_affinity(parked.tid) == before
    finally:
        parked.stop()


@pytest.mark.parametrize(
    ("err", "cls"),
    [
        (PermissionError(errno.EPERM, "Operation not permitted"), PermissionDenied),
        (ProcessLookupError(errno.ESRCH, "No such process"), NotFound),
        (OSError(errno.EINVAL, "Invalid argument"), UsageError),
        (OSError(errno.EIO, "I/O error"), KrexError),
    ],
)
def test_affinity_errors_map_to_krex_errors(
    monkeypatch: pytest.MonkeyPatch, err: OSError, cls: type[KrexError]
) -> None:
    def fail(tid: int, mask: object) -> None:
        raise err

    monkeypatch.setattr(os, "sched_setaffinity", fail)
    with pytest.raises(cls) as info:
        cpus.restore_thread(os.getpid(), [0])
    assert info.value.fix or cls is KrexError


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another uid")
def test_pin_other_users_thread_is_permission_denied() -> None:
    parent = os.getpid()
    before = os.sched_getaffinity(parent)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: become nobody, then try to move the root-owned parent
        code = b"?"
        try:
            os.setgid(65534)
            os.setuid(65534)
            cpus.pin_thread(parent, [0])
            code = b"ok"
        except PermissionDenied:
            code = b"denied"
        except BaseException:
            code = b"other"
        finally:
            os.write(w, code)
            os._exit(0)
    os.close(w)
    try:
        result = os.read(r, 16)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
        os.sched_setaffinity(parent, before)  # in case the child did move us
    assert result == b"denied"


_EVICT_VICTIM = """
import os, sys, threading, time
d = sys.argv[1]
def idle():
    while not os.path.exists(d + "/stop"):
        time.sleep(0.005)
def self_setter(cpu):
    while not os.path.exists(d + "/set"):
        time.sleep(0.005)
    os.sched_setaffinity(0, {cpu})
    open(d + "/was_set", "w").close()
    idle()
a = threading.Thread(target=idle); a.start()
b = threading.Thread(target=self_setter, args=(int(sys.argv[2]),)); b.start()
open(d + "/tids", "w").write(f"{a.native_id} {b.native_id}")
while not os.path.exists(d + "/spawn"):
    time.sleep(0.005)
os.sched_setaffinity(0, set(range(os.cpu_count() or 1)) & {int(c) for c in sys.argv[3].split(",")})
c = threading.Thread(target=idle); c.start()  # made with the wide mask, after the first move
open(d + "/spawned", "w").write(str(c.native_id))
idle()
"""


def _wait_file(p: Path) -> str:
    import time

    deadline = time.monotonic() + 20
    while not p.exists():
        assert time.monotonic() < deadline, f"{p} never came"
        time.sleep(0.01)
    time.sleep(0.01)
    return p.read_text()


def test_evict_second_pass_audit_and_guarded_restore(tmp_path: Path) -> None:
    """With real threads of a real process: evict moves every thread off the reserved CPU
    (and returns what it did); a pass `into` the first moves only a thread made since;
    restore gives the old masks back except to a thread that set its own meanwhile; audit
    finds a thread whose mask allows the reserved CPU."""
    import subprocess
    import sys

    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs 2 CPUs")
    hi = allowed[-1]
    wide = ",".join(map(str, allowed))
    # b later pins itself to `hi`: a mask of its own, not the one the move set
    proc = subprocess.Popen([sys.executable, "-c", _EVICT_VICTIM, str(tmp_path), str(hi), wide])
    try:
        a, b = map(int, _wait_file(tmp_path / "tids").split())
        ev = cpus.evict([proc.pid], [hi], keep_tid=-1)
        tids = {int(t) for t in os.listdir(f"/proc/{proc.pid}/task")}
        assert {a, b, proc.pid} <= tids and ev.seen == tids and not ev.stuck
        assert {t for t, _o, _n in ev.moved} == tids
        assert all(hi not in os.sched_getaffinity(t) for t in tids)
        assert cpus.audit([proc.pid], [hi], keep_tid=-1) == {}
        (tmp_path / "spawn").touch()
        c = int(_wait_file(tmp_path / "spawned"))
        assert set(cpus.audit([proc.pid], [hi], keep_tid=-1)[proc.pid]) == {proc.pid, c}  # re-widened, new
        n = len(ev.moved)
        cpus.evict([proc.pid], [hi], keep_tid=-1, into=ev)
        assert [t for t, _o, _n in ev.moved[n:]] == [c], "the second pass looks only at new threads"
        assert cpus.audit([proc.pid], [hi], keep_tid=-1) == {proc.pid: [proc.pid]}  # it re-widened itself
        (tmp_path / "set").touch()
        _wait_file(tmp_path / "was_set")
        cpus.restore_evicted(ev)
        assert os.sched_getaffinity(b) == {hi}, "a mask the thread set itself is kept"
        assert os.sched_getaffinity(a) == set(allowed) and os.sched_getaffinity(c) == set(allowed)
        os.sched_setaffinity(a, {hi})  # pinned to the reserved CPU alone: no move can help
        ev2 = cpus.evict([proc.pid], [hi], keep_tid=-1)
        assert ev2.stuck == {proc.pid} and os.sched_getaffinity(a) == {hi}
        assert a in cpus.audit([proc.pid], [hi], keep_tid=-1)[proc.pid]
        assert a not in cpus.audit([proc.pid], [hi], keep_tid=-1, pinned_ok=[proc.pid]).get(proc.pid, [])
    finally:
        (tmp_path / "stop").touch()
        proc.kill()
        proc.wait()


def _parked_thread(name: str | None = None) -> tuple[int, threading.Event, threading.Thread, list[int]]:
    """A thread that waits on an event; on `go` it starts a child thread, records that one's
    nice, and waits again. (its tid, the event, the thread, where the child's nice goes)"""
    ready, go, out, tid = threading.Event(), threading.Event(), [], []

    def body() -> None:
        tid.append(threading.get_native_id())
        if name:
            Path(f"/proc/self/task/{tid[0]}/comm").write_text(name)
        ready.set()
        go.wait(10)
        child = threading.Thread(target=lambda: out.append(os.getpriority(os.PRIO_PROCESS, 0)))
        child.start()
        child.join()

    t = threading.Thread(target=body, daemon=True)
    t.start()
    ready.wait(10)
    return tid[0], go, t, out


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering a nice value needs root (CAP_SYS_NICE)")
def test_boost_renices_one_thread_reset_on_fork_and_unboost_puts_it_back() -> None:
    """Relative to the nice the suite runs at (`nice -n 5 make test`): threads start at it."""
    pid = os.getpid()
    base = os.getpriority(os.PRIO_PROCESS, 0)
    low, raised = min(base - 7, -1), min(19, base + 3)
    tid, go, t, child_nice = _parked_thread("krex-drain")
    try:
        assert cpus.boost(pid, tid, low, "not-this-name") is None
        assert os.getpriority(os.PRIO_PROCESS, tid) == base
        assert cpus.boost(pid, 2**22 - 3, low) is None  # no such thread
        assert cpus.boost(pid, tid, low, "krex-drain") == base
        assert os.getpriority(os.PRIO_PROCESS, tid) == low
        assert os.sched_getscheduler(tid) == os.SCHED_OTHER | os.SCHED_RESET_ON_FORK
        assert os.getpriority(os.PRIO_PROCESS, 0) == base, "only that thread"
        assert cpus.boost(pid, tid, low) is None, "already there: nothing to undo later"
        go.set()
        t.join(10)
        # reset-on-fork: a thread it starts meanwhile gets nice 0 (the kernel's rule for a
        # negative nice), not the boost
        assert child_nice == [0], "a thread it starts meanwhile inherits the boost"
    finally:
        go.set()
    tid, go, t, _ = _parked_thread()
    try:
        assert cpus.boost(pid, tid, low) == base
        cpus.unboost(pid, tid, base)
        assert os.getpriority(os.PRIO_PROCESS, tid) == base
        assert os.sched_getscheduler(tid) == os.SCHED_OTHER, "reset-on-fork cleared"
        assert cpus.boost(pid, tid, low) == base
        os.setpriority(os.PRIO_PROCESS, tid, low + 1)  # raised a little (no privilege needed): not kept
        cpus.unboost(pid, tid, base)
        assert os.getpriority(os.PRIO_PROCESS, tid) == base
        assert cpus.boost(pid, tid, low) == base
        os.setpriority(os.PRIO_PROCESS, tid, raised)  # the thread's own change, above its old nice
        cpus.unboost(pid, tid, base)
        assert os.getpriority(os.PRIO_PROCESS, tid) == raised, "left alone"
    finally:
        go.set()
        t.join(10)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_boost_without_the_privilege_changes_nothing() -> None:
    """Not root: boost raises PermissionError and leaves no reset-on-fork flag behind (which
    an unprivileged user could never clear again)."""
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through its exit status
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            base = os.getpriority(os.PRIO_PROCESS, 0)  # the suite may run under `nice -n 5`
            tid, go, t, _ = _parked_thread()
            try:
                cpus.boost(os.getpid(), tid, min(base - 7, -1))
            except PermissionError:
                flagless = os.sched_getscheduler(tid) == os.SCHED_OTHER
                code = 0 if flagless and os.getpriority(os.PRIO_PROCESS, tid) == base else 2
            go.set()
            t.join(10)
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_each_helper_is_reniced_once_and_a_reused_pid_again() -> None:
    """krexd's _boost_helpers renices a (pid, start time, helper tid) once; a process that
    reused the pid (another start time) is a new helper. Only its own user's processes."""
    import types

    from krex.node.daemon import Daemon

    done: list[tuple[int, int, str | None]] = []
    fake = types.SimpleNamespace(
        cfg=types.SimpleNamespace(helper_nice=-10),
        _boost_ok=True,
        _boost_lock=threading.Lock(),
        _boosted=set(),
        _boost=lambda pid, tid, name=None: done.append((pid, tid, name)),
    )
    me = os.getpid()
    Daemon._boost_helpers(fake, [(me, 100, 7), (me, 100, 0)])  # type: ignore[arg-type]
    Daemon._boost_helpers(fake, [(me, 100, 7)])  # type: ignore[arg-type]
    assert done == [(me, 7, "krex-drain")]
    Daemon._boost_helpers(fake, [(me, 101, 7)])  # type: ignore[arg-type]
    assert done == [(me, 7, "krex-drain")] * 2
    fake.cfg.helper_nice = 0
    Daemon._boost_helpers(fake, [(me, 102, 7)])  # type: ignore[arg-type]
    assert len(done) == 2, "helper_nice 0: off"
