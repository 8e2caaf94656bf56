"""A region request (Region) and the region protocol of DESIGN.md it runs (RegionRun, one
method per step, its state a RegionState):

  block (close gate) -> catch stragglers (in-flight == 0) -> drain -> freeze siblings
      -> (wait for exiting ones) -> pin the measuring thread -> grant
  end  -> hold (END or --max-region) -> check -> unpin -> thaw -> open gate -> journal

What it sends and leaves, the grant and the region's record, are records.py's."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from typing import Any

from krex.errors import Busy, KrexError
from krex.native import ffi, lib
from krex.node import coretime, cpus, optin, procfs
from krex.node import unheld as unheldwork
from krex.node.records import Grant, Reason, RegionRecord
from krex.node.regionchecks import RegionChecks
from krex.node.slots import RELEASE_MAX_RECORDS, Slot
from krex.node.state import log


@dataclass
class Region:
    slot: int
    gpu: int
    pid: int
    tid: int
    t_request: float
    label: str = ""  # who opened it, e.g. "auto:triton.testing:do_bench"
    tenant: str = ""  # its command's tenant: whose share of the GPU's exclusive time it uses
    word: int = 0  # the gate word while this region holds the gate
    thawing: bool = False  # set (under krexd's lock) once its end has listed whom to thaw
    granted: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    end_reason: str = ""
    grant: dict[str, Any] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)
    after_reply: Callable[[], None] | None = None  # run by the connection thread once the grant is sent


def _same_processes(known: dict[int, int]) -> set[int]:
    """The pids of `known` (pid -> start time) that are gone or still the same process:
    not one that reused the pid since."""
    out = set()
    for pid, start in known.items():
        now = int(lib.krex_pid_start_ticks(pid))
        if now == 0 or now == start:
            out.add(pid)
    return out


class _FreezePlan:
    """Which siblings a region freezes, each started as soon as its processes have acked
    the drain (`progress` is shm.drain's callback). The siblings and the policy are read
    on the first call, right after the drain request; `final=True` after the drain adds
    the siblings that arrived meanwhile and starts every freeze not yet started."""

    def __init__(
        self,
        d: RegionChecks,
        gpu: int,
        owner_slot: int,
        frozen: list[Slot],
        stuck: Iterable[int] = (),
        excuse_life: bool = False,
    ) -> None:
        self.d, self.gpu, self.owner_slot = d, gpu, owner_slot
        # life_freeze: a sibling whose only owed drain is the LIFE call it is inside is frozen
        # at once, and its ack excused once frozen (krex_drain_excuse), not waited for.
        self.excuse_life = excuse_life
        self.excusable: set[int] = set()  # such pids, read at the first plan
        self.excused: list[int] = []  # those frozen and excused (pool threads append)
        self.seq = 0  # the drain request they owed
        self.t0 = time.monotonic()  # (made just before the drain request)
        self.ending = threading.Event()  # the region's thaw began: freeze nothing again
        # Pids still inside a GPU call when the in-flight wait gave up: past the gate, so
        # the gate cannot hold them; their slots are frozen whatever the policy.
        self.stuck = set(stuck)
        self.frozen = frozen  # the region's list, filled as each freeze starts: thawed whatever happens
        self.planned = False
        self.owner: Slot | None = None
        self.policy = ""
        self.why: list[str] = []
        self.siblings: list[Slot] = []
        self.to_freeze: list[Slot] = []
        self.futs: dict[Slot, concurrent.futures.Future[float]] = {}
        self.early = 0  # freezes started while other siblings still drained
        self.life_unfrozen: list[int] = []  # inside a LIFE call, of no slot krexd can freeze
        self.boosted: list[tuple[int, int, int]] = []  # (pid, tid, old nice) lent priority by _plan
        self.lent: list[list[int]] = []  # [pid, tid] of each, for the region's record
        self.draining = True  # until unboost: a plan made after the drain lends nothing
        self.unheld: dict[int, tuple[int, str]] = {}  # sibling pids the gate does not hold: (slot, why)

    def _plan(self, siblings: list[Slot]) -> None:
        policy, chosen, why, unheld = self.d._freeze_choice(self.owner, siblings)
        self.unheld.update(unheld)
        chosen, why = list(chosen), list(why)
        # Read after the gate closed: a LIFE call (context, module, device memory) begun
        # since parks at the gate, so one read finds every one the gate cannot stop.
        life: dict[int, list[int]] = {}
        busy = self.d.seg.life_busy(self.gpu, self.owner_slot)
        for pid, (slot, _tid) in busy.items():
            life.setdefault(slot, []).append(pid)
        if self.draining:
            self._lend(busy, siblings)
        if self.excuse_life and busy:
            self.seq = int(self.d.seg.raw.gpus[self.gpu].drain_seq)  # the request just made
            self.excusable |= self.d.seg.life_only(p for p in busy if p not in self.unheld)
        for s in siblings:
            if s in chosen:
                continue
            if self.stuck & set(self.d._group_pids(s)):
                chosen.append(s)
                why.append(f"slot {s.slot}: a process is still inside a GPU call, past the gate")
            elif s.slot in life:
                chosen.append(s)
                why.append(
                    f"slot {s.slot}: pids {sorted(life[s.slot])} inside a context, module or device "
                    "memory call (or exiting after one), which the gate cannot stop midway"
                )
        known = {s.slot for s in siblings} | {s.slot for s in self.siblings}
        self.life_unfrozen.extend(p for slot, ps in life.items() if slot not in known for p in ps)
        self.policy = self.policy or policy
        self.why.extend(why)
        self.siblings.extend(siblings)
        self.to_freeze.extend(chosen)

    def _lend(self, busy: dict[int, tuple[int, int]], siblings: list[Slot]) -> None:
        """Lend helper_nice to the thread inside each sibling's LIFE call until the drain is
        over (unboost): its drain waits for that call (the helper's sync needs the driver
        lock it holds). Only a process its slot's group holds (the record is the command's
        to write: not one it merely names), of krexd's own user (_boost)."""
        by_slot = {s.slot: s for s in siblings}
        for pid, (slot, tid) in busy.items():
            s = by_slot.get(slot)
            if not tid or s is None:
                continue
            try:
                held = set(s.group.pids()) | set(s.root_pids)
            except KrexError:
                continue
            if pid not in held:
                continue
            old_nice = self.d._boost(pid, tid)
            if old_nice is not None:
                self.boosted.append((pid, tid, old_nice))
                self.lent.append([pid, tid])

    def unboost(self) -> None:
        """The LIFE threads' own nice back (after the drain; again at the region's end)."""
        self.draining = False
        while self.boosted:
            pid, tid, old = self.boosted.pop()
            cpus.unboost(pid, tid, old)

    def progress(self, pending: set[int], final: bool = False) -> None:
        d = self.d
        with d.lock:
            now = [s for s in d.slots.values() if s.gpu == self.gpu and s.slot != self.owner_slot]
            if not self.planned:
                self.owner = d.slots.get(self.owner_slot)
        if not self.planned:
            self.planned = True
            self._plan(now)
        elif final:
            # By identity, not by number: a sibling that ended mid-drain may have left its
            # number to a newcomer, which must be planned (frozen) as well.
            known = set(self.siblings)
            self._plan([s for s in now if s not in known])
        for s in self.to_freeze:
            if s in self.futs:
                continue
            # Its registered pids read now, not at the plan: one that registered since
            # must have acked too.
            owing = set(d.seg.slot_pids(s.slot)) & pending
            if final or not owing:
                self.early += 0 if final else 1
                self.frozen.append(s)
                self.futs[s] = d.pool.submit(s.group.freeze, d.cfg.freeze_timeout_s)
            elif owing <= self.excusable:
                self.early += 1
                self.frozen.append(s)
                self.futs[s] = d.pool.submit(self._freeze_excusing, s, owing)

    def _freeze_excusing(self, s: Slot, owing: set[int]) -> float:
        """Freeze a sibling whose owing pids are inside a LIFE call with nothing else queued,
        then take their drain acks as given: a frozen helper cannot ack, and nothing but
        the frozen call can be queued (the gate closed before the drain: they submit no
        more). Only pids of the tree the freeze holds."""
        d = self.d
        took = s.group.freeze(d.cfg.freeze_timeout_s)
        try:
            held = set(s.group.pids())  # the group's members, all frozen now (not its registered pids)
        except KrexError:
            return took  # the group went: its acks are waited for, as without life_freeze
        left = set()
        for p in sorted(owing & held):
            if d.seg.drain_excuse(self.gpu, p, self.seq):
                self.excused.append(p)
            else:
                left.add(p)
        if left & d.seg.drain_owing(self.gpu, self.owner_slot, self.seq):
            # Its record changed between the plan and the freeze (the call ended and a free
            # began, a flag came): not excusable now, and frozen its helper could never ack.
            # Thawed until it has acked (within the drain's time), then frozen again.
            s.group.thaw()
            while left & d.seg.drain_owing(self.gpu, self.owner_slot, self.seq):
                if time.monotonic() - self.t0 >= d.cfg.drain_timeout_s or self.ending.wait(0.002):
                    break
            if not self.ending.is_set():  # (the region's thaw waits for this freeze to end)
                took += s.group.freeze(d.cfg.freeze_timeout_s)
        return took


