"""Which KREX world a `krex bench` or `krex batch` runs in, and whether the daemon already
running there gives its commands the configuration they need.

A command under `krex run` joins the daemon of its world (state directory, segment). A bench
cell krex-C needs C slots per GPU; `krex batch -j N` needs N slots at once; both need the
device they measure on. A daemon that runs already (an operator's, or one an earlier
`krex run` started on demand) may have fewer slots, or another device: its extra commands
would wait at admission and the cell would measure a queue, silently. So:

* `daemon_misfit` says, in words, what the running daemon lacks ("" when it fits);
* `describe` names it (pid, socket, device, slots, freeze policy) for a refusal or a note;
* `OwnWorld` is a world of its own (private state directory, segment and simulated GPU,
  throwaway: its daemon's clean stop removes them), for a run on the simulated GPU, where
  nothing else shares the device. On a real GPU two worlds would not exclude each other's
  regions, so there the caller refuses instead."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from krex.protocol import StatusReply

__all__ = ["OwnWorld", "daemon_misfit", "daemon_status", "describe", "node_slots_per_gpu"]

# What a world is made of; an own world replaces all of them for its duration.
WORLD_VARS = ("KREX_STATE_DIR", "KREX_SOCKET", "KREX_JOURNAL", "KREX_SHM", "KREX_SIM_SHM", "KREX_SIM_TRACE",
              "KREX_THROWAWAY", "KREX_SLOT", "KREX_GPU")


def daemon_status() -> StatusReply | None:
    """The status of the daemon of the current world, or None when none answers."""
    from krex.proc.client import Client, daemon_alive

    if not daemon_alive():
        return None
    c = Client.connect()
    try:
        return cast("StatusReply", c.request({"op": "status"}))
    finally:
        c.close()


def describe(st: StatusReply) -> str:
    d = st.get("daemon") or {}
    per = st.get("slots_per_gpu") or []
    slots = f"{min(per)}" if per and min(per) == max(per) else "/".join(map(str, per)) or "?"
    how = "started on demand, exits when idle" if d.get("idle_exit_s") else "a node daemon"
    return (f"the running KREX daemon (pid {d.get('pid')}, socket {d.get('socket')}; {how}; device "
            f"{d.get('device')}, {slots} slot(s) per GPU, freeze policy {d.get('freeze_policy')})")


def daemon_misfit(st: StatusReply, device: str, per_gpu: int, gpus: Sequence[int] | None = None,
                  own_settings: Sequence[str] = (), sim_on_gpu: bool = False) -> str:
    """What the running daemon (status `st`) lacks for commands on `device` ("sim"/"gpu") that
    need `per_gpu` slots on each GPU of `gpus` (None: every GPU); `own_settings` names cells
    that need daemon settings of their own (prewarm, lend_cores); `sim_on_gpu`: simulated
    commands may join a real GPU's daemon. "" when it fits."""
    d = st.get("daemon") or {}
    dev = "sim" if d.get("device") == "sim" else "gpu"
    why = []
    if dev != device and not (sim_on_gpu and device == "sim"):
        why.append("it runs on the simulated GPU" if dev == "sim" else
                   "it runs on this node's real GPUs (a simulated run would share their gates)")
    per = list(st.get("slots_per_gpu") or [])
    have = min((per[g] for g in (gpus if gpus is not None else range(len(per))) if 0 <= g < len(per)),
               default=0)
    if have < per_gpu:
        why.append(f"it admits {have} command(s) per GPU at a time, fewer than the {per_gpu} needed "
                   "(the others would wait at admission)")
    if own_settings:
        why.append(f"{', '.join(own_settings)} need a daemon started with their own settings")
    return "; ".join(why)


def node_slots_per_gpu(device: str, count: int, numa: Sequence[int | None] | None) -> list[int]:
    """Slots per GPU a daemon started now would have (the config file and KREX_SLOTS_PER_GPU,
    else the physical cores of each GPU's CPU slice)."""
    from krex.node import config, cpus

    set_ = config.config_from(device, {}, on_demand=True).slots_per_gpu
    if set_:
        return [int(set_)] * count
    part = cpus.partition(cpus.discover(), count, list(numa) if numa else None)
    return [cpus.default_slots_per_gpu(part, g) for g in range(count)]


class OwnWorld:
    """A private, throwaway KREX world in this process's environment while it is entered:
    state directory, segment and simulated GPU of its own (as the tests make them). The
    daemon started in it (by the caller) removes its segments when it stops cleanly; `exit`
    removes the state directory, keeping its daemon log as `keep_log` if given."""

    def __init__(self, tag: str = "own") -> None:
        self.tag = tag
        self.saved: dict[str, str | None] = {}
        self.state: Path | None = None

    def enter(self) -> OwnWorld:
        u = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.state = Path(tempfile.mkdtemp(prefix=f"krex{self.tag}-"))  # short: it holds the socket
        self.saved = {k: os.environ.get(k) for k in WORLD_VARS}
        for k in WORLD_VARS:
            os.environ.pop(k, None)
        os.environ.update(KREX_STATE_DIR=str(self.state), KREX_SHM=f"/krex-{self.tag}-{u}",
                          KREX_SIM_SHM=f"/krex-{self.tag}sim-{u}", KREX_THROWAWAY="1")
        return self

    @property
    def shm(self) -> str:
        return os.environ.get("KREX_SHM", "")

    def exit(self, keep_log: Path | None = None) -> None:
        from krex.node.segguard import remove_world
        from krex.proc.client import daemon_alive

        # Its daemon's clean stop removed the segments already; one that was killed did not.
        if self.state is not None and not daemon_alive():
            remove_world(os.environ.get("KREX_SHM", ""), os.environ.get("KREX_SIM_SHM"))
        if self.state is not None:
            log = self.state / "krexd.log"
            if keep_log is not None and log.is_file():
                with contextlib.suppress(OSError):
                    shutil.copyfile(log, keep_log)
            shutil.rmtree(self.state, ignore_errors=True)
            self.state = None
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self.saved = {}
