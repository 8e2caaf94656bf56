"""Per-region attestation: what could still have disturbed a region, beyond the gate.

At a region's grant and at its end krexd samples, for the region's GPU, NVML's
running processes (compute and graphics), the SM clock and the clock-event
(throttle) reasons. `judge` compares both samples with the processes KREX knows:
a GPU process that is not under KREX, or a power / thermal / hardware slowdown,
flags the region with the reason. Processes that start and end between the two
samples are not seen; NVML in a container may report host pids, which then all
look foreign (the reason says so, so such a node shows it at once).

On the simulated GPU there is no NVML (unless KREX_NVML_FAKE is set for a test):
the record says so and nothing is flagged."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from krex.device.nvml import DISTURBING, Nvml, NvmlUnavailable, open_nvml, throttle_names
from krex.native import lib
from krex.node import procfs

_MEM_KEEP_S = 60.0  # a process's GPU memory figure is forgotten this long after NVML last gave it


def _cmd(pid: int) -> str:
    cmd = procfs.cmdline(pid, 120)
    return "not visible in this pid namespace" if cmd is None else cmd or "?"


class Attestor:
    def __init__(self, kind: str, physical: list[int], nvml: Nvml | None = None, note: str = "") -> None:
        self.physical = physical
        self.nvml = nvml
        self.note = note
        self.pids_local = False  # NVML's pids are krexd's: set once a sample lists one KREX knows
        self._listed_start: dict[int, int] = {}  # pid -> start time when NVML listed it first
        self._mem: dict[int, tuple[int, float]] = {}  # pid -> (most GPU bytes NVML gave, when last)
        self._mem_lock = threading.Lock()  # krexd's reaper samples it too (sample_memory)
        if nvml is None and not note:
            try:
                self.nvml = open_nvml()
            except NvmlUnavailable as e:
                self.note = f"unavailable: {e}"
            if kind == "sim" and self.nvml is None:
                self.note = "unavailable: simulated GPU"

    @classmethod
    def for_device(cls, kind: str, physical: list[int]) -> Attestor:
        from krex.device.nvml import fake_path

        if kind == "sim" and not fake_path():
            return cls(kind, physical, None, "unavailable: simulated GPU")
        return cls(kind, physical)

    def listed_gone(self, gpu: int) -> set[int] | None:
        """Pids NVML lists on `gpu` whose process has ended in krexd's pid namespace (gone,
        a zombie with no live thread, or its pid reused since NVML first listed it): the
        driver is still tearing their contexts down, on the GPU. Empty until a sample
        listed a process KREX knows, which shows NVML's pids are ours (in a container they
        may be the host's, and would all look gone). None when NVML did not answer."""
        if self.nvml is None or not self.pids_local:
            return set()
        try:
            listed = self.nvml.process_memory(self.physical[gpu] if gpu < len(self.physical) else gpu)
        except Exception:  # noqa: BLE001 - NVML errors must never fail a region
            return None
        self._note_memory(listed)
        return {p for p in listed if self._ended(p)}

    def listed(self, gpu: int) -> set[int] | None:
        """The pids NVML lists on `gpu` now (compute and graphics: the processes with a
        context there); None when there is no NVML or it did not answer."""
        if self.nvml is None:
            return None
        try:
            mem = self.nvml.process_memory(self.physical[gpu] if gpu < len(self.physical) else gpu)
        except Exception:  # noqa: BLE001 - NVML errors must never fail a region
            return None
        self._note_memory(mem)
        return set(mem)

    def sample_memory(self, gpu: int) -> None:
        """Note the GPU memory NVML gives for each process on `gpu` (krexd's reaper, between
        regions): what sizes the wait for its scrubbing once it ends (settle_ns)."""
        if self.nvml is not None:
            self.listed(gpu)

    def _note_memory(self, mem: dict[int, int | None]) -> None:
        now = time.monotonic()
        with self._mem_lock:
            for p, b in mem.items():
                if b is not None:
                    self._mem[p] = (max(b, self._mem.get(p, (0, 0.0))[0]), now)
            for p in [p for p, (_b, t) in self._mem.items() if now - t > _MEM_KEEP_S]:
                del self._mem[p]

    def settle_ns(self, pids: set[int]) -> int | None:
        """How long the GPU may still clear memory after these processes ended: the most
        GPU memory NVML reported for any of them, at KREX_SETTLE_NS_PER_GB (at least
        KREX_SETTLE_MIN_NS). None when NVML gave no figure for one of them (never listed,
        or its pids are not ours): the caller keeps its fixed settle time."""
        if self.nvml is None or not self.pids_local or not pids:
            return None
        with self._mem_lock:
            got = [self._mem.get(p) for p in pids]
        if any(g is None for g in got):
            return None
        most = max(g[0] for g in got if g is not None)
        return max(int(lib.KREX_SETTLE_MIN_NS), int(most * lib.KREX_SETTLE_NS_PER_GB / 2**30))

    def _ended(self, pid: int) -> bool:
        st = procfs.pid_stat(pid)
        # A zombie leader whose other threads run on is alive (krex_pid_alive's rule too).
        if st is None or (st.state in "ZX" and st.threads <= 1):
            return True
        first = self._listed_start.setdefault(pid, st.start)
        return first != st.start

    def _remember(self, listed: list[int]) -> None:
        """The start time of each listed process, as NVML first listed it: a pid reused
        later is another process, and the one NVML listed has ended."""
        for p in list(self._listed_start):
            if p not in listed:
                del self._listed_start[p]
        for p in listed:
            if p not in self._listed_start:
                st = procfs.pid_stat(p)
                if st is not None:
                    self._listed_start[p] = st.start

    def sample(self, gpu: int) -> dict[str, Any]:
        if self.nvml is None:
            return {}
        i = self.physical[gpu] if gpu < len(self.physical) else gpu
        try:
            thr = self.nvml.throttle(i)
            mem = self.nvml.process_memory(i)
            procs = sorted(mem)
            self._note_memory(mem)
            self._remember(procs)
            return {
                "t_ns": time.monotonic_ns(),
                "sm_clock_mhz": self.nvml.sm_clock(i),
                "throttle_mask": thr,
                "procs": procs,
            }
        except Exception as e:  # noqa: BLE001 - NVML errors must never fail a region
            return {"error": f"{type(e).__name__}: {e}"}

    def judge(
        self,
        gpu: int,
        entry: dict[str, Any],
        exit_: dict[str, Any],
        known: Callable[[], set[int]],
        unheld: dict[int, str] | None = None,
    ) -> tuple[dict[str, Any], list[tuple[str, str]]]:
        """(the record's "attest" object, reasons as (flag, text)). `unheld`: sibling
        processes the gate does not hold (pid -> why): never counted as known, so NVML
        listing one flags the region as work KREX did not hold."""
        if self.nvml is None:
            return {"nvml": self.note or "unavailable"}, []
        reasons: list[tuple[str, str]] = []
        out: dict[str, Any] = {"nvml": "ok"}
        for k, s in (("entry", entry), ("exit", exit_)):
            if s.get("error"):
                out["nvml"] = f"error at {k}: {s['error']}"
        out["sm_clock_mhz"] = [entry.get("sm_clock_mhz"), exit_.get("sm_clock_mhz")]
        masks = [entry.get("throttle_mask"), exit_.get("throttle_mask")]
        out["throttle"] = [throttle_names(m) if m is not None else None for m in masks]
        bad = 0
        for m in masks:
            bad |= (m or 0) & DISTURBING
        if bad:
            reasons.append(
                (
                    "throttle",
                    f"GPU {gpu} clocks were slowed during the region: {', '.join(throttle_names(bad))}",
                )
            )
        seen = sorted(set(entry.get("procs") or []) | set(exit_.get("procs") or []))
        foreign: list[dict[str, Any]] = []
        unheld = unheld or {}
        if seen:
            ours = known()
            self.pids_local = self.pids_local or bool(ours.intersection(seen))
            ours -= set(unheld)
            foreign = [{"pid": p, "cmd": _cmd(p)} for p in seen if p not in ours]
        out["gpu_processes"] = len(seen)
        out["foreign"] = foreign
        for f in foreign:
            if f["pid"] in unheld:
                reasons.append(
                    (
                        "unheld-sibling",
                        f"pid {f['pid']} ({f['cmd']}), a sibling's process the gate does not hold "
                        f"({unheld[f['pid']]}), held a context on GPU {gpu} during the region",
                    )
                )
            else:
                reasons.append(
                    ("foreign-process", f"pid {f['pid']} ({f['cmd']}) used GPU {gpu} outside KREX")
                )
        return out, reasons
