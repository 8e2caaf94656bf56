"""NVIDIA MPS in `krex bench`: the cells that measure sharing under MPS beside the others.

  unprotected-mps-C  as unprotected-C (C commands at a time, no KREX), each command an MPS
                     client of control daemons the bench starts for the cell alone: one per
                     GPU the cell uses (the first visible one, or each of --gpus), with pipe
                     and log directories of their own; started before the cell's first
                     command, quit (and waited for) after its last, also when the cell fails
                     or is interrupted
  krex-mps-C         as krex-C, under a krexd the bench starts with MPS on (the same as
                     `krex daemon start --mps`); it is stopped before any other cell runs, so
                     no MPS server sits on the GPU beside another cell's commands

The control daemons are started and quit the way krexd does it (krex.node.mps: the control
program is ``nvidia-cuda-mps-control`` on PATH, or $KREX_MPS_CONTROL; the GPU's compute mode
is never changed). A control daemon and its clients name the GPU by its UUID where known: the
MPS server renumbers indices. Asking for an MPS mode where MPS cannot run (no control
program, the simulated GPU without a stand-in, AMD GPUs) is a UsageError before anything
runs."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from krex import paths
from krex.bench import benchdaemon
from krex.bench.plan import Cell
from krex.errors import MpsUnavailable, UsageError
from krex.node import mps

__all__ = ["CellControl", "cell_control", "require_mps"]

DROP = "drop unprotected-mps and krex-mps from --modes"


def require_mps(device: str) -> None:
    """Raise UsageError unless the MPS modes can run on `device` (auto, gpu, sim)."""
    from krex.device.gpus import discover

    info = discover(device)
    what = "krex bench's MPS modes (unprotected-mps, krex-mps) need NVIDIA MPS"
    if info.kind == "amd":
        raise UsageError(f"{what}: this node's GPUs are AMD", DROP)
    if info.kind == "sim" and not os.environ.get(mps.CONTROL_ENV, "").strip():
        raise UsageError(
            f"{what}, and the simulated GPU has none",
            f"run them on an NVIDIA GPU, or {DROP} (tests name a stand-in control program in "
            f"{mps.CONTROL_ENV})",
        )
    try:
        mps.control_program()
    except MpsUnavailable:
        raw = os.environ.get(mps.CONTROL_ENV, "").strip()
        where = f"{mps.CONTROL_ENV}={raw!r} cannot be found or run" if raw else (
            f"{mps.CONTROL_BIN} is not on PATH"
        )
        raise UsageError(
            f"{what}, and {where}",
            f"install the NVIDIA driver's MPS tools ({mps.CONTROL_BIN}) or put them on PATH, set "
            f"{mps.CONTROL_ENV} to the control program, or {DROP}",
        ) from None


@dataclass
class _Daemon:
    gpu: int  # position among the visible GPUs
    visible: str  # CUDA_VISIBLE_DEVICES of the control daemon and of its clients
    pipe: Path
    log_dir: Path
    pid: int | None = None
    ticks: int = 0


class CellControl:
    """The control daemons of one unprotected-mps cell, one per GPU position it uses."""

    def __init__(self, cell_key: str, gpus: Sequence[int], device: str, log_root: Path) -> None:
        from krex.device.gpus import discover
        from krex.native import lib

        self._lib = lib
        self.control = mps.control_program()
        self.names = mps.control_names()
        info = discover(device)
        uuids = mps.gpu_uuids(info)
        # Pipe directories under KREX's state directory, as krexd's (a short path: MPS names
        # its pipes under it), one set per bench process; logs beside the results.
        self.root = paths.ensure_state_dir() / f"bench-mps-{os.getpid()}"
        self.daemons: list[_Daemon] = []
        for g in gpus:
            uuid = uuids[g] if g < len(uuids) else None
            visible = uuid or (info.visible_token(g) if g < info.count else str(g))
            self.daemons.append(_Daemon(g, visible, self.root / f"gpu{g}" / "pipe",
                                        log_root / cell_key / f"gpu{g}"))

    def _env(self, d: _Daemon) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        env.update(self.client_env(d.gpu))
        return env

    def _clear_stale(self) -> None:
        """Quit what a bench that was killed (its pid gone) left under the state directory."""
        for d in self.root.parent.glob("bench-mps-*"):
            pid = d.name.removeprefix("bench-mps-")
            if d.is_symlink() or not d.is_dir() or not pid.isdigit() or os.path.exists(f"/proc/{pid}"):
                continue
            for pipe in sorted(d.glob("gpu*/pipe")):
                mps.clear_stale(self.control, self.names, pipe, f"krex bench pid {pid}")
            shutil.rmtree(d, ignore_errors=True)

    def start(self) -> None:
        """Start every control daemon; on a failure (or an interrupt), quit those started and
        raise."""
        self._clear_stale()
        try:
            mps.private_dir(self.root)
            for d in self.daemons:
                mps.private_dir(d.pipe.parent)
                mps.private_dir(d.pipe)
                d.log_dir.mkdir(parents=True, exist_ok=True)
                mps.private_dir(d.log_dir)
                try:
                    d.pid = mps.start_control(self.control, self.names, self._env(d), d.pipe, d.log_dir)
                except mps.StartFailed as e:
                    raise MpsUnavailable(
                        f"cannot start the MPS control daemon for the cell's GPU {d.gpu}: {e}",
                        f"see {d.log_dir}; check `{self.control}` runs (the NVIDIA driver's MPS), or {DROP}",
                    ) from None
                d.ticks = int(self._lib.krex_pid_start_ticks(d.pid))
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Quit every control daemon started (and any a failed start left), remove the pipe
        directories."""
        for d in self.daemons:
            if d.pid is not None or (d.pipe / mps.CONTROL_PIPE).exists():
                mps.quit_control(self.control, d.pipe, d.pid, d.ticks, d.log_dir)
            d.pid = None
        shutil.rmtree(self.root, ignore_errors=True)

    def client_env(self, gpu: int | None) -> dict[str, str]:
        """The MPS variables of a command of the cell on GPU position `gpu` (None: the first)."""
        d = next((x for x in self.daemons if x.gpu == gpu), self.daemons[0])
        return {"CUDA_MPS_PIPE_DIRECTORY": str(d.pipe), "CUDA_MPS_LOG_DIRECTORY": str(d.log_dir),
                "CUDA_VISIBLE_DEVICES": d.visible}

    def describe(self) -> str:
        return "; ".join(f"GPU {d.gpu}: pid {d.pid}, CUDA_VISIBLE_DEVICES={d.visible}, pipe {d.pipe}, "
                         f"log {d.log_dir}" for d in self.daemons)


@contextmanager
def cell_control(cell: Cell, gpus: Sequence[int] | None, device: str, out_dir: Path | None,
                 note: Callable[[str], None]) -> Iterator[CellControl | None]:
    """The control daemons of an unprotected-mps cell while it runs (None for other cells):
    started on entry, quit on exit however the cell ends. Their logs go to
    `out_dir`/mps/<cell>/gpuN."""
    if cell.mode != "unprotected-mps":
        yield None
        return
    ctl = CellControl(cell.key, list(gpus or [0]), device, (out_dir or Path.cwd()).resolve() / "mps")
    ctl.start()
    try:
        note(f"{cell.key}: MPS control daemons for this cell ({ctl.describe()}); quit after it")
        st = benchdaemon.running()  # the bench's own MPS krexd is stopped before other cells
        if st is not None and (st.get("mps") or {}).get("mode", "off") != "off":
            note(f"{cell.key}: the running KREX daemon (pid {(st.get('daemon') or {}).get('pid')}) has MPS "
                 "control daemons of its own on the GPU beside this cell's")
        yield ctl
    finally:
        ctl.stop()
