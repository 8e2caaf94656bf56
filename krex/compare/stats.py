"""The statistics of `krex compare`: a ratio of two candidates' figures with a confidence
interval, the probability that their order is wrong, and the sequential plan.

Method (docs/compare.md says why). Figures are compared on the log scale, where a
multiplicative difference (B = r * A) is a shift by log r. The estimate of log r is the
Hodges-Lehmann shift: the median of the m*n differences log b_j - log a_i. Its interval is
the Mann-Whitney (Moses) one: the k-th smallest and k-th largest of those differences,
with k from the exact null distribution of the Mann-Whitney U statistic (its normal
approximation once m*n exceeds EXACT_MAX_MN). Under the shift model (the candidates' log
figures differ by a constant, whatever their noise distribution) the interval covers the
true ratio with probability at least its stated level, at any sample size: no normality,
no resampling, robust to the outliers GPU timings have.

``p_wrong`` is the one-sided p-value of the hypothesis that the true order is the other
one (B not faster when B measured faster): the confidence-distribution mass on the other
side of a ratio of 1.

Sequential looks: `plan_looks` fixes the looks (a doubling schedule of blocks up to the
run budget) and their levels before any run: half of alpha at the last look, the other
half split equally over the earlier ones, and alpha divided by the number of comparisons
(Bonferroni). By the union bound, every interval shown at every look then covers its
truth simultaneously with probability at least 1 - alpha, whatever the correlation
between looks, so stopping at the first look whose intervals exclude 1 keeps the
stated level. Pure functions, no I/O."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist

__all__ = [
    "EXACT_MAX_MN",
    "Look",
    "ShiftEstimate",
    "mw_cdf",
    "plan_looks",
    "runs_needed",
    "shift_estimate",
]

EXACT_MAX_MN = 2500  # m*n up to which the Mann-Whitney null distribution is computed exactly
_NORMAL = NormalDist()


@lru_cache(maxsize=256)
def _mw_counts(m: int, n: int) -> tuple[int, ...]:
    """How many of the C(m+n, n) rank arrangements give U = 0..m*n: the coefficients of the
    Gaussian binomial [m+n choose n]_q = prod_{i=1..n} (1 - q^(m+i)) / (1 - q^i)."""
    top = m * n
    c = [0] * (top + 1)
    c[0] = 1
    for i in range(1, n + 1):
        k = m + i
        for d in range(top, k - 1, -1):  # times (1 - q^k)
            c[d] -= c[d - k]
        for d in range(i, top + 1):  # divided by (1 - q^i); the quotient's low terms need only low terms
            c[d] += c[d - i]
    return tuple(c)


def mw_cdf(u: float, m: int, n: int) -> float:
    """P(U <= u) for the Mann-Whitney U of samples of sizes m and n with no difference
    (exact up to EXACT_MAX_MN, else normal with continuity correction)."""
    if u < 0:
        return 0.0
    top = m * n
    if u >= top:
        return 1.0
    if top <= EXACT_MAX_MN:
        counts = _mw_counts(min(m, n), max(m, n))
        k = int(math.floor(u))
        return sum(counts[: k + 1]) / math.comb(m + n, n)
    mean = top / 2
    sd = math.sqrt(m * n * (m + n + 1) / 12)
    return _NORMAL.cdf((math.floor(u) + 0.5 - mean) / sd)


def _k_for(alpha: float, m: int, n: int) -> int:
    """The largest k >= 0 with P(U <= k - 1) <= alpha / 2: the interval is the k-th smallest
    and k-th largest difference (k = 0: no interval is possible at this level)."""
    top = m * n
    if top <= EXACT_MAX_MN:
        counts = _mw_counts(min(m, n), max(m, n))
        total = math.comb(m + n, n)
        limit = alpha / 2 * total
        acc, k = 0, 0
        while k < top and acc + counts[k] <= limit:
            acc += counts[k]
            k += 1
        return k
    z = _NORMAL.inv_cdf(1 - alpha / 2)
    k = int(math.floor(top / 2 - z * math.sqrt(m * n * (m + n + 1) / 12)))
    return max(0, min(k, top // 2))


@dataclass(frozen=True)
class ShiftEstimate:
    """The shift of y against x (log scale when given logs): estimate, interval at the
    level asked, the level the discrete distribution actually gives, and p_wrong."""

    estimate: float
    low: float  # -inf / inf: too few values for an interval at this level
    high: float
    level: float  # asked: 1 - alpha
    achieved: float  # >= level: the exact coverage of this interval under the shift model
    p_wrong: float  # confidence that the sign of the true shift is not the sign of `estimate`
    m: int
    n: int

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def shift_estimate(x: Sequence[float], y: Sequence[float], alpha: float) -> ShiftEstimate:
    """Hodges-Lehmann shift of ``y`` against ``x`` with its Mann-Whitney interval at level
    1 - ``alpha`` (two-sided). Needs at least one value on each side."""
    m, n = len(x), len(y)
    if m < 1 or n < 1:
        raise ValueError("need at least one value per sample")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha {alpha} not in (0, 1)")
    diffs = sorted(b - a for a in x for b in y)
    top = len(diffs)
    mid = top // 2
    est = diffs[mid] if top % 2 else (diffs[mid - 1] + diffs[mid]) / 2
    k = _k_for(alpha, m, n)
    if k >= 1:
        low, high = diffs[k - 1], diffs[top - k]
        achieved = 1 - 2 * mw_cdf(k - 1, m, n)
    else:
        low, high, achieved = -math.inf, math.inf, 1.0
    # U: pairs where y is above x (ties count half). A negative estimate is wrong when the
    # true shift is >= 0: the one-sided p-value P(U <= u_obs) under no shift, and mirrored.
    above = sum(1 for d in diffs if d > 0) + 0.5 * sum(1 for d in diffs if d == 0)
    if est < 0:
        p = mw_cdf(above, m, n)
    elif est > 0:
        p = mw_cdf(top - above, m, n)
    else:
        p = 0.5
    return ShiftEstimate(est, low, high, 1 - alpha, achieved, min(p, 0.5), m, n)


# ------------------------------------------------------------------------------ sequential plan


@dataclass(frozen=True)
class Look:
    """A planned look: after ``blocks`` blocks (each candidate then has 2*blocks runs), each
    comparison's interval at level 1 - ``alpha``."""

    index: int
    blocks: int
    alpha: float
    last: bool


