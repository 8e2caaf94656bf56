"""Which siblings a region freezes (protocol step 5 as a policy), and which sibling
processes the gate is proven to hold.

A sibling process is HELD by the gate only when it is proven to be, by one of:
  - its record: a live, sealed process record in krexd's segment (pid and start time
    match, its check valid), registered under the slot of the command whose tree it is in
    and that slot's current generation, its drain helper thread still a thread of it (an
    exec ends that thread: every exec is caught; one its own exit handler stopped,
    KREX_PF_IN_EXIT, still holds), and no GPU driver or runtime library
    loaded in another link-map namespace (KREX_PF_FOREIGN_NS, set by the shim's dlmopen
    hook and its helper), nor a library exporting a CUDA runtime of its own
    (KREX_PF_UNSEEN: frozen, drained, as a static runtime in its executable); or
  - for a process that made no gated call yet (no record): its maps and environment show
    an active, attached shim: the shim mapped, krexd's segment mapped (the shim attaches at
    load, with the credentials the process started with), KREX_SHM naming this segment and
    KREX_SLOT and KREX_SLOT_GEN naming its command's slot and generation (or no KREX_SLOT
    and a KREX_SOCKET: it registers with krexd first). Its first gated call registers and
    waits at the gate.
In both cases no GPU library may be mapped at two bases (a second link-map namespace, by
dlmopen) and its executable must not link the CUDA runtime statically (a held record
with a static runtime: its launches pass no hook, so its slot is frozen, but its helper
drains its contexts). The record is read first (one pass over the records in shared
memory, one access() of the helper thread); the maps and environment are read once per
image of a process (pid, start time, executable and the layout an exec changes:
procfs.Stat.image), at most INSPECT_INLINE new ones by a region itself.

Every other process of a sibling's tree is UNHELD: its slot is frozen under every policy,
and the region treats the work it may have queued before the freeze as work KREX cannot
drain (unheld.py's `queued_work`, in region.py's freeze step): on the simulated GPU it
waits until the device has run everything queued; on a GPU with NVML it flags the region
when NVML lists such a process on the GPU (it holds a context); with neither it flags the
region. At a region's end the processes of siblings it did not freeze are judged again,
and any unheld one flags the region (it may have run during it), unless it cannot reach a
GPU at all (no GPU library mapped, no GPU device file open: Inspector.gpu_less), as the
compilers and linkers of a sibling's JIT compile.

Policies:
  gpu       (the default) freeze only the siblings with a process the gate does not hold
            (above). Every other sibling keeps running on its own cores and parks at the
            gate if it submits. A sibling inside a context, module or device-memory call,
            or in its exit after one, is frozen too (region.py's _FreezePlan).
  all       freeze every sibling's whole tree (the paper's protocol).
  adaptive  `all` for a short, launch-bound region (the owner's previous region of this
            command submitted faster than ADAPTIVE_RATE per second, or it is the first
            one), else `gpu`.

What `gpu` does not see: a process that made no gated call and loads, after krexd read its
maps, a library carrying a statically linked CUDA runtime and launches through it (`all`
freezes it, and its work is waited for or flagged as above), and a process of a running
sibling that starts, runs GPU work outside the gate and ends within one region (one alive
at the region's end is judged then; one that by then has also unloaded every GPU library
and closed its GPU device files passes as one that never reached a GPU). A registered
process quiet since its last drain that loads a library with its own CUDA runtime and
launches through it, just before a region (its helper looks at each drain request, but
krexd does not wait for a quiet record) or inside it, is flagged at the region's end: a look
round of the siblings left running and their records' flags against those read as the
drain was requested (regionchecks.py, _look_end). Not seen: such a process of a sibling
the region froze whose helper had not looked between its dlopen and the freeze."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from krex.device import elfcheck
from krex.native import ffi, lib
from krex.node import procfs

POLICIES = ("all", "gpu", "adaptive")
DEFAULT = "gpu"
# New processes a region inspects itself (about 1 ms each); the rest wait for the inspector thread.
INSPECT_INLINE = 8
# Submissions per second above which a region counts as launch-bound (adaptive): a region of
# kernels shorter than ~0.2 ms each, where host-side CPU noise is a visible part of a timing.
ADAPTIVE_RATE = 5000.0
SHIM_NAME = "libkrex_interpose.so"
# GPU driver and runtime libraries, by file name (the simulated ones have the same names).
GPU_LIBS = (b"libcuda.so", b"libcudart.so", b"libamdhip64.so")
# A process that maps none of these and has none of GPU_DEVICES open cannot reach a GPU
# (Inspector.gpu_less): the driver and runtime libraries, the simulated device's, and the
# device files through which a program without them (raw ioctls) would go.
GPU_LESS_LIBS = (*GPU_LIBS, b"libnvidia-", b"libhsa-runtime", b"libkrexsim.so")
GPU_DEVICES = ("/dev/nvidia", "/dev/kfd", "/dev/dri/")
# ... and what a process that drives a GPU maps, whatever its libraries are called: the
# device files, and KREX's shared memory (krexd's segment, the simulated device).
_GPU_MAPS = (*(d.encode() for d in GPU_DEVICES), b" /dev/shm/krex")
# The environment the shim reads at load.
ENV_KEYS = (b"KREX_SHM", b"KREX_SLOT", b"KREX_SLOT_GEN", b"KREX_SOCKET", b"KREX_SIM_SHM")
# A process without the shim (or the segment) in its maps may only not have mapped it yet
# (the loader of a process that just exec'd): such facts are read again after this long.
RECHECK_S = 0.5

_HELD, _NONE = int(lib.KREX_TRUST_HELD), int(lib.KREX_TRUST_NONE)  # read once: cffi lookups cost
# What an exit does to a record that held: its helper thread ends, its executable stops reading.
_EXIT_CODES = (_HELD, int(lib.KREX_TRUST_EXECD), int(lib.KREX_TRUST_NO_HELPER))
RECORD_WHY = {
    int(lib.KREX_TRUST_FILLING): "its process record is being written",
    int(lib.KREX_TRUST_DAMAGED): "its process record is damaged",
    int(lib.KREX_TRUST_OTHER_SLOT): "it registered under another command's slot",
    int(lib.KREX_TRUST_STALE): "it registered under an earlier command of its slot",
    int(lib.KREX_TRUST_NO_HELPER): "its drain helper is not running",
    int(lib.KREX_TRUST_EXECD): "it exec'd since it registered (its drain helper is gone)",
    int(lib.KREX_TRUST_FOREIGN_NS): "it loaded a GPU library into another link-map namespace (dlmopen), "
    "whose calls pass no hook",
    int(lib.KREX_TRUST_UNSEEN): "it loaded a CUDA runtime the hooks cannot see (unseen-runtime): its "
    "launches through it pass no hook",
}
_UNSEEN = int(lib.KREX_TRUST_UNSEEN)


@dataclass(frozen=True)
class Verdict:
    gateable: bool  # held by the gate: its slot needs no freeze for it
    why: str = ""
    # Not proven held: besides the freeze, the work it may have queued is not KREX's to
    # drain (waited for on the device, or the region flagged). False with gateable False:
    # a held record whose launches bypass the hooks (static runtime): frozen, drained.
    unheld: bool = False


@dataclass(frozen=True)
class Facts:
    """One image of a process as its maps, executable and environment show it."""

    shim: bool = False
    segments: frozenset[tuple[int, int]] = frozenset()  # (device, inode) of each /dev/shm file it maps
    gpu_libs: tuple[str, ...] = ()  # GPU libraries it maps
    twice: tuple[str, ...] = ()  # ... at two or more bases (a second link-map namespace)
    static_cudart: bool = False
    env: dict[bytes, bytes] = field(default_factory=dict)  # ENV_KEYS it started with
    error: str = ""  # why they could not be read
    final: bool = True  # False: may change while this image lives (read again after RECHECK_S)


@dataclass(frozen=True)
class SlotRef:
    """What a sibling process is judged against: its command's slot in krexd's segment."""

    slot: int
    generation: int
    shm_name: str
    seg_id: tuple[int, int] | None  # (device, inode) of krexd's segment (segment_id)
    raw: Any = None  # the segment (cffi pointer) whose records are read; None: no records


_PENDING = Facts(error="not inspected yet (now queued)", final=False)
_HELD_VERDICT = Verdict(True)


class Inspector:
    """Per-image facts, cached by (pid, start time, executable, procfs.Stat.image):
    reading a process's maps costs about a millisecond (more for a process that imported
    torch), and commands live for many regions. A region inspects at most INSPECT_INLINE
    new images itself; past that it asks with `inspect=False`: an image not inspected yet
    is judged unheld unless its record holds it (its slot is frozen: the safe side) and is
    queued, and krexd's inspector thread (`inspect_pending`, `seen`) inspects it off the
    region's path. On the H200, first inspections of a family's fresh compile workers
    made a region's entry wait 66-90 ms with nothing left to drain."""

    def __init__(self, shim_name: str = SHIM_NAME) -> None:
        self.shim_name = shim_name
        self._cache: dict[tuple[Any, ...], Facts] = {}
        self._static: dict[tuple[str, int, int], bool] = {}
        self._lock = threading.Lock()  # the cache is shared by region threads and the inspector's
        self._pending: set[int] = set()
        self._pids: set[int] = set()  # pids with some facts cached
        # pid -> (the key of its facts that may change, when they go stale); one per pid
        self._recheck: dict[int, tuple[tuple[Any, ...], float]] = {}
        self.wanted = threading.Event()  # set when a region queued a process to inspect

    def verdict(self, pid: int, ref: SlotRef, inspect: bool = True) -> Verdict | None:
        """None: the process is gone."""
        return self._verdict(pid, ref, inspect)[0]

    def facts(self, pid: int, inspect: bool = True) -> Facts | None:
        """The facts of the process's current image (None: gone)."""
        got = self._facts(pid, inspect)
        return None if got is None else got[2]

    def _facts(self, pid: int, inspect: bool) -> tuple[procfs.Stat, str, Facts, bool] | None:
        """(its stat, its executable's name, its facts, whether this call read its maps:
        the inline budget's unit); None: gone."""
        st = procfs.pid_stat(pid)
        # An ended process not reaped yet (a zombie whose only thread is its dead leader)
        # runs nothing again, and its files, GPU ones too, are closed; its executable no
        # longer reads. Taken as gone: torch.compile's short-lived children leave such zombies,
        # and slots were frozen for processes whose executable did not read (25-130 ms of
        # entry on the H200). Not "X": a leader released mid-exec reads so.
        if st is None or (st.state == "Z" and st.threads == 1):
            return None
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:  # a kernel thread, or gone, or not ours to read: cannot vouch for it
            if not _alive(pid):
                return None
            # Inside its exit too (PF_EXITING): its leader's memory is released, but another
            # thread may still hold its GPU files, and the slot's freeze ends only once that
            # thread has left (after its contexts' teardown).
            return st, "?", Facts(error="its executable cannot be read", final=False), False
        key = (pid, st.start, exe, st.image)
        with self._lock:
            f = self._cache.get(key)
            rc = self._recheck.get(pid)
            if f is not None and not f.final and (rc is None or rc[0] != key or time.monotonic() >= rc[1]):
                f = None  # stale: read again
            if f is None and not inspect:
                self._pending.add(pid)
        if f is not None:
            return st, exe, f, False
        if not inspect:
            self.wanted.set()
            return st, exe, _PENDING, False
        f = self._inspect(pid, exe)
        with self._lock:
            if len(self._cache) > 65536:
                self._cache.clear()
                self._pids.clear()
                self._recheck.clear()
            self._cache[key] = f
            self._pids.add(pid)
            if f.final:
                self._recheck.pop(pid, None)
            else:
                self._recheck[pid] = (key, time.monotonic() + RECHECK_S)
        return st, exe, f, True

    def _verdict(self, pid: int, ref: SlotRef, inspect: bool) -> tuple[Verdict | None, bool]:
        """(the verdict, whether this call read the process's maps)."""
        got = self._facts(pid, inspect)
        if got is None:
            return None, False
        st, exe, facts, read = got
        code = _NONE
        if ref.raw is not None:  # the record first: one pass over shared memory
            code = lib.krex_proc_trust(ref.raw, pid, st.start, ref.slot, ref.generation)
        return judge(pid, exe, code, facts, ref, self.shim_name, bool(st.flags & procfs.PF_EXITING)), read

    def gpu_less(self, pid: int) -> bool:
        """Whether the process, read now, cannot have run GPU work: no thread of it maps a
        GPU driver, runtime or simulated-device library or a GPU device (GPU_DEVICES, or a
        KREX shared-memory file: krexd's segment, the simulated device), no thread holds a
        GPU device file open, and its executable does not link the CUDA runtime statically.
        Compilers and linkers that siblings' JIT compiles start (cc1, ptxas, ld) are such
        processes. Every thread is read (a leader that exited leaves its maps and files empty
        while its other threads run on; a thread may have a file table of its own), afresh:
        a process may load a library or open a device at any time. False when any of it
        cannot be read (another user's process to a krexd that is not root): when in doubt,
        it is not. Library names are only a first look: a GPU library under another name
        still maps the device it drives."""
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return False
        mapped = False
        for tid in tasks:
            base = f"/proc/{pid}/task/{tid}"
            try:
                # Threads share one memory map: read it from the first thread that has one
                # (a map of a large process costs about a millisecond).
                maps = b""
                if not mapped:
                    with open(f"{base}/maps", "rb") as f:
                        maps = f.read()
                fds = os.listdir(f"{base}/fd")
            except FileNotFoundError:
                continue  # a thread that ended meanwhile
            except OSError:
                return False
            mapped = mapped or bool(maps)
            if any(b"/" + n in maps for n in GPU_LESS_LIBS) or any(d in maps for d in _GPU_MAPS):
                return False
            for fd in fds:
                try:
                    target = os.readlink(f"{base}/fd/{fd}")
                except FileNotFoundError:
                    continue  # closed meanwhile
                except OSError:
                    return False
                if target.startswith(GPU_DEVICES):
                    return False
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            return not mapped  # every thread inside its exit, its memory released
        return not self._static_cudart(pid, exe)

    def seen(self, pid: int) -> bool:
        """Whether some facts for this pid are cached (any image) and none have gone stale."""
        with self._lock:
            if pid not in self._pids:
                return False
            rc = self._recheck.get(pid)
            return rc is None or time.monotonic() < rc[1]

    def inspect_pending(self) -> int:
        """Inspect the processes regions queued; how many. Forgets the stale facts of
        processes that have ended."""
        with self._lock:
            todo = list(self._pending)
            self._pending.clear()
            for pid in [p for p in self._recheck if not _alive(p)]:
                del self._recheck[pid]
        for pid in todo:
            self._facts(pid, True)  # (a pid that exec'd meanwhile is read as its new image)
        return len(todo)

    def _inspect(self, pid: int, exe: str) -> Facts:
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                maps = f.read()
        except OSError as e:
            return Facts(error=f"cannot read its maps ({e.strerror})", final=False)
        segs, libs = _mapped(maps)
        env = _environ(pid)
        shim = self.shim_name.encode() in maps
        return Facts(
            shim=shim,
            segments=frozenset(segs),
            gpu_libs=tuple(sorted(libs)),
            twice=tuple(sorted(n for n, bases in libs.items() if bases > 1)),
            static_cudart=self._static_cudart(pid, exe),
            env=env if env is not None else {},
            error="" if env is not None else "cannot read its environment",
            # Not mapped yet, maybe: a process right after its exec, before its loader ran
            # (the shim attaches in its constructor when KREX_SHM and KREX_SLOT are set).
            final=env is not None
            and shim
            and (bool(segs) or not (env.get(b"KREX_SHM") and env.get(b"KREX_SLOT"))),
        )

    def _static_cudart(self, pid: int, exe: str) -> bool:
        path = f"/proc/{pid}/exe"  # the file the process runs, even if renamed or deleted
        try:
            st = os.stat(path)
        except OSError:
            return False
        key = (exe, st.st_dev, st.st_ino)
        if key not in self._static:
            self._static[key] = elfcheck.inspect(path).static_cudart
        return self._static[key]


