"""CPU topology, the per-GPU CPU partition, and thread pinning.

The node's physical cores (hyperthread siblings always kept together) are split
into one housekeeping core for the daemon plus one disjoint slice per GPU. Each
slice has `reserved` cores, where only the measuring thread of the GPU's current
region runs (region protocol step 6, "Pin"), and `shared` cores, where the
GPU's commands run. When the machine has too few cores for that, `partition`
degrades openly (`Partition.degraded`, `Partition.reason`) instead of failing:
measurements still work, they just share cores, and every report says so.

The library never prints; `Partition.describe()` returns lines for `krex doctor`."""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from krex.errors import KrexError, NotFound, PermissionDenied, UsageError, error_kind
from krex.node import procfs

# Fewest shared cores a slice may have before we call the partition degraded: a
# benchmarking command is a Python process with compiler and loader threads, and
# one core shared by all commands of a GPU would serialise them worse than simply
# sharing every core of the machine.
MIN_SHARED_CORES = 2

# Upper bound of the default admission limit per GPU (see default_slots_per_gpu).
MAX_DEFAULT_SLOTS = 16

__all__ = [
    "MIN_SHARED_CORES",
    "MAX_DEFAULT_SLOTS",
    "Core",
    "Topology",
    "Slice",
    "Partition",
    "parse_cpulist",
    "format_cpulist",
    "discover",
    "partition",
    "default_slots_per_gpu",
    "thread_affinity",
    "pin_thread",
    "restore_thread",
    "Eviction",
    "evict",
    "audit",
    "unnarrow",
    "unpin_inherited",
    "restore_evicted",
]


# --------------------------------------------------------------------------- cpulists


def parse_cpulist(text: str) -> list[int]:
    """Parse a kernel cpulist such as "0-3,8,10-11" (empty string -> [])."""
    out: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?(?::(\d+))?", part)
        if m is None:
            raise UsageError(f"malformed cpulist element {part!r} in {text!r}", "use e.g. 0-3,8")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        step = int(m.group(3)) if m.group(3) is not None else 1
        if hi < lo or step < 1:
            raise UsageError(f"malformed cpulist range {part!r} in {text!r}", "use e.g. 0-3,8")
        out.update(range(lo, hi + 1, step))
    return sorted(out)


def format_cpulist(cpus: Iterable[int]) -> str:
    """Format CPU ids the way the kernel does: [0, 1, 2, 5] -> "0-2,5"."""
    ids = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


# --------------------------------------------------------------------------- topology


@dataclass(frozen=True)
class Core:
    """One physical core: its usable hyperthreads, socket and NUMA node."""

    cpus: tuple[int, ...]
    package: int | None = None
    numa: int | None = None


@dataclass(frozen=True)
class Topology:
    """The physical cores this process may use, in ascending order of their first CPU."""

    cores: tuple[Core, ...]

    @property
    def cpus(self) -> list[int]:
        return sorted(c for core in self.cores for c in core.cpus)

    @property
    def numa_nodes(self) -> list[int]:
        return sorted({core.numa for core in self.cores if core.numa is not None})

    @property
    def packages(self) -> list[int]:
        return sorted({core.package for core in self.cores if core.package is not None})

    def core_of(self, cpu: int) -> Core:
        for core in self.cores:
            if cpu in core.cpus:
                return core
        raise NotFound(f"CPU {cpu} is not in this topology", "use one of " + format_cpulist(self.cpus))

    @classmethod
    def from_cores(cls, cores: Iterable[Core]) -> Topology:
        return cls(tuple(sorted(cores, key=lambda c: min(c.cpus))))


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read(path)
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None


