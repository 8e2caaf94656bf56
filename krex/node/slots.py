"""krexd's slots: the Slot record of each admitted command, the slot table's claims and
releases (checked against the segment first), pre-warmed admission (a GPU's free slots go to
its pre-warmed commands, oldest first), recovery of a previous daemon's slots, the process
trees of slots and their leftovers, and a guardian lost before its command ended."""

from __future__ import annotations

import collections
import contextlib
import os
import pwd
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from krex.errors import DaemonLost, KrexError, NotFound
from krex.native import lib
from krex.node import coretime, cpus, freezer, procfs, regionqueue
from krex.node.records import GuardianLost
from krex.node.segguard import Expected
from krex.node.state import DaemonState, log
from krex.protocol import int_field

# A slot's region records kept for its report (the `release` reply); its tally counts every
# region, and the report says how many it does not list.
RELEASE_MAX_RECORDS = 1000


@dataclass(eq=False)  # identity semantics: slots are dict keys and set members
class Slot:
    slot: int
    gpu: int
    # "run" (a krex run guardian), "auto" (a self-registered process) or "orphan" (processes
    # of a command from before krexd restarted on a fresh segment: see _adopt_orphans)
    kind: str
    guardian_pid: int
    group: freezer.Group
    # pid -> its start time (clock ticks): a root that died and whose pid was reused by
    # an unrelated process must not make that process a member of the slot.
    root_pids: dict[int, int] = field(default_factory=dict)
    guardian_connected: bool = True
    created: float = field(default_factory=time.time)
    started_ns: int = field(default_factory=time.monotonic_ns)  # (the MPS client faults it ran beside)
    freeze: str | None = None  # the command's own freeze policy (krex run --freeze), else the daemon's
    # Admitted pre-warmed (Config.prewarm): started before a slot freed up; its processes wait at
    # their first gated call (and its regions in _begin) until _promote gives it the GPU.
    warm: bool = False
    warm_s: float | None = None  # how long it waited pre-warmed, once given the GPU
    last_rate: float | None = None  # submissions per second of its last region (adaptive policy)
    generation: int = 0  # the segment's slot generation when this slot was claimed
    last_deep_scan: float = 0.0
    # Its regions' records, for the guardian's report (the `release` reply): krexd's own
    # record of the command, never read back from a journal that may have rotated. The
    # first RELEASE_MAX_RECORDS are kept; those past it are counted in `records_dropped`.
    records: list[dict[str, Any]] = field(default_factory=list)
    records_dropped: int = 0
    # optin.region_tally of all its regions (kept past `records`' limit): the release's notes
    # and the report's counts; optin.auto_labels of all its regions: the auto_region counts.
    tally: dict[str, Any] = field(default_factory=dict)
    auto_labels: dict[str, int] = field(default_factory=dict)
    # For the native guardian's report (`release` with "report": true): its admit's wait
    # and whether it runs on the simulated device.
    admission_wait_s: float = 0.0
    simulated: bool = False
    # The native guardian's KREX_AUTO_REGION (its admit): the release's notes and report.
    auto_value: str = ""
    # Whose share of the GPU's exclusive time its regions use (regionqueue): `krex run
    # --tenant`, else its user's name.
    tenant: str = ""
    # Where its group went (below the caller's cgroup, or a fallback and why): the admit's
    # notes, the report and, for a fallback, its regions' records.
    placement: freezer.Placement | None = None
    # Its processes' time on its GPU's region core, counted in other commands' regions
    # (coretime; opened at its first such region, closed with the slot).
    core_watch: list[coretime.CoreWatch] | None = None


def _roots(pids: Iterable[int]) -> dict[int, int]:
    """pid -> start time of those still alive (one gone already cannot be told from a reuse)."""
    out = {}
    for p in pids:
        start = int(lib.krex_pid_start_ticks(p))
        if start:
            out[p] = start
    return out