def judge(
    pid: int,
    exe: str,
    code: int,
    facts: Facts,
    ref: SlotRef,
    shim_name: str = SHIM_NAME,
    exiting: bool = False,
) -> Verdict:
    """A process's verdict from its record's answer (`code`, krex_proc_trust) and the facts
    of its image (`exe`: its executable), against its command's slot `ref` (module
    docstring). The held cases first and without building a reason: this runs for every
    sibling process of every region. `exiting`: inside its exit (PF_EXITING): a registered
    one whose helper or executable is gone is frozen, not unheld: its gated work was
    drained, and its teardown is waited for as every exit is (regionchecks.py, _await_exits)."""
    held = code == _HELD
    env = facts.env
    if held:
        if facts.shim and not (facts.error or facts.twice or facts.static_cudart):
            return _HELD_VERDICT
    elif code == _NONE and (
        facts.shim
        and not (facts.error or facts.twice or facts.static_cudart)
        and env.get(b"KREX_SHM") == ref.shm_name.encode()
        and (
            env.get(b"KREX_SLOT") == str(ref.slot).encode()
            and env.get(b"KREX_SLOT_GEN") == str(ref.generation).encode()
            or not env.get(b"KREX_SLOT")
            and bool(env.get(b"KREX_SOCKET"))
        )
        and ref.seg_id is not None
        and ref.seg_id in facts.segments
    ):
        return _HELD_VERDICT
    why, unheld = _unheld_why(pid, exe, code, facts, ref)
    if unheld and exiting and code in _EXIT_CODES and (code != _HELD or facts.error):
        return Verdict(False, f"{why} (inside its exit)")
    return Verdict(False, why, unheld)