def discover(sysfs_root: str = "/sys", allowed: Iterable[int] | None = None) -> Topology:
    """Read the topology from sysfs, restricted to `allowed` CPUs.

    `allowed` defaults to this process's affinity (os.sched_getaffinity(0)), so a
    cpuset or taskset around the daemon is respected. Tests pass it explicitly
    together with a fake `sysfs_root`. Missing files degrade gracefully: a CPU
    without sibling information is its own core, one without a node has numa None.
    """
    allow = set(os.sched_getaffinity(0) if allowed is None else allowed)
    cpu_dir = Path(sysfs_root) / "devices" / "system" / "cpu"
    node_dir = Path(sysfs_root) / "devices" / "system" / "node"

    numa_of: dict[int, int] = {}
    if node_dir.is_dir():
        for nd in node_dir.iterdir():
            m = re.fullmatch(r"node(\d+)", nd.name)
            text = _read(nd / "cpulist") if m else None
            if m is None or text is None:
                continue
            try:
                for c in parse_cpulist(text):
                    numa_of[c] = int(m.group(1))
            except UsageError:
                continue

    # Union-find over sibling lists: robust even if the kernel's lists disagree.
    parent: dict[int, int] = {c: c for c in allow}

    def find(c: int) -> int:
        while parent[c] != c:
            parent[c] = parent[parent[c]]
            c = parent[c]
        return c

    package_of: dict[int, int] = {}
    by_core_id: dict[tuple[int, int], int] = {}
    for c in sorted(allow):
        topo = cpu_dir / f"cpu{c}" / "topology"
        pkg = _read_int(topo / "physical_package_id")
        if pkg is not None:
            package_of[c] = pkg
        text = _read(topo / "thread_siblings_list")
        siblings: list[int] = []
        if text is not None:
            try:
                siblings = parse_cpulist(text)
            except UsageError:
                siblings = []
        if not siblings:
            # Older kernels or odd containers: fall back to (package, core_id).
            core_id = _read_int(topo / "core_id")
            if core_id is not None and pkg is not None:
                first = by_core_id.setdefault((pkg, core_id), c)
                siblings = [first]
        for s in siblings:
            if s in parent and find(s) != find(c):
                parent[find(s)] = find(c)

    groups: dict[int, list[int]] = {}
    for c in sorted(allow):
        groups.setdefault(find(c), []).append(c)
    cores = []
    for cpus in groups.values():
        first = cpus[0]
        cores.append(Core(tuple(cpus), package_of.get(first), numa_of.get(first)))
    return Topology.from_cores(cores)


# --------------------------------------------------------------------------- partition


@dataclass
class Slice:
    """The CPUs of one GPU. `shared`: where its commands run. `reserved`: the region core(s)."""

    gpu: int
    shared: list[int]
    reserved: list[int]
    numa: int | None = None

    @property
    def cpus(self) -> list[int]:
        return sorted(set(self.shared) | set(self.reserved))


@dataclass
class Partition:
    housekeeping: list[int]
    slices: list[Slice]
    degraded: bool = False
    reason: str = ""
    # Non-fatal remarks (e.g. a slice that had to spill outside its GPU's NUMA node).
    notes: list[str] = field(default_factory=list)
    # The physical cores (CPU ids per core) it was computed from.
    cores: list[list[int]] = field(default_factory=list)
    numa_nodes: list[int] = field(default_factory=list)

    @property
    def n_cpus(self) -> int:
        return sum(len(c) for c in self.cores)

    def slice_for(self, gpu: int) -> Slice:
        for s in self.slices:
            if s.gpu == gpu:
                return s
        raise NotFound(f"no CPU slice for GPU {gpu}", f"GPUs with slices: {[s.gpu for s in self.slices]}")

    def command_cpus(self, gpu: int, lend: str = "off") -> list[int]:
        """Where a command on `gpu` runs: its slice's shared cores, plus, while no region
        needs them, the region core(s) (lend "region") and the housekeeping core ("all")."""
        sl = self.slice_for(gpu)
        extra = {"off": [], "region": sl.reserved, "all": [*sl.reserved, *self.housekeeping]}[lend]
        return sl.shared + [c for c in dict.fromkeys(extra) if c not in sl.shared]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> list[str]:
        nodes = f", NUMA nodes {format_cpulist(self.numa_nodes)}" if self.numa_nodes else ""
        lines = [f"cpus: {self.n_cpus} usable CPUs, {len(self.cores)} physical cores{nodes}"]
        if self.degraded:
            lines.append(f"cpus: DEGRADED partition (cores are shared): {self.reason}")
        lines.append(f"cpus: housekeeping (daemon): {format_cpulist(self.housekeeping) or '-'}")
        for s in self.slices:
            numa = f" numa {s.numa}" if s.numa is not None else ""
            lines.append(
                f"cpus: gpu {s.gpu}{numa}: shared {format_cpulist(s.shared) or '-'}, "
                f"reserved for regions {format_cpulist(s.reserved) or '-'}"
            )
        lines.extend(f"cpus: note: {n}" for n in self.notes)
        return lines


