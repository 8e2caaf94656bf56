"""krex.compare.stats: the Mann-Whitney null distribution, the Hodges-Lehmann ratio and
its interval, P(order wrong), the sequential plan, and coverage on simulated samples of
known ratio (no processes: the end-to-end check on the simulated GPU is
tests/integration/test_compare_e2e.py and docs/results/compare-coverage/)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from krex.compare.stats import _mw_counts, mw_cdf, plan_looks, runs_needed, shift_estimate


def _brute_counts(m: int, n: int) -> list[int]:
    """U over every placement of n y's among m + n ranks (U: pairs with y above x)."""
    counts = [0] * (m * n + 1)
    for ys in itertools.combinations(range(m + n), n):
        yset = set(ys)
        u = 0
        xs_below = 0
        for r in range(m + n):
            if r in yset:
                u += xs_below
            else:
                xs_below += 1
        counts[u] += 1
    return counts


@pytest.mark.parametrize(("m", "n"), [(1, 1), (2, 3), (3, 3), (4, 6), (5, 5)])
def test_null_distribution_is_the_exact_count_of_rank_arrangements(m: int, n: int) -> None:
    assert list(_mw_counts(min(m, n), max(m, n))) == _brute_counts(m, n)
    assert sum(_mw_counts(m, n)) == math.comb(m + n, n)


def test_cdf_exact_and_normal_agree_where_both_apply() -> None:
    m = n = 40  # exact (1600 <= EXACT_MAX_MN)
    for u in (600, 700, 800):
        exact = mw_cdf(u, m, n)
        sd = math.sqrt(m * n * (m + n + 1) / 12)
        approx = 0.5 * (1 + math.erf((u + 0.5 - m * n / 2) / sd / math.sqrt(2)))
        assert exact == pytest.approx(approx, abs=0.01)
    assert mw_cdf(-1, 3, 3) == 0.0 and mw_cdf(9, 3, 3) == 1.0


def test_estimate_interval_and_order_on_separated_samples() -> None:
    x = [math.log(v) for v in (100, 101, 99, 100.5, 99.5, 100.2)]
    y = [math.log(v) for v in (90, 91, 89, 90.5, 89.5, 90.2)]
    e = shift_estimate(x, y, 0.05)
    assert math.exp(e.estimate) == pytest.approx(0.9, rel=0.01)
    assert e.high < 0 and e.excludes_zero
    assert e.achieved >= 0.95
    assert e.p_wrong == pytest.approx(1 / math.comb(12, 6))  # every pair in order: the smallest p


def test_too_few_values_give_no_interval_rather_than_a_false_one() -> None:
    e = shift_estimate([0.0, 0.1], [1.0, 1.1], 0.05)  # 2 vs 2: P(U=0) = 1/6 > 0.025
    assert e.low == -math.inf and e.high == math.inf and not e.excludes_zero
    assert runs_needed(e) is None


def test_p_wrong_is_a_coin_flip_at_no_difference_and_consistent_with_the_interval() -> None:
    assert shift_estimate([1.0, 2.0], [1.0, 2.0], 0.05).p_wrong == 0.5
    rng = random.Random(7)
    for _ in range(200):
        x = [rng.gauss(0, 0.03) for _ in range(8)]
        y = [rng.gauss(0.02, 0.03) for _ in range(8)]
        e = shift_estimate(x, y, 0.05)
        if e.excludes_zero:  # the interval excludes 0 at 97.5% one-sided: p_wrong below 2.5%
            assert e.p_wrong <= 0.025 + 1e-12


def _coverage(ratio: float, sigma: float, m: int, reps: int, rng: random.Random,
              noise: str = "lognormal") -> float:
    hit = 0
    for _ in range(reps):
        def draw() -> float:
            if noise == "lognormal":
                return rng.gauss(0, sigma)
            # heavy-tailed: mostly tight, one run in ten far off (preemption, a clock dip)
            return rng.gauss(0, sigma) + (rng.expovariate(1 / (8 * sigma)) if rng.random() < 0.1 else 0.0)

        x = [math.log(1.0) + draw() for _ in range(m)]
        y = [math.log(ratio) + draw() for _ in range(m)]
        e = shift_estimate(x, y, 0.05)
        hit += e.low <= math.log(ratio) <= e.high
    return hit / reps