def _unheld_why(pid: int, exe: str, code: int, facts: Facts, ref: SlotRef) -> tuple[str, bool]:
    """(why the process is not held, whether it is unheld: False for a held record whose
    executable links the CUDA runtime statically, or not inspected yet: frozen, drained)."""
    name = f"pid {pid} ({os.path.basename(exe)})"
    held = code == _HELD
    if code == _UNSEEN:  # gated and drained by its record, as a static runtime in its executable
        return f"{name}: {RECORD_WHY[code]}", False
    if not held and code != _NONE:
        return f"{name}: {RECORD_WHY.get(code, f'its record says {code}')}", True
    if facts is _PENDING and held:
        # Gated and drained by its record; only its executable (a static runtime) and a
        # second namespace made by another way than dlmopen are not known yet.
        return f"{name}: not inspected yet (now queued)", False
    if facts.error:
        return f"{name}: {facts.error}", True
    if facts.twice:
        return (
            f"{name} maps {', '.join(facts.twice)} at two bases: GPU calls from another link-map namespace "
            "(dlmopen) pass no hook",
            True,
        )
    if not facts.shim:
        return f"{name} runs without the KREX shim", True
    if facts.static_cudart:
        if held:
            return f"{name} links the CUDA runtime statically", False
        return f"{name} links the CUDA runtime statically and made no hooked call: nothing drains it", True
    env = facts.env
    shm = env.get(b"KREX_SHM")
    if shm != ref.shm_name.encode():
        what = "not set" if shm is None else f"{shm.decode(errors='replace')!r}, not this krexd's segment"
        return f"{name}: its shim is inactive (KREX_SHM {what})", True
    slot = env.get(b"KREX_SLOT")
    if not slot:
        if not env.get(b"KREX_SOCKET"):
            return f"{name}: its shim is inactive (no KREX_SLOT, no KREX_SOCKET)", True
    elif slot != str(ref.slot).encode():
        return f"{name}: KREX_SLOT={slot.decode(errors='replace')!r}, not its command's slot {ref.slot}", True
    elif (gen := env.get(b"KREX_SLOT_GEN")) != str(ref.generation).encode():
        shown = gen.decode(errors="replace") if gen else "(unset)"
        return f"{name}: KREX_SLOT_GEN={shown} is not its slot's generation {ref.generation}", True
    return (
        f"{name} has not attached krexd's segment (another user, or started before the segment was made): "
        "its calls pass the gate",
        True,
    )