def plan_looks(min_blocks: int, max_blocks: int, alpha: float, comparisons: int) -> list[Look]:
    """Looks after min_blocks, 2*min_blocks, 4*min_blocks, ... blocks, and at max_blocks.
    Alpha per comparison is alpha / comparisons; the last look gets half of it, the earlier
    looks share the other half equally (one look only: all of it). The union bound makes
    every interval of every look hold simultaneously at level >= 1 - alpha."""
    if min_blocks < 1 or max_blocks < min_blocks:
        raise ValueError(f"blocks: need 1 <= min ({min_blocks}) <= max ({max_blocks})")
    if comparisons < 1:
        raise ValueError("need at least one comparison")
    at = [min_blocks]
    while at[-1] * 2 < max_blocks:
        at.append(at[-1] * 2)
    if at[-1] != max_blocks:
        at.append(max_blocks)
    a = alpha / comparisons
    if len(at) == 1:
        return [Look(0, at[0], a, True)]
    early = a / 2 / (len(at) - 1)
    return [Look(i, b, a / 2 if i == len(at) - 1 else early, i == len(at) - 1) for i, b in enumerate(at)]


def runs_needed(est: ShiftEstimate) -> int | None:
    """Runs per candidate (both samples that size) that would make an interval like this
    one exclude zero if the estimate holds: the width shrinks as 1/sqrt(n). None when the
    estimate is 0 (no number of runs settles a difference of nothing)."""
    if est.estimate == 0 or not math.isfinite(est.low) or not math.isfinite(est.high):
        return None
    half = (est.high - est.low) / 2
    if half <= 0:
        return max(est.m, est.n)
    n_now = 2 * est.m * est.n / (est.m + est.n)  # the harmonic mean: what a balanced design needs
    return max(est.m, est.n, math.ceil(n_now * (half / abs(est.estimate)) ** 2))
