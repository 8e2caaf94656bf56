"""`krex compare` / `Executor.compare`: run candidates interleaved under KREX until their
ratios to the first candidate are settled or the run budget is spent.

Runs go in randomized palindromic blocks (krex.compare.design), one block at a time, at
most ``jobs`` runs at once. After the planned looks (krex.compare.stats.plan_looks) every
candidate's ratio to the first gets a Hodges-Lehmann estimate with its Mann-Whitney
interval at that look's level; the comparison stops at the first look where every
interval excludes 1 (or lies inside the equivalence margin, when one is given).

A run counts only when its command succeeded, its figure was read, and its timing was
inside a clean region: a run with no region (the timing was unprotected) stops the
comparison with a UsageError naming the fix, unless ``require_region`` is False; a run
with a flagged region (contaminated, cut) is left out, recorded with the reason, and run
again (``retries`` times at most) so its block stays balanced."""

from __future__ import annotations

import contextlib
import math
import os
import random
import shlex
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from krex.compare.design import Slot, block_order
from krex.compare.extract import FigureSource, parse_figure
from krex.compare.stats import Look, ShiftEstimate, plan_looks, runs_needed, shift_estimate
from krex.errors import KrexError, UsageError

if TYPE_CHECKING:
    from concurrent.futures import Future

    from krex.executor import Executor, RunResult

__all__ = ["Comparison", "FigureSource", "Ratio", "RunFigure", "compare", "OUT_PLACEHOLDER"]

OUT_PLACEHOLDER = "{out}"  # in a candidate's command: a per-run file the figure is read from
MIN_RUNS = 6  # per candidate, before the first look (3 blocks)
MAX_RUNS = 30  # per candidate: the default budget
_UNLIKELY = 3  # runs_needed beyond this many budgets: "more runs are unlikely to settle it"


class CandidateFailed(KrexError):
    """A candidate's command failed (non-zero exit, timeout), so the comparison stopped."""

    exit_code = 1


@dataclass(frozen=True)
class RunFigure:
    """One run of one candidate."""

    candidate: int
    block: int
    position: int
    value: float | None  # None: left out (see `left_out`)
    wall_s: float
    region_s: float
    regions: int
    left_out: str | None = None
    result: RunResult | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Ratio:
    """Candidate ``name``'s figure over the first candidate's: estimate and interval on the
    ratio scale, the stated (simultaneous) confidence, and what it means."""

    name: str
    ratio: float
    low: float
    high: float
    confidence: float  # simultaneous over candidates and looks
    look_level: float  # this interval's own level (>= confidence)
    achieved: float  # the exact coverage of this interval alone under the shift model
    p_wrong: float
    verdict: str  # faster, slower, equivalent, unsettled
    runs: int  # this candidate's runs that counted
    base_runs: int
    runs_needed: int | None  # per candidate, for the interval to exclude 1 if the ratio holds

    def to_json(self) -> dict[str, Any]:
        def f(v: float) -> float | None:
            return round(v, 6) if math.isfinite(v) else None

        return {"name": self.name, "ratio": f(self.ratio), "low": f(self.low), "high": f(self.high),
                "confidence": self.confidence, "look_level": round(self.look_level, 6),
                "achieved": round(self.achieved, 6), "p_wrong": round(self.p_wrong, 6),
                "verdict": self.verdict, "runs": self.runs, "base_runs": self.base_runs,
                "runs_needed": self.runs_needed}


