"""What the bench keeps of a run beside its result: the compact `krex run` report of each
command (raw.jsonl's "krex"), and the CPU time of the node and of krexd over a cell
(cells.jsonl's node_busy and krexd_cpu_s)."""

from __future__ import annotations

import os
from typing import Any

from krex.node import procfs

__all__ = ["compact_report", "node_cpu_s", "tree_cpu_s"]


def compact_report(rep: dict[str, Any]) -> dict[str, Any]:
    """What raw.jsonl keeps of a `krex run --report`: the run's counters and, per region, its
    timings, flags and reasons."""
    keys = (
        "queue_wait_s",
        "block_s",
        "inflight_s",
        "drain_s",
        "freeze_s",
        "exit_wait_s",
        "teardown_wait_s",
        "settle_s",
        "pin_s",
        "entry_s",
        "region_s",
        "t_grant_ns",
        "t_end_ns",
        "thaw_s",
        "contaminated",
        "reasons",
        "siblings_frozen",
        "drained",
        "partition_degraded",
        "freezer",
        "freeze_policy",
        "running_slots",
        "freeze_why",
        "drain_slow",
        "drain_waited_on",
        "lent_priority",
        "freeze_ms",
        "freeze_slow",
        "cut",
        "flags",
        "label",
        "attest",
    )
    regions = [{k: r.get(k) for k in keys if k in r} for r in rep.get("regions") or [] if isinstance(r, dict)]
    return {
        "slot": rep.get("slot"),
        "gpu": rep.get("gpu"),
        "admission_wait_s": rep.get("admission_wait_s"),
        "prewarm_s": rep.get("prewarm_s"),
        "gate_blocks": rep.get("gate_blocks"),
        "gate_blocked_ms": rep.get("gate_blocked_ms"),
        "fail_opens": rep.get("fail_opens"),
        "paced": rep.get("paced"),
        "paced_ms": rep.get("paced_ms"),
        "contaminated_regions": rep.get("contaminated_regions"),
        "region_wait_s": rep.get("region_wait_s"),
        "cut_regions": rep.get("cut_regions"),
        "inductor_regions": rep.get("inductor_regions"),  # torch's hook or KREX's fallback wrapper
        "simulated": rep.get("simulated"),
        "leftovers": len(rep.get("leftovers") or []),
        "auto_region": {
            k: (rep.get("auto_region") or {}).get(k) for k in ("value", "wrapped", "auto_regions")
        }
        if rep.get("auto_region")
        else None,
        "regions": regions,
    }


_TCK = os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of `pid` and its live children (krexd and its watchdog), or
    None if `pid` is gone. Where krex-C's CPU goes beside the commands' own."""
    table = procfs.proc_table()
    if pid not in table:
        return None
    return sum(st.cpu_ticks for st in table.values() if pid in (st.pid, st.ppid)) / _TCK


def node_cpu_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole node since boot, from /proc/stat: how saturated
    the cores were over a cell."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle, iowait
    total = sum(v[:8])  # guest time is already in user
    return (total - idle) / _TCK, total / _TCK