def _flat(cores: Iterable[Core]) -> list[int]:
    return sorted(c for core in cores for c in core.cpus)


def _common_numa(cores: list[Core]) -> int | None:
    nodes = {c.numa for c in cores}
    return nodes.pop() if len(nodes) == 1 else None


def _degraded(
    topo: Topology, numa: list[int | None], reserved_per_gpu: int, reason: str, base: Partition
) -> Partition:
    """Everything shares everything; each GPU still gets a distinct region core where possible
    so that two concurrent regions on different GPUs do not pin onto the same core."""
    cores = list(topo.cores)
    all_cpus = _flat(cores)
    base.degraded = True
    base.reason = reason
    base.housekeeping = list(cores[0].cpus) if cores else []
    for g, node in enumerate(numa):
        if cores:
            n = len(cores)
            picks = {(g * reserved_per_gpu + j) % n for j in range(min(reserved_per_gpu, n))}
            reserved = _flat(cores[n - 1 - k] for k in picks)
        else:
            reserved = []
        base.slices.append(Slice(g, list(all_cpus), reserved, node))
    return base


def _slice_sizes(
    n_gpus: int, n_cores: int, gpu_numa: list[int | None], capacity: dict[int | None, int]
) -> list[int]:
    """Equal sizes (differing by at most one); the +1s go to GPUs whose NUMA node has room."""
    base, extra = divmod(n_cores, n_gpus)
    sizes = [base] * n_gpus
    room = dict(capacity)
    for node in gpu_numa:
        if node is not None:
            room[node] = room.get(node, 0) - base
    for _ in range(extra):
        candidates = [g for g in range(n_gpus) if sizes[g] == base]

        # Prefer a GPU whose node still has spare cores (largest surplus first), then any GPU.
        def rank(g: int) -> tuple[bool, int, int]:
            spare = room.get(gpu_numa[g], 0)
            return (gpu_numa[g] is not None and spare > 0, spare, -g)

        best = max(candidates, key=rank)
        sizes[best] += 1
        if gpu_numa[best] is not None:
            room[gpu_numa[best]] = room.get(gpu_numa[best], 0) - 1
    return sizes