@dataclass
class Comparison:
    names: list[str]
    commands: list[list[str]]
    figure: FigureSource
    confidence: float
    max_runs: int
    margin: float | None
    seed: int
    looks: list[Look]
    runs: list[RunFigure] = field(default_factory=list)
    ratios: list[Ratio] = field(default_factory=list)
    looks_done: int = 0
    settled: bool = False
    budget_spent: bool = False
    started_at: float = 0.0
    wall_s: float = 0.0
    simulated: bool = False

    def values(self, candidate: int) -> list[float]:
        return [r.value for r in self.runs if r.candidate == candidate and r.value is not None]

    @property
    def more_runs_would_settle(self) -> bool | None:
        """None when settled; else whether the projection says more runs would."""
        if self.settled:
            return None
        return any(r.verdict == "unsettled" and r.runs_needed is not None
                   and r.runs_needed <= _UNLIKELY * self.max_runs for r in self.ratios)

    def to_json(self) -> dict[str, Any]:
        return {
            "candidates": [{"name": n, "command": c} for n, c in zip(self.names, self.commands, strict=True)],
            "figure": self.figure.to_json(),
            "confidence": self.confidence,
            "method": "Hodges-Lehmann ratio on the log scale, Mann-Whitney interval; randomized "
                      "palindromic blocks; alpha split over looks and comparisons (Bonferroni)",
            "max_runs": self.max_runs,
            "margin": self.margin,
            "seed": self.seed,
            "looks_planned": [{"blocks": lk.blocks, "runs_per_candidate": 2 * lk.blocks,
                               "level": round(1 - lk.alpha, 6)} for lk in self.looks],
            "looks_done": self.looks_done,
            "settled": self.settled,
            "budget_spent": self.budget_spent,
            "more_runs_would_settle": self.more_runs_would_settle,
            "ratios": [r.to_json() for r in self.ratios],
            "runs": [{"candidate": self.names[r.candidate], "block": r.block, "position": r.position,
                      "value": r.value, "wall_s": round(r.wall_s, 6), "region_s": round(r.region_s, 6),
                      "regions": r.regions, "left_out": r.left_out} for r in self.runs],
            "started_at": self.started_at,
            "wall_s": round(self.wall_s, 3),
            "simulated": self.simulated,
        }

    def summary_lines(self) -> list[str]:
        """What `krex compare` prints."""
        unit = f" {self.figure.unit}" if self.figure.unit else ""
        out = []
        for i, n in enumerate(self.names):
            vals = self.values(i)
            left = sum(1 for r in self.runs if r.candidate == i and r.value is None)
            med = _median(vals) if vals else float("nan")
            out.append(f"{n}: median {med:.6g}{unit} over {len(vals)} run(s)"
                       + (f" ({left} left out)" if left else ""))
        better = "lower" if self.figure.lower_is_better else "higher"
        for r in self.ratios:
            finite = math.isfinite(r.low) and math.isfinite(r.high)
            ci = f"[{r.low:.4f}, {r.high:.4f}]" if finite else "[-, -]"
            what = {"faster": f"{r.name} is faster than {self.names[0]}",
                    "slower": f"{r.name} is slower than {self.names[0]}",
                    "equivalent": f"{r.name} and {self.names[0]} are equivalent within {self.margin:.1%}"
                    if self.margin else "equivalent",
                    "unsettled": "not settled"}[r.verdict]
            out.append(f"{r.name}/{self.names[0]} = {r.ratio:.4f} {ci} at {self.confidence:.0%} confidence "
                       f"({better} is better): {what}; P(order wrong) = {r.p_wrong:.3g}")
            if r.verdict == "unsettled":
                if not (math.isfinite(r.low) and math.isfinite(r.high)):
                    out.append("  too few runs for an interval at this level: give a larger --max-runs")
                elif r.runs_needed is None:
                    out.append(f"  no difference was measured: more runs will not settle it"
                               f"{'' if self.margin else '; give --margin to test equivalence'}")
                elif r.runs_needed <= _UNLIKELY * self.max_runs:
                    out.append(f"  more runs would likely settle it: about {r.runs_needed} per candidate "
                               f"if the ratio holds (budget was {self.max_runs})")
                else:
                    out.append(f"  more runs are unlikely to settle it: about {r.runs_needed} per candidate "
                               f"would be needed if the ratio holds; the difference is within the noise "
                               f"of {self.max_runs} runs")
        state = "settled" if self.settled else "budget spent" if self.budget_spent else "stopped"
        out.append(f"{state} after {self.looks_done} of {len(self.looks)} look(s), "
                   f"{sum(1 for r in self.runs)} run(s), {self.wall_s:.1f} s; order seed {self.seed}")
        if self.simulated:
            out.append("SIMULATED GPU: these ratios prove the method, never a real GPU's performance")
        return out


def _median(v: Sequence[float]) -> float:
    s = sorted(v)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _verdict(est: ShiftEstimate, lower_is_better: bool, margin: float | None) -> str:
    if margin is not None and est.low >= -math.log1p(margin) and est.high <= math.log1p(margin):
        return "equivalent"
    if not est.excludes_zero:
        return "unsettled"
    b_lower = est.high < 0
    return "faster" if b_lower == lower_is_better else "slower"


