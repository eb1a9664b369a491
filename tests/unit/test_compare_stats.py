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


def test_verdicts_on_a_a_pairs_are_almost_never_changed():
    """The whole rule (Holm over 6 tests, then the interval outside 1 ± 2 %): a changed
    verdict on A/A pairs at or below α, family-wise."""
    rng = np.random.default_rng(3)
    families, m, n = 300, 6, 20
    a, b = _lognormal(rng, 0.1, (families, m, n)), _lognormal(rng, 0.1, (families, m, n))
    _, low, high = stats.median_ratio_ci(a, b, rng=rng, resamples=400)
    p = np.apply_along_axis(stats.holm, 1, stats.mann_whitney(a, b))
    v = stats.verdicts(p, low, high, stats.reachable([n] * m, [n] * m, ALPHA), alpha=ALPHA,
                       min_effect=0.02)
    changed = (v == stats.SLOWER) | (v == stats.FASTER)
    assert changed.any(axis=1).mean() <= _upper(ALPHA, families)


def test_same_is_shown_when_the_noise_allows():
    """The equivalence test's power: with 1 % noise, 20 iterations put the interval inside
    ±2 % for most A/A pairs; with 10 % noise they cannot, and the verdict says so."""
    rng = np.random.default_rng(13)
    quiet = _judge(_lognormal(rng, 0.01, (300, 20)), _lognormal(rng, 0.01, (300, 20)), rng)[0]
    assert (quiet == stats.SAME).mean() > 0.8
    noisy = _judge(_lognormal(rng, 0.1, (300, 20)), _lognormal(rng, 0.1, (300, 20)), rng)[0]
    assert (noisy == stats.UNCLEAR).mean() > 0.8


def _judge(a, b, rng, min_effect=0.02):
    n = a.shape[-1]
    ratio, low, high = stats.median_ratio_ci(a, b, rng=rng, resamples=400)
    v = stats.verdicts(stats.mann_whitney(a, b), low, high, stats.reachable([n], [n], ALPHA),
                       alpha=ALPHA, min_effect=min_effect)
    return v, ratio, low, high


@pytest.mark.parametrize("sigma", [0.05, 0.3, 0.8])  # quiet, this machine, hopeless
@pytest.mark.parametrize("n", [5, 20])
def test_a_true_20_percent_difference_is_rarely_called_same(sigma, n):
    """The equivalence test's error rate: B truly 20 % slower, "same" in under α of the
    pairs whatever the noise; noise that hides the change makes it unclear, not same."""
    rng = np.random.default_rng(10)
    trials = 1000
    a, b = _lognormal(rng, sigma, (trials, n)), _lognormal(rng, sigma, (trials, n), 1.2)
    v, *_ = _judge(a, b, rng)
    assert (v == stats.SAME).mean() <= ALPHA
    assert (v == stats.FASTER).mean() <= ALPHA
    if sigma == 0.8 and n == 20:  # the case the old rule called "same": now unclear
        assert (v == stats.UNCLEAR).mean() > 0.5


@pytest.mark.parametrize("sigma", [0.05, 0.3])
def test_no_difference_is_rarely_called_slower_or_faster(sigma):
    rng = np.random.default_rng(11)
    trials = 1000
    a, b = _lognormal(rng, sigma, (trials, 20)), _lognormal(rng, sigma, (trials, 20))
    v, *_ = _judge(a, b, rng)
    assert ((v == stats.SLOWER) | (v == stats.FASTER)).mean() <= ALPHA


@pytest.mark.slow
def test_iterations_to_resolve_do_resolve():
    """An unclear 10 % change at 10 iterations: rerun with the estimated iterations, most
    pairs resolve (here: slower); the estimate is not just "more"."""
    rng = np.random.default_rng(12)
    sigma, trials = 0.3, 300
    a, b = _lognormal(rng, sigma, (trials, 10)), _lognormal(rng, sigma, (trials, 10), 1.1)
    v, ratio, low, high = _judge(a, b, rng)
    unclear = v == stats.UNCLEAR
    assert unclear.mean() > 0.5
    need = stats.iterations_to_resolve(ratio, low, high, 10, min_effect=0.02)[unclear]
    n = int(np.median(need[np.isfinite(need)]))
    assert 20 < n < 2000
    a2, b2 = _lognormal(rng, sigma, (trials, n)), _lognormal(rng, sigma, (trials, n), 1.1)
    v2, *_ = _judge(a2, b2, rng)
    assert (v2 == stats.SLOWER).mean() > 0.5


def test_iterations_to_resolve_on_the_band_edge_is_never():
    assert stats.iterations_to_resolve(1.02, 0.95, 1.09, 20, min_effect=0.02) == np.inf
    # half-width 0.05 in log space, 0.03 from the edge, at 50 % power no widening:
    # (0.05 / 0.03)² × 20 ≈ 56; at 80 % power × ((1.96 + 0.84) / 1.96)²
    r = math.exp(math.log(1.02) + 0.03)
    low, high = r * math.exp(-0.05), r * math.exp(0.05)
    assert stats.iterations_to_resolve(r, low, high, 20, min_effect=0.02, power=0.5) == \
        math.ceil(20 * (0.05 / 0.03) ** 2 - 1e-9)
    assert stats.iterations_to_resolve(r, low, high, 20, min_effect=0.02) == pytest.approx(
        20 * (0.05 / 0.03 * (1.96 + 0.8416) / 1.96) ** 2, abs=1.5)


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
    p = [0.001, 0.001, 0.2, 0.001, 0.001, 0.001, 0.2, 0.001]
    low = [1.05, 0.90, 1.05, 1.01, 0.95, 1.05, 0.99, 1.005]
    high = [1.10, 0.95, 1.10, 1.10, 0.99, 1.10, 1.01, 1.015]
    can = [True, True, True, True, True, False, True, True]
    v = stats.verdicts(p, low, high, can, alpha=ALPHA, min_effect=0.02)
    # not significant, or straddling the band's edge: unclear; inside the band: same, whether
    # or not the test is significant (a real 1 % change is practically no change)
    assert list(v) == [stats.SLOWER, stats.FASTER, stats.UNCLEAR, stats.UNCLEAR,
                       stats.UNCLEAR, stats.INSUFFICIENT, stats.SAME, stats.SAME]