def partition(
    topo: Topology,
    n_gpus: int,
    gpu_numa: Sequence[int | None] | None = None,
    reserved_per_gpu: int = 1,
) -> Partition:
    """Split the topology into housekeeping + one slice per GPU.

    Housekeeping is the core holding the lowest CPU id (CPU 0 where usable: that
    is where the kernel's own per-node housekeeping tends to land anyway). Each
    GPU's slice is taken from its NUMA node (`gpu_numa[g]`) when that node has
    the cores, and the region cores are the slice's highest cores. Never raises
    for too few cores: the result is then `degraded` with a `reason`.
    """
    if n_gpus < 0:
        raise UsageError(f"n_gpus must be >= 0, got {n_gpus}")
    if reserved_per_gpu < 1:
        raise UsageError(
            f"reserved_per_gpu must be >= 1, got {reserved_per_gpu}",
            "each GPU needs at least one region core to pin the measuring thread on",
        )
    numa: list[int | None] = list(gpu_numa) if gpu_numa is not None else [None] * n_gpus
    if len(numa) != n_gpus:
        raise UsageError(
            f"gpu_numa has {len(numa)} entries for {n_gpus} GPUs", "give one node (or None) per GPU"
        )

    cores = list(topo.cores)
    part = Partition(
        housekeeping=[], slices=[], cores=[list(c.cpus) for c in cores], numa_nodes=topo.numa_nodes
    )
    if not cores:
        return _degraded(topo, numa, reserved_per_gpu, "no usable CPUs", part)
    part.housekeeping = list(cores[0].cpus)
    if n_gpus == 0:
        return part

    need = 1 + n_gpus * (reserved_per_gpu + MIN_SHARED_CORES)
    if len(cores) < need:
        reason = (
            f"{len(cores)} physical cores for {n_gpus} GPU(s); a partition needs {need} "
            f"(1 housekeeping + per GPU {reserved_per_gpu} reserved + {MIN_SHARED_CORES} shared); "
            "commands, regions and the daemon share all cores, so CPU interference is not excluded"
        )
        return _degraded(topo, numa, reserved_per_gpu, reason, part)

    rest = cores[1:]
    pools: dict[int | None, list[Core]] = {}
    for core in rest:
        pools.setdefault(core.numa, []).append(core)
    capacity = {node: len(p) for node, p in pools.items()}
    sizes = _slice_sizes(n_gpus, len(rest), numa, capacity)

    # Pass 1: GPUs with a known node take their cores from that node, lowest first.
    taken: list[list[Core]] = [[] for _ in range(n_gpus)]
    for g in range(n_gpus):
        node = numa[g]
        if node is None or node not in pools:
            continue
        pool = pools[node]
        take, pools[node] = pool[: sizes[g]], pool[sizes[g] :]
        taken[g] = take
    # Pass 2: the rest (unknown node, or the node ran out) from what is left, in CPU order,
    # so a slice stays as contiguous as possible.
    leftover = sorted((c for p in pools.values() for c in p), key=lambda c: min(c.cpus))
    for g in range(n_gpus):
        missing = sizes[g] - len(taken[g])
        if missing > 0:
            taken[g] += leftover[:missing]
            leftover = leftover[missing:]
            if numa[g] is not None:
                part.notes.append(
                    f"gpu {g}: NUMA node {numa[g]} has too few free cores; "
                    f"{missing} core(s) of its slice come from another node"
                )

    for g in range(n_gpus):
        mine = sorted(taken[g], key=lambda c: min(c.cpus))
        # Region cores at the top of the slice (the design's example: core 15 of 0-15).
        reserved, shared = mine[len(mine) - reserved_per_gpu :], mine[: len(mine) - reserved_per_gpu]
        node = numa[g] if numa[g] is not None else _common_numa(mine)
        part.slices.append(Slice(g, _flat(shared), _flat(reserved), node))
    return part