def _with_out(cmd: Sequence[str] | str, path: Path) -> tuple[Sequence[str] | str, bool]:
    """The command with {out} replaced by ``path`` (shell-quoted in a shell line)."""
    if isinstance(cmd, str):
        return (cmd.replace(OUT_PLACEHOLDER, shlex.quote(str(path))), OUT_PLACEHOLDER in cmd)
    used = any(OUT_PLACEHOLDER in a for a in cmd)
    return ([a.replace(OUT_PLACEHOLDER, str(path)) for a in cmd], used)


def _names(candidates: Sequence[Any], names: Sequence[str] | None) -> list[str]:
    if names is None:
        return [chr(ord("A") + i) if i < 26 else f"C{i}" for i in range(len(candidates))]
    if len(names) != len(candidates) or len(set(names)) != len(names) or not all(names):
        raise UsageError(f"names {list(names)} do not name the {len(candidates)} candidates once each",
                         "give one distinct, non-empty name per candidate")
    return list(names)


def _check(candidates: Sequence[Any], confidence: float, min_runs: int, max_runs: int, jobs: int,
           margin: float | None) -> None:
    if len(candidates) < 2:
        raise UsageError("a comparison needs at least two candidates",
                         "give the baseline first, then the others")
    if not 0.5 <= confidence < 1:
        raise UsageError(f"confidence {confidence} not in [0.5, 1)", "give e.g. 0.95")
    if min_runs < 2 or min_runs % 2 or max_runs < min_runs:
        raise UsageError(f"runs: min {min_runs}, max {max_runs}",
                         "runs go in blocks of 2 per candidate: give an even min >= 2 and max >= min")
    if jobs < 1:
        raise UsageError(f"jobs {jobs} < 1", "give 1 (one run at a time, the default) or more")
    if margin is not None and not 0 < margin < 1:
        raise UsageError(f"margin {margin} not in (0, 1)", "give a fraction, e.g. 0.01 for 1%")


def compare(
    ex: Executor,
    candidates: Sequence[Sequence[str] | str],
    figure: FigureSource | str,
    *,
    names: Sequence[str] | None = None,
    confidence: float = 0.95,
    min_runs: int = MIN_RUNS,
    max_runs: int = MAX_RUNS,
    margin: float | None = None,
    jobs: int = 1,
    seed: int | None = None,
    require_region: bool = True,
    retries: int = 2,
    out_dir: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] | None = None,
    **submit_options: Any,
) -> Comparison:
    """Compare ``candidates`` (the first is the baseline) on ``figure`` (see
    krex.compare.extract), running them through ``ex``. ``min_runs``/``max_runs``: runs per
    candidate before the first look and at most (the budget); ``margin``: call a ratio
    within 1 +- margin equivalent; ``jobs``: runs at once (1: one after another, the order
    then balances drift best); ``retries``: how often a run whose region was flagged is run
    again; ``out_dir``: where {out} files go (default: a temporary directory, removed).
    Other options go to every ``ex.submit``."""
    src = parse_figure(figure)
    _check(candidates, confidence, min_runs, max_runs, jobs, margin)
    labels = _names(candidates, names)
    seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    looks = plan_looks(min_runs // 2, max_runs // 2, 1 - confidence, len(candidates) - 1)
    shown = [c if isinstance(c, str) else shlex.join(c) for c in candidates]
    cmp = Comparison(labels, [[c] if isinstance(c, str) else list(c) for c in candidates], src, confidence,
                     max_runs, margin, seed, looks, started_at=time.time())
    tmp = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="krex-compare-"))
    tmp.mkdir(parents=True, exist_ok=True)
    runs = _Runs(ex, candidates, shown, labels, src, tmp, jobs, require_region, retries, submit_options)
    t0 = time.monotonic()
    try:
        block = 0
        for look in looks:
            while block < look.blocks:
                _run_block(runs, cmp, block_order(len(candidates), block, rng))
                block += 1
                if progress is not None:
                    progress(f"block {block}/{looks[-1].blocks} done ({2 * block} runs per candidate)")
            cmp.looks_done = look.index + 1
            _estimate(cmp, look)
            if progress is not None:
                progress("; ".join(
                    f"{r.name}/{labels[0]} {r.ratio:.4f} [{r.low:.4f}, {r.high:.4f}] {r.verdict}"
                    for r in cmp.ratios))
            if all(r.verdict != "unsettled" for r in cmp.ratios):
                cmp.settled = True
                break
        else:
            cmp.budget_spent = True
    finally:
        cmp.wall_s = time.monotonic() - t0
        if out_dir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    return cmp


