"""The region protocol (krex/node/region.py: RegionRun), step by step, on a fake daemon: a
segment whose gate is a plain word, slot groups that record their freezes and thaws, and
checks that find nothing unless a test says so. No socket, no process, no cgroup: what each
step leaves in the region's state, the grant and the record, and that the end puts back
whatever the entry got to (the gate opened, every frozen sibling thawed) however it ends."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from krex.native import lib
from krex.node.config import Config
from krex.node.region import Region, RegionRun
from krex.node.slots import Slot

GATE_WORD = 0x5EED


class FakeGroup:
    def __init__(self, name: str, events: list[tuple[str, Any]]) -> None:
        self.name, self.path, self.events = name, f"/fake/{name}", events
        self.slow: list[str] = []
        self.frozen = False

    def freeze(self, timeout_s: float) -> float:
        self.frozen = True
        self.events.append(("freeze", self.name))
        return 0.001

    def thaw(self) -> None:
        self.frozen = False
        self.events.append(("thaw", self.name))

    def pids(self) -> list[int]:
        return []


class FakeSeg:
    """The gate as a plain word, and waits that return at once with what a test set."""

    def __init__(self, events: list[tuple[str, Any]]) -> None:
        self.events = events
        self.raw = SimpleNamespace(gpus=[SimpleNamespace(gate=int(lib.KREX_GATE_OPEN), fail_opens=0)])
        self.inflight = SimpleNamespace(ok=True, seconds=0.001, stats={"scans": 1}, stragglers=[])
        self.drained = SimpleNamespace(
            ok=True, seconds=0.002, acks={41: 0.002}, stats={"scans": 1}, count=1, stragglers=[], partial=[]
        )

    def holder(self, gpu: int, word: int) -> None:
        return None

    def close_gate(self, gpu: int, slot: int, holder: int, holder_pid: int, expect: int) -> int:
        assert self.raw.gpus[gpu].gate == expect
        self.raw.gpus[gpu].gate = GATE_WORD
        self.events.append(("close_gate", slot))
        return GATE_WORD

    def open_gate(self, gpu: int, word: int) -> bool:
        self.events.append(("open_gate", word))
        if self.raw.gpus[gpu].gate != word:
            return False
        self.raw.gpus[gpu].gate = int(lib.KREX_GATE_OPEN)
        return True

    def wait_inflight(self, gpu: int, slot: int, timeout_s: float) -> Any:
        return self.inflight

    def drain(self, gpu: int, slot: int, timeout_s: float, on_progress: Any, on_slow: Any, full: bool) -> Any:
        self.events.append(("drain", full))
        on_progress(set())  # every sibling has acked: their freezes start now
        return self.drained

    def slot_pids(self, slot: int) -> list[int]:
        return []

    def life_busy(self, gpu: int, owner_slot: int) -> dict[int, tuple[int, int]]:
        return {}

    def ctx_token_drop(self, pids: Any) -> int:
        list(pids)  # (the frozen siblings' pids, read as the segment's would)
        return 0

    def frees_inflight(self, gpu: int, owner_slot: int) -> bool:
        return False

    def slot_submits(self, slot: int) -> int:
        return 0

    def proc_brief(self, pid: int) -> dict[str, Any]:
        return {}

    def bypass_procs(self, gpu: int, owner_slot: int) -> dict[tuple[int, int], int]:
        return {}


class FakeAttestor:
    nvml = None

    def sample(self, gpu: int) -> dict[str, Any]:
        return {}

    def judge(
        self, gpu: int, entry: Any, exit_: Any, known: Any, unheld: Any
    ) -> tuple[dict[str, Any], list[Any]]:
        return {"checked": True}, []

    def settle_ns(self, pids: Any) -> int | None:
        return None


class FakeDaemon:
    """What RegionRun reads of the daemon, each check finding nothing (`extra` adds reasons)."""

    def __init__(self, siblings: int = 2, policy: str = "all", max_region_s: float = 5.0) -> None:
        self.events: list[tuple[str, Any]] = []
        self.journaled: list[dict[str, Any]] = []
        self.cfg = Config(freeze_policy=policy, max_region_s=max_region_s, lend_cores="off")
        self.lock = threading.RLock()
        self.stop = threading.Event()
        self.pid = os.getpid()
        self.seg = FakeSeg(self.events)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=4)
        self.pending = SimpleNamespace(unqueue=lambda req: None)
        self.partition = SimpleNamespace(
            degraded=False, slice_for=lambda gpu: SimpleNamespace(reserved=sorted(os.sched_getaffinity(0)))
        )
        self.info = SimpleNamespace(kind="sim")
        self.freezer = SimpleNamespace(name="fake")
        self.attestor = FakeAttestor()
        self.slots = {n: self.slot(n) for n in range(siblings + 1)}  # slot 0: the owner
        self.extra: dict[str, list[tuple[str, str]]] = {}  # a check's name -> the reasons it finds
        self.fail: dict[str, Exception] = {}  # a check's name -> what it raises

    def slot(self, n: int) -> Slot:
        return Slot(n, 0, "run", 1000 + n, FakeGroup(f"slot-{n}", self.events))  # type: ignore[arg-type]

    def _check(self, name: str) -> list[tuple[str, str]]:
        if name in self.fail:
            raise self.fail[name]
        return list(self.extra.get(name, []))

    def _freeze_choice(
        self, owner: Any, siblings: list[Slot]
    ) -> tuple[str, list[Slot], list[str], dict[int, Any]]:
        if self.cfg.freeze_policy == "all":
            return "all", list(siblings), [], {}
        return self.cfg.freeze_policy, [], [], {}

    def _sibling_gpu_procs(self, gpu: int, owner_slot: int) -> set[tuple[int, int, int]]:
        return set()

    def _boost_helpers(self, procs: Any) -> None:
        pass

    def _boost(self, pid: int, tid: int, name: str | None = None) -> None:
        return None

    def _group_pids(self, s: Slot, deep: bool = False) -> list[int]:
        return []

    def _unrecorded(self, gpu: int) -> dict[int, int]:
        return {}

    def _phys(self, gpu: int) -> int:
        return gpu

    def _sim_shm_of(self, pid: int) -> None:
        return None

    def _await_exits(self, gpu: int, owner_slot: int) -> tuple[set[int], set[int]]:
        self._check("exits")
        return set(), set()

    def _await_teardowns(self, gpu: int) -> set[int]:
        return set()

    def _evict_again(self, *a: Any) -> list[tuple[str, str]]:
        return []

    def _trust_checks(self, gpu: int, req: Region, since_ns: int) -> list[tuple[str, str]]:
        return self._check("trust")

    def _settle(self, gpu: int, owner_slot: int, ended_ns: int, t: dict[str, float], sized: Any) -> list[Any]:
        t["settle_s"] = 0.0
        return []

    def _watch_region_core(self, *a: Any) -> tuple[dict[Slot, Any], list[tuple[str, str]]]:
        return {}, []

    def _region_core_time(self, *a: Any) -> list[tuple[str, str]]:
        return []

    def _known_pids(self) -> set[int]:
        return {self.pid}

    def _own_pids(self, req: Region) -> set[int]:
        return {req.pid}

    def _context_changes(self, *a: Any) -> list[tuple[str, str]]:
        return self._check("contexts")

    def _audit_region_core(self, *a: Any) -> list[tuple[str, str]]:
        return []

    def _stalled_during(self, t0: float, t1: float) -> float:
        return 0.0

    def _unheld_at_end(self, fz: Any, frozen: list[Slot]) -> list[tuple[str, str]]:
        return []

    def _look_begin(self, gpu: int, fz: Any, frozen: list[Slot]) -> tuple[int, list[int]]:
        return 0, []

    def _look_end(self, *a: Any) -> tuple[list[tuple[str, str]], float | None]:
        return self._check("look"), None

    def _journal(self, rec: dict[str, Any]) -> None:
        self.events.append(("journal", rec["owner_slot"]))
        self.journaled.append(rec)


def _region(d: FakeDaemon) -> tuple[RegionRun, Region]:
    req = Region(0, 0, os.getpid(), threading.get_native_id(), time.monotonic(), label="unit", tenant="t")
    return RegionRun(d, 0, req), req  # type: ignore[arg-type]


def _gate(d: FakeDaemon) -> int:
    return int(d.seg.raw.gpus[0].gate)


def _kinds(d: FakeDaemon) -> list[str]:
    return [e[0] for e in d.events]


def test_each_step_in_turn_leaves_what_the_next_one_reads() -> None:
    d = FakeDaemon(siblings=2)
    run, req = _region(d)
    mask = sorted(os.sched_getaffinity(req.tid))
    assert run.block()
    assert _gate(d) == GATE_WORD == req.word == run.st.word and run.st.owner_slot is d.slots[0]
    assert set(run.st.t) == {"queue_wait_s", "block_s"}
    run.close()
    run.stragglers()
    assert run.st.stuck == [] and "wait_inflight" in run.st.waits
    run.drain()
    assert run.st.drained == 1 and run.st.drain_slow == [[41, 2.0]] and ("drain", True) in d.events
    assert [s.slot for s in run.st.frozen] == [1, 2]  # started as soon as they acked
    run.freeze()
    assert run.st.freeze_ms == {"1": 1.0, "2": 1.0} and run.st.reasons == []
    run.exits()
    run.pin()
    assert run.st.old_aff == mask and run.st.reserved == mask
    assert not req.granted.is_set()
    run.grant()
    g = req.grant
    assert req.granted.is_set() and g["ok"] and not g["contaminated"] and g["flags"] == []
    assert g["frozen_slots"] == [1, 2] and g["freeze_policy"] == "all" and g["running_slots"] == []
    assert g["label"] == "unit" and g["tenant"] == "t" and g["device"] == "sim" and g["freezer"] == "fake"
    for k in ("queue_wait_s", "block_s", "inflight_s", "drain_s", "freeze_s", "pin_s", "settle_s", "entry_s"):
        assert k in g, k
    req.ended.set()
    run.hold()
    assert not run.st.cut and run.st.t_end_ns >= run.st.t_grant_ns > 0
    run.check_end()
    assert run.st.attest == {"checked": True}
    run.unpin()
    assert sorted(os.sched_getaffinity(req.tid)) == mask
    assert all(s.group.frozen for s in run.st.frozen)  # type: ignore[attr-defined]
    run.thaw()
    assert not any(s.group.frozen for s in d.slots.values())  # type: ignore[attr-defined]
    assert req.thawing
    run.open()
    assert _gate(d) == lib.KREX_GATE_OPEN
    run.journal()
    (rec,) = d.journaled
    assert req.record is rec and d.slots[0].records == [rec]
    assert rec["owner_slot"] == 0 and rec["siblings_frozen"] == 2 and rec["end"] == "end"
    assert not rec["contaminated"] and "ok" not in rec and rec["frozen_slots"] == [1, 2]
    assert _kinds(d) == [
        "close_gate", "drain", "freeze", "freeze", "thaw", "thaw", "open_gate", "journal"
    ]  # fmt: skip


def test_the_steps_yield_once_at_the_grant_and_end_on_another_thread() -> None:
    d = FakeDaemon(siblings=1)
    run, req = _region(d)
    steps = run.steps()
    assert next(steps, "done") is None  # stopped at the grant
    assert req.granted.is_set() and _gate(d) == GATE_WORD and "journal" not in _kinds(d)
    req.ended.set()
    t = threading.Thread(target=lambda: [None for _ in steps])
    t.start()
    t.join(10)
    assert _gate(d) == lib.KREX_GATE_OPEN and len(d.journaled) == 1
    assert _kinds(d)[-3:] == ["thaw", "open_gate", "journal"]


def test_a_straggler_and_a_drain_timeout_make_the_grant_and_the_record_contaminated() -> None:
    d = FakeDaemon(siblings=1)
    d.seg.inflight = SimpleNamespace(ok=False, seconds=0.5, stats={}, stragglers=[4242])
    d.seg.drained = SimpleNamespace(
        ok=False, seconds=0.5, acks={}, stats={}, count=0, stragglers=[], partial=[77]
    )
    run, req = _region(d)
    steps = run.steps()
    next(steps)
    assert run.st.stuck == [4242]
    assert req.grant["contaminated"]
    assert req.grant["flags"] == ["drain-partial", "drain-timeout", "inflight-timeout"]
    req.ended.set()
    list(steps)
    (rec,) = d.journaled
    assert rec["contaminated"] and rec["flags"] == req.grant["flags"] and len(rec["reasons"]) == 3


def test_what_the_end_finds_is_added_to_the_grants_reasons_once() -> None:
    d = FakeDaemon(siblings=1)
    d.extra["trust"] = [("segment", "the segment was touched")]  # at the grant and again at the end
    d.extra["contexts"] = [("sibling-context", "a sibling started a context")]
    run, req = _region(d)
    steps = run.steps()
    next(steps)
    assert req.grant["flags"] == ["segment"]
    req.ended.set()
    list(steps)
    (rec,) = d.journaled
    assert rec["flags"] == ["segment", "sibling-context"]
    assert rec["reasons"] == ["the segment was touched", "a sibling started a context"]


def test_a_step_that_fails_before_the_grant_still_opens_the_gate_and_thaws() -> None:
    d = FakeDaemon(siblings=2)
    d.fail["exits"] = RuntimeError("the exit wait broke")
    run, req = _region(d)
    with pytest.raises(RuntimeError, match="the exit wait broke"):
        next(run.steps())
    assert _gate(d) == lib.KREX_GATE_OPEN
    assert not any(s.group.frozen for s in d.slots.values())  # type: ignore[attr-defined]
    assert req.granted.is_set() and req.grant["ok"] is False and req.grant["error"] == "region setup failed"
    assert d.journaled == []  # the GPU's worker logs the failure (_drive); no record is made


def test_a_region_dropped_at_its_grant_still_closes() -> None:
    d = FakeDaemon(siblings=1)
    run, req = _region(d)
    steps = run.steps()
    next(steps)
    steps.close()
    assert _gate(d) == lib.KREX_GATE_OPEN and not d.slots[1].group.frozen  # type: ignore[attr-defined]


def test_max_region_cuts_a_region_that_never_ends() -> None:
    d = FakeDaemon(siblings=0, max_region_s=0.05)
    run, req = _region(d)
    t0 = time.monotonic()
    for _ in run.steps():
        pass  # nobody sets `ended`
    assert 0.05 <= time.monotonic() - t0 < 5
    (rec,) = d.journaled
    assert rec["cut"] and rec["end"] == "max-region (0.05s)" and "cut" in rec["flags"]


def test_an_owner_gone_while_queued_gets_no_gate() -> None:
    d = FakeDaemon(siblings=1)
    run, req = _region(d)
    req.ended.set()
    assert list(run.steps()) == []
    assert req.granted.is_set() and req.grant == {} and d.events == [] and d.journaled == []


def test_a_gate_taken_from_the_region_is_flagged_at_its_end() -> None:
    d = FakeDaemon(siblings=1)
    run, req = _region(d)
    steps = run.steps()
    next(steps)
    d.seg.raw.gpus[0].gate = GATE_WORD + 1  # someone else's word now
    req.ended.set()
    list(steps)
    assert d.journaled[0]["flags"] == ["gate-lost"]


def test_a_command_admitted_during_the_region_is_thawed_at_its_end() -> None:
    d = FakeDaemon(siblings=1)
    run, req = _region(d)
    steps = run.steps()
    next(steps)
    late = d.slot(5)
    late.group.freeze(1.0)  # admitted while the gate was closed: it starts frozen
    d.slots[5] = late
    req.ended.set()
    list(steps)
    assert not late.group.frozen  # type: ignore[attr-defined]
    assert d.journaled[0]["siblings_frozen"] == 1  # it was not one the region froze


def test_under_the_gpu_policy_a_quiet_sibling_runs_and_only_the_grant_says_so() -> None:
    d = FakeDaemon(siblings=2, policy="gpu")
    run, req = _region(d)
    steps = run.steps()
    next(steps)
    assert ("drain", False) in d.events  # quiet siblings owe no drain under `gpu`
    assert req.grant["frozen_slots"] == [] and req.grant["running_slots"] == [1, 2]
    req.ended.set()
    list(steps)
    assert "freeze" not in _kinds(d) and d.journaled[0]["siblings_frozen"] == 0


GRANT_KEYS = [
    "ok", "gpu", "slot", "queue_wait_s", "block_s", "inflight_s", "drain_s", "freeze_s", "unheld_wait_s",
    "exit_wait_s", "teardown_wait_s", "pin_s", "settle_s", "entry_s", "drained", "wait_inflight",
    "wait_drain",
    "frozen_slots", "freeze_policy", "frozen_early", "drain_slow", "drain_waited_on", "lent_priority",
    "freeze_ms", "freeze_slow", "evicted_threads", "running_slots", "freeze_why", "unheld", "life_frozen",
    "reserved_cpus",
    "contaminated", "reasons", "flags", "freezer", "partition_degraded", "device", "label", "tenant",
]  # fmt: skip
RECORD_END_KEYS = ["region_s", "thaw_s", "end", "siblings_frozen", "t_grant_ns", "t_end_ns", "cut", "attest"]


def test_the_grant_and_the_record_keep_their_keys_and_their_order() -> None:
    """The wire's grant and the journal's line, key for key (readers, `krex journal` and
    the reports, see them in this order)."""
    d = FakeDaemon(siblings=1)
    d.slots[0].placement = SimpleNamespace(note="krex: warning: placed at the root")  # type: ignore[assignment]
    run, req = _region(d)
    steps = run.steps()
    next(steps)
    assert list(req.grant) == GRANT_KEYS
    d.extra["contexts"] = [("sibling-context", "a sibling started a context")]
    req.ended.set()
    list(steps)
    (rec,) = d.journaled
    head = ["ts", "gpu", "owner_slot", "owner_pid", "tid", "cmd"]
    assert list(rec) == [*head, *GRANT_KEYS[2:], *RECORD_END_KEYS, "cgroup_fallback"]
    assert rec["cgroup_fallback"] == "placed at the root"
    # The grant's verdict in the record is the end's, in the grant's place.
    assert not req.grant["contaminated"] and rec["contaminated"] and rec["flags"] == ["sibling-context"]
    assert rec["slot"] == 0 and rec["queue_wait_s"] == req.grant["queue_wait_s"]


def test_a_lost_guardians_journal_line() -> None:
    from krex.node.records import GuardianLost

    procs = [{"pid": 7, "cmd": "x"}]
    line = GuardianLost(1.5, 0, 3, 99, "pid 99 is gone", "kill-failed", procs, [7]).as_dict()
    assert line == {
        "ts": 1.5, "event": "guardian-lost", "gpu": 0, "slot": 3, "guardian_pid": 99, "why": "pid 99 is gone",
        "action": "kill-failed", "processes": procs, "alive": [7],
    }  # fmt: skip
    assert list(line) == ["ts", "event", "gpu", "slot", "guardian_pid", "why", "action", "processes", "alive"]
    assert "alive" not in GuardianLost(1.5, 0, 3, 99, "gone", "killed", procs).as_dict()


class _LifeSeg(FakeSeg):
    """Sibling pid 41 (slot 1) is inside a LIFE call with nothing else queued as the plan
    reads it; by the time its freeze lands the excuse no longer holds (`excusable`), so its
    ack can only come from its helper, which runs only while its slot is thawed."""

    def __init__(self, events: list[tuple[str, Any]], groups: dict[int, FakeGroup], excusable: bool) -> None:
        super().__init__(events)
        self.raw.gpus[0].drain_seq = 7
        self.groups, self.excusable, self.acked = groups, excusable, False

    def slot_pids(self, slot: int) -> list[int]:
        return [41] if slot == 1 else []

    def life_busy(self, gpu: int, owner_slot: int) -> dict[int, tuple[int, int]]:
        return {41: (1, 0)}

    def life_only(self, pids: Any) -> set[int]:
        return set(pids) & {41}

    def drain_excuse(self, gpu: int, pid: int, seq: int) -> bool:
        self.acked |= self.excusable
        return self.excusable

    def drain_owing(self, gpu: int, owner_slot: int, seq: int) -> set[int]:
        if not self.acked and not self.groups[1].frozen:
            self.acked = True  # its helper, running, acks
        return set() if self.acked else {41}

    def drain(self, gpu: int, slot: int, timeout_s: float, on_progress: Any, on_slow: Any, full: bool) -> Any:
        self.events.append(("drain", full))
        on_progress({41})  # it owes: frozen (and excused) at once
        deadline = time.monotonic() + timeout_s
        while self.drain_owing(gpu, slot, 7) and time.monotonic() < deadline:
            time.sleep(0.005)
        if self.drain_owing(gpu, slot, 7):
            return SimpleNamespace(
                ok=False, seconds=timeout_s, acks={}, stats={"scans": 1}, count=1, stragglers=[41], partial=[]
            )
        on_progress(set())
        return self.drained


@pytest.mark.parametrize("excusable", [True, False])
def test_a_life_frozen_sibling_whose_excuse_no_longer_holds_is_thawed_until_it_acks(excusable: bool) -> None:
    """life_freeze: a sibling frozen inside its LIFE call is excused; one whose record changed
    between the plan and the freeze (its call ended and a free began, a flag came) cannot be,
    and frozen it could never ack: it is thawed until its helper has acked, then frozen again,
    rather than hold the drain to its timeout."""
    d = FakeDaemon(siblings=1, policy="gpu")
    d.cfg = Config(freeze_policy="gpu", life_freeze=True, drain_timeout_s=2.0, lend_cores="off")
    groups = {n: s.group for n, s in d.slots.items()}
    d.seg = _LifeSeg(d.events, groups, excusable)  # type: ignore[assignment]
    d._group_pids = lambda s, deep=False: [41] if s.slot == 1 else []  # type: ignore[method-assign]
    d.slots[1].group.pids = lambda: [41]  # type: ignore[attr-defined,method-assign]  # its freezer group's member
    run, req = _region(d)
    steps = run.steps()
    next(steps)
    assert not req.grant["contaminated"], req.grant["reasons"]
    assert req.grant["frozen_slots"] == [1]
    assert req.grant["life_frozen"] == ([41] if excusable else [])
    assert req.grant["drain_s"] < 1.0, req.grant
    freezes = [e for e in d.events if e[0] in ("freeze", "thaw") and e[1] == "slot-1"]
    assert freezes == (
        [("freeze", "slot-1")]
        if excusable
        else [("freeze", "slot-1"), ("thaw", "slot-1"), ("freeze", "slot-1")]
    )
    req.ended.set()
    list(steps)
