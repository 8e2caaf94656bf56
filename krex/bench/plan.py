"""What a bench runs, in which order, and what an earlier run already did.

A *cell* is a mode and a concurrency C (see krex.bench.run). `plan_cells` orders
them so that drift cannot favour one mode; `order_jobs` orders the commands of a
cell. Results go to a directory as JSON lines: ``raw.jsonl`` (one per command run)
and ``cells.jsonl`` (one per finished cell), with ``meta.json``; `load_results`
reads them back, and ``--resume`` (`carried_runs`, `serial_span_s`) continues a
run: finished cells are skipped, runs of an unfinished cell are ignored (a serial
cell's successful ones are kept)."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from krex.bench.corpus import Workload
from krex.bench.records import CellRow, RunRecord
from krex.errors import NotFound, UsageError
from krex.node.config import LEND as LEND_CHOICES
from krex.node.freezepolicy import POLICIES as FREEZE_POLICIES

__all__ = [
    "CELLS",
    "CONCURRENT",
    "DEFAULT_MODES",
    "KREX_MODES",
    "LEND_CHOICES",
    "META",
    "MODES",
    "MPS_MODES",
    "RAW",
    "SCHEMA",
    "Cell",
    "Job",
    "append_jsonl",
    "carried_runs",
    "load_results",
    "order_jobs",
    "parse_concurrency",
    "parse_modes",
    "plan_cells",
    "read_jsonl",
    "serial_span_s",
]

MODES: tuple[str, ...] = (
    "reference", "native-serial", "native-repeat", "unprotected", "unprotected-mps", "krex", "krex-mps"
)
# The MPS modes need NVIDIA MPS (krex.bench.mpscell): asked for by name, never by default.
MPS_MODES = ("unprotected-mps", "krex-mps")
DEFAULT_MODES = tuple(m for m in MODES if m not in MPS_MODES)
CONCURRENT = ("unprotected", "unprotected-mps", "krex", "krex-mps")
KREX_MODES = ("krex", "krex-mps")  # commands under a KREX guardian and a krexd the bench may start
RAW, CELLS, META = "raw.jsonl", "cells.jsonl", "meta.json"
SCHEMA = 1


@dataclass(frozen=True, order=True)
class Cell:
    mode: str
    c: int = 1
    freeze: str = ""  # krex cells: the freeze policy their commands ask for ("" = the daemon's)
    # krex cells: pre-warmed starts per GPU (krexd's `prewarm`): C + prewarm commands run at
    # once, of which only C hold a slot; the others wait at their first GPU call.
    prewarm: int = 0
    # krex cells: krexd's `lend_cores` (off, region, all) for a daemon the bench starts for
    # them ("" = the daemon's own setting).
    lend: str = ""

    @property
    def key(self) -> str:
        base = f"{self.mode}-{self.c}" if self.mode in CONCURRENT else self.mode
        base = f"{base}@{self.freeze}" if self.freeze else base
        base = f"{base}+lend-{self.lend}" if self.lend else base
        return f"{base}+pw{self.prewarm}" if self.prewarm else base

    @staticmethod
    def from_key(key: str) -> Cell:
        if "+pw" in key:
            base, _, n = key.rpartition("+pw")
            c = Cell.from_key(base)
            if c.mode != "krex" or not (n.isascii() and n.isdigit()) or not 1 <= int(n) <= 64:
                raise UsageError(
                    f"unknown cell {key!r}", "krex-C[@POLICY]+pwN takes N pre-warmed starts, 1..64"
                )
            return Cell(c.mode, c.c, c.freeze, int(n), c.lend)
        if "+lend-" in key:
            base, _, lend = key.rpartition("+lend-")
            c = Cell.from_key(base)
            if c.mode != "krex" or lend not in LEND_CHOICES:
                raise UsageError(
                    f"unknown cell {key!r}", "krex-C[@POLICY]+lend-X takes off, region or all"
                )
            return Cell(c.mode, c.c, c.freeze, 0, lend)
        if "@" in key:
            base, _, freeze = key.partition("@")
            c = Cell.from_key(base)
            if c.mode not in KREX_MODES or freeze not in FREEZE_POLICIES:
                raise UsageError(
                    f"unknown cell {key!r}", "krex-C@POLICY takes a freeze policy: all, gpu, adaptive"
                )
            return Cell(c.mode, c.c, freeze)
        for m in CONCURRENT:
            if key.startswith(m + "-") and key[len(m) + 1 :].isascii() and key[len(m) + 1 :].isdigit():
                return Cell(m, int(key[len(m) + 1 :]))
        if key in MODES:
            return Cell(key, 1)
        raise UsageError(
            f"unknown cell {key!r}",
            "cells are reference, native-serial, native-repeat, unprotected-C, unprotected-mps-C, krex-C "
            "or krex-mps-C",
        )


def parse_modes(text: str | Sequence[str]) -> list[str]:
    """'native-serial,krex' -> ['native-serial', 'krex'] (validated, deduplicated)."""
    items = [s.strip() for s in (text.split(",") if isinstance(text, str) else text)]
    out: list[str] = []
    for s in items:
        if not s:
            continue
        if s not in MODES:
            raise UsageError(f"unknown mode {s!r}", f"use a comma list of: {', '.join(MODES)}")
        if s not in out:
            out.append(s)
    if not out:
        raise UsageError("no mode given", f"use a comma list of: {', '.join(MODES)}")
    return out


def parse_concurrency(text: str | Sequence[int]) -> list[int]:
    """'2,4,8' -> [2, 4, 8] (each in 1..64, deduplicated, in the given order)."""
    raw: list[str] = text.split(",") if isinstance(text, str) else [str(x) for x in text]
    out: list[int] = []
    for s in raw:
        s = s.strip()
        if not s:
            continue
        if not (s.isascii() and s.isdigit()) or not 1 <= int(s) <= 64:
            raise UsageError(
                f"bad concurrency {s!r}", "give a comma list of integers in 1..64, e.g. 2,4,8,16"
            )
        if int(s) not in out:
            out.append(int(s))
    if not out:
        raise UsageError("no concurrency given", "give a comma list such as 2,4,8,16")
    return out


def plan_cells(
    modes: Sequence[str],
    concurrency: Sequence[int],
    seed: int,
    freezes: Sequence[str] = ("",),
    prewarms: Sequence[int] = (0,),
    lends: Sequence[str] = ("",),
) -> list[Cell]:
    """The order in which cells run.

    reference first (it only establishes true orders), then native-serial (the
    reference for inflation, so that a partial run is already useful); then, for each
    C in a seeded random order, the unprotected-C and krex-C cells back to back in a
    seeded random order (with their MPS twins, unprotected-mps-C and krex-mps-C, when
    asked for); native-repeat goes into the middle of that sequence so that
    slow drift over the run shows up as native-serial vs native-repeat difference
    (the noise floor) instead of favouring one mode."""
    rng = random.Random(seed)
    head = [Cell(m) for m in ("reference", "native-serial") if m in modes]
    cs = list(concurrency)
    rng.shuffle(cs)
    pairs: list[list[Cell]] = []
    for c in cs:
        pair = [
            Cell(m, c, f, w, ln)
            for m in CONCURRENT
            if m in modes
            for f in (freezes if m in KREX_MODES else ("",))
            for w in (prewarms if m == "krex" else (0,))
            for ln in (lends if m == "krex" else ("",))
        ]
        rng.shuffle(pair)
        if pair:
            pairs.append(pair)
    middle: list[Cell] = []
    for i, pair in enumerate(pairs):
        if i == len(pairs) // 2 and "native-repeat" in modes:
            middle.append(Cell("native-repeat"))
        middle.extend(pair)
    if "native-repeat" in modes and Cell("native-repeat") not in middle:
        middle.append(Cell("native-repeat"))
    return head + middle


# ------------------------------------------------------------------------------ results directory


def append_jsonl(path: Path, rec: Mapping[str, Any]) -> None:
    line = (json.dumps(rec, separators=(",", ":"), default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out: list[dict[str, Any]] = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                v = json.loads(line)
            except ValueError:
                continue  # a torn last line after a crash
            if isinstance(v, dict):
                out.append(v)
    return out


def load_results(out_dir: Path) -> tuple[dict[str, Any], list[CellRow], list[RunRecord]]:
    """(meta, finished cells, raw records of finished cells) of a results directory."""
    mp = out_dir / META
    if not mp.exists():
        raise NotFound(
            f"{out_dir} holds no krex bench results ({META} is missing)",
            "pass the directory an earlier `krex bench` wrote",
        )
    try:
        meta = json.loads(mp.read_text())
    except ValueError as e:
        raise UsageError(
            f"{mp} is not valid JSON: {e}", "restore it, or start a new results directory"
        ) from e
    cells = cast("list[CellRow]", read_jsonl(out_dir / CELLS))
    done_runs = {c.get("run") for c in cells}
    recs = [r for r in cast("list[RunRecord]", read_jsonl(out_dir / RAW)) if r.get("run") in done_runs]
    return meta, cells, recs


# --------------------------------------------------------------------------------- jobs, resume


@dataclass
class Job:
    workload: Workload
    rep: int
    seq: int


def order_jobs(
    cell: Cell, workloads: Sequence[Workload], repeat: int, seed: int, wall_hint: dict[str, float]
) -> list[Job]:
    """Serial cells: a seeded shuffle per pass. Concurrent cells: longest first (by the
    native-serial wall time, else the manifest's estimate), ties in seeded random order,
    which keeps the end-of-cell tail (fewer than C commands left) short."""
    rng = random.Random(f"{seed}:{cell.key}")
    jobs: list[Job] = []
    for rep in range(repeat):
        ws = list(workloads)
        rng.shuffle(ws)
        jobs.extend(Job(w, rep, 0) for w in ws)
    if cell.mode in CONCURRENT:
        jobs.sort(key=lambda j: -wall_hint.get(j.workload.name, j.workload.est_wall_s))
    for i, j in enumerate(jobs):
        j.seq = i
    return jobs


def carried_runs(out_dir: Path, cell: Cell) -> list[RunRecord]:
    """Finished, successful runs of a serial cell whose invocation stopped before the cell
    did (killed, timed out, interrupted). A serial run does not depend on its neighbours,
    so `--resume` keeps them and runs only the rest; a concurrent cell always runs again
    whole, since its makespan and its contention need all of its commands together."""
    if cell.mode in CONCURRENT:
        return []
    finished = {c.get("run") for c in read_jsonl(out_dir / CELLS)}
    best: dict[tuple[str, int], RunRecord] = {}
    for r in cast("list[RunRecord]", read_jsonl(out_dir / RAW)):
        if r.get("cell") == cell.key and r.get("run") not in finished and r.get("ok"):
            best[(str(r.get("name")), int(r.get("rep", 0)))] = r
    return list(best.values())


def serial_span_s(recs: Iterable[RunRecord]) -> float:
    """Wall time the given runs took, summed over the invocations they ran in
    (``ran_in``): the makespan a serial cell had before it was resumed."""
    spans: dict[str, tuple[float, float]] = {}
    for r in recs:
        a, b = r.get("started_at"), r.get("ended_at")
        if a is None or b is None:
            continue
        k = str(r.get("ran_in") or r.get("run"))
        lo, hi = spans.get(k, (float(a), float(b)))
        spans[k] = (min(lo, float(a)), max(hi, float(b)))
    return sum(hi - lo for lo, hi in spans.values())
