"""Processes with GPU state that ended, and how long the GPU may still scrub their memory.

A process's exit frees all its GPU memory, and the driver clears it on the GPU after the
process is gone (H200: at most 5 ms after the reap for 16 GB, 115 ms for 64 GB;
docs/results/free-settle/). A region granted meanwhile shares the GPU with that clearing.
krexd frees the records of dead processes (its reaper every REAP_EVERY_S, a region's
settle step, a slot's release) and each comes here: its wait is counted from when krexd
found it gone, which is no earlier than when it went, at KREX_SETTLE_NS_PER_GB of the most
memory NVML reported for it (Attestor.settle_ns). Where NVML gave no figure, the fixed
KREX_FREE_SETTLE_NS from the start of its exit (the shim's exit handler), or from when it
was found gone if it had none: a signal or a crash ended it. That second kind is also what
an MPS server may fail its other clients for (krex/node/mps.py).

An exec ends a GPU image as _exit does (the new image marks the old one's record at load). A
record of a process outside krexd's pid namespace (Ended.unseen) tells no kill: krexd may
have freed it while the process lived.

The shim's exit handler still stamps the slot's free time (the recent-free flag's "since"),
with no settle time of its own: the wait is this ledger's, sized, from the process's end
rather than the start of its exit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from krex.native import lib
from krex.node.shm import Ended

log = logging.getLogger("krex.node.daemon")  # krexd's one logger (state.py)

REAP_EVERY_S = 0.1  # krexd's reaper loop frees dead records this often (loops.py)
KEEP_AFTER_NS = 2_000_000_000  # an entry stays this long past its deadline: recent-free's look back


@dataclass(frozen=True)
class Exit:
    """One ended process as krexd waits for it."""

    pid: int
    gpu: int
    slot: int
    slot_gen: int
    seen_ns: int  # krex_now_ns when krexd found it gone (it went at or before)
    until_ns: int  # until when the GPU may still scrub its memory
    killed: bool  # it ended without its exit handler: a signal or a crash
    sized: bool  # until_ns comes from NVML's figure for it

    def of_command(self, slot: int, gen: int) -> bool:
        """Whether it was a process of the command holding slot `slot` at generation `gen`."""
        return self.slot == slot and self.slot_gen == gen & 0xFFFFFFFF


class Exits:
    """The ledger: fed by Segment.on_ended, read by a region's settle step."""

    def __init__(self, settle_ns: Callable[[set[int]], int | None],
                 killed: Callable[[Exit], None] | None = None) -> None:
        self._settle_ns = settle_ns  # Attestor.settle_ns
        self._killed = killed
        self._lock = threading.Lock()
        self._exits: list[Exit] = []

    def add(self, ended: list[Ended]) -> None:
        now = int(lib.krex_now_ns())
        fixed = int(lib.KREX_FREE_SETTLE_NS)
        least = int(lib.KREX_SETTLE_MIN_NS)
        new = []
        for e in ended:
            sized = self._settle_ns({e.pid})
            if sized is not None:
                until = now + sized
            elif e.exit_ns and e.exit_ns <= now:
                until = max(e.exit_ns + fixed, now + least)
            else:
                until = now + fixed
            killed = e.exit_ns == 0 and not e.unseen  # an end krexd did not see is no kill
            new.append(Exit(e.pid, e.gpu, e.slot, e.slot_gen, now, until, killed, sized is not None))
        with self._lock:
            self._exits = [x for x in self._exits if x.until_ns + KEEP_AFTER_NS > now] + new
        for x in new:
            log.debug("ended: pid %d (slot %d, gpu %d, %s), its memory cleared in %.1f ms%s", x.pid, x.slot,
                      x.gpu, "killed" if x.killed else "exited", (x.until_ns - now) / 1e6,
                      "" if x.sized else " (no NVML figure)")
        if self._killed is not None:
            for x in new:
                if x.killed:
                    self._killed(x)

    def settle_until(self, gpu: int, owner_slot: int, owner_gen: int) -> tuple[int, int]:
        """(until when the GPU may still scrub the memory of other commands' ended
        processes, 0 if none; when krexd found the latest of them gone)."""
        until = newest = 0
        with self._lock:
            for x in self._exits:
                if x.gpu != gpu or x.of_command(owner_slot, owner_gen):
                    continue
                until, newest = max(until, x.until_ns), max(newest, x.seen_ns)
        return until, newest

    def since(self, gpu: int, owner_slot: int, owner_gen: int, since_ns: int) -> list[Exit]:
        """Other commands' processes on `gpu` found gone at or after `since_ns`."""
        with self._lock:
            return [x for x in self._exits
                    if x.gpu == gpu and x.seen_ns >= since_ns and not x.of_command(owner_slot, owner_gen)]