@dataclass
class RegionState:
    """What one region's steps found and hold, from leaving the queue to its journal line:
    each step reads what the ones before it left here, and the end (unpin, thaw, open) puts
    back whatever the entry got to, whatever happened."""

    reasons: list[Reason] = field(default_factory=list)  # why it is contaminated (records.Reason)
    t: dict[str, float] = field(default_factory=dict)  # the grant's step times (seconds)
    t0: float = 0.0  # monotonic, as it left the queue
    t_entry_ns: int = 0
    owner_slot: Slot | None = None  # held on to: `release` may drop the slot before the record is made
    word: int = 0  # the gate word this region closed the gate with
    # block: taken as the gate closed
    sib_procs: set[tuple[int, int, int]] = field(default_factory=set)  # siblings' GPU processes
    at_close: list[Slot] = field(default_factory=list)  # this GPU's commands (lent cores)
    evict_fut: concurrent.futures.Future[cpus.Eviction] | None = None
    # stragglers
    stuck: list[int] = field(default_factory=list)  # still inside a GPU call past the gate
    waits: dict[str, Any] = field(default_factory=dict)  # how each wait ended
    # drain
    fz: _FreezePlan | None = None
    frozen: list[Slot] = field(default_factory=list)  # thawed at the end, whatever happens
    waited_on: list[str] = field(default_factory=list)  # where the siblings a slow drain waits for are
    drain_slow: list[list[float]] = field(default_factory=list)  # the last acks: [pid, ms]
    drained: int = 0
    bypass0: dict[tuple[int, int], int] = field(default_factory=dict)  # siblings flagged past the hooks then
    # freeze
    freeze_ms: dict[str, float] = field(default_factory=dict)
    freeze_slow: dict[str, list[str]] = field(default_factory=dict)
    sib_at_grant: set[tuple[int, int, int]] = field(default_factory=set)
    ended_ns: int = 0  # when siblings seen gone during entry were seen so
    ended_settle: int | None = None  # how long their memory's scrubbing may take (ns)
    # pin
    reserved: list[int] = field(default_factory=list)  # the region core(s)
    old_aff: list[int] | None = None  # the measuring thread's mask before the pin
    evicted: cpus.Eviction | None = None
    # grant
    core_watch: dict[Slot, list[coretime.CoreWatch]] = field(default_factory=dict)
    fail_opens0: int = 0
    t_grant: float = 0.0
    t_grant_ns: int = 0
    adaptive: bool = False  # the owner's policy is adaptive: its submission rate is measured
    sub0: int = 0
    # hold and the end's checks
    t_end_ns: int = 0
    region_s: float = 0.0
    cut: bool = False
    attest_entry: dict[str, Any] = field(default_factory=dict)  # the device's sample at the grant
    known_at_entry: dict[int, int] = field(default_factory=dict)  # pid -> start time: ours at the grant
    own_at_entry: set[int] = field(default_factory=set)  # the owner's command's processes at the grant
    attest: dict[str, Any] = field(default_factory=dict)
    look_s: float | None = None  # how long the end waited for the running siblings' look acks
    # thaw
    thaw_s: float = 0.0


