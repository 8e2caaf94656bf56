"""krexd's regions: each GPU's queue and worker (FIFO, fair between tenants), entry on the
requesting connection's thread when the GPU is idle, and the begin and end requests. The
protocol's steps are region.py's; the checks they make, regionchecks.py's."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Generator
from typing import Any

from krex.errors import Busy, DaemonLost, KrexError, NotFound, UsageError
from krex.node.region import Region, RegionRun
from krex.node.regionchecks import RegionChecks
from krex.node.shm import gate_owner
from krex.node.state import handles, log
from krex.protocol import int_field


class Regions(RegionChecks):
    """The Daemon's queues, GPU workers and region requests."""

    def _gpu_loop(self, gpu: int) -> None:
        """The GPU's worker: runs queued regions in FIFO order, and holds (waits for the end
        of, then closes) regions whose entry ran on the requesting connection's thread."""
        while True:
            with self.lock:
                while self.held[gpu] is None and (
                    self.stop.is_set() or self.current[gpu] is not None or not self.queues[gpu]
                ):
                    if self.stop.is_set() and self.current[gpu] is None:
                        return
                    self.changed.wait(0.5)
                held = self.held[gpu]
                if held is not None:
                    self.held[gpu] = None
                    req, steps = held
                else:
                    req = self.queues[gpu].pop()
                    if req.cancelled:
                        continue
                    self.current[gpu] = req
                    steps = RegionRun(self, gpu, req).steps()
            self._drive(gpu, req, steps, to_grant=False)

    def _enter_inline(self, gpu: int, req: Region) -> bool:
        """Run a region's entry on the requesting connection's thread when its GPU is idle
        and nobody queues (FIFO holds: nobody is overtaken): no hand-off to the GPU's worker
        and back before the grant. False when the GPU is busy: the caller queues it."""
        with self.lock:
            if self.stop.is_set() or self.current[gpu] is not None or self.queues[gpu]:
                return False
            self.current[gpu] = req
            self.queues[gpu].start_inline(req.tenant)
        steps = RegionRun(self, gpu, req).steps()
        if self._drive(gpu, req, steps, to_grant=True):
            # Granted: the worker holds the region from here (--max-region, END, the exit
            # steps). Handed over only after the reply went out (see _client).
            def hand_over() -> None:
                with self.lock:
                    if not self.stop.is_set():
                        self.held[gpu] = (req, steps)
                        self.changed.notify_all()
                        return
                # Stopping: the worker may be gone; finish here (shutdown ended the region).
                self._drive(gpu, req, steps, to_grant=False)

            req.after_reply = hand_over
        return True

    def _drive(self, gpu: int, req: Region, steps: Generator[None, None, None], to_grant: bool) -> bool:
        """Advance a region's steps: up to its grant (to_grant) or to its end. True when it
        stopped at the grant; once its steps are over, the GPU is free for the next one."""
        try:
            if to_grant:
                if next(steps, "done") is None:
                    return True
            else:
                for _ in steps:
                    pass
        except Exception as e:  # noqa: BLE001 - a bad region must never take the GPU's queue down
            log.exception("gpu %d: region of slot %d pid %d failed; gate reopened", gpu, req.slot, req.pid)
            req.grant = {
                "ok": False,
                "error": f"region failed: {type(e).__name__}: {e}",
                "fix": "see krexd.log; the gate was reopened",
            }
            req.granted.set()
            with contextlib.suppress(Exception):
                cur = self.seg.gate_word(gpu)
                if gate_owner(cur) == req.slot + 1:  # ours: never open someone else's gate
                    self.seg.open_gate(gpu, cur)
        with self.lock:
            # The GPU's exclusive time this region took (entry and region), charged to its
            # tenant before the next region is picked.
            used = float(req.record.get("entry_s") or 0.0) + float(req.record.get("region_s") or 0.0)
            self.queues[gpu].charge(req.tenant, used)
            self.current[gpu] = None
            self.regions_done += 1
            self.changed.notify_all()
        req.released.set()
        return False

    @handles("begin")
    def _op_begin(
        self, conn: socket.socket, pid: int, msg: dict[str, Any], owned: dict[str, Any]
    ) -> dict[str, Any]:
        return self._begin(pid, msg, owned)

    @handles("end")
    def _op_end(
        self, conn: socket.socket, pid: int, msg: dict[str, Any], owned: dict[str, Any]
    ) -> dict[str, Any]:
        return self._end(pid, owned)

    def _begin(self, pid: int, msg: dict[str, Any], owned: dict[str, Any]) -> dict[str, Any]:
        if owned["region"] is not None and not owned["region"].released.is_set():
            raise Busy("this connection already holds a region", "end it first")
        self._check_not_lost()
        s = self._slot_for(pid, msg, owned)
        tid = int_field(msg, "tid") or pid
        if not os.path.exists(f"/proc/{pid}/task/{tid}"):
            raise UsageError(f"thread {tid} is not a thread of pid {pid}", "send your own thread id")
        label = str(msg.get("label") or "")[:200]
        t_request = time.monotonic()
        self._wait_warm(s, pid)
        if not os.path.exists(f"/proc/{pid}/task/{tid}"):
            raise NotFound(f"thread {tid} of pid {pid} ended while its command waited pre-warmed", "")
        req = Region(s.slot, s.gpu, pid, tid, t_request, label=label, tenant=s.tenant)
        owned["region"] = req
        self.pending.queue(req, s.gpu, s.slot)
        try:
            if not self._enter_inline(s.gpu, req):
                with self.lock:
                    self.queues[s.gpu].push(req)
                    self.changed.notify_all()
            req.granted.wait()
        finally:
            self.pending.unqueue(req)
        if req.cancelled:
            if self.stop.is_set():
                raise DaemonLost("region cancelled: the daemon is stopping", "run again; it starts on demand")
            raise KrexError("region cancelled", "the daemon is stopping or the slot was released")
        return req.grant

    def _end(self, pid: int, owned: dict[str, Any]) -> dict[str, Any]:
        req: Region | None = owned["region"]
        if req is None or req.released.is_set() and req.end_reason:
            s = self._slot_of_pid(pid)
            with self.lock:
                cur = [
                    r for r in self.current.values() if r is not None and s is not None and r.slot == s.slot
                ]
            if req is None and not cur:
                raise UsageError("END without BEGIN: this process holds no region", "call begin first")
            if req is None:
                # I6: only the connection that began a region may end it.
                raise Busy(
                    "that region belongs to another connection of your command", "end it where it began"
                )
        assert req is not None
        req.ended.set()
        req.released.wait(10)
        owned["region"] = None
        rec = req.record
        # The verdict up front: a cut or flagged region must never read as a clean one.
        return {
            "ok": True,
            "end": req.end_reason or "end",
            "clean": not rec.get("contaminated", True),
            "cut": bool(rec.get("cut")),
            "flags": rec.get("flags", []),
            "region": rec,
        }