@pytest.mark.parametrize(
    ("ratio", "sigma", "m", "noise"),
    [(1.0, 0.03, 6, "lognormal"), (0.98, 0.03, 10, "lognormal"), (1.05, 0.10, 20, "lognormal"),
     (0.95, 0.03, 12, "heavy")],
)
def test_intervals_cover_the_true_ratio_at_their_stated_rate(ratio: float, sigma: float, m: int,
                                                              noise: str) -> None:
    reps = 600
    seed = int(ratio * 1e4) + int(sigma * 1e3) + m + len(noise)
    cov = _coverage(ratio, sigma, m, reps, random.Random(seed), noise)
    # 95% stated; 3 binomial standard errors below it is a failure (not chance)
    assert cov >= 0.95 - 3 * math.sqrt(0.95 * 0.05 / reps), cov


def test_plan_spends_half_of_alpha_at_the_last_look_and_never_more_than_alpha() -> None:
    looks = plan_looks(3, 15, 0.05, 2)
    assert [lk.blocks for lk in looks] == [3, 6, 12, 15]
    assert looks[-1].last and not any(lk.last for lk in looks[:-1])
    assert looks[-1].alpha == pytest.approx(0.05 / 2 / 2)
    assert sum(lk.alpha for lk in looks) == pytest.approx(0.05 / 2)  # per comparison
    one = plan_looks(5, 5, 0.05, 1)
    assert len(one) == 1 and one[0].alpha == pytest.approx(0.05)
    with pytest.raises(ValueError):
        plan_looks(4, 3, 0.05, 1)


def _sequential(ratio: float, sigma: float, rng: random.Random) -> tuple[bool, bool, int]:
    """One comparison run the way krex.compare.run does it (2 values per block per
    candidate, a look per planned look, stop once the interval excludes 0). Returns
    (the stopped interval covers the truth, it stopped early with a claim, values used)."""
    looks = plan_looks(3, 15, 0.05, 1)
    x: list[float] = []
    y: list[float] = []
    for lk in looks:
        while len(x) < 2 * lk.blocks:
            x.append(rng.gauss(0, sigma))
            y.append(math.log(ratio) + rng.gauss(0, sigma))
        e = shift_estimate(x, y, lk.alpha)
        if e.excludes_zero or lk.last:
            return e.low <= math.log(ratio) <= e.high, e.excludes_zero, len(x)
    raise AssertionError("unreachable")


@pytest.mark.parametrize(("ratio", "sigma"), [(1.0, 0.03), (1.02, 0.03), (0.95, 0.05)])
def test_sequential_stopping_keeps_the_stated_coverage(ratio: float, sigma: float) -> None:
    rng = random.Random(int(ratio * 1000) + int(sigma * 100))
    reps = 400
    runs = [_sequential(ratio, sigma, rng) for _ in range(reps)]
    cov = sum(c for c, _, _ in runs) / reps
    assert cov >= 0.95 - 3 * math.sqrt(0.95 * 0.05 / reps), cov
    if ratio == 1.0:  # no difference: a claimed order is a false one, at most alpha of the time
        assert sum(claim for _, claim, _ in runs) / reps <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / reps)


def test_a_large_difference_stops_at_the_first_look() -> None:
    rng = random.Random(3)
    runs = [_sequential(0.8, 0.02, rng) for _ in range(50)]
    assert all(claim and n == 6 for _, claim, n in runs)


def test_runs_needed_grows_as_the_difference_shrinks() -> None:
    rng = random.Random(11)
    x = [rng.gauss(0, 0.03) for _ in range(10)]
    noise = [rng.gauss(0, 0.03) for _ in range(10)]
    small = shift_estimate(x, [v + 0.005 for v in noise], 0.05)
    large = shift_estimate(x, [v + 0.03 for v in noise], 0.05)
    rs, rl = runs_needed(small), runs_needed(large)
    assert rs is not None and rl is not None and rs > rl >= 10
