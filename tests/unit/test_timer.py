"""The timer: warm-up excluded, a barrier before every timed iteration, median of the slowest
rank per iteration."""

import time

import pytest

from cpbench import metrics
from cpbench.bench import timer


def test_warmup_untimed_and_barrier_each_iteration():
    calls, barriers = [], []
    t = timer.Timer("cpu", barrier=lambda: barriers.append(len(calls)))
    samples = t.measure(lambda: calls.append(1), warmup=3, iters=4)
    assert len(calls) == 7 and len(samples) == 4
    assert barriers == [3, 4, 5, 6]  # one barrier right before each timed call


def test_measures_the_closure():
    samples = timer.Timer("cpu").measure(lambda: time.sleep(0.02), warmup=0, iters=2)
    assert all(15 <= s <= 500 for s in samples)


def test_median_of_slowest_rank():
    by_rank = [[1.0, 9.0, 3.0, 2.0],
               [2.0, 1.0, 4.0, 1.0],
               [1.5, 1.0, 1.0, 8.0]]
    assert metrics.slowest_per_iter(by_rank) == [2.0, 9.0, 4.0, 8.0]
    assert metrics.step_time(by_rank) == pytest.approx(6.0)  # median of 2, 4, 8, 9
    assert metrics.slowest_rank(by_rank) == 1  # slowest in iterations 0 and 2


def test_gather_without_process_group():
    assert timer.gather_samples([1.0, 2.0]) == [[1.0, 2.0]]
