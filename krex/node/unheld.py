"""The work of sibling processes the gate does not hold (freezepolicy: "unheld").

Such a process's slot is frozen, so it queues nothing new; but what it queued before the
freeze was never counted by a hook, and no drain helper of it synchronises it: KREX cannot
drain it. Before a region's grant (`queued_work`):
  - on the simulated GPU the device model's timeline says when all queued work ends (its
    shared `busy_until`, per device): the region waits until then, at most the drain
    timeout, else it is flagged;
  - with NVML (a real NVIDIA GPU; on the simulated one too when a test fakes NVML, after
    the wait above) a process that NVML does not list on the GPU holds no context there,
    so it has no work queued; one that NVML lists is flagged, idle or not: when its work
    ends cannot be known;
  - on a real GPU without NVML (unavailable or failing, or listing pids that are not
    krexd's), the region is flagged for every unheld process.
Every flag names the processes and why the gate does not hold them."""

from __future__ import annotations

import contextlib
import os
import struct
import time
from collections.abc import Callable, Mapping

from krex.node.attest import Attestor

FLAG = "unheld-sibling"
_SIM_DEVICES = 16  # SIMGPU_MAX: struct sim_dev_shm {u32 magic, u32 ndev, u64 busy_until[16]}


def describe(unheld: Mapping[int, tuple[int, str]], limit: int = 3) -> str:
    """'slot S: why; ...' for the first `limit` processes (why names the pid)."""
    items = sorted(unheld.items())
    out = "; ".join(f"slot {slot}: {why}" for _pid, (slot, why) in items[:limit])
    return out + (f"; and {len(items) - limit} more" if len(items) > limit else "")


def sim_busy_until(name: str, dev: int) -> int | None:
    """CLOCK_MONOTONIC ns at which the work queued on simulated device `dev` of the device
    model `name` (its KREX_SIM_SHM) ends; None when there is no such device model."""
    if not 0 <= dev < _SIM_DEVICES:
        return None
    try:
        with open("/dev/shm/" + name.lstrip("/"), "rb") as f:
            raw = f.read(8 + 8 * _SIM_DEVICES)
    except OSError:
        return None
    if len(raw) < 8 + 8 * _SIM_DEVICES:
        return None
    return int(struct.unpack_from("<Q", raw, 8 + 8 * dev)[0])


def sim_models(pids: list[int], sim_shm_of: Callable[[int], str | None]) -> set[str]:
    """The device models these processes use: each one's KREX_SIM_SHM, else the default
    of its user (the simulator's own rule), plus krexd's own."""
    names = {os.environ.get("KREX_SIM_SHM") or f"/krex-sim-{os.getuid()}"}
    for pid in pids:
        name = sim_shm_of(pid)
        if name:
            names.add(name)
        else:
            with contextlib.suppress(OSError):
                names.add(f"/krex-sim-{os.stat(f'/proc/{pid}').st_uid}")
    return names


def queued_work(
    kind: str,
    attestor: Attestor,
    gpu: int,
    phys: int,
    unheld: Mapping[int, tuple[int, str]],
    bound_s: float,
    sim_shm_of: Callable[[int], str | None],
) -> tuple[list[tuple[str, str]], float]:
    """(reasons as (flag, text), seconds waited) for the work unheld siblings may have
    queued on GPU `gpu` (physical index `phys`) before their freeze (module docstring)."""
    if not unheld:
        return [], 0.0
    t0 = time.monotonic()
    who = describe(unheld)
    if kind == "sim":
        ends = [sim_busy_until(n, phys) for n in sim_models(sorted(unheld), sim_shm_of)]
        until = max((e for e in ends if e is not None), default=0)
        now = time.monotonic_ns()
        if until - now > bound_s * 1e9:
            return [
                (
                    FLAG,
                    f"sibling processes the gate does not hold ({who}) had {((until - now) / 1e6):.0f} ms of "
                    f"work queued on the simulated GPU, past the drain timeout {bound_s:g}s: it ran into the "
                    "region",
                )
            ], time.monotonic() - t0
        if until > now:
            time.sleep((until - now) / 1e9)
        if attestor.nvml is None:
            return [], time.monotonic() - t0
    return _nvml_check(attestor, gpu, unheld, who), time.monotonic() - t0


def _nvml_check(
    attestor: Attestor, gpu: int, unheld: Mapping[int, tuple[int, str]], who: str
) -> list[tuple[str, str]]:
    listed = attestor.listed(gpu)
    if listed is None:
        why = attestor.note or "NVML did not answer"
        return [
            (
                FLAG,
                f"sibling processes the gate does not hold ({who}) may have GPU work queued that KREX cannot "
                f"drain, and whether they hold a context on GPU {gpu} cannot be told ({why})",
            )
        ]
    if not listed:
        return []  # no process holds a context on the GPU: nothing of theirs is queued
    on_gpu = {p: v for p, v in unheld.items() if p in listed}
    if on_gpu:
        return [
            (
                FLAG,
                f"sibling processes the gate does not hold have a context on GPU {gpu} (NVML), and KREX "
                f"cannot drain what they queued before their freeze: {describe(on_gpu)}",
            )
        ]
    if attestor.pids_local:
        return []  # NVML's pids are krexd's, and none of theirs is listed
    return [
        (
            FLAG,
            f"sibling processes the gate does not hold ({who}) may have GPU work queued, and NVML's pids "
            "cannot be matched to krexd's yet (another pid namespace?)",
        )
    ]


# A sibling frozen inside a context, module or memory call (krexd's `life_freeze`): what the
# half-done call queued on the GPU before the freeze landed. On a real GPU this short wait is
# the whole of it until benchmarks/gpu_frozen_life.py measures what such a call leaves
# (hence the knob is off by default); the simulated GPU's timeline says when it ends.
LIFE_FROZEN_SETTLE_S = 0.005
LIFE_FLAG = "life-frozen"


def life_frozen_settle(
    kind: str, phys: int, pids: list[int], bound_s: float, sim_shm_of: Callable[[int], str | None]
) -> tuple[list[tuple[str, str]], float]:
    """(reasons, seconds waited) for what siblings frozen inside a LIFE call had queued."""
    if not pids:
        return [], 0.0
    t0 = time.monotonic()
    if kind != "sim":
        time.sleep(LIFE_FROZEN_SETTLE_S)
        return [], time.monotonic() - t0
    ends = [sim_busy_until(n, phys) for n in sim_models(sorted(pids), sim_shm_of)]
    until = max((e for e in ends if e is not None), default=0)
    now = time.monotonic_ns()
    if until - now > bound_s * 1e9:
        return [(LIFE_FLAG, f"pids {sorted(pids)}, frozen inside a context, module or memory call, had "
                 f"{(until - now) / 1e6:.0f} ms of work queued on the simulated GPU, past the drain timeout "
                 f"{bound_s:g}s: it ran into the region")], time.monotonic() - t0
    if until > now:
        time.sleep((until - now) / 1e9)
    return [], time.monotonic() - t0
