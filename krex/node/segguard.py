"""krexd's watch over its shared-memory segment.

Everything KREX promises rests on one segment that every process of the user can
write. krexd therefore checks it before every slot claim (an admission, or a region's
automatic slot) and every grant, at the end of every region and every heartbeat
(100 ms): the name still leads to krexd's own segment (its inode), the header (magic,
ABI version, GPU count, size, the random instance number and a check over them), every
process record (a check over its identity fields) and, from krexd's own state, the gate
words and the slot table.

What it does when something is wrong (an *incident*):
- the name was unlinked: it is linked again to krexd's segment, from a hidden hard
  link kept next to it (`<name>.krexpin-<pid>` in /dev/shm), so processes that attach
  from now on get the same segment;
- the name leads to another object: if nothing uses that object, it is replaced by
  krexd's segment again; otherwise the segment is *lost*: krexd refuses new commands
  and regions with a clear error (the commands it already gates stay gated);
- header, records, gates or slots were damaged: the header, gates and slots are
  rewritten from krexd's state and damaged records are dropped.
Every process that was alive at an incident is *tainted*: its view of the segment may
have been wrong. Regions are flagged ("segment") while a tainted process of another
slot lives, and every region that overlaps an incident is flagged. Nothing here
prints; krexd reports incidents through `status` (shown by `krex status` and
`krex doctor`)."""

from __future__ import annotations

import contextlib
import glob
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from krex.native import ffi, lib
from krex.node.shm import Segment, gate_owner, pid_namespace

SHM_DIR = "/dev/shm"
_WHY = {1: "check", 2: "gpu", 4: "drain ack ahead", 8: "slot", 16: "counters"}
BAD_NAMES = {
    lib.KREX_BAD_MAGIC: "magic",
    lib.KREX_BAD_ABI: "ABI version",
    lib.KREX_BAD_GPUS: "GPU count",
    lib.KREX_BAD_SIZE: "size",
    lib.KREX_BAD_CHECK: "header check",
}


def shm_path(name: str) -> str:
    return SHM_DIR + name


def remove_world(name: str, sim_name: str | None) -> list[str]:
    """Unlink a throwaway world's segment `name`, every krexd pin link of it and the simulated
    GPU's segment `sim_name` (a plain `/name` only); the names that were there."""
    gone: list[str] = []
    if not name.startswith("/") or "/" in name[1:]:
        return gone
    for path in [shm_path(name), *glob.glob(glob.escape(shm_path(name)) + ".krexpin-*")]:
        with contextlib.suppress(OSError):
            os.unlink(path)
            gone.append(path[len(SHM_DIR):])
    if sim_name and sim_name.startswith("/") and "/" not in sim_name[1:]:
        with contextlib.suppress(OSError):
            os.unlink(shm_path(sim_name))
            gone.append(sim_name)
    return gone


def _slot_damaged(sp: Any, gpu: int, gen: int, warm: bool) -> bool:
    """A slot krexd handed out that no longer reads as it wrote it (a `warm` set by anyone
    else would hold a command at its first GPU call for ever; cleared, it jumps the queue)."""
    return (
        int(sp.state) != lib.KREX_SLOT_ACTIVE
        or int(sp.gpu) != gpu
        or int(sp.generation) != gen
        or int(sp.inflight) > 65536
        or bool(sp.warm) != warm
    )


@dataclass
class Incident:
    t: float  # epoch seconds
    t_ns: int  # CLOCK_MONOTONIC
    problems: list[str]
    actions: list[str]
    tainted: int

    def to_json(self) -> dict[str, Any]:
        return {
            "ts": round(self.t, 3),
            "t_ns": self.t_ns,
            "problems": self.problems,
            "actions": self.actions,
            "tainted": self.tainted,
        }


@dataclass
class Expected:
    """What krexd believes the segment holds (it owns these words)."""

    gates: dict[int, set[int]] = field(default_factory=dict)  # gpu -> the current region's word
    owner: dict[int, int] = field(default_factory=dict)  # gpu -> owner byte of the current region, or -1
    slots: dict[int, tuple[int, int]] = field(default_factory=dict)  # slot -> (gpu, generation)
    warm: set[int] = field(default_factory=set)  # slots admitted pre-warmed, not yet given the GPU


