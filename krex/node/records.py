"""The shapes of what krexd's regions send and leave: the grant (`begin`'s reply), the
region's record (`end`'s reply, the release's report and the journal's line), and the
journal's other line, a guardian lost. One definition each; as_dict() makes the dict the wire
and the journal carry, in the key order their readers have always seen."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Why a region is contaminated: (flag, text). The flag is a short code for machines (the
# journal's "flags"), the text says what happened. Any reason makes the region
# contaminated: never silently clean.
Reason = tuple[str, str]


def verdict(reasons: list[Reason]) -> dict[str, Any]:
    """`contaminated`, `reasons` (the texts) and `flags` (sorted, each once)."""
    return {
        "contaminated": bool(reasons),
        "reasons": [text for _f, text in reasons],
        "flags": sorted({f for f, _t in reasons}),
    }


@dataclass
class Grant:
    """A granted region: what its entry did and found, as `begin`'s reply."""

    gpu: int
    slot: int
    times: dict[str, float]  # each step's seconds (queue_wait_s ... entry_s), in step order
    drained: int
    waits: dict[str, Any]  # how each wait ended: wake-ups versus re-checks without one
    frozen_slots: list[int]
    freeze_policy: str
    frozen_early: int  # frozen while other siblings still drained
    # What entry waited for: the last acks (pid, ms), where the siblings that owed one 25 ms
    # in were, the threads lent priority, each freeze's time, and threads a slow one waited for.
    drain_slow: list[list[float]]
    drain_waited_on: list[str]
    lent_priority: list[list[int]]
    freeze_ms: dict[str, float]
    freeze_slow: dict[str, list[str]]
    evicted_threads: int
    running_slots: list[int]
    freeze_why: list[str]
    unheld: list[list[Any]]  # sibling processes the gate does not hold (all frozen): [pid, slot, why]
    reserved_cpus: list[int]
    reasons: list[Reason]  # the grant's verdict
    freezer: str
    partition_degraded: bool
    device: str
    tenant: str
    label: str = ""
    # Siblings frozen inside a context, module or memory call, their drain acks excused
    # (krexd's life_freeze): pids.
    life_frozen: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "ok": True,
            "gpu": self.gpu,
            "slot": self.slot,
            **{k: round(v, 6) for k, v in self.times.items()},
            "drained": self.drained,
            **self.waits,
            "frozen_slots": self.frozen_slots,
            "freeze_policy": self.freeze_policy,
            "frozen_early": self.frozen_early,
            "drain_slow": self.drain_slow,
            "drain_waited_on": self.drain_waited_on,
            "lent_priority": self.lent_priority,
            "freeze_ms": self.freeze_ms,
            "freeze_slow": self.freeze_slow,
            "evicted_threads": self.evicted_threads,
            "running_slots": self.running_slots,
            "freeze_why": self.freeze_why,
            "unheld": self.unheld,
            "life_frozen": self.life_frozen,
            "reserved_cpus": self.reserved_cpus,
            **verdict(self.reasons),
            "freezer": self.freezer,
            "partition_degraded": self.partition_degraded,
            "device": self.device,
        }
        if self.label:
            out["label"] = self.label
        out["tenant"] = self.tenant
        return out


@dataclass
class RegionRecord:
    """A region that ended: its grant, then what its end found. The journal's line."""

    ts: float
    gpu: int
    owner_slot: int
    owner_pid: int
    tid: int
    cmd: str | None  # the command that held it, for `krex journal` (None once its process is gone)
    grant: dict[str, Any]  # as sent (Grant.as_dict); its verdict is replaced by the end's
    region_s: float
    thaw_s: float
    end: str  # "end", or why it was ended by force
    siblings_frozen: int
    t_grant_ns: int
    t_end_ns: int
    cut: bool
    reasons: list[Reason]  # the verdict at the end: the grant's reasons plus what happened inside
    attest: dict[str, Any]
    cgroup_fallback: str | None = None  # where its command's group went instead, and why
    look_s: float | None = None  # the end's wait for running siblings' look acks (None: none asked)

    def as_dict(self) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "ts": self.ts,
            "gpu": self.gpu,
            "owner_slot": self.owner_slot,
            "owner_pid": self.owner_pid,
            "tid": self.tid,
            "cmd": self.cmd,
            **self.grant,
            "region_s": round(self.region_s, 6),
            "thaw_s": round(self.thaw_s, 6),
            "end": self.end,
            "siblings_frozen": self.siblings_frozen,
            "t_grant_ns": self.t_grant_ns,
            "t_end_ns": self.t_end_ns,
            "cut": self.cut,
            **verdict(self.reasons),
            "attest": self.attest,
        }
        rec.pop("ok", None)
        if self.cgroup_fallback is not None:
            rec["cgroup_fallback"] = self.cgroup_fallback
        if self.look_s is not None:
            rec["look_s"] = round(self.look_s, 6)
        return rec


@dataclass
class GuardianLost:
    """A `krex run` guardian died before its command ended: the journal's event line."""

    ts: float
    gpu: int
    slot: int
    guardian_pid: int
    why: str
    action: str  # killed, kill-failed, or none (nothing of it was left)
    processes: list[dict[str, Any]]
    alive: list[int] | None = None  # those a failed kill left

    def as_dict(self) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "ts": self.ts,
            "event": "guardian-lost",
            "gpu": self.gpu,
            "slot": self.slot,
            "guardian_pid": self.guardian_pid,
            "why": self.why,
            "action": self.action,
            "processes": self.processes,
        }
        if self.alive:
            rec["alive"] = self.alive
        return rec