class RegionRun:
    """The region protocol for one request, a method per step, its state in `st`. steps()
    runs them and yields once, right after the grant: the entry (block, stragglers, drain,
    freeze, exits, pin, grant) may run on one thread and the rest (hold until END or
    --max-region, the end's checks, unpin, thaw, open, journal) on another. Its try/finally
    spans both halves, so even a generator dropped at the grant closes its region.

    `d` is the daemon (its RegionChecks layer and those below: the segment, the slots, the
    pool, the checks); tests/unit/test_region_steps.py drives the steps with a fake one."""

    def __init__(self, d: RegionChecks, gpu: int, req: Region) -> None:
        self.d, self.gpu, self.req = d, gpu, req
        self.st = RegionState()

    def steps(self) -> Generator[None, None, None]:
        if not self.block():
            return
        try:
            self.close()
            self.stragglers()
            self.drain()
            self.freeze()
            self.exits()
            self.pin()
            self.grant()
            yield
            self.hold()
            self.check_end()
        finally:
            self.unpin()
            self.thaw()
            self.open()
        self.journal()

    # ------------------------------------------------------------------ entry
    def block(self) -> bool:
        """Close the gate (after an operator pause ends). False, with the owner told, when
        the owner left while queued or the daemon stops: nothing else runs."""
        d, req, st = self.d, self.req, self.st
        st.t["queue_wait_s"] = time.monotonic() - req.t_request
        st.t0 = time.monotonic()
        st.t_entry_ns = time.monotonic_ns()
        with d.lock:
            st.owner_slot = d.slots.get(req.slot)
        word = self._take_gate()
        d.pending.unqueue(req)  # its gate is closed (or it was dropped): siblings park there now
        if word is None:
            req.granted.set()
            return False
        req.word = st.word = word
        st.t["block_s"] = time.monotonic() - st.t0
        return True

    def _take_gate(self) -> int | None:
        """Take the gate for the request with one compare-and-swap (krex_gate_acquire). While
        an operator pause holds it, wait; a pause whose lease ran out is taken over in the
        same CAS. None when the owner left or the daemon stops meanwhile."""
        d, gpu, req = self.d, self.gpu, self.req
        gp = d.seg.raw.gpus[gpu]
        while not d.stop.is_set() and not req.ended.is_set():
            cur = int(gp.gate)
            expect = lib.KREX_GATE_OPEN
            if cur != lib.KREX_GATE_OPEN:
                h = d.seg.holder(gpu, cur)
                lapsed = h is not None and h[0] == lib.KREX_HOLDER_PAUSE and 0 < h[2] < int(lib.krex_now_ns())
                if lapsed:
                    expect = cur
                else:
                    lib.krex_futex_wait(ffi.addressof(gp, "gate"), cur, lib.KREX_GATE_RECHECK_NS)
                    continue
            try:
                return d.seg.close_gate(
                    gpu, req.slot, holder=lib.KREX_HOLDER_REGION, holder_pid=d.pid, expect=expect
                )
            except Busy:
                continue
        return None

    def close(self) -> None:
        """As the gate closes: the siblings' GPU processes (a sibling that starts or ends its
        GPU work from here on can overlap the region, entry included), their drain helpers'
        priority, and the move of this GPU's threads off the region core."""
        d, gpu, req, st = self.d, self.gpu, self.req, self.st
        st.sib_procs = d._sibling_gpu_procs(gpu, req.slot)
        d._boost_helpers(st.sib_procs)  # before the drain request: its acks come sooner
        if d.cfg.lend_cores != "off" or d.partition.degraded:
            # Others may run on the region core (lent, or a degraded partition): move every
            # thread of this GPU's commands but the measuring one off it, while the siblings
            # drain (as a step of its own it took 2-7 ms at p95 on the H200). The frozen ones
            # too: which those are is decided later, and the move costs them nothing. A
            # command admitted from here on starts frozen.
            with d.lock:
                st.at_close = [s for s in d.slots.values() if s.gpu == gpu]
            reserved0 = d.partition.slice_for(gpu).reserved
            at_close = st.at_close
            st.evict_fut = d.pool.submit(
                lambda: cpus.evict([p for s in at_close for p in d._group_pids(s)], reserved0, req.tid)
            )

    def stragglers(self) -> None:
        """Wait until no sibling is inside a GPU call (in-flight == 0)."""
        d, st = self.d, self.st
        r = d.seg.wait_inflight(self.gpu, self.req.slot, d.cfg.drain_timeout_s)
        st.t["inflight_s"] = r.seconds
        st.waits["wait_inflight"] = r.stats
        if not r.ok:
            st.stuck = list(r.stragglers)
            st.reasons.append(
                (
                    "inflight-timeout",
                    f"in-flight submissions of pids {r.stragglers} did not finish (a call still "
                    "running, or a thread that left a GPU call abnormally: its calls are not gated)",
                )
            )

    def drain(self) -> None:
        """Drain the siblings' queued GPU work. Each sibling is frozen as soon as it has
        drained, while the others still drain: entry pays the slowest drain plus one freeze,
        not every drain then every freeze. The plan is made right after the drain request (its
        checks run while the GPU finishes the siblings' queued work)."""
        d, gpu, req, st = self.d, self.gpu, self.req, self.st
        # Under `all` (and `adaptive`, which may pick it) every sibling drains, quiet or not:
        # a process whose work the hooks cannot see (a static CUDA runtime in a library it
        # loaded) is covered there, as its freeze covers its later work.
        policy0 = (st.owner_slot.freeze if st.owner_slot is not None else "") or d.cfg.freeze_policy
        st.fz = fz = _FreezePlan(
            d, gpu, req.slot, st.frozen, stuck=st.stuck, excuse_life=d.cfg.life_freeze and policy0 == "gpu"
        )

        def slow_drain(owing: set[int]) -> None:
            for p in sorted(owing)[:3]:
                b = d.seg.proc_brief(p) or {}
                helper = procfs.thread_line(p, b["helper_tid"]) if b.get("helper_tid") else "helper -"
                st.waited_on.append(
                    f"pid {p}: in flight {b.get('inflight')}, LIFE {b.get('life_inflight')}; "
                    f"helper {helper}; main {procfs.thread_line(p, p)}"[:500]
                )

        # Who had a way past the hooks before the request (not quiet: drained): one flagged from
        # here on (its helper looks at each request) is judged at the end (_look_end).
        st.bypass0 = d.seg.bypass_procs(gpu, req.slot)
        r = d.seg.drain(
            gpu,
            req.slot,
            d.cfg.drain_timeout_s,
            on_progress=fz.progress,
            on_slow=slow_drain,
            full=policy0 != "gpu",
        )
        st.t["drain_s"] = r.seconds
        fz.unboost()
        st.drain_slow = sorted(([p, round(s * 1e3, 1)] for p, s in r.acks.items()), key=lambda x: -x[1])[:3]
        st.waits["wait_drain"] = r.stats
        st.drained = r.count
        if not r.ok:
            # Where their threads are (a helper stuck in the driver or the loader): the log
            # has all of it, the reason the first straggler's.
            detail = [procfs.thread_report(p) for p in r.stragglers[:4]]
            for line in detail:
                log.warning("drain straggler: %s", line)
            st.reasons.append(
                (
                    "drain-timeout",
                    f"pids {r.stragglers} did not ack the drain within {d.cfg.drain_timeout_s:g}s "
                    f"({detail[0][:600] if detail else '-'})",
                )
            )
        if r.partial:
            st.reasons.append(
                (
                    "drain-partial",
                    f"pids {r.partial} could not drain all their work (a CUDA graph capture under way, or a "
                    "context beyond the drain helper's tables); their earlier work was not drained",
                )
            )
        unrec = {n: c for n, c in d._unrecorded(gpu).items() if n != req.slot}  # its own are its own
        if unrec:
            st.reasons.append(
                (
                    "drain-unknown",
                    f"{sum(unrec.values())} process(es) of slot(s) {sorted(unrec)} that krexd cannot "
                    f"account for (no free process record, all {lib.KREX_MAX_PROCS} taken, or a pid "
                    "namespace of their own): their queued GPU work may not have been drained",
                )
            )

    def freeze(self) -> None:
        """Freeze the siblings the policy picks (those that came since the first plan too),
        and wait for every freeze; then for what siblings the gate does not hold queued."""
        d, gpu, st = self.d, self.gpu, self.st
        fz = st.fz
        assert fz is not None
        t1 = time.monotonic()
        fz.progress(set(), final=True)  # siblings that came (or a plan never made) since the first call
        if fz.life_unfrozen:
            st.reasons.append(
                (
                    "life-running",
                    f"pids {sorted(set(fz.life_unfrozen))} were inside a context, module or device "
                    "memory call and belong to no command krexd can freeze",
                )
            )
        froze: list[Slot] = []
        for s, f in fz.futs.items():
            try:
                st.freeze_ms[str(s.slot)] = round(f.result() * 1e3, 1)
                froze.append(s)
                if s.group.slow:
                    st.freeze_slow[str(s.slot)] = s.group.slow
            except (KrexError, OSError) as e:  # OSError: the group vanished mid-freeze
                with d.lock:
                    gone = s.slot not in d.slots  # the command ended meanwhile: nothing to freeze
                if not gone:
                    st.reasons.append(("freeze-failed", f"slot {s.slot} did not freeze: {e}"))
        # A sibling frozen inside a context creation would hold the node's token (krex_abi.h,
        # KREX_CTX_TOKEN_LEASE_MS) until thawed: freed, so that no frozen process holds it.
        if froze:
            d.seg.ctx_token_drop(p for s in froze for p in d._group_pids(s))
        st.t["freeze_s"] = time.monotonic() - t1  # what the freeze added after the drain
        # What the siblings the gate does not hold queued before their freeze: no drain
        # reaches it. Waited for where the device shows it, else flagged (unheld.py).
        more, st.t["unheld_wait_s"] = unheldwork.queued_work(
            d.info.kind, d.attestor, gpu, d._phys(gpu), fz.unheld, d.cfg.drain_timeout_s, d._sim_shm_of
        )
        st.reasons.extend(more)
        # What siblings frozen inside a LIFE call (their acks excused) had queued.
        if fz.excused:
            more, st.t["life_settle_s"] = unheldwork.life_frozen_settle(
                d.info.kind, d._phys(gpu), fz.excused, d.cfg.drain_timeout_s, d._sim_shm_of
            )
            st.reasons.extend(more)

    def exits(self) -> None:
        """Wait for siblings that are ending: one inside the kernel's exit cannot be frozen,
        and its contexts' teardown runs on the GPU; one reaped just before may still be torn
        down by the driver (NVML lists it meanwhile)."""
        d, gpu, req, st = self.d, self.gpu, self.req, self.st
        t3 = time.monotonic()
        exiting, waited_exit = d._await_exits(gpu, req.slot)
        st.t["exit_wait_s"] = time.monotonic() - t3
        t3 = time.monotonic()
        waited_exit |= d._await_teardowns(gpu)  # waited out, not flagged
        st.t["teardown_wait_s"] = time.monotonic() - t3
        if exiting:
            st.reasons.append(
                (
                    "sibling-context",
                    f"sibling pids {sorted(exiting)} were still exiting {d.cfg.freeze_timeout_s:g}s "
                    "after the gate closed: their contexts' teardown may run inside the region",
                )
            )
        # The processes that ended during entry ended before the grant; their teardown is
        # over, the scrubbing of their memory is what _settle waits out.
        st.sib_at_grant = d._sibling_gpu_procs(gpu, req.slot)
        # So did a free of a sibling frozen right after its driver call (no closing stamp).
        ended_pids = waited_exit | {p for p, _s, _t in st.sib_procs - st.sib_at_grant}
        freeing = d.seg.frees_inflight(gpu, req.slot)
        st.ended_ns = time.monotonic_ns() if ended_pids or freeing else 0
        # Sized by what they held (NVML), where it said; a free seen only in flight is not.
        st.ended_settle = None if freeing else d.attestor.settle_ns(ended_pids)

    def pin(self) -> None:
        """Pin the measuring thread to the region core; finish the move of the others off it."""
        d, req, st = self.d, self.req, self.st
        t2 = time.monotonic()
        st.reserved = d.partition.slice_for(self.gpu).reserved
        try:
            st.old_aff = cpus.pin_thread(req.tid, st.reserved)
        except KrexError as e:
            st.reasons.append(("pin-failed", f"could not pin thread {req.tid}: {e}"))
        if st.evict_fut is not None:  # the move off the region core, started as the gate closed
            st.evicted, st.evict_fut = st.evict_fut.result(), None
            st.reasons.extend(d._evict_again(req, st.at_close, st.frozen, st.reserved, st.evicted))
        st.t["pin_s"] = time.monotonic() - t2

    def grant(self) -> None:
        """The last checks (the segment's trust, frees settling, the region core watched),
        then the grant: the reply to `begin`, with what entry found."""
        d, gpu, req, st = self.d, self.gpu, self.req, self.st
        fz = st.fz
        assert fz is not None
        st.reasons.extend(d._trust_checks(gpu, req, st.t_entry_ns))
        st.reasons.extend(d._settle(gpu, req.slot, st.ended_ns, st.t, st.ended_settle))
        st.core_watch, more = d._watch_region_core(gpu, req, st.frozen, st.reserved)
        st.reasons.extend(more)
        st.t["entry_s"] = time.monotonic() - st.t0
        req.grant = Grant(
            gpu=gpu,
            slot=req.slot,
            times=st.t,
            drained=st.drained,
            waits=st.waits,
            frozen_slots=[s.slot for s in st.frozen],
            freeze_policy=fz.policy,
            frozen_early=fz.early,
            drain_slow=st.drain_slow,
            drain_waited_on=st.waited_on,
            lent_priority=fz.lent,
            freeze_ms=st.freeze_ms,
            freeze_slow=st.freeze_slow,
            evicted_threads=len(st.evicted.moved) if st.evicted is not None else 0,
            running_slots=sorted(s.slot for s in set(fz.siblings) - set(st.frozen)),
            freeze_why=fz.why,
            unheld=[[p, sl, w] for p, (sl, w) in sorted(fz.unheld.items())[:8]],
            life_frozen=sorted(fz.excused),
            reserved_cpus=st.reserved,
            reasons=list(st.reasons),
            freezer=d.freezer.name,
            partition_degraded=d.partition.degraded,
            device=d.info.kind,
            tenant=req.tenant,
            label=req.label,
        ).as_dict()
        st.fail_opens0 = int(d.seg.raw.gpus[gpu].fail_opens)
        st.t_grant = time.monotonic()
        owner = fz.owner
        st.adaptive = owner is not None and (owner.freeze or d.cfg.freeze_policy) == "adaptive"
        st.sub0 = d.seg.slot_submits(req.slot) if st.adaptive else 0
        st.t_grant_ns = time.monotonic_ns()
        req.granted.set()

    # -------------------------------------------------------------------- end
    def hold(self) -> None:
        """Hold the region until END (or the owner's end, or the daemon's) or --max-region,
        and check what could have disturbed it while it ran."""
        d, gpu, req, st = self.d, self.gpu, self.req, self.st
        # Who was ours at the start: a sibling that is not frozen (gpu policy) may end during
        # the region, and NVML still lists it; it was never foreign. Kept with each process's
        # start time: a pid reused meanwhile is another process.
        if d.attestor.nvml is not None:
            st.known_at_entry = {p: int(lib.krex_pid_start_ticks(p)) for p in d._known_pids()}
        st.attest_entry = d.attestor.sample(gpu)
        st.own_at_entry = d._own_pids(req)
        if not req.ended.wait(d.cfg.max_region_s):
            req.end_reason = f"max-region ({d.cfg.max_region_s:g}s)"
            st.cut = True
            st.reasons.append(
                (
                    "cut",
                    f"cut by --max-region after {d.cfg.max_region_s:g}s: what the owner ran after "
                    "that was not protected",
                )
            )
        st.t_end_ns = time.monotonic_ns()
        st.region_s = time.monotonic() - st.t_grant

    def check_end(self) -> None:
        """What could have disturbed the region while it ran: siblings on the region core,
        fail-opens, the segment's trust, the attestation, contexts started or ended, threads
        that may run on the region core, a stall of krexd's own."""
        d, gpu, req, st = self.d, self.gpu, self.req, self.st
        fz = st.fz
        assert fz is not None
        look_seq, look_pids = d._look_begin(gpu, fz, st.frozen)  # answered while the checks below run
        st.reasons.extend(d._region_core_time(st.core_watch, st.reserved))
        sib_procs_end = d._sibling_gpu_procs(gpu, req.slot)  # first: the timing is over
        owner = fz.owner
        if st.adaptive and owner is not None and st.region_s > 0:
            owner.last_rate = (d.seg.slot_submits(req.slot) - st.sub0) / st.region_s
        fail_opens = int(d.seg.raw.gpus[gpu].fail_opens) - st.fail_opens0
        if fail_opens > 0:
            st.reasons.append(
                (
                    "fail-open",
                    f"{fail_opens} sibling call(s) stopped waiting at the closed gate and went on",
                )
            )
        st.reasons.extend(d._trust_checks(gpu, req, st.t_grant_ns))
        attest_exit = d.attestor.sample(gpu)
        known_at_entry = st.known_at_entry
        st.attest, more = d.attestor.judge(
            gpu,
            st.attest_entry,
            attest_exit,
            lambda: _same_processes(known_at_entry) | d._known_pids(),
            {p: w for p, (_sl, w) in fz.unheld.items()},
        )
        st.reasons.extend(more)
        skip = st.own_at_entry | d._own_pids(req) | {f["pid"] for f in st.attest.get("foreign") or []}
        st.reasons.extend(
            d._context_changes(
                gpu, st.sib_procs, st.sib_at_grant, sib_procs_end, st.attest_entry, attest_exit, skip
            )
        )
        if st.evicted is not None:
            st.reasons.extend(d._audit_region_core(req, st.at_close, st.frozen, st.reserved))
        more, st.look_s = d._look_end(gpu, req.slot, look_seq, look_pids, st.bypass0)
        st.reasons.extend(more)
        stalled = d._stalled_during(st.t0, time.monotonic())
        if stalled:
            st.reasons.append(
                (
                    "daemon-stalled",
                    f"krexd stalled for {stalled:.2f}s during the region (stopped or starved): guardians "
                    "thawed their commands and shims failed open meanwhile",
                )
            )

    def unpin(self) -> None:
        """Stop counting the region core; put back the measuring thread's mask, the masks the
        move off the region core changed, and those their new threads inherited."""
        d, gpu, req, st = self.d, self.gpu, self.req, self.st
        for ws in st.core_watch.values():  # (entry failed after they started)
            for w in ws:
                w.stop()
        if st.fz is not None:
            st.fz.unboost()  # (the drain raised)
        if st.old_aff is not None:
            with contextlib.suppress(KrexError):
                cpus.restore_thread(req.tid, st.old_aff)
            if st.owner_slot is not None:  # else they would keep the region core for good
                known = st.evicted.seen if st.evicted else set()
                cpus.unpin_inherited(d._group_pids(st.owner_slot), st.reserved, st.old_aff, req.tid, known)
        if st.evict_fut is not None:  # entry ended early: put back what the move did
            with contextlib.suppress(Exception):
                st.evicted = st.evict_fut.result()
        cpus.restore_evicted(st.evicted)
        if st.evicted is not None:
            # Threads and processes that moved ones started during the region inherited the
            # narrowed mask: else a long-running command would lose the lent cores.
            with contextlib.suppress(KrexError):
                full = d.partition.command_cpus(gpu, d.cfg.lend_cores)
                pids = [p for s in st.at_close for p in d._group_pids(s)]
                res = d.partition.slice_for(gpu).reserved
                # Not those that were there as the gate closed (a narrowed mask there is the
                # command's own) nor the moved ones (restore_evicted's).
                skip = st.evicted.before | {tid for tid, _old, _new in st.evicted.moved} | {req.tid}
                cpus.unnarrow(pids, res, full, skip, pinned=False)

    def thaw(self) -> None:
        """Thaw the siblings it froze and those admitted (frozen) during the region."""
        d, gpu, req, st = self.d, self.gpu, self.req, self.st
        t3 = time.monotonic()
        if st.fz is not None:
            # A freeze still running (an error ended the entry early) would undo the thaw
            # below and leave its sibling frozen: let every started freeze end first.
            st.fz.ending.set()
            concurrent.futures.wait(list(st.fz.futs.values()), timeout=d.cfg.freeze_timeout_s + 1)
        with d.lock:  # slots admitted during the region started frozen: thaw them too
            req.thawing = True
            late = [s for s in d.slots.values() if s.gpu == gpu and s.slot != req.slot and s not in st.frozen]
        for f in [d.pool.submit(s.group.thaw) for s in [*st.frozen, *late]]:
            with contextlib.suppress(KrexError, OSError):
                f.result()
        st.thaw_s = time.monotonic() - t3

    def open(self) -> None:
        """Open the gate; then judge the siblings it did not freeze once more. A region that
        failed before its grant tells its owner why."""
        d, gpu, req, st = self.d, self.gpu, self.req, self.st
        if not d.seg.open_gate(gpu, st.word):
            st.reasons.append(
                ("gate-lost", f"the gate of GPU {gpu} no longer held this region's word at its end")
            )
        if st.fz is not None and st.t_end_ns:  # after the gate opened: the next region need not wait
            st.reasons.extend(d._unheld_at_end(st.fz, st.frozen))
        st.reasons = list(dict.fromkeys(st.reasons))  # the end-of-region checks may repeat the grant's
        if not req.granted.is_set():  # failed before the grant: tell the owner why
            req.grant = {"ok": False, "error": "region setup failed", "reasons": [x for _f, x in st.reasons]}
            req.granted.set()

    def journal(self) -> None:
        """The region's record: for its owner's `end` reply, its command's report, the log
        and the journal."""
        d, req, st = self.d, self.req, self.st
        owner_slot = st.owner_slot
        placement = owner_slot.placement if owner_slot is not None else None
        note = placement.note if placement is not None else ""
        rec = RegionRecord(
            ts=time.time(),
            gpu=self.gpu,
            owner_slot=req.slot,
            owner_pid=req.pid,
            tid=req.tid,
            cmd=procfs.cmdline(req.pid, 200),
            grant=req.grant,
            region_s=st.region_s,
            thaw_s=st.thaw_s,
            end=req.end_reason or "end",
            siblings_frozen=len(st.frozen),
            t_grant_ns=st.t_grant_ns,
            t_end_ns=st.t_end_ns,
            cut=st.cut,
            reasons=st.reasons,
            attest=st.attest,
            cgroup_fallback=note.removeprefix("krex: warning: ") if note else None,
            look_s=st.look_s,
        ).as_dict()
        req.record = rec
        if owner_slot is not None:
            with d.lock:  # read by the release's reply
                optin.region_tally([rec], owner_slot.tally)
                optin.auto_labels([rec], owner_slot.auto_labels)
                if len(owner_slot.records) < RELEASE_MAX_RECORDS:
                    owner_slot.records.append(rec)
                else:  # counted (tally), not listed: bounded memory per slot
                    owner_slot.records_dropped += 1
        _log_region(rec)
        d._journal(rec)


def _log_region(rec: dict[str, Any]) -> None:
    who = f"gpu {rec['gpu']}: region of slot {rec['owner_slot']} pid {rec['owner_pid']} tid {rec['tid']}"
    if rec.get("contaminated"):
        log.warning("%s granted CONTAMINATED: %s", who, "; ".join(rec.get("reasons", [])))
    end = rec.get("end", "end")
    if end != "end":
        log.warning("%s ended by force: %s after %.3f s", who, end, rec.get("region_s", 0.0))
    else:
        log.debug(
            "%s: entry %.2f ms, %.3f s, %d sibling(s) frozen",
            who,
            1e3 * rec.get("entry_s", 0.0),
            rec.get("region_s", 0.0),
            rec.get("siblings_frozen", 0),
        )