class SegmentGuard:
    def __init__(self, seg: Segment, n_gpus: int, pid: int, heartbeat_timeout_ns: int) -> None:
        self.seg = seg
        self.name = seg.name
        self.n_gpus = n_gpus
        self.pid = pid
        self.lock = threading.Lock()
        h = seg.raw.hdr
        self.instance = int(h.instance)
        self.created_ns = int(h.created_ns)
        self.heartbeat_timeout_ns = heartbeat_timeout_ns
        self.pidns = pid_namespace()  # what set_daemon publishes (the same process)
        # The whole header as krexd set it up (after set_daemon): a repair writes back every
        # field from here. Its counters follow the segment's while the header reads sound.
        self.want = ffi.new("struct krex_header *")
        ffi.memmove(self.want, ffi.addressof(h), ffi.sizeof("struct krex_header"))
        self.want.n_gpus = n_gpus
        self.want.daemon_pid = pid
        self.want.pidns = self.pidns
        self.want.heartbeat_timeout_ns = heartbeat_timeout_ns
        self.want.flags &= ~lib.KREX_HF_RESTORED
        self.size = int(lib.krex_shm_size())
        self.path = shm_path(self.name)
        # Our own descriptor of the segment: its size is checked, and given back, through it
        # whatever its name now leads to.
        self.fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        st = os.fstat(self.fd)
        self.ino = (st.st_dev, st.st_ino)
        self.pin = f"{self.path}.krexpin-{pid}"
        for old in glob.glob(glob.escape(self.path) + ".krexpin-*"):  # pins of daemons that died
            tail = old.rsplit("-", 1)[-1]
            if old == self.pin or (tail.isdigit() and not lib.krex_pid_alive(int(tail), 0)):
                with contextlib.suppress(OSError):
                    os.unlink(old)
        try:
            os.link(self.path, self.pin)
        except OSError:
            self.pin = ""
        self.incidents: list[Incident] = []
        self.tainted: set[int] = set()
        self.lost = ""  # why, once the segment cannot be trusted for new work

    def close(self) -> None:
        if self.pin:
            with contextlib.suppress(OSError):
                os.unlink(self.pin)
        with contextlib.suppress(OSError):
            os.close(self.fd)

    # ------------------------------------------------------------------ checks
    def _name_state(self) -> str:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return "unlinked"
        except OSError as e:
            return f"unreadable ({e.strerror})"
        return "ok" if (st.st_dev, st.st_ino) == self.ino else "replaced"

    def _file_size(self) -> int:
        try:
            return os.fstat(self.fd).st_size
        except OSError:
            return self.size

    def _header_problems(self) -> list[str]:
        """Which header fields do not read as krexd wrote them (every field but the beat)."""
        h = self.seg.raw.hdr
        bad = int(lib.krex_shm_verify(self.seg.raw, self.n_gpus))
        what = [n for b, n in BAD_NAMES.items() if bad & b]
        w = self.want
        for name, ok in (
            ("instance", int(h.instance) == self.instance),
            ("pid namespace", int(h.pidns) == self.pidns),
            ("daemon pid", int(h.daemon_pid) == self.pid),
            ("heartbeat timeout", int(h.heartbeat_timeout_ns) == int(w.heartbeat_timeout_ns)),
            ("flags", not int(h.flags) & ~lib.KREX_HF_PROCS_FULL),
            # Shims only ever add to it: less than krexd last read is damage.
            ("overflow count", int(w.proc_overflows) <= int(h.proc_overflows) < 1 << 40),
            ("reserved words", not any(int(h.reserved[i]) for i in range(len(h.reserved)))),
        ):
            if not ok:
                what.append(name)
        return what

    def check(self, expected: Expected) -> list[str]:
        """Problems found now (empty when all is well). Cheap enough for every grant."""
        out: list[str] = []
        ns = self._name_state()
        if ns == "unlinked":
            out.append(f"segment {self.name} was unlinked (rm /dev/shm{self.name}?)")
        elif ns == "replaced":
            out.append(f"segment {self.name} now names another object than krexd's")
        elif ns != "ok":
            out.append(f"segment {self.name} is {ns}")
        size = self._file_size()
        if size < self.size:
            # Before anything reads it: a page past the end would fault (the SIGBUS guard
            # would give the size back too, but then only the flag below tells why).
            out.append(f"segment {self.name} was truncated to {size} of {self.size} bytes")
            self._restore_size()
        raw = self.seg.raw
        if int(raw.hdr.flags) & lib.KREX_HF_RESTORED:
            out.append(
                f"segment {self.name} was truncated (truncate -s?); a process that touched it "
                "gave it its size back, zero-filled"
            )
        what = self._header_problems()
        if what:
            out.append(f"segment header damaged ({', '.join(what)})")
        else:
            # Sound: follow the counters shims add to, for a later repair.
            self.want.proc_overflows = int(raw.hdr.proc_overflows)
            self.want.flags = int(raw.hdr.flags) & lib.KREX_HF_PROCS_FULL
        for g, ok in expected.gates.items():
            w = int(raw.gpus[g].gate)
            if not self._gate_ok(w, ok, expected.owner.get(g, -1)):
                out.append(f"gate of GPU {g} holds 0x{w:x}, a word no holder set")
        for n, (gpu, gen) in expected.slots.items():
            sp = raw.slots[n]
            if _slot_damaged(sp, gpu, gen, n in expected.warm):
                out.append(f"slot {n} record damaged")
        odd = [n for n in range(lib.KREX_MAX_SLOTS) if n not in expected.slots and self._slot_bad(n)]
        if odd:
            out.append(f"{len(odd)} slot record(s) hold values no claim wrote")
        idx = ffi.new("int[64]")
        nb = int(lib.krex_proc_audit(raw, self.n_gpus, idx, 64))
        if nb:
            out.append(f"{nb} process record(s) damaged")
        return out

    def _slot_bad(self, n: int) -> bool:
        """A slot krexd does not hold: free, or claimed directly (`krex run --no-daemon`) by a
        live guardian on a real GPU. Anything else was written by something else."""
        sp = self.seg.raw.slots[n]
        st = int(sp.state)
        if st == lib.KREX_SLOT_FREE:
            return False
        if st != lib.KREX_SLOT_ACTIVE or not 0 <= int(sp.gpu) < self.n_gpus:
            return True
        return not lib.krex_pid_alive(sp.owner_pid, 0)

    @staticmethod
    def _gate_ok(w: int, ok: set[int], owner: int) -> bool:
        if w == lib.KREX_GATE_OPEN or w in ok:
            return True
        if gate_owner(w) == lib.KREX_OWNER_NONE:
            return True  # an operator pause (krex pause holds it without krexd)
        # A region of `owner` that has just taken the gate (its word not yet known here).
        return not ok and gate_owner(w) == owner

    # ------------------------------------------------------------------ repair
    def repair(
        self, problems: list[str], expected: Expected, live_pids: Callable[[], set[int]]
    ) -> Incident:
        actions: list[str] = []
        raw = self.seg.raw
        ns = self._name_state()
        if ns == "unlinked":
            actions.append(self._relink())
        elif ns == "replaced":
            actions.append(self._reclaim())
        if self._file_size() < self.size:
            actions.append(self._restore_size())
        fields = self._header_problems()
        if fields or int(raw.hdr.flags) & lib.KREX_HF_RESTORED:
            lib.krex_hdr_restore(raw, self.want)
            actions.append(f"header rewritten from krexd's copy ({', '.join(fields) or 'flags'})")
        for g, ok in expected.gates.items():
            w = int(raw.gpus[g].gate)
            if self._gate_ok(w, ok, expected.owner.get(g, -1)):
                continue
            if ok:
                # A region holds this GPU: put its word back (its owner passes, others wait).
                raw.gpus[g].gate = next(iter(ok))
                actions.append(f"gate of GPU {g} restored to the region's word")
            else:
                self.seg.open_gate(g, w)
                actions.append(f"gate of GPU {g} reopened")
        for n, (gpu, gen) in expected.slots.items():
            sp = raw.slots[n]
            if _slot_damaged(sp, gpu, gen, n in expected.warm):
                sp.gpu, sp.generation, sp.inflight = gpu, gen, 0
                sp.state = lib.KREX_SLOT_ACTIVE
                lib.krex_slot_set_warm(raw, n, int(n in expected.warm))
                actions.append(f"slot {n} rewritten")
        odd = [n for n in range(lib.KREX_MAX_SLOTS) if n not in expected.slots and self._slot_bad(n)]
        for n in odd:
            sp = raw.slots[n]
            sp.gpu, sp.owner_pid, sp.inflight = -1, 0, 0
            sp.state = lib.KREX_SLOT_FREE
        if odd:
            actions.append(f"{len(odd)} damaged slot record(s) freed")
        idx = ffi.new("int[1024]")
        nb = int(lib.krex_proc_audit(raw, self.n_gpus, idx, 1024))
        why: Counter[str] = Counter()
        for k in range(min(nb, 1024)):
            rec = raw.procs[idx[k]]
            code = int(lib.krex_proc_why(raw, ffi.addressof(raw.procs, idx[k]), self.n_gpus))
            why[_WHY.get(code, "repaired meanwhile")] += 1
            rec.check = 0
            rec.pid = 0
        if nb:
            what = ", ".join(f"{k} {v}" for k, v in why.items())
            actions.append(f"{nb} damaged process record(s) dropped ({what})")
        pids = live_pids()
        with self.lock:
            self.tainted |= pids
            inc = Incident(time.time(), time.monotonic_ns(), problems, actions, len(pids))
            self.incidents.append(inc)
            del self.incidents[:-20]
        return inc

    def _restore_size(self) -> str:
        try:
            os.ftruncate(self.fd, self.size)
        except OSError as e:
            self.lost = f"segment {self.name} was truncated and its size cannot be given back: {e.strerror}"
            return f"size not restored: {e.strerror}"
        return f"size restored to {self.size} bytes (the lost part reads as zeroes)"

    def _relink(self) -> str:
        if not self.pin:
            self.lost = f"segment {self.name} was unlinked and krexd holds no link to restore it"
            return "cannot relink: no pin"
        try:
            os.link(self.pin, self.path)
        except FileExistsError:
            return self._reclaim()
        except OSError as e:
            self.lost = f"segment {self.name} was unlinked and could not be linked again: {e.strerror}"
            return f"relink failed: {e.strerror}"
        return "name linked again to krexd's segment"

    def _reclaim(self) -> str:
        """The name leads elsewhere. Take it back only if nothing uses that object."""
        try:
            other = Segment.attach(self.name)
        except Exception:  # noqa: BLE001 - not a KREX segment at all: nobody can be using it as one
            other = None
        if other is not None:
            try:
                snap = other.snapshot()
                busy = [p.pid for p in snap.procs if p.alive]
                daemon = snap.daemon_pid if snap.daemon_pid and lib.krex_pid_alive(snap.daemon_pid, 0) else 0
            finally:
                other.close()
            if busy or (daemon and daemon != os.getpid()):
                self.lost = (
                    f"segment {self.name} was replaced by another one that is in use "
                    f"(daemon {daemon or '-'}, processes {busy[:5]})"
                )
                return "replacement in use: segment lost"
        tmp = f"{self.path}.krexnew-{os.getpid()}"
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            os.link(self.pin, tmp)
            os.replace(tmp, self.path)  # atomic: the name never disappears meanwhile
        except OSError as e:
            self.lost = f"segment {self.name} was replaced and could not be taken back: {e.strerror}"
            return f"reclaim failed: {e.strerror}"
        return "replacement removed; name linked again to krexd's segment"

    # ------------------------------------------------------------------ verdicts
    def flag(self, since_ns: int, owner_pids: set[int]) -> list[str]:
        """Why a region that started at `since_ns` cannot be called clean, if it cannot."""
        out = []
        with self.lock:
            recent = [i for i in self.incidents if i.t_ns >= since_ns]
            self.tainted = {p for p in self.tainted if lib.krex_pid_alive(p, 0)}
            others = self.tainted - owner_pids
        if recent:
            out.append(f"segment incident during the region: {recent[-1].problems[0]}")
        if others:
            out.append(
                f"{len(others)} process(es) that lived through a segment incident still run "
                f"(e.g. pid {min(others)}); their view of the gate may be wrong"
            )
        if self.lost:
            out.append(self.lost)
        return out

    def to_json(self) -> dict[str, Any]:
        with self.lock:
            alive = {p for p in self.tainted if lib.krex_pid_alive(p, 0)}
            return {
                "name": self.name,
                "state": "lost" if self.lost else ("recovered" if self.incidents else "ok"),
                "lost": self.lost,
                "pin": self.pin,
                "incidents": [i.to_json() for i in self.incidents],
                "tainted_alive": sorted(alive)[:50],
            }
