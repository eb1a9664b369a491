"""The comparison's statistics tested as statistics: calibration on A/A pairs from a skewed
distribution, power against a 5 % shift, the bootstrap interval's coverage, Holm's correction
against a hand-computed case. Vectorised over thousands of seeded synthetic pairs."""

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from cpbench.compare import stats

ALPHA = 0.05


def _upper(rate: float, trials: int) -> float:
    """rate plus three binomial standard errors: what a fraction of ``trials`` can reach by
    chance when its true rate is ``rate`` (fails about once in 700 seeds, never here: seeded)."""
    return rate + 3 * math.sqrt(rate * (1 - rate) / trials)


def _lognormal(rng, sigma: float, shape, scale: float = 1.0) -> np.ndarray:
    # step times are right-skewed: most iterations near the typical time, a tail of slow ones
    return scale * rng.lognormal(mean=math.log(10.0), sigma=sigma, size=shape)


@pytest.mark.parametrize("n", [5, 8, 20])  # 5 and 8: scipy's exact null; 20: the normal one
def test_mann_whitney_is_calibrated_on_skewed_a_a_pairs(n):
    rng = np.random.default_rng(1)
    trials = 4000
    a, b = _lognormal(rng, 0.5, (trials, n)), _lognormal(rng, 0.5, (trials, n))
    rejected = (stats.mann_whitney(a, b) < ALPHA).mean()
    assert rejected <= _upper(ALPHA, trials)


def test_holm_keeps_the_family_wise_error_of_a_comparison():
    """A/A comparisons of 6 (case, phase) tests each: the chance that any of a comparison's
    tests is declared changed stays at or below α after Holm (uncorrected it is ~26 %)."""
    rng = np.random.default_rng(2)
    families, m, n = 3000, 6, 20
    p = stats.mann_whitney(_lognormal(rng, 0.5, (families, m, n)),
                           _lognormal(rng, 0.5, (families, m, n)))
    adjusted = np.apply_along_axis(stats.holm, 1, p)
    any_false = (adjusted < ALPHA).any(axis=1).mean()
    assert any_false <= _upper(ALPHA, families)
    assert (p < ALPHA).any(axis=1).mean() > 0.2  # the correction is what keeps it there


def test_verdicts_on_a_a_pairs_are_almost_always_same():
    """The whole rule (Holm over 6 tests, then the interval outside 1 ± 2 %): a changed
    verdict on A/A pairs at or below α, family-wise."""
    rng = np.random.default_rng(3)
    families, m, n = 300, 6, 20
    a, b = _lognormal(rng, 0.1, (families, m, n)), _lognormal(rng, 0.1, (families, m, n))
    _, low, high = stats.median_ratio_ci(a, b, rng=rng, resamples=400)
    p = np.apply_along_axis(stats.holm, 1, stats.mann_whitney(a, b))
    v = stats.verdicts(p, low, high, stats.reachable([n] * m, [n] * m, ALPHA), alpha=ALPHA,
                       min_effect=0.02)
    assert (v != stats.SAME).any(axis=1).mean() <= _upper(ALPHA, families)


@pytest.mark.parametrize("sigma, rule", [(0.04, "mann-whitney"), (0.02, "verdict")])
def test_power_against_a_5_percent_shift_with_20_samples(sigma, rule):
    """B 5 % slower, 20 iterations a side. The test alone detects it at 4 % timing noise
    (lognormal σ); the verdict also needs the interval clear of the ±2 % band, which 20
    iterations give at ~2 % noise (GPU step times at long sequences are quieter still)."""
    rng = np.random.default_rng(4)
    trials = 400
    a, b = _lognormal(rng, sigma, (trials, 20)), _lognormal(rng, sigma, (trials, 20), 1.05)
    p = stats.mann_whitney(a, b)
    if rule == "mann-whitney":
        detected = (p < ALPHA).mean()
    else:
        _, low, high = stats.median_ratio_ci(a, b, rng=rng, resamples=1000)
        v = stats.verdicts(p, low, high, stats.reachable([20], [20], ALPHA), alpha=ALPHA,
                           min_effect=0.02)
        detected = (v == stats.SLOWER).mean()
    assert detected >= 0.8


@pytest.mark.parametrize("n", [10, 20, 50])
def test_bootstrap_interval_covers_the_true_ratio_at_its_nominal_rate(n):
    rng = np.random.default_rng(5)
    trials, true_ratio = 400, 1.1  # B's distribution is A's scaled: so is its median
    a, b = _lognormal(rng, 0.3, (trials, n)), _lognormal(rng, 0.3, (trials, n), true_ratio)
    _, low, high = stats.median_ratio_ci(a, b, rng=rng, resamples=1000)
    covered = ((low <= true_ratio) & (true_ratio <= high)).mean()
    se = math.sqrt(stats.LEVEL * (1 - stats.LEVEL) / trials)
    assert abs(covered - stats.LEVEL) <= 3 * se + 0.01, covered


def test_bootstrap_is_the_ratio_of_medians_and_reproducible():
    a, b = [10.0, 12.0, 11.0, 30.0, 10.5], [13.0, 12.5, 14.0, 12.0, 40.0]
    r1 = stats.median_ratio_ci(a, b, rng=np.random.default_rng(7), resamples=2000)
    r2 = stats.median_ratio_ci(a, b, rng=np.random.default_rng(7), resamples=2000)
    assert r1 == r2
    ratio, low, high = r1
    assert ratio == pytest.approx(13.0 / 11.0) and low <= ratio <= high


def test_holm_against_a_hand_computed_case():
    # sorted: 0.005·4 = 0.02, 0.01·3 = 0.03, 0.03·2 = 0.06, 0.04·1 = 0.04 → monotone: 0.06
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert stats.holm([0.5, 0.6]) == pytest.approx([1.0, 1.0])  # 0.5·2 capped at 1
    assert stats.holm([0.2]) == pytest.approx([0.2])  # one test: unchanged


def test_smallest_p_is_scipys_exact_p_for_separated_samples():
    for n_a, n_b in [(3, 3), (5, 5), (4, 7)]:
        exact = scipy_stats.mannwhitneyu(np.arange(n_a), np.arange(n_b) + 100,
                                         method="exact").pvalue
        assert stats.min_p(n_a, n_b) == pytest.approx(exact)


def test_reachable_under_holm():
    # 3 vs 3 iterations: p ≥ 0.1, never below 0.05
    assert not stats.reachable([3], [3], ALPHA).any()
    # 5 vs 5: p ≥ 2/252 ≈ 0.0079; Holm's first step needs < 0.05 / m: m = 6 passes, 7 not
    assert stats.reachable([5] * 6, [5] * 6, ALPHA).all()
    assert not stats.reachable([5] * 7, [5] * 7, ALPHA).any()
    # one well-sampled test makes Holm's first step possible; the 3-vs-3 one still cannot
    assert list(stats.reachable([20, 3], [20, 3], ALPHA)) == [True, False]


def test_verdict_needs_both_significance_and_an_interval_outside_the_band():
    p = [0.001, 0.001, 0.2, 0.001, 0.001, 0.001]
    low = [1.05, 0.90, 1.05, 1.01, 0.95, 1.05]
    high = [1.10, 0.95, 1.10, 1.10, 0.99, 1.10]
    can = [True, True, True, True, True, False]
    v = stats.verdicts(p, low, high, can, alpha=ALPHA, min_effect=0.02)
    assert list(v) == [stats.SLOWER, stats.FASTER, stats.SAME, stats.SAME, stats.SAME,
                       stats.INSUFFICIENT]