def _mapped(maps: bytes) -> tuple[set[tuple[int, int]], dict[str, int]]:
    """From /proc/PID/maps: the (device, inode) of each /dev/shm file mapped, and each GPU
    library mapped with how many bases it has (mappings at file offset 0: one per
    link-map namespace that loaded it). Only the lines that name them are parsed."""
    segs: set[tuple[int, int]] = set()
    bases: dict[tuple[int, int, str], int] = {}
    for needle in (b" /dev/shm/", *(b"/" + n for n in GPU_LIBS)):
        at = maps.find(needle)
        while at >= 0:
            start = maps.rfind(b"\n", 0, at) + 1
            end = maps.find(b"\n", at)
            end = len(maps) if end < 0 else end
            parts = maps[start:end].split(None, 5)
            at = maps.find(needle, end)
            if len(parts) < 6:
                continue
            try:
                major, minor = (int(x, 16) for x in parts[3].split(b":"))
                ident = (os.makedev(major, minor), int(parts[4]))
                off = int(parts[2], 16)
            except ValueError:
                continue
            if needle == b" /dev/shm/":
                segs.add(ident)
                continue
            base = os.path.basename(parts[5].decode(errors="replace")).removesuffix(" (deleted)")
            k = (*ident, base)
            bases[k] = bases.get(k, 0) + (off == 0)
    libs: dict[str, int] = {}
    for (_d, _i, base), n in bases.items():
        libs[base] = max(libs.get(base, 0), n)
    return segs, libs


