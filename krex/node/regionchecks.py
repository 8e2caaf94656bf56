"""What a region's entry waits for and what its grant and end check: the freeze policy's
choice of siblings, frees settling, exiting siblings, contexts started or ended, the region
core's use, the drain helpers' priority, the segment's trust."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from krex.errors import KrexError
from krex.native import ffi, lib
from krex.node import coretime, cpus, freezepolicy
from krex.node import unheld as unheldwork
from krex.node.loops import Loops
from krex.node.slots import Slot
from krex.node.state import log

if TYPE_CHECKING:
    from krex.node.region import Region, _FreezePlan


def _wait_out(
    probe: Callable[[], set[int] | None], step_s: float, timeout_s: float, stop: threading.Event
) -> tuple[set[int], set[int]]:
    """Re-probe every `step_s`, at most `timeout_s`, until none of the first probe's pids is
    left; a probe that could not answer (None) changes nothing. (Those still left at the
    deadline, those it waited for.)"""
    left = probe() or set()
    waited = set(left)
    deadline = time.monotonic() + timeout_s
    while left and time.monotonic() < deadline and not stop.is_set():
        time.sleep(step_s)
        now = probe()
        if now is not None:
            left &= now
    return left, waited


class RegionChecks(Loops):
    """The Daemon's checks and waits around a region."""

    def _slot_ref(self, s: Slot) -> freezepolicy.SlotRef:
        """What the processes of slot `s` are judged against (freezepolicy.judge)."""
        raw = self.seg.raw
        addr = int(ffi.cast("uintptr_t", raw))
        if self._seg_id is None or self._seg_id[0] != addr:  # read once per segment krexd maps
            self._seg_id = (addr, freezepolicy.segment_id(addr))
        return freezepolicy.SlotRef(s.slot, s.generation, self.shm_name, self._seg_id[1], raw)

    def _freeze_choice(
        self, owner: Slot | None, siblings: list[Slot]
    ) -> tuple[str, list[Slot], list[str], dict[int, tuple[int, str]]]:
        """(effective policy, the siblings to freeze, why each one under `gpu`, the sibling
        processes the gate does not hold: pid -> (slot, why)). The processes are judged
        under every policy: under `all` the unheld ones are frozen with the rest, and their
        queued work is still not KREX's to drain (_unheld_work)."""
        chosen = (owner.freeze if owner else None) or self.cfg.freeze_policy
        policy = freezepolicy.effective(chosen, owner.last_rate if owner else None)
        out: list[Slot] = []
        why: list[str] = []
        unheld: dict[int, tuple[int, str]] = {}
        inline = [freezepolicy.INSPECT_INLINE]  # shared by all siblings of this region
        for s in siblings:
            bad = freezepolicy.classify(self._group_pids(s), self.inspector, self._slot_ref(s), inline)
            unheld.update((pid, (s.slot, v.why)) for pid, v in bad if v.unheld)
            if s.kind == "orphan":  # registered in a segment krexd replaced: no gate holds them
                out.append(s)
                why.append(f"slot {s.slot}: processes of a command from before krexd restarted")
            elif bad:
                out.append(s)
                why.append(f"slot {s.slot}: " + "; ".join(v.why for _p, v in bad[:3]))
        if policy == "all":
            return policy, list(siblings), [], unheld
        return policy, out, why, unheld

    def _phys(self, gpu: int) -> int:
        return self.info.physical[gpu] if gpu < len(self.info.physical) else gpu

    def _sim_shm_of(self, pid: int) -> str | None:
        """The simulated device a process uses (its KREX_SIM_SHM), where krexd read it."""
        f = self.inspector.facts(pid, inspect=False)
        v = f.env.get(b"KREX_SIM_SHM") if f is not None else None
        return v.decode(errors="replace") if v else None

    def _running_siblings(self, fz: _FreezePlan, frozen: list[Slot]) -> list[Slot]:
        """The region's siblings it did not freeze that still hold their slots, once each."""
        with self.lock:
            return [s for s in dict.fromkeys(fz.siblings) if s not in frozen and self.slots.get(s.slot) is s]

    def _unheld_at_end(self, fz: _FreezePlan, frozen: list[Slot]) -> list[tuple[str, str]]:
        """The siblings a region did not freeze, judged again at its end: a process of
        theirs the gate does not hold now (one that exec'd without the shim, or started
        during the region) may have run GPU work inside it."""
        running = self._running_siblings(fz, frozen)
        bad: dict[int, tuple[int, str]] = {}
        for s in running:
            for pid, v in freezepolicy.classify(self._group_pids(s), self.inspector, self._slot_ref(s)):
                # One that cannot reach a GPU now ran no GPU work in the region unless it
                # loaded a GPU library, used it and unloaded it, and closed its device
                # files, all inside the region.
                if v.unheld and not self.inspector.gpu_less(pid):
                    bad[pid] = (s.slot, v.why)
        if not bad:
            return []
        return [
            (
                unheldwork.FLAG,
                f"at the region's end, sibling processes the gate does not hold ran in commands it did not "
                f"freeze ({unheldwork.describe(bad)}): GPU work of theirs may have run inside it",
            )
        ]

    def _look_begin(self, gpu: int, fz: _FreezePlan, frozen: list[Slot]) -> tuple[int, list[int]]:
        """At the region's end, before the thaw: ask the drain helpers of the siblings it did not
        freeze to look at what their processes loaded (krex_look_request). (Its sequence, the
        pids whose ack the end waits for; (0, []) when every sibling was frozen: a frozen one
        loaded nothing.)"""
        pids = [p for s in self._running_siblings(fz, frozen) for p in self._group_pids(s)]
        if not pids:
            return 0, []
        return self.seg.look_request(gpu), pids

    def _look_end(
        self, gpu: int, owner_slot: int, seq: int, pids: list[int], before: dict[tuple[int, int], int]
    ) -> tuple[list[tuple[str, str]], float | None]:
        """Wait (at most KREX_LOOK_TIMEOUT_MS) for the look acks `_look_begin` asked for, then
        compare the siblings' records with `before` (read just before the drain request): one
        flagged since with a way past the hooks (a CUDA runtime the hooks cannot see, a GPU
        library in another namespace) may have queued work the drain did not wait for (its
        record read quiet) or launched inside the region past the gate. A sibling that did
        not ack may have done the same unseen. (The reasons, the seconds it waited; None when
        no look was asked.)"""
        out: list[tuple[str, str]] = []
        timeout = lib.KREX_LOOK_TIMEOUT_MS / 1e3
        waited = None
        if seq:
            r = self.seg.wait_look(gpu, pids, seq, timeout)
            waited = r.seconds
            if not r.ok:
                out.append(
                    (
                        unheldwork.FLAG,
                        f"sibling pids {r.stragglers} did not look at what they loaded within "
                        f"{lib.KREX_LOOK_TIMEOUT_MS} ms of the region's end (stopped or starved): "
                        "a CUDA runtime the hooks cannot see that they loaded would go unseen",
                    )
                )
        names = {int(lib.KREX_PF_UNSEEN): "unseen-runtime", int(lib.KREX_PF_FOREIGN_NS): "foreign-namespace"}
        new = []
        for (pid, start), fl in sorted(self.seg.bypass_procs(gpu, owner_slot).items()):
            got = fl & ~before.get((pid, start), 0)
            if got:
                new.append(f"pid {pid} ({', '.join(n for b, n in names.items() if got & b)})")
        if new:
            out.append(
                (
                    unheldwork.FLAG,
                    f"sibling processes loaded a way past the hooks after the region's drain request "
                    f"({'; '.join(new[:8])}): a CUDA runtime the hooks cannot see (unseen-runtime) or a GPU "
                    "library in another link-map namespace; work they queued through it may have run "
                    "inside the region",
                )
            )
        return out, waited

    def _trust_checks(self, gpu: int, req: Region, since_ns: int) -> list[tuple[str, str]]:
        """Run before the grant and again at the region's end: the segment is krexd's own and
        intact, nothing that lived through an incident could have disturbed the region, and
        the GPU's MPS control daemon (when krexd runs one) did not die in it."""
        self._guard_tick()
        segment = [("segment", text) for text in self.guard.flag(since_ns, self._own_pids(req))]
        return segment + self.mps.flags(gpu, since_ns)

    def _frees_since(self, gpu: int, owner_slot: int, since_ns: int) -> list[tuple[int, int]]:
        """(slot, ns ago) of other commands' slots whose processes freed GPU memory, or exited
        after setting some up, at or after `since_ns` (CLOCK_MONOTONIC, as krex_now_ns). The
        stamps outlive those processes and commands; the owner's slot counts when the stamp is
        of another command that had its number before."""
        gen = self._owner_gen(owner_slot)
        slots, ago = ffi.new("int32_t[64]"), ffi.new("uint64_t[64]")
        n = min(int(lib.krex_recent_frees(self.seg.raw, gpu, owner_slot, gen, since_ns, slots, ago, 64)), 64)
        return [(int(slots[i]), int(ago[i])) for i in range(n)]

    def _owner_gen(self, owner_slot: int) -> int:
        with self.lock:
            s = self.slots.get(owner_slot)
        return s.generation if s is not None else int(self.seg.raw.slots[owner_slot].generation)

    def _settle_until(self, gpu: int, owner_slot: int) -> tuple[int, int]:
        """(until when the GPU may still clear memory other commands freed, the newest of
        their stamps): each slot's stamp carries its own time, sized by the bytes freed where
        the shim could ask the driver, else KREX_FREE_SETTLE_NS (krex_settle_until)."""
        latest = ffi.new("uint64_t *")
        gen = self._owner_gen(owner_slot)
        until = int(lib.krex_settle_until(self.seg.raw, gpu, owner_slot, gen, 0, latest))
        return until, int(latest[0])

    def _running_pids(self, at_close: list[Slot], frozen: list[Slot]) -> dict[Slot, list[int]]:
        """The processes of the commands that were on the GPU as the gate closed, still live
        and not frozen."""
        with self.lock:
            running = [s for s in at_close if s not in frozen and s.slot in self.slots]
        return {s: self._group_pids(s) for s in running}

    def _evict_again(
        self, req: Region, at_close: list[Slot], frozen: list[Slot], reserved: list[int], ev: cpus.Eviction
    ) -> list[tuple[str, str]]:
        """At the grant, after the move started as the gate closed: move the threads and
        processes made meanwhile (looking only at those), and freeze a running sibling with a
        thread pinned to the region core alone (which no move can take off it). The owner's
        own such thread is flagged: it shares the core with the measuring thread."""
        pids = self._running_pids(at_close, frozen)
        cpus.evict([p for ps in pids.values() for p in ps], reserved, req.tid, into=ev)
        out: list[tuple[str, str]] = []
        for s, ps in pids.items():
            stuck = sorted(set(ps) & ev.stuck)
            if not stuck:
                continue
            if s.slot == req.slot:
                out.append(("region-core", f"the owner's pids {stuck} have threads pinned to the region core "
                             f"{cpus.format_cpulist(reserved)}, which the measuring thread shares"))
                continue
            frozen.append(s)  # thawed with the others at the end, whatever happens
            try:
                s.group.freeze(self.cfg.freeze_timeout_s)
            except (KrexError, OSError) as e:
                with self.lock:
                    gone = s.slot not in self.slots
                if not gone:
                    out.append(("freeze-failed", f"slot {s.slot} (threads pinned to the region core) did not "
                                 f"freeze: {e}"))
        return out

    def _watch_region_core(
        self, gpu: int, req: Region, frozen: list[Slot], reserved: list[int]
    ) -> tuple[dict[Slot, list[coretime.CoreWatch]], list[tuple[str, str]]]:
        """At the grant: start counting the time each running sibling's processes (its slot's
        cgroup, every process that comes and goes in it) spend on the region core. Where
        that cannot be counted the region says so if a running sibling might use the core
        (lent, or a degraded partition that shares it)."""
        with self.lock:
            running = [
                s for s in self.slots.values() if s.gpu == gpu and s.slot != req.slot and s not in frozen
            ]
        if not running or not reserved:
            return {}, []
        if self.core_watch_off:
            if self.cfg.lend_cores != "off" and not self.partition.degraded:
                return {}, [("region-core", f"the running siblings' time on the region core cannot be "
                             f"counted ({self.core_watch_off})")]
            return {}, []
        out: dict[Slot, list[coretime.CoreWatch]] = {}
        failed: list[str] = []
        for s in running:
            try:
                if s.core_watch is None:
                    s.core_watch = coretime.watch(s.group.path, reserved)
                for w in s.core_watch:
                    w.start()
                out[s] = s.core_watch
            except (KrexError, OSError) as e:
                with self.lock:
                    if s.slot in self.slots:  # (a slot released meanwhile has nothing left to run)
                        failed.append(f"slot {s.slot}: {e}")
        if not failed:
            return out, []
        return out, [("region-core", "the time some running siblings spend on the region core cannot be "
                      f"counted: {'; '.join(failed)}")]

    def _region_core_time(
        self, watches: dict[Slot, list[coretime.CoreWatch]], reserved: list[int]
    ) -> list[tuple[str, str]]:
        """At the region's end: a running sibling whose processes ran on the region core while
        the region did (one that pinned itself there after the move, a child it started that
        did and ended meanwhile) shared it with the measuring thread."""
        found = []
        for s, ws in list(watches.items()):
            used = [w.stop() for w in ws]
            ns = sum(u.ns for u in used)
            if ns:
                pids = sorted({p for u in used for p in u.pids})
                found.append(f"slot {s.slot} {ns / 1e6:.2f} ms (pids {pids[:8] or 'not sampled'})")
        watches.clear()
        if not found:
            return []
        core = cpus.format_cpulist(reserved)
        return [("region-core", f"processes of running siblings ran on the region core {core} during the "
                 f"region: {', '.join(found)} (those ended by its end included); they shared it with the "
                 "measuring thread")]

    def _audit_region_core(
        self, req: Region, at_close: list[Slot], frozen: list[Slot], reserved: list[int]
    ) -> list[tuple[str, str]]:
        """At the end, before the moved threads get their masks back: a thread of a running
        command (the owner's but the measuring one, or a sibling's) that may run on the
        region core now could have during the region (its command re-widened its mask, or a
        process or thread came after the moves). Commands admitted during the region
        started frozen and are not looked at."""
        pids = self._running_pids(at_close, frozen)
        own = [p for s, ps in pids.items() if s.slot == req.slot for p in ps]
        bad = cpus.audit([p for ps in pids.values() for p in ps], reserved, req.tid, pinned_ok=own)
        if not bad:
            return []
        what = ", ".join(f"pid {p} ({len(t)} thread(s))" for p, t in sorted(bad.items())[:4])
        core = cpus.format_cpulist(reserved)
        return [("region-core", f"threads that may run on the region core {core} were found at the "
                 f"region's end: {what}; they could have shared it with the measuring thread")]

    def _settle(
        self,
        gpu: int,
        owner_slot: int,
        ended_ns: int,
        t: dict[str, float],
        ended_settle_ns: int | None = None,
    ) -> list[tuple[str, str]]:
        """The driver clears freed memory on the GPU after the freeing call returned (or the
        process ended), on a copy-engine channel of its own that no drain orders: wait until
        each other command's latest free may be cleared (its stamp's own time: the bytes it
        freed at KREX_SETTLE_NS_PER_GB where the shim could size it, else
        KREX_FREE_SETTLE_NS), and since `ended_ns` (siblings seen gone during entry) until
        `ended_settle_ns` (sized by the memory they held, Attestor.settle_ns) or else the
        fixed time. Then flag `recent-free` only for frees made meanwhile (no sibling can
        free through a gated call now: a path the gate does not see)."""
        settle = int(lib.KREX_FREE_SETTLE_NS)
        t0 = time.monotonic_ns()
        until, newest = self._settle_until(gpu, owner_slot)
        # Siblings gone by now, each from when krexd found it gone (krex/node/exits.py).
        self.seg.reap_records()
        gen = self._owner_gen(owner_slot)
        gone_until, gone_newest = self.exits.settle_until(gpu, owner_slot, gen)
        t["exit_settle_s"] = max(0, gone_until - t0) / 1e9  # what ended processes alone asked for
        until, newest = max(until, gone_until), max(newest, gone_newest)
        latest = max(ended_ns, newest)
        if ended_ns:
            after_end = settle if ended_settle_ns is None else ended_settle_ns
            until = max(until, ended_ns + after_end)
            t["ended_settle_s"] = after_end / 1e9
        if until > t0:
            time.sleep((until - t0) / 1e9)
        t["settle_s"] = (time.monotonic_ns() - t0) / 1e9
        since = max(latest + 1, time.monotonic_ns() - settle)
        new = self._frees_since(gpu, owner_slot, since)
        self.seg.reap_records()
        now = time.monotonic_ns()
        new += [(x.slot, now - x.seen_ns) for x in self.exits.since(gpu, owner_slot, gen, since)]
        if not new:
            return []
        what = ", ".join(f"slot {s} {ago / 1e6:.0f} ms" for s, ago in new)
        return [
            (
                "recent-free",
                f"other commands freed GPU memory or ended just before the grant ({what} before it), "
                "after krexd had waited for the earlier frees to settle: the driver clears freed memory "
                "on the GPU after the fact",
            )
        ]

    def _await_exits(self, gpu: int, owner_slot: int) -> tuple[set[int], set[int]]:
        """Wait (at most freeze_timeout_s) for sibling processes inside the kernel's exit
        (PF_EXITING, not yet zombies): the freezer cannot stop them, and closing their GPU
        files tears their contexts down on the GPU. Returns (those still exiting at the
        deadline, those it waited for)."""
        probe = lambda: self.seg.exiting(gpu, owner_slot)  # noqa: E731
        return _wait_out(probe, 0.002, self.cfg.freeze_timeout_s, self.stop)

    def _await_teardowns(self, gpu: int) -> set[int]:
        """Wait (at most freeze_timeout_s) while NVML lists a process that has ended: its
        contexts' teardown still runs on the GPU (H200: a sibling reaped just before a grant
        was still listed by NVML, and its region was flagged `foreign-process`). One still
        listed at the deadline is flagged by the attestation. Those it waited for."""
        probe = lambda: self.attestor.listed_gone(gpu)  # noqa: E731
        return _wait_out(probe, 0.005, self.cfg.freeze_timeout_s, self.stop)[1]

    def _sibling_gpu_procs(self, gpu: int, owner_slot: int) -> set[tuple[int, int, int]]:
        """(pid, start time, drain-helper thread) of the other commands' live processes on
        `gpu` that made GPU calls, and of released slots' leftovers: one C pass over the
        records (krex_sibling_procs)."""
        n = lib.KREX_MAX_PROCS
        buf = ffi.new("struct krex_proc_id[]", n)
        got = min(int(lib.krex_sibling_procs(self.seg.raw, gpu, owner_slot, buf, n)), n)
        return {(int(buf[i].pid), int(buf[i].start_ticks), int(buf[i].helper_tid)) for i in range(got)}

    def _boost(self, pid: int, tid: int, name: str | None = None) -> int | None:
        """cpus.boost to helper_nice; None if off, refused (not root: warned once, then
        off), not needed, or `pid` is not of krexd's own user: its records and thread names
        are the command's to write, and raising one's nice back a little needs no privilege,
        so another user's command could keep a boost for good (a shared daemon, `group`)."""
        want = self.cfg.helper_nice
        if want >= 0 or not self._boost_ok or not tid:
            return None
        try:
            if os.stat(f"/proc/{pid}").st_uid != os.geteuid():
                return None
        except OSError:
            return None
        try:
            return cpus.boost(pid, tid, want, name)
        except PermissionError as e:
            self._boost_ok = False
            log.warning(
                "cannot renice threads a region waits for to %d (%s): region entry may wait behind "
                "siblings' CPU work; run krexd as root, or set helper_nice 0",
                want,
                e.strerror,
            )
            return None

    def _boost_helpers(self, procs: Iterable[tuple[int, int, int]]) -> None:
        """Renice the drain helpers of `procs` (pid, start, helper tid) to helper_nice, each
        once: a region's entry waits for every sibling's ack, and a helper at its command's
        nice 0 waited runnable behind that command's CPU-bound threads (H200, CPU-heavy
        family). Only a thread of that pid named krex-drain (a helper tid outlives its
        thread across an exec); only processes of krexd's own user (_boost)."""
        if self.cfg.helper_nice >= 0 or not self._boost_ok:
            return
        with self._boost_lock:
            new = [k for k in procs if k[2] and k not in self._boosted]
        for pid, _st, tid in new:
            self._boost(pid, tid, "krex-drain")
        if new:
            with self._boost_lock:
                self._boosted.update(new)
                if len(self._boosted) > 4 * lib.KREX_MAX_PROCS:  # bounded: forget the dead
                    self._boosted = {k for k in self._boosted if os.path.exists(f"/proc/{k[0]}/task/{k[2]}")}

    def _own_pids(self, req: Region) -> set[int]:
        """The owner and its command's whole process tree (slot group)."""
        with self.lock:
            s = self.slots.get(req.slot)
        return {req.pid, *(self._group_pids(s) if s is not None else [])}

    def _context_changes(
        self,
        gpu: int,
        before: set[tuple[int, int, int]],
        at_grant: set[tuple[int, int, int]],
        after: set[tuple[int, int, int]],
        nvml_entry: dict[str, Any],
        nvml_exit: dict[str, Any],
        skip: set[int],
    ) -> list[tuple[str, str]]:
        """A sibling process that started or ended its GPU work (or exec'd) between the
        gate's closing and the region's end. Setting up or tearing down a GPU context
        (allocations, page tables, scrubbing the memory freed at exit) runs on the GPU
        outside any gated call: under a policy that leaves siblings running it slowed
        kernels over 10 ms by up to 16% in regions that read clean (H200,
        docs/results/lifecycle-calls/). Frozen siblings cannot; one killed while frozen is
        flagged too. NVML adds processes with a context but no gated call that it listed
        at only one end (`skip`: the owner's own and those already flagged foreign). Not
        seen: such a process that comes and goes between the two NVML samples. `before` is
        taken as the gate closed (a start from then on may have set up a context through a
        path the gate does not see), `at_grant` at the grant: a process that ended before the
        grant was torn down before it (its memory's scrubbing is _settle's)."""
        ent, ext = set(nvml_entry.get("procs") or []), set(nvml_exit.get("procs") or [])
        known_before = {p for p, _s, _t in before}
        # A newcomer registers at its first gated call, which then waits at the closed gate:
        # it has run nothing on the GPU unless a context of its own came first through an
        # ungated path, which completes before that call, so NVML lists it at the end. Not
        # flagged when NVML answered and does not list it (on the H200 every `sibling-context`
        # flag under `gpu` was such a start, docs/results/freeze-policies/). An exec'd process (same
        # pid, new image) still is.
        nvml_ok = "procs" in nvml_exit
        started = {p for p, _s, _t in after - before if p in known_before or not nvml_ok or p in ext}
        ended = {p for p, _s, _t in at_grant - after}
        started |= (ext - ent) - skip
        ended |= (ent - ext) - skip
        if not ended and not started:
            return []

        def some(ps: set[int]) -> str:
            xs = sorted(ps)
            return ", ".join(map(str, xs[:5])) + (" ..." if len(xs) > 5 else "")

        what = "; ".join(f"{k} pid {some(ps)}" for k, ps in (("started", started), ("ended", ended)) if ps)
        return [
            (
                "sibling-context",
                f"sibling processes on GPU {gpu} started or ended their GPU work during the region ({what}): "
                "a GPU context's set-up and teardown run on the GPU outside the gate",
            )
        ]