def _user_name(uid: int) -> str:
    """A command's default tenant: its user's name (the uid where it has none)."""
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid-{uid}"
    try:
        return regionqueue.check_tenant(name)
    except KrexError:
        return f"uid-{uid}"


def _is_root(s: Slot, pid: int) -> bool:
    """`pid` is one of the slot's root processes (the same process, not a reuse of its pid)."""
    start = s.root_pids.get(pid)
    return start is not None and lib.krex_pid_alive(pid, start) == 1


class Slots(DaemonState):
    """The slot table and the segment's check (the Daemon's first layer)."""

    def slots_per_gpu(self, gpu: int) -> int:
        if self.cfg.slots_per_gpu:
            return self.cfg.slots_per_gpu
        return cpus.default_slots_per_gpu(self.partition, gpu)

    def _recover(self) -> dict[str, int]:
        """Leave nothing from a previous daemon frozen or closed (I4, I5)."""
        thawed = self.freezer.recover()
        reopened = 0
        now = int(lib.krex_now_ns())
        for g in range(self.info.count):
            w = self.seg.gate_word(g)
            h = self.seg.holder(g, w) if w != lib.KREX_GATE_OPEN else None
            live_pause = h is not None and h[0] == lib.KREX_HOLDER_PAUSE and (h[2] == 0 or h[2] > now)
            if w != lib.KREX_GATE_OPEN and not live_pause and self.seg.open_gate(g, w):
                reopened += 1
        reaped = self.seg.reap_records()  # records only: slots are judged below
        # A slot whose guardian or processes still live is adopted: its command is a
        # sibling like any other (frozen during regions) until its processes are gone.
        adopted = 0
        for n in range(lib.KREX_MAX_SLOTS):
            sp = self.seg.raw.slots[n]
            if sp.state != lib.KREX_SLOT_ACTIVE:
                continue
            gpu = int(sp.gpu) if 0 <= sp.gpu < self.info.count else 0
            group = self.freezer.group(f"slot-{n}")
            slot = Slot(
                n,
                gpu,
                "run",
                int(sp.owner_pid),
                group,
                _roots(self.seg.slot_pids(n)),
                guardian_connected=False,
                generation=int(sp.generation),
                warm=bool(sp.warm),  # still pre-warmed: it waits on, in slot order
            )
            if lib.krex_pid_alive(sp.owner_pid, 0) or self._group_pids(slot):
                self.slots[n] = slot
                self._publish_queue_caps()
                adopted += 1
            else:
                with contextlib.suppress(KrexError, OSError):
                    group.remove()
                self.seg.release_slot(n)
        # Groups of the previous daemon that still hold processes, with no slot adopted for
        # them: their command registered in a segment this one replaced (the name unlinked,
        # then krexd killed before it linked it again).
        for group in self.freezer.leftover_groups():
            name = group.name
            n = int(name[5:]) if name.startswith("slot-") and name[5:].isdigit() else -1
            if not 0 <= n < lib.KREX_MAX_SLOTS or n in self.slots:
                continue
            group = self.freezer.group(name)
            with contextlib.suppress(KrexError):
                if group.pids() and lib.krex_slot_claim_n(self.seg.raw, n, 0, 0):
                    self._adopt_orphans(n, 0, group)
                    adopted += 1
        # A daemon killed inside a region left its owner's measuring thread pinned to the
        # region core and, with lent cores, the other threads moved off it: undone here.
        for s in list(self.slots.values()):
            with contextlib.suppress(KrexError):
                sl = self.partition.slice_for(s.gpu)
                full = self.partition.command_cpus(s.gpu, self.cfg.lend_cores)
                cpus.unnarrow(self._group_pids(s), sl.reserved, full)
        with self.lock:
            self._promote()  # slots that freed up with the old daemon go to warm ones now
        return {"thawed": thawed, "reopened": reopened, "reaped": reaped, "adopted": adopted}

    def _adopt_orphans(self, n: int, gpu: int, group: freezer.Group) -> None:
        """Slot `n`'s group holds live processes no slot of this segment knows: a command from
        before krexd restarted on a fresh segment. Their shims registered in the old one, whose
        gate nobody closes, and they would pass a new owner of slot `n` as its own. So the
        number stays theirs (claimed here), and they are frozen in every region under every
        policy (_freeze_choice) until they are gone (the reaper then releases it)."""
        pids = group.pids()
        roots = {p: int(lib.krex_pid_start_ticks(p)) for p in pids}
        gen = int(self.seg.raw.slots[n].generation)
        s = Slot(n, gpu, "orphan", 0, group, roots, guardian_connected=False, generation=gen)
        with self.lock:
            self.slots[n] = s
        log.warning(
            "slot %d: %d process(es) of a command from before this krexd (pids %s) hold its group; "
            "kept as a sibling frozen in every region until they end",
            n,
            len(pids),
            pids[:8],
        )
        self._publish_queue_caps()

    def _new_slot(self, gpu: int, kind: str, guardian_pid: int, warm: bool = False) -> Slot:
        # The slot table lives in the segment, which any process of the user can write:
        # check (and repair) it before claiming from it, as before every grant. Waiting for
        # the next heartbeat instead, a claim right after damage read random slot records
        # as taken ("all 64 slots are taken") or took a slot whose generation was garbage.
        self._guard_tick()
        self._check_not_lost()
        n = self.seg.claim_slot(gpu, guardian_pid, reap=False)
        # Below the cgroup of the guardian (or of the process registering itself): the
        # command stays in its job's or pod's subtree (freezer.place, cgplace).
        group, placed = self.freezer.place(f"slot-{n}", guardian_pid)
        while group.pids():  # a new command has no process yet: these are orphans
            self._adopt_orphans(n, gpu, group)
            n = self.seg.claim_slot(gpu, guardian_pid, reap=False)
            group, placed = self.freezer.place(f"slot-{n}", guardian_pid)
        if placed.note:
            log.warning("slot %d (pid %d): %s", n, guardian_pid, placed.note.removeprefix("krex: warning: "))
        self._unremoved.pop(group.path, None)
        with contextlib.suppress(KrexError):
            group.thaw()
        s = Slot(
            n, gpu, kind, guardian_pid, group, generation=int(self.seg.raw.slots[n].generation), warm=warm
        )
        s.placement = placed
        # Set before the admit reply: the command cannot have started yet.
        lib.krex_slot_set_warm(self.seg.raw, n, int(warm))
        cur = self.current.get(gpu)
        if cur is not None and cur.word and not cur.thawing:
            # Joining once a region has closed the gate (entering or granted): start frozen
            # so I3 holds for newcomers too. The region's end thaws every slot it did not
            # freeze itself; `thawing` is set, under this lock, when it lists them, so a
            # newcomer is either on that list or not frozen at all.
            with contextlib.suppress(KrexError):
                group.freeze(self.cfg.freeze_timeout_s)
        self.slots[n] = s
        self._publish_queue_caps()
        return s

    def _release(self, n: int, reason: str) -> None:
        with self.lock:
            s = self.slots.pop(n, None)
            if s is None:
                return
            for w in s.core_watch or []:  # (one a region still counts closes after its stop)
                w.close()
            log.info("slot %d on gpu %d released (%s, %s pid %d)", n, s.gpu, reason, s.kind, s.guardian_pid)
            for r in self.current.values():
                if r is not None and r.slot == n and not r.ended.is_set():
                    r.end_reason = reason
                    r.ended.set()
            for q in self.queues.values():
                for r in q:
                    if r.slot == n:
                        r.cancelled = True
                        r.granted.set()
            with contextlib.suppress(KrexError):
                s.group.remove()
            if self.freezer.proc_path(s.group) is not None and os.path.isdir(s.group.path):
                # Still busy (a killed leftover not yet reaped): removed by the reaper once
                # empty, so no group is left in the caller's job or pod cgroup.
                self._unremoved[s.group.path] = s.group
            self.seg.release_slot(n)
            self.pending.drop_slot(n)
            self._publish_queue_caps()
            self._promote()
            self.changed.notify_all()

    def _remove_released(self) -> None:
        """Remove the released slots' groups that were still busy at their release (call
        with self.lock: a new slot may be handed the same group meanwhile)."""
        if not self._unremoved:
            return
        used = {s.group.path for s in self.slots.values()}
        for path, group in list(self._unremoved.items()):
            if path in used:
                del self._unremoved[path]
                continue
            with contextlib.suppress(KrexError, OSError):
                if not group.pids():
                    group.remove()
            if not os.path.isdir(path):
                del self._unremoved[path]

    def _publish_queue_caps(self) -> None:
        """Pacing (interpose/pace.c) bounds the queued GPU work a region's entry must drain,
        while two or more commands share a GPU (alone, nothing waits for it): all of it by the
        GPU's drain budget, each command its share (long work taking one of pace_tokens
        turns), or, with no budget, each command's by queue_cap_ms."""
        cap_us = int(self.cfg.queue_cap_ms * 1000)
        budget_us = int(self.cfg.drain_budget_ms * 1000)
        with self.lock:
            per_gpu = collections.Counter(s.gpu for s in self.slots.values())
        for g in range(self.seg.n_gpus):
            shared = per_gpu[g] >= 2
            # The budget first: a shim that reads it never falls back to the cap meanwhile.
            self.seg.raw.gpus[g].pace_tokens = self.cfg.pace_tokens if shared and budget_us else 0
            self.seg.raw.gpus[g].budget_us = budget_us if shared else 0
            self.seg.raw.gpus[g].queue_cap_us = cap_us if shared else 0

    def _slot_of_pid(self, pid: int) -> Slot | None:
        """The slot a process belongs to: its cgroup, else its ancestry."""
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                lines = f.read().splitlines()
            paths_ = [line.split(":", 2)[-1] for line in lines]
            for s in self.slots.values():
                # The group's path as /proc/PID/cgroup names it (a sub-cgroup of it too).
                rel = self.freezer.proc_path(s.group)
                if rel is not None and any(p == rel or p.startswith(rel + "/") for p in paths_):
                    return s
        except OSError:
            pass
        p = pid
        for _ in range(64):
            for s in self.slots.values():
                if _is_root(s, p) or (s.kind == "auto" and p == s.guardian_pid):
                    return s
            st = procfs.pid_stat(p)
            if st is None:
                return None
            p = st.ppid
            if p <= 1:
                return None
        return None

    def _load(self) -> tuple[dict[int, int], dict[int, int]]:
        """Slots per GPU that hold it (leftover processes included), and pre-warmed ones."""
        active = dict.fromkeys(range(self.info.count), 0)
        warm = dict.fromkeys(range(self.info.count), 0)
        for s in self.slots.values():
            (warm if s.warm else active)[s.gpu] += 1
        return active, warm

    def _pick_gpu(self, want: int | None) -> tuple[int, bool] | None:
        """A GPU with a free slot, else one with room for a pre-warmed start: (gpu, warm).
        Call with self.lock. Pre-warmed commands go first (FIFO): a GPU with any is full."""
        self._promote()
        active, warm = self._load()
        gpus = [want] if want is not None else list(active)
        free = [g for g in gpus if active[g] < self.slots_per_gpu(g) and not warm[g]]
        if free:
            return min(free, key=lambda g: active[g]), False
        # A pre-warmed start takes a slot record too: never the last ones (then it queues).
        if len(self.slots) >= lib.KREX_MAX_SLOTS:
            return None
        room = [g for g in gpus if warm[g] < self.cfg.prewarm]
        return (min(room, key=lambda g: warm[g]), True) if room else None

    def _promote(self) -> None:
        """Give each GPU's free slots to its pre-warmed commands, oldest first (on every
        release and admission). Call with self.lock."""
        active, _ = self._load()
        for s in sorted((s for s in self.slots.values() if s.warm), key=lambda s: s.created):
            if active[s.gpu] >= self.slots_per_gpu(s.gpu):
                continue
            s.warm = False
            s.warm_s = round(time.time() - s.created, 6)
            active[s.gpu] += 1
            lib.krex_slot_set_warm(self.seg.raw, s.slot, 0)
            log.info("slot %d on gpu %d: pre-warmed, given the GPU after %.1f s", s.slot, s.gpu, s.warm_s)
            self.changed.notify_all()

    def _slot_for(self, pid: int, msg: dict[str, Any], owned: dict[str, Any]) -> Slot:
        with self.lock:
            s = self._slot_of_pid(pid)
            if s is not None:
                return s
            want = int_field(msg, "gpu", 0)
            assert want is not None
            if not 0 <= want < self.info.count:
                raise NotFound(f"unknown GPU {want}", f"this node has {self.info.count} GPU(s)")
            s = self._new_slot(want, "auto", pid)
            s.tenant = _user_name(owned["uid"])
            s.root_pids.update(_roots([pid]))
            with contextlib.suppress(KrexError):
                s.group.add(pid)
            owned["slot"] = s.slot
            return s

    def _wait_warm(self, s: Slot, pid: int) -> None:
        """A pre-warmed command's region or registration waits for its slot, as its GPU calls
        do in the shim: a region must never close the gate for a command whose own GPU calls
        cannot pass yet. Never for a slot released meanwhile, nor for a process that died."""
        with self.lock:
            while s.warm and self.slots.get(s.slot) is s and not self.stop.is_set():
                if not lib.krex_pid_alive(pid, 0):
                    raise NotFound(f"pid {pid} ended while its command waited pre-warmed", "")
                self.changed.wait(0.5)
            if self.slots.get(s.slot) is not s:
                raise NotFound(
                    f"the slot of pid {pid} was released while its command waited pre-warmed",
                    "start the command again",
                )
        if self.stop.is_set():
            raise DaemonLost("the daemon is stopping", "run again; it starts on demand")

    def _group_pids(self, s: Slot, deep: bool = False) -> list[int]:
        """Live processes of a slot's tree: its freezer group, its root pids, the processes
        registered under it in the segment and, with `deep`, every process whose
        environment names this slot and its generation (one that left the group or the
        ancestry still carries them)."""
        try:
            pids = set(s.group.pids())
        except KrexError:
            pids = set()
        pids |= {p for p, t in s.root_pids.items() if lib.krex_pid_alive(p, t)}
        pids |= set(self.seg.slot_pids(s.slot))
        if deep:
            pids |= self._env_tagged(s.slot, s.generation)
        pids.discard(self.pid)
        pids.discard(s.guardian_pid)  # the guardian lives outside the slot
        return sorted(p for p in pids if lib.krex_pid_alive(p, 0))

    def _env_tagged(self, slot: int, generation: int) -> set[int]:
        """Processes whose environment says they belong to slot `slot` of generation
        `generation` of our segment (what `krex run` gives its command): those that left
        the slot's group and its ancestry too. Every /proc/PID/environ is read, from a scan
        that began after this call (FreshScan), so concurrent releases share one scan."""
        want_slot, want_gen = str(slot).encode(), str(generation).encode()
        return {
            pid
            for pid, vals in self._tag_scan.get().items()
            if want_slot in vals[b"KREX_SLOT"] and want_gen in vals[b"KREX_SLOT_GEN"]
        }

    def _deep_scan_due(self, s: Slot) -> bool:
        now = time.monotonic()
        if now - s.last_deep_scan < 1.0:
            return False
        s.last_deep_scan = now
        return True

    def _leftovers(self, n: int, policy: str, slot: Slot | None = None) -> dict[str, Any]:
        """The command of slot `n` ended: what of its tree still lives is a leftover. Kill
        them (the default, as most runners do) or keep them as a sibling slot that lives on
        (frozen in other commands' regions) until they end. Either way the slot number is
        not handed out while one of them lives. `slot`: that command's Slot (nothing is done
        if the number went to another command meanwhile)."""
        with self.lock:
            s = self.slots.get(n)
        if s is None or (slot is not None and s is not slot):
            return {"leftovers": [], "action": "none"}
        found = self._group_pids(s, deep=True)
        info = [{"pid": p, "cmd": procfs.cmdline(p, 200) or "?"} for p in found]
        if not found:
            return {"leftovers": [], "action": "none"}
        if policy == "keep":
            return {"leftovers": info, "action": "kept"}
        deadline = time.monotonic() + 5.0
        while found and time.monotonic() < deadline:
            s.group.kill_all(found)
            time.sleep(0.02)
            found = self._group_pids(s, deep=True)
        return {"leftovers": info, "action": "kill-failed" if found else "killed", "alive": found}

    def _guardian_lost(self, s: Slot, why: str) -> None:
        """A `krex run` guardian died before its command ended: end the command as a leftover
        is ended (its whole tree, killed), journal it, and free the slot (once its last
        process is gone: the reaper frees a slot whose kill failed)."""
        out = self._leftovers(s.slot, "kill", s)
        log.warning(
            "slot %d: guardian pid %d died (%s); its command was %s: %s",
            s.slot, s.guardian_pid, why, out["action"], [x["pid"] for x in out["leftovers"]],
        )
        lost = GuardianLost(
            time.time(), s.gpu, s.slot, s.guardian_pid, why, out["action"], out["leftovers"], out.get("alive")
        )
        self._journal(lost.as_dict())
        with self.lock:  # (the reaper may have freed it once its processes were gone)
            if self.slots.get(s.slot) is s and out["action"] in ("none", "killed"):
                self._release(s.slot, "guardian-lost")

    def _known_pids(self) -> set[int]:
        """Every process KREX knows on this node: slot trees, registered processes, itself."""
        with self.lock:
            slots = list(self.slots.values())
        pids = {self.pid}
        for s in slots:
            pids.update(self._group_pids(s))
        for n in {int(lib.KREX_PROC_STALE), *range(lib.KREX_MAX_SLOTS)}:
            pids.update(self.seg.slot_pids(n))
        pids.update(self.mps.servers())  # MPS servers hold their clients' contexts
        return pids

    def _expected(self) -> Expected:
        """What the segment must hold, from krexd's own state (call with self.lock)."""
        exp = Expected()
        for g in range(self.info.count):
            r = self.current.get(g)
            exp.gates[g] = {r.word} if r is not None and r.word else set()
            exp.owner[g] = r.slot + 1 if r is not None else -1
        exp.slots = {n: (s.gpu, s.generation) for n, s in self.slots.items()}
        exp.warm = {n for n, s in self.slots.items() if s.warm}
        return exp

    def _guard_tick(self) -> list[str]:
        """Check the segment; on trouble repair it and record an incident. Returns the problems."""
        with self.lock:
            if self.stop.is_set():
                return []  # shutdown clears the header's daemon pid: not an incident
            exp = self._expected()
            problems = self.guard.check(exp)
            if not problems:
                return []
            inc = self.guard.repair(problems, exp, lambda: self._known_pids() - {self.pid})
        log.warning("segment incident: %s; %s", "; ".join(inc.problems), "; ".join(inc.actions))
        return problems

    def _check_not_lost(self) -> None:
        if self.guard.lost:
            raise KrexError(
                f"KREX cannot gate new work: {self.guard.lost}",
                "stop the commands using it, then `krex daemon stop` and start again "
                "(`krex doctor` says more)",
            )
