"""Pure metric functions for `krex bench` (no I/O, no state).

Definitions (docs/bench.md has the long form):

* **inflation** of one measurement: ``measured / reference - 1`` (signed; 0.0158 is
  1.58 %), where the reference is the same command's native-serial measurement.
* **bands** are the paper's *nested* duration bands, by reference duration:
  ``>10 ms``, ``>1 ms``, ``>0.1 ms`` (a 20 ms kernel is in all three).
* **Kendall tau** is tau-b (tie-corrected), as `scipy.stats.kendalltau` computes it.
* **pairwise flip**: for two candidates of a family whose true durations differ, the
  measured order disagrees with the true order (a measured tie counts as a flip: a
  comparator that cannot tell them apart is no better than a coin).
* **gap** of a pair: ``slower / faster - 1`` of the *true* durations.
* **critical fraction** of a command: ``t_region_s / t_total_s``; the **Amdahl bound**
  on the throughput gain of region-granular exclusivity is ``1 / fraction`` (for a mix
  of commands: total command time over total region time).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "BANDS",
    "SPLIT_BANDS",
    "GAP_CLASSES",
    "Dist",
    "FlipRate",
    "amdahl_bound",
    "bands_of",
    "critical_fraction",
    "dist",
    "flip_rates",
    "gap_class",
    "inflation",
    "inflation_by_band",
    "inflation_by_split_band",
    "kendall_tau",
    "median",
    "pairwise_flips",
    "percentile",
    "speedup_bound",
    "throughput_per_min",
]

# (label, lower bound in ms): nested, as in the paper's abstract.
BANDS: tuple[tuple[str, float], ...] = ((">10ms", 10.0), (">1ms", 1.0), (">0.1ms", 0.1))
# Disjoint bands (lo, hi]: the nested ones let the many long kernels hide the short ones.
SPLIT_BANDS: tuple[tuple[str, float, float], ...] = (
    ("<0.1ms", 0.0, 0.1),
    ("0.1-1ms", 0.1, 1.0),
    ("1-10ms", 1.0, 10.0),
    (">10ms", 10.0, math.inf),
)
# (label, lower, upper) on the true gap, as a fraction: [lower, upper).
GAP_CLASSES: tuple[tuple[str, float, float], ...] = (
    ("<2%", 0.0, 0.02),
    ("2-5%", 0.02, 0.05),
    ("5-10%", 0.05, 0.10),
    (">=10%", 0.10, math.inf),
)


def percentile(xs: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default). NaN for an empty input."""
    v = sorted(float(x) for x in xs)
    if not v:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} is outside 0..100")
    pos = (len(v) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def median(xs: Iterable[float]) -> float:
    return percentile(xs, 50.0)


@dataclass(frozen=True)
class Dist:
    n: int
    p50: float
    p95: float
    max: float
    mean: float

    def to_json(self) -> dict[str, float | int | None]:
        def f(x: float) -> float | None:
            return None if math.isnan(x) else x

        return {"n": self.n, "p50": f(self.p50), "p95": f(self.p95), "max": f(self.max), "mean": f(self.mean)}


def dist(xs: Iterable[float]) -> Dist:
    v = [float(x) for x in xs]
    if not v:
        return Dist(0, math.nan, math.nan, math.nan, math.nan)
    return Dist(len(v), percentile(v, 50), percentile(v, 95), max(v), sum(v) / len(v))


def inflation(measured: float, reference: float) -> float:
    """Signed relative inflation of a measurement against its reference."""
    if reference <= 0 or not math.isfinite(reference):
        raise ValueError(f"reference duration must be positive, got {reference}")
    return measured / reference - 1.0


def bands_of(reference_ms: float) -> list[str]:
    """The nested bands a command with this reference duration belongs to."""
    return [label for label, lo in BANDS if reference_ms > lo]


def inflation_by_band(pairs: Iterable[tuple[float, float]]) -> dict[str, list[float]]:
    """Inflation values per band from (reference_ms, measured_ms) pairs. Every band
    is present (possibly empty)."""
    out: dict[str, list[float]] = {label: [] for label, _ in BANDS}
    for ref, meas in pairs:
        if ref <= 0 or not math.isfinite(ref) or not math.isfinite(meas):
            continue
        x = inflation(meas, ref)
        for label in bands_of(ref):
            out[label].append(x)
    return out


def inflation_by_split_band(pairs: Iterable[tuple[float, float]]) -> dict[str, list[float]]:
    """As inflation_by_band, over the disjoint SPLIT_BANDS."""
    out: dict[str, list[float]] = {label: [] for label, _lo, _hi in SPLIT_BANDS}
    for ref, meas in pairs:
        if ref <= 0 or not math.isfinite(ref) or not math.isfinite(meas):
            continue
        for label, lo, hi in SPLIT_BANDS:
            if lo < ref <= hi:
                out[label].append(inflation(meas, ref))
    return out


def kendall_tau(x: Sequence[float], y: Sequence[float]) -> float:
    """Kendall's tau-b between two equally long sequences (O(n^2); n is a family's
    size). NaN when undefined (fewer than 2 items, or one sequence is constant)."""
    if len(x) != len(y):
        raise ValueError(f"sequences differ in length: {len(x)} vs {len(y)}")
    n = len(x)
    conc = disc = tie_x = tie_y = 0
    for i in range(n):
        for j in range(i + 1, n):
            dx = (x[i] > x[j]) - (x[i] < x[j])
            dy = (y[i] > y[j]) - (y[i] < y[j])
            if dx == 0 and dy == 0:
                continue  # tied in both: in neither term (as scipy's tau-b)
            if dx == 0:
                tie_x += 1
            elif dy == 0:
                tie_y += 1
            elif dx == dy:
                conc += 1
            else:
                disc += 1
    # tau-b = (C - D) / sqrt((C + D + T_x)(C + D + T_y)), ties in both excluded from both.
    denom = math.sqrt((conc + disc + tie_x) * (conc + disc + tie_y))
    if denom == 0:
        return math.nan
    return (conc - disc) / denom


def pairwise_flips(truth: Sequence[float], measured: Sequence[float]) -> list[tuple[float, bool]]:
    """(true gap, flipped) for every pair of candidates whose true values differ.
    ``truth`` holds true durations (or any positive quantity proportional to them)."""
    if len(truth) != len(measured):
        raise ValueError(f"sequences differ in length: {len(truth)} vs {len(measured)}")
    out: list[tuple[float, bool]] = []
    for i in range(len(truth)):
        for j in range(i + 1, len(truth)):
            ti, tj = truth[i], truth[j]
            if ti == tj or min(ti, tj) <= 0:
                continue
            gap = max(ti, tj) / min(ti, tj) - 1.0
            true_sign = 1 if tj > ti else -1
            mi, mj = measured[i], measured[j]
            meas_sign = (mj > mi) - (mj < mi)
            out.append((gap, meas_sign != true_sign))
    return out


def gap_class(gap: float) -> str:
    for label, lo, hi in GAP_CLASSES:
        if lo <= gap < hi:
            return label
    raise ValueError(f"gap {gap} is negative")


@dataclass(frozen=True)
class FlipRate:
    flips: int
    pairs: int

    @property
    def rate(self) -> float:
        return self.flips / self.pairs if self.pairs else math.nan

    def to_json(self) -> dict[str, float | int | None]:
        return {"flips": self.flips, "pairs": self.pairs, "rate": None if not self.pairs else self.rate}


def flip_rates(pairs: Iterable[tuple[float, bool]]) -> dict[str, FlipRate]:
    """Flip rate per gap class (every class present, possibly with 0 pairs)."""
    flips = {label: 0 for label, _, _ in GAP_CLASSES}
    total = {label: 0 for label, _, _ in GAP_CLASSES}
    for gap, flipped in pairs:
        c = gap_class(gap)
        total[c] += 1
        flips[c] += int(flipped)
    return {label: FlipRate(flips[label], total[label]) for label, _, _ in GAP_CLASSES}


def throughput_per_min(n_commands: int, makespan_s: float) -> float:
    """Commands per minute over a makespan (NaN for an empty or zero-length run)."""
    if n_commands <= 0 or makespan_s <= 0:
        return math.nan
    return 60.0 * n_commands / makespan_s


def critical_fraction(t_region_s: float, t_total_s: float) -> float:
    """Share of a command's time spent inside its critical region(s), clamped to [0, 1]."""
    if t_total_s <= 0:
        return math.nan
    return min(1.0, max(0.0, t_region_s / t_total_s))


def amdahl_bound(fraction: float) -> float:
    """Upper bound on the throughput gain when only ``fraction`` of each command is
    serialised and the rest overlaps perfectly: 1 / fraction."""
    if fraction <= 0:
        return math.inf
    return 1.0 / fraction


def speedup_bound(fraction: float, c: int) -> float:
    """Amdahl with C-way overlap: 1 / (f + (1 - f) / C), the paper's toy model."""
    if c < 1:
        raise ValueError("concurrency must be >= 1")
    return 1.0 / (fraction + (1.0 - fraction) / c)