def default_slots_per_gpu(part: Partition, gpu: int) -> int:
    """Default admission limit for one GPU: the physical shared cores of its slice, in [1, 16].

    Why: about 90% of a benchmarking command is CPU work (imports, compilation,
    input generation), so admitting more commands than the slice has physical
    cores only time-slices the CPU and slows every command without getting more
    GPU work done. Hyperthreads are not counted: they share a core's execution
    units. The cap of 16 bounds GPU-memory pressure and the number of siblings a
    region must drain and freeze; the node-wide slot table (KREX_MAX_SLOTS) is
    split evenly between GPUs so that all GPUs together fit in it. In a degraded
    partition every slice holds all cores, so the cores are divided between GPUs.
    """
    s = part.slice_for(gpu)
    reserved = set(s.reserved)
    housekeeping = set(part.housekeeping)
    shared = set(s.shared)
    cores = [grp for grp in part.cores if set(grp) & shared]
    if part.degraded:
        n = len(cores) // max(1, len(part.slices))
    else:
        n = sum(1 for grp in cores if not (set(grp) & (reserved | housekeeping)))
    n_slices = max(1, len(part.slices))
    try:
        from krex.native import lib

        table_share = max(1, int(lib.KREX_MAX_SLOTS) // n_slices)
    except ImportError:  # pragma: no cover - only without the built cffi module
        table_share = MAX_DEFAULT_SLOTS
    return max(1, min(n, MAX_DEFAULT_SLOTS, table_share))


# --------------------------------------------------------------------------- pinning


def _affinity_error(tid: int, exc: OSError, doing: str) -> KrexError:
    kind = error_kind(exc)
    if kind is NotFound:
        return NotFound(
            f"thread {tid} does not exist (it exited?) while {doing}", "nothing to pin; check the tid"
        )
    if kind is PermissionDenied:
        return PermissionDenied(
            f"not allowed to change the CPU affinity of thread {tid} while {doing}",
            "run the daemon as the command's user or as root (CAP_SYS_NICE)",
        )
    if exc.errno == errno.EINVAL:  # sched_setaffinity's own meaning: the CPU set it was given
        return UsageError(
            f"CPU set rejected for thread {tid} while {doing}: {exc.strerror}",
            "the CPUs must be online and inside the thread's cpuset "
            "(see Cpus_allowed_list in /proc/<pid>/status)",
        )
    return KrexError(f"sched_setaffinity failed for thread {tid} while {doing}: {exc}", "")


def thread_affinity(tid: int) -> list[int]:
    """The CPUs thread `tid` (a kernel thread id; 0 = the calling thread) may run on."""
    try:
        return sorted(os.sched_getaffinity(tid))
    except OSError as exc:
        raise _affinity_error(tid, exc, "reading its affinity") from exc


def _set(tid: int, cpus: list[int], doing: str) -> None:
    if not cpus:
        raise UsageError(f"empty CPU set for thread {tid} while {doing}", "give at least one CPU")
    try:
        # On Linux sched_setaffinity acts on a single thread id, not the whole process.
        os.sched_setaffinity(tid, cpus)
    except OSError as exc:
        raise _affinity_error(tid, exc, doing) from exc


def pin_thread(tid: int, cpus: list[int]) -> list[int]:
    """Move thread `tid` onto `cpus`; returns its old affinity for restore_thread()."""
    old = thread_affinity(tid)
    _set(tid, cpus, f"pinning it to {format_cpulist(cpus)}")
    return old


def restore_thread(tid: int, old: list[int]) -> None:
    """Give thread `tid` back the affinity pin_thread() returned."""
    _set(tid, old, f"restoring its affinity to {format_cpulist(old)}")


@dataclass
class Eviction:
    """What evict() did: the threads it moved, (tid, old mask, the mask it set), for
    restore_evicted(); every thread it looked at, so a later pass looks only at new ones;
    and the pids with a thread it could not move (its mask holds reserved CPUs alone: a
    thread pinned there by its command, e.g. OpenMP's OMP_PROC_BIND over a lent core)."""

    moved: list[tuple[int, list[int], list[int]]] = field(default_factory=list)
    seen: set[int] = field(default_factory=set)
    stuck: set[int] = field(default_factory=set)
    before: set[int] = field(default_factory=set)  # seen by the first pass: there as the gate closed


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def evict(pids: list[int], reserved: list[int], keep_tid: int, into: Eviction | None = None) -> Eviction:
    """Move every thread of `pids` but `keep_tid` off the `reserved` CPUs (the region core is
    the measuring thread's alone). With `into` (an earlier pass), only threads it has not
    seen are looked at, and what this pass does is added to it.

    Race-tolerant, not airtight: a thread that exits meanwhile is skipped, and one created
    after its creator was moved inherits the narrowed mask; one created by a thread not
    moved yet, or a process started after the listing, is not moved (a second pass at the
    grant catches those made during the first, audit() at the end flags the rest)."""
    res = set(reserved)
    ev = into if into is not None else Eviction()
    for pid in pids:
        for tid in _threads(pid):
            if tid == keep_tid or tid in ev.seen:
                continue
            ev.seen.add(tid)
            try:
                old = os.sched_getaffinity(tid)
                if not old & res:
                    continue
                rest = old - res
                if not rest:
                    ev.stuck.add(pid)
                    continue
                os.sched_setaffinity(tid, rest)
                ev.moved.append((tid, sorted(old), sorted(rest)))
            except OSError:
                continue
    if into is None:
        ev.before = set(ev.seen)
    return ev


def audit(
    pids: list[int], reserved: list[int], keep_tid: int, pinned_ok: Iterable[int] = ()
) -> dict[int, list[int]]:
    """pid -> its threads (but `keep_tid`) whose mask allows a `reserved` CPU now. For the
    pids in `pinned_ok` (the owner's), a mask within the reserved CPUs is not counted: a
    thread the measuring thread started inherits its pin."""
    res, ok = set(reserved), set(pinned_ok)
    out: dict[int, list[int]] = {}
    for pid in pids:
        for tid in _threads(pid):
            if tid == keep_tid:
                continue
            try:
                mask = os.sched_getaffinity(tid)
            except OSError:
                continue
            if mask & res and not (pid in ok and mask <= res):
                out.setdefault(pid, []).append(tid)
    return out


def unpin_inherited(
    pids: list[int], reserved: list[int], old: list[int], keep_tid: int, known: set[int]
) -> int:
    """At a region's end: the threads the measuring thread started inside it inherited its
    pin to the region core; give them the mask it had before (`old`). Threads in `known`
    (seen by the move at entry) keep theirs. How many."""
    res = set(reserved)
    n = 0
    for pid in pids:
        for tid in _threads(pid):
            if tid == keep_tid or tid in known:
                continue
            with contextlib.suppress(OSError):
                mask = os.sched_getaffinity(tid)
                if mask and mask <= res:
                    os.sched_setaffinity(tid, old)
                    n += 1
    return n


def unnarrow(
    pids: list[int], reserved: list[int], full: list[int], skip: set[int] | None = None, pinned: bool = True
) -> int:
    """Give `full` back to the threads left moved off the region core (mask: `full` without
    `reserved`) and, with `pinned`, to those pinned to it (mask within `reserved`, the
    measuring thread): by a krexd that died mid-region, or, at a region's end, threads that
    moved ones started during it (they inherited the narrowed mask; `skip`: the moved ones,
    which restore_evicted handles). Other masks are the commands' own and are left. How many."""
    res, wide, skip = set(reserved), set(full), skip or set()
    narrowed = wide - res
    n = 0
    for pid in pids:
        for tid in _threads(pid):
            if tid in skip:
                continue
            with contextlib.suppress(OSError):
                mask = os.sched_getaffinity(tid)
                if mask != wide and (mask == narrowed or (pinned and mask and mask <= res)):
                    os.sched_setaffinity(tid, wide)
                    n += 1
    return n


def restore_evicted(ev: Eviction | None) -> None:
    """Give each moved thread its old mask back, unless it changed its own mask meanwhile
    (or the thread ended and its tid went to another): that one is left as it is."""
    if ev is None:
        return
    for tid, old, new in ev.moved:
        with contextlib.suppress(OSError):
            if sorted(os.sched_getaffinity(tid)) == new:
                os.sched_setaffinity(tid, old)


# Lent priority: a thread a region waits for (a sibling's drain helper, or the thread inside
# a context, module or memory call its drain waits behind) gets a lower nice, with
# reset-on-fork so that threads it starts meanwhile (the driver starts some at a context's
# creation) keep nice 0.


def boost(pid: int, tid: int, nice: int, name: str | None = None) -> int | None:
    """Renice thread `tid` of process `pid` to `nice` (reset-on-fork): only a SCHED_OTHER
    thread of that process whose nice is above `nice` and, with `name`, whose comm is that.
    Its old nice, or None if nothing was changed. PermissionError (not root) passes
    through. A thread that ends and whose tid is reused in between is the one race left."""
    base = f"/proc/{pid}/task/{tid}"
    if (name is not None and procfs.read_or_empty(f"{base}/comm") != name) or not os.path.exists(base):
        return None
    try:
        old = os.getpriority(os.PRIO_PROCESS, tid)
        if old <= nice or os.sched_getscheduler(tid) != os.SCHED_OTHER:
            return None
        # The nice first: without the privilege it fails before the flag is set (which an
        # unprivileged user could then never clear). A thread started in between inherits
        # the nice without the flag: a window of one system call.
        os.setpriority(os.PRIO_PROCESS, tid, nice)
        os.sched_setscheduler(tid, os.SCHED_OTHER | os.SCHED_RESET_ON_FORK, os.sched_param(0))
    except ProcessLookupError:
        return None
    return old


def unboost(pid: int, tid: int, old: int) -> None:
    """Undo `boost`: nice `old` again, without reset-on-fork, for a thread still below `old`
    (one that raised its own nice to `old` or above since is left alone; one only a little
    above `nice` is not: raising one's nice needs no privilege, keeping a low one would).
    A boosted thread that exec'd became its process's leader under another tid and keeps
    the boost: only processes of krexd's own user are boosted, who could set it anyway."""
    with contextlib.suppress(OSError):
        if not os.path.exists(f"/proc/{pid}/task/{tid}") or os.getpriority(os.PRIO_PROCESS, tid) >= old:
            return
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, tid, old)