def _estimate(cmp: Comparison, look: Look) -> None:
    base = [math.log(v) for v in cmp.values(0)]
    cmp.ratios = []
    for i in range(1, len(cmp.names)):
        ys = [math.log(v) for v in cmp.values(i)]
        if not base or not ys:
            raise UsageError(f"no run of {cmp.names[0] if not base else cmp.names[i]} counted",
                             "see the runs' left_out reasons (regions flagged or missing)")
        est = shift_estimate(base, ys, look.alpha)
        cmp.ratios.append(Ratio(
            name=cmp.names[i], ratio=math.exp(est.estimate), low=math.exp(est.low), high=math.exp(est.high),
            confidence=cmp.confidence, look_level=1 - look.alpha, achieved=est.achieved, p_wrong=est.p_wrong,
            verdict=_verdict(est, cmp.figure.lower_is_better, cmp.margin), runs=len(ys), base_runs=len(base),
            runs_needed=runs_needed(est),
        ))


@dataclass
class _Runs:
    """What every run of a comparison needs."""

    ex: Executor
    candidates: Sequence[Sequence[str] | str]
    shown: list[str]
    labels: list[str]
    src: FigureSource
    tmp: Path
    jobs: int
    require_region: bool
    retries: int
    submit_options: dict[str, Any]


def _run_block(r: _Runs, cmp: Comparison, slots: list[Slot]) -> None:
    """Run one block's slots in order, at most ``jobs`` at a time; record each run. A run
    whose region was flagged is recorded (left out) and run again, up to ``retries`` times
    per slot, so the block keeps its balance."""
    inflight: list[tuple[Slot, int, Path, bool, Future[RunResult]]] = []
    pending = [(s, 0) for s in slots]
    while pending or inflight:
        while pending and len(inflight) < r.jobs:
            s, tries = pending.pop(0)
            path = r.tmp / f"{r.labels[s.candidate]}-b{s.block:03d}-p{s.position}-t{tries}.out"
            with contextlib.suppress(OSError):
                path.unlink()
            cmd, used = _with_out(r.candidates[s.candidate], path)
            fut = r.ex.submit(cmd, name=f"{r.labels[s.candidate]} (block {s.block + 1})", **r.submit_options)
            inflight.append((s, tries, path, used, fut))
        s, tries, path, used, fut = inflight.pop(0)
        got = _record(s, path, used, fut.result(), r)
        cmp.runs.append(got)
        cmp.simulated = cmp.simulated or bool(got.result and got.result.simulated)
        if got.value is None and tries < r.retries:
            pending.append((s, tries + 1))


def _record(s: Slot, path: Path, used: bool, res: RunResult, r: _Runs) -> RunFigure:
    from krex.runner import tail_lines

    who = f"{r.labels[s.candidate]} ({r.shown[s.candidate]}), block {s.block + 1}"
    if not res.ok:
        how = "timed out" if res.timed_out else "was stopped" if res.stopped else f"exited {res.exit_status}"
        raise CandidateFailed(f"{who} {how}: {tail_lines(res.stderr) or res.error or 'no output'}",
                              "fix the candidate's command (a comparison needs every run to succeed)")
    regs = res.regions

    def figure(value: float | None, left_out: str | None = None) -> RunFigure:
        return RunFigure(s.candidate, s.block, s.position, value, res.wall_s, res.region_s, len(regs),
                         left_out, res)

    if not regs and r.require_region:
        raise UsageError(
            f"{who}: its run made no region, so its timing was not protected from the other commands",
            "mark the timed loop (krex.region(), the C macros), or give --auto-region do_bench / "
            "--nvtx-region PATTERN; --allow-unprotected compares anyway",
        )
    flagged = [g for g in regs if not g.clean]
    if flagged:
        why = "; ".join(sorted({f for g in flagged for f in (g.flags or (("cut",) if g.cut else ()))}))
        return figure(None, f"region flagged: {why or 'contaminated'}")
    text = path.read_text(errors="replace") if used and path.exists() else res.stdout
    if used and not path.exists():
        raise UsageError(f"{who}: the command did not write its {OUT_PLACEHOLDER} file {path}",
                         f"make the command write its result to the path given for {OUT_PLACEHOLDER}")
    return figure(r.src.read(text))