def _environ(pid: int) -> dict[bytes, bytes] | None:
    """The ENV_KEYS of the environment the process started with (the first of each, as
    getenv finds); None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    out: dict[bytes, bytes] = {}
    for item in raw.split(b"\0"):
        k, eq, v = item.partition(b"=")
        if eq and k in ENV_KEYS and k not in out:
            out[k] = v
    return out


def segment_id(addr: int) -> tuple[int, int] | None:
    """(device, inode) of the file mapped at `addr` in this process (krexd's segment, as
    its commands' maps show it); None when no mapping starts there."""
    want = f"{addr:x}-".encode()
    try:
        with open("/proc/self/maps", "rb") as f:
            for line in f:
                if line.startswith(want):
                    parts = line.split(None, 5)
                    major, minor = (int(x, 16) for x in parts[3].split(b":"))
                    return os.makedev(major, minor), int(parts[4])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def classify(
    pids: Iterable[int], inspector: Inspector, ref: SlotRef, inline: list[int] | None = None
) -> list[tuple[int, Verdict]]:
    """The processes of one sibling command that the gate does not hold, with why. `inline`:
    a budget (one number, spent as used) of images not inspected yet that may be inspected
    now; past it such an image is judged unheld unless its record holds it (Inspector).
    None: no limit. Their records are read in one pass (krex_proc_trust_n)."""
    got: list[tuple[int, procfs.Stat, str, Facts]] = []
    for pid in pids:
        g = inspector._facts(pid, inline is None or inline[0] > 0)
        if g is None:
            continue
        if inline is not None and g[3]:
            inline[0] -= 1
        got.append((pid, g[0], g[1], g[2]))
    if not got:
        return []
    if ref.raw is None:
        codes: Any = [_NONE] * len(got)
    else:
        codes = ffi.new("int32_t[]", len(got))
        lib.krex_proc_trust_n(
            ref.raw,
            ffi.new("int64_t[]", [g[0] for g in got]),
            ffi.new("uint64_t[]", [g[1].start for g in got]),
            len(got),
            ref.slot,
            ref.generation,
            codes,
        )
    out: list[tuple[int, Verdict]] = []
    for i, (pid, st, exe, facts) in enumerate(got):
        v = judge(pid, exe, codes[i], facts, ref, inspector.shim_name, bool(st.flags & procfs.PF_EXITING))
        if not v.gateable:
            out.append((pid, v))
    return out


def ungateable(
    pids: Iterable[int], inspector: Inspector, ref: SlotRef, inline: list[int] | None = None
) -> list[str]:
    """Why these processes are not held by the gate (empty: all are)."""
    return [v.why for _pid, v in classify(pids, inspector, ref, inline)]


def effective(policy: str, last_rate: float | None) -> str:
    """The policy a region applies: `adaptive` resolves to `all` or `gpu`."""
    if policy != "adaptive":
        return policy
    return "all" if last_rate is None or last_rate > ADAPTIVE_RATE else "gpu"


def check(policy: str) -> str:
    from krex.errors import UsageError

    if policy not in POLICIES:
        raise UsageError(f"unknown freeze policy {policy!r}", f"use one of: {', '.join(POLICIES)}")
    return policy
