"""Regions about to begin, per GPU: what krexd publishes so that siblings' queues shrink
before a region's gate closes (the GPU record's `pending_slots` and `soon_slots`, read by
the shim: interpose/pace.c and shim.c, `krex_pending`).

- **queued**: a region's BEGIN arrived and its gate is not closed yet (it waits behind
  another region, or its entry is about to close the gate). The bit of its slot is set
  from the request until the gate closes for it or the request is dropped.
- **soon**: a command said a region comes soon (the `soon` request: an automatic region's
  target was entered, its warm-up runs first). The bit lapses after KREX_SOON_MS, at the
  region's BEGIN, or when the slot is released.

While either bit of another slot is set, a sibling's pacing check waits for its own queued
work (and, queued, for the gate to close), and its LIFE calls wait for the gate; each such
wait is bounded by KREX_PENDING_HOLD_MS in the shim, so a word left set slows, never stops.
Nothing here decides exclusivity: a region's grant still waits for every sibling's queued
work (the drain) or flags it."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from krex.native import lib

SOON_S = lib.KREX_SOON_MS / 1e3


class Pending:
    """The queued and announced regions of each GPU, published as one bit per slot."""

    def __init__(self, seg: Callable[[], Any], n_gpus: int, enabled: bool) -> None:
        self._seg = seg  # the current segment (krexd may replace it)
        self.enabled = enabled
        self._lock = threading.Lock()
        self._queued: dict[int, collections.Counter[int]] = {g: collections.Counter() for g in range(n_gpus)}
        self._tokens: dict[int, tuple[int, int]] = {}  # id(request) -> (gpu, slot)
        self._soon: dict[int, dict[int, float]] = {g: {} for g in range(n_gpus)}  # slot -> lapses at

    def queue(self, key: object, gpu: int, slot: int) -> None:
        """A region's BEGIN (`key`: the request) for `slot` on `gpu`; its announcement, if
        any, has served."""
        if not self.enabled or gpu not in self._queued:
            return
        with self._lock:
            if id(key) in self._tokens:
                return
            self._tokens[id(key)] = (gpu, slot)
            self._queued[gpu][slot] += 1
            self._soon[gpu].pop(slot, None)
            self._publish(gpu)

    def unqueue(self, key: object) -> None:
        """The request's gate closed, or it was dropped (idempotent)."""
        with self._lock:
            got = self._tokens.pop(id(key), None)
            if got is None:
                return
            gpu, slot = got
            self._queued[gpu][slot] -= 1
            if self._queued[gpu][slot] <= 0:
                del self._queued[gpu][slot]
            self._publish(gpu)

    def announce(self, gpu: int, slot: int) -> bool:
        """`slot` says a region comes soon on `gpu`; False when early shrinking is off."""
        if not self.enabled or gpu not in self._soon:
            return False
        with self._lock:
            self._soon[gpu][slot] = time.monotonic() + SOON_S
            self._publish(gpu)
        return True

    def expire(self) -> None:
        """Drop announcements whose time ran out (krexd's heartbeat calls it)."""
        now = time.monotonic()
        with self._lock:
            for gpu, soon in self._soon.items():
                old = [s for s, t in soon.items() if t <= now]
                for s in old:
                    del soon[s]
                if old:
                    self._publish(gpu)

    def drop_slot(self, slot: int) -> None:
        """A released slot announces nothing (its queued requests are cancelled, and each
        unqueues itself as its BEGIN returns)."""
        with self._lock:
            for gpu, soon in self._soon.items():
                if soon.pop(slot, None) is not None:
                    self._publish(gpu)

    def masks(self, gpu: int) -> tuple[int, int]:
        """(queued, soon) bit masks of `gpu`, as published."""
        with self._lock:
            return self._mask(self._queued[gpu]), self._mask(self._soon[gpu])

    @staticmethod
    def _mask(slots: Any) -> int:
        m = 0
        for s in slots:
            if 0 <= s < lib.KREX_MAX_SLOTS:
                m |= 1 << s
        return m

    def _publish(self, gpu: int) -> None:  # with self._lock
        g = self._seg().raw.gpus[gpu]
        g.pending_slots = self._mask(self._queued[gpu])
        g.soon_slots = self._mask(self._soon[gpu])
