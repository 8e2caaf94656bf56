"""The driver of one `krex fleet` run (krex.fleet.run_fleet calls `drive`): it submits each
command as a Ray task, at most twice the live slots in flight, collects what comes back,
runs a command lost with its node again, cancels on request and writes every file."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from krex.batch import BatchCommand, CommandResult, _write_json
from krex.fleet import (
    GRACE_S,
    NODES_REFRESH_S,
    RESOURCE,
    FleetConfig,
    FleetEvent,
    FleetSummary,
    LostAttempt,
    NodeInfo,
    _alive_nodes,
    _Attempt,
    _final_nodes,
    _lost_errors,
    _node_of_error,
    fleet_summary,
    gather_journals_connected,
    run_on_node,
)
from krex.runner import TICK_S

__all__ = ["drive"]


def drive(ray: Any, commands: Sequence[BatchCommand], cfg: FleetConfig, out: Path,
          progress: Callable[[FleetEvent], None] | None, cancel: threading.Event) -> FleetSummary:
    return _Drive(ray, commands, cfg, out, progress, cancel).run()


class _Drive:
    """One fleet run's state, and one method per step of its loop."""

    def __init__(self, ray: Any, commands: Sequence[BatchCommand], cfg: FleetConfig, out: Path,
                 progress: Callable[[FleetEvent], None] | None, cancel: threading.Event) -> None:
        self.ray, self.commands, self.cfg, self.out = ray, commands, cfg, out
        self.progress, self.cancel = progress, cancel
        self.lost_types = _lost_errors(ray)
        self.task = ray.remote(run_on_node)
        self.width = max(3, len(str(len(commands))))
        self.cwd = cfg.cwd or os.getcwd()
        self.t_run, self.started_wall = time.monotonic(), time.time()
        self.nodes = _alive_nodes(ray)
        # every node that offered slots during the run
        self.seen: dict[str, NodeInfo] = dict(self.nodes)
        self.nodes_at = time.monotonic()
        self.no_nodes_since: float | None = None if self.nodes else time.monotonic()
        self.pending: deque[BatchCommand] = deque(commands)
        self.in_flight: dict[Any, _Attempt] = {}
        self.results: dict[int, CommandResult] = {}
        self.extra: dict[int, dict[str, Any]] = {}  # per command: node, attempts, result line
        self.lost_log: list[LostAttempt] = []
        # Nodes named by a NodeDiedError: lost for good (a node id is never reused), even while
        # the GCS still lists them as alive (it notices a dead raylet only after its health checks).
        self.dead: set[str] = set()
        self.per_node: dict[str, int] = {}
        self.failed = 0
        self.next_tick = self.t_run + TICK_S
        self.cancel_step, self.cancel_at = 0, 0.0
        self.gave_up: str | None = None
        self.retry: dict[int, list[LostAttempt]] = {}
        self.attempts: dict[int, int] = {}

    def emit(self, kind: Literal["submit", "done", "lost", "tick"], **kw: Any) -> None:
        if self.progress is not None:
            self.progress(FleetEvent(kind, len(self.commands), len(self.results), len(self.in_flight),
                                     self.failed, len(self.lost_log), time.monotonic() - self.t_run,
                                     len(self.nodes), sum(n["slots"] for n in self.nodes.values()),
                                     dict(self.per_node), cancelling=self.cancel_step > 0, **kw))

    def submit(self, cmd: BatchCommand, attempt: int, lost: list[LostAttempt]) -> None:
        cfg = self.cfg
        payload = {"index": cmd.index, "argv": cmd.argv, "attempt": attempt, "device": cfg.device,
                   "node_root": None if cfg.node_root is None else str(Path(cfg.node_root).absolute()),
                   "idle_exit_s": cfg.idle_exit_s, "cwd": self.cwd, "tail_bytes": cfg.tail_bytes}
        ref = self.task.options(resources={RESOURCE: 1}, num_cpus=0, max_retries=0,
                                name=f"krex-fleet:{cmd.index}").remote(payload)
        self.in_flight[ref] = _Attempt(cmd, attempt, time.monotonic(), lost)
        self.emit("submit", command=cmd)

    def record(self, a: _Attempt, res: dict[str, Any] | None, error: str | None, t_back: float,
               status: int | None = None) -> None:
        """One command's final outcome; `res` None: no result came back (`status` None = never
        completed, counted as not run; 1 = the task itself failed)."""
        cmd = a.cmd
        stem = f"cmd-{cmd.index:0{self.width}d}"
        so, se = self.out / f"{stem}.stdout", self.out / f"{stem}.stderr"
        if res is None:
            cr = CommandResult(cmd, status, 0.0, None, None, "", "", None, error)
            node = None
        else:
            so.write_text(res.get("stdout_tail") or "")
            se.write_text(res.get("stderr_tail") or "")
            cr = CommandResult(cmd, res.get("exit_status"), float(res.get("wall_s") or 0.0),
                               res.get("started_at"), res.get("ended_at"), str(so), str(se),
                               res.get("report"), res.get("error"))
            node = res.get("node_id")
            if node:
                self.per_node[node] = self.per_node.get(node, 0) + 1
        self.results[cmd.index] = cr
        if cr.exit_status is not None and not cr.ok:
            self.failed += 1
        got = res or {}
        ex = {"node_id": node, "node_ip": got.get("node_ip"), "host": got.get("host"),
              "attempt": a.attempt, "lost_attempts": a.lost,
              "result_line": got.get("result_line"), "result": got.get("result"),
              "stdout_bytes": got.get("stdout_bytes"), "stderr_bytes": got.get("stderr_bytes"),
              "setup_s": got.get("setup_s"), "daemon_started": got.get("daemon_started"),
              "round_trip_s": round(t_back - a.submitted, 6), "cancelled": bool(got.get("cancelled"))}
        self.extra[cmd.index] = ex
        _write_json(self.out / f"{stem}.json", {**cr.to_json(), **ex})
        self.emit("done", command=cmd, result=cr, node_id=node)

    def lose(self, a: _Attempt, node: str | None, kind: str, message: str, t_back: float) -> None:
        """An attempt lost with its node or worker: run the command again (it was never counted)."""
        rec: LostAttempt = {"index": a.cmd.index, "attempt": a.attempt, "node_id": node, "error": kind,
                            "message": message}
        self.lost_log.append(rec)
        self.emit("lost", command=a.cmd, node_id=node, lost=rec)
        if self.cancel_step:
            self.record(a, None, "interrupted while its node was lost", t_back)
        elif a.attempt < self.cfg.max_attempts:
            self.pending.appendleft(a.cmd)
            self.retry[a.cmd.index] = [*a.lost, rec]
        else:
            self.record(a, None, f"lost {a.attempt} time(s) with its node or worker; last: {message}", t_back)

    def collect(self, ref: Any) -> None:
        ray = self.ray
        a = self.in_flight.pop(ref)
        t_back = time.monotonic()
        try:
            res = ray.get(ref)
        except self.lost_types as e:
            node = _node_of_error(e)
            if node and isinstance(e, ray.exceptions.NodeDiedError):
                self.dead.add(node)
                self.nodes.pop(node, None)
            self.lose(a, node, type(e).__name__,
                      str(e).strip().splitlines()[0][:300] if str(e).strip() else "", t_back)
            return
        except ray.exceptions.TaskCancelledError:
            self.record(a, None, "cancelled: the fleet run was interrupted", t_back)
            return
        except ray.exceptions.RayError as e:  # the task itself raised: a failed command, never re-run
            self.record(a, None, f"{type(e).__name__}: {str(e).strip()[-600:]}", t_back, status=1)
            return
        if res.get("lost"):
            self.lose(a, res.get("node_id"), "GuardianKilled", str(res["lost"]), t_back)
            return
        self.record(a, res, None, t_back)

    def run(self) -> FleetSummary:
        try:
            while self.pending or self.in_flight:
                try:
                    self.step()
                except KeyboardInterrupt:
                    self.cancel.set()
        finally:
            if self.in_flight:  # only reached with tasks left if something above raised: don't orphan them
                for ref in self.in_flight:
                    with contextlib.suppress(Exception):
                        self.ray.cancel(ref, force=True)
        return self.finish()

    def step(self) -> None:
        """One pass of the loop: refresh the nodes, advance a cancel, give up without nodes,
        submit up to the window, collect what is back, tick."""
        now = time.monotonic()
        if now - self.nodes_at >= NODES_REFRESH_S:
            self.nodes, self.nodes_at = _alive_nodes(self.ray, self.dead), now
            self.seen.update(self.nodes)
            self.no_nodes_since = (self.no_nodes_since or now) if not self.nodes else None
        self.advance_cancel(now)
        starved = self.no_nodes_since is not None and now - self.no_nodes_since > self.cfg.wait_nodes_s
        if starved and self.cancel_step == 0:
            self.gave_up = (f"no live Ray node offered the {RESOURCE} resource for "
                            f"{self.cfg.wait_nodes_s:g} s")
            self.cancel.set()
            return
        window = max(1, 2 * sum(n["slots"] for n in self.nodes.values()))
        while self.pending and len(self.in_flight) < window and self.cancel_step == 0:
            cmd = self.pending.popleft()
            self.attempts[cmd.index] = self.attempts.get(cmd.index, 0) + 1
            self.submit(cmd, self.attempts[cmd.index], self.retry.pop(cmd.index, []))
        if self.in_flight:
            ready, _ = self.ray.wait(list(self.in_flight), num_returns=1, timeout=0.2)
            if ready:
                ready, _ = self.ray.wait(list(self.in_flight), num_returns=len(self.in_flight), timeout=0)
            for ref in ready:
                self.collect(ref)
        now = time.monotonic()
        if now >= self.next_tick:
            self.next_tick = now + TICK_S
            self.emit("tick")

    def advance_cancel(self, now: float) -> None:
        """Once `cancel` is set: stop submitting and interrupt the tasks; after GRACE_S + 5 s
        kill those still running."""
        if self.cancel.is_set() and self.cancel_step == 0:
            self.cancel_step, self.cancel_at = 1, now
            self.pending.clear()
            for ref in list(self.in_flight):
                self.ray.cancel(ref, force=False)
        elif self.cancel_step == 1 and now - self.cancel_at > GRACE_S + 5:
            self.cancel_step = 2
            for ref in list(self.in_flight):
                self.ray.cancel(ref, force=True)

    def finish(self) -> FleetSummary:
        """Every command's result (a never-run one says why), the nodes' journals and summary.json."""
        out, extra = self.out, self.extra
        total = time.monotonic() - self.t_run
        interrupted = self.cancel_step > 0
        all_results: list[CommandResult] = []
        for cmd in self.commands:
            res = self.results.get(cmd.index)
            if res is None:
                res = CommandResult(cmd, None, 0.0, None, None, "", "", None,
                                    self.gave_up or "not started: the fleet run was interrupted")
                extra[cmd.index] = {"node_id": None, "attempt": self.attempts.get(cmd.index, 0),
                                    "lost_attempts": self.retry.get(cmd.index, [])}
                stem = f"cmd-{cmd.index:0{self.width}d}"
                _write_json(out / f"{stem}.json", {**res.to_json(), **extra[cmd.index]})
            all_results.append(res)
        final_nodes = _final_nodes(self.ray, self.dead, self.lost_log)
        journals = gather_journals_connected(self.ray, self.cfg.node_root, since=self.started_wall - 5.0,
                                             nodes=[n for n in self.seen if n in final_nodes])
        with open(out / "journal.jsonl", "w") as f:
            for j in journals:
                for r in j.records:
                    f.write(json.dumps({"node_id": j.node_id, **r}, separators=(",", ":")) + "\n")
        data = fleet_summary(all_results, extra, self.seen, set(final_nodes), self.lost_log, total, self.cfg,
                             str(out), interrupted, journals)
        if self.gave_up:
            data["gave_up"] = self.gave_up
        _write_json(out / "summary.json", data)
        return FleetSummary(out, all_results, data)
