"""The timer: warm-up excluded, a barrier before every timed iteration, median of the slowest
rank per iteration. Steps take their time on an injected clock (``Clock``), so what a test
asserts holds however busy the host is; one test times a real sleep, from below only."""

import time

import pytest

from cpbench import metrics
from cpbench.bench import timer


class Clock:
    """A clock that moves only when a step says it took ``ms``."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def takes(self, ms) -> None:
        self.now += ms / 1e3


def test_warmup_untimed_and_barrier_each_iteration():
    calls, barriers = [], []
    t = timer.Timer("cpu", barrier=lambda: barriers.append(len(calls)))
    samples = t.measure(lambda: calls.append(1), warmup=3, iters=4)
    assert len(calls) == 7 and len(samples) == 4
    assert barriers == [3, 4, 5, 6]  # one barrier right before each timed call


def test_measures_the_closure():
    clock = Clock()
    samples = timer.Timer("cpu", clock=clock).measure(lambda: clock.takes(20), warmup=0,
                                                      iters=2)
    assert samples == pytest.approx([20, 20])


def test_the_real_clock_sees_at_least_a_real_sleep():
    # a sleep lasts at least what it asks for at any load (how much longer is the host's)
    samples = timer.Timer("cpu").measure(lambda: time.sleep(0.02), warmup=0, iters=2)
    assert all(s >= 19.9 for s in samples)


def test_median_of_slowest_rank():
    by_rank = [[1.0, 9.0, 3.0, 2.0],
               [2.0, 1.0, 4.0, 1.0],
               [1.5, 1.0, 1.0, 8.0]]
    assert metrics.slowest_per_iter(by_rank) == [2.0, 9.0, 4.0, 8.0]
    assert metrics.step_time(by_rank) == pytest.approx(6.0)  # median of 2, 4, 8, 9
    assert metrics.slowest_rank(by_rank) == 1  # slowest in iterations 0 and 2


def test_gather_without_process_group():
    assert timer.gather_samples([1.0, 2.0]) == [[1.0, 2.0]]


def test_each_part_of_a_step_is_timed_on_its_own():
    """A step of FWD (20 ms) then BWD (50 ms): each iteration gives a BWD sample of its own,
    never FWD+BWD less FWD, and the step spans both."""
    barriers, clock = [], Clock()
    # a barrier takes 1 ms: it comes before the step, outside what is timed
    t = timer.Timer("cpu", barrier=lambda: (barriers.append(1), clock.takes(1)), clock=clock)
    got = t.measure_steps([lambda: clock.takes(20), lambda: clock.takes(50)],
                          settle=timer.Settle(least=1, most=1), iters=3)
    fwd, bwd = got.parts
    assert len(fwd) == len(bwd) == len(got.steps) == 3 and got.warmup == 1
    assert fwd == pytest.approx([20] * 3) and bwd == pytest.approx([50] * 3)
    assert got.steps == pytest.approx([70] * 3)  # back to back: no barrier between the parts
    assert len(barriers) == 3  # the ranks line up before each timed step, not between parts


def test_bwd_samples_are_what_the_backward_took_whatever_the_forward_did():
    # a forward whose first timed iterations are slow (cold) cannot make BWD negative or
    # shorter: the backward's samples are its own
    fwd_ms, clock = iter([80, 5, 5]), Clock()
    got = timer.Timer("cpu", clock=clock).measure_steps(
        [lambda: clock.takes(next(fwd_ms)), lambda: clock.takes(30)],
        settle=timer.Settle(least=0, most=0), iters=3)
    assert got.parts == [pytest.approx([80, 5, 5]), pytest.approx([30] * 3)]


def test_warmup_runs_until_the_step_settles():
    # steps of 90, 60, 40, 31, 30, 30, 30 ms: settled once the last three are within 10 %
    times, clock = iter([90, 60, 40, 31, 30, 30, 30, 30, 30, 30]), Clock()
    got = timer.Timer("cpu", clock=clock).measure_steps([lambda: clock.takes(next(times))],
                                           settle=timer.Settle(least=2, most=12), iters=2)
    assert got.settled and got.warmup == 6  # 31, 30, 30 within 10 % after the sixth


def test_warmup_is_bounded_when_the_step_never_settles():
    times, seen, clock = iter([10, 40, 10, 40, 10, 40, 10, 40, 10, 40]), [], Clock()
    got = timer.Timer("cpu", clock=clock).measure_steps(
        [lambda: clock.takes(next(times))], settle=timer.warmup_rule(2, 3), iters=3,
        progress=lambda what, done, most: seen.append((what, done, most)))
    assert not got.settled and got.warmup == 5  # at most --warmup + --iters
    # said before each step: the one about to run
    assert seen == [("warm-up", i, 5) for i in range(1, 6)] + [("timed", i, 3)
                                                               for i in range(1, 4)]


def test_every_rank_decides_the_warmup_on_the_slowest_ranks_times():
    # this rank's steps (1 ms each) settle at once; the slowest rank's, which the all-reduce
    # (agree) returns to every rank, do not: every rank warms up to the bound alike
    slowest = iter([90.0, 30.0, 60.0, 30.0, 60.0, 30.0])
    clock = Clock()
    got = timer.Timer("cpu", agree=lambda mine: next(slowest), clock=clock).measure_steps(
        [lambda: clock.takes(1)], settle=timer.Settle(least=1, most=6), iters=1)
    assert got.warmup == 6 and not got.settled


def test_the_settling_rule():
    assert timer.settled([100, 31, 30, 30])
    assert not timer.settled([100, 40, 30, 30]) and not timer.settled([30, 30])
    assert timer.warmup_rule(0, 5) == timer.Settle(least=0, most=0)  # --warmup 0: none
    assert timer.Settle(least=2, most=7).done([50, 10, 10, 10]) is True
    assert timer.Settle(least=5, most=7).done([10, 10, 10]) is False  # the least first


def test_a_steps_samples_are_gathered_and_cut_per_phase():
    from cpbench.bench import steps

    got = timer.Timed(parts=[[1.0, 2.0], [3.0, 4.0]], steps=[4.5, 6.5], warmup=2, settled=True)
    mine = steps.flat(got)
    other = [x + 10 for x in mine]
    assert steps.samples_of([mine, other], iters=2) == {
        "fwd": [[1.0, 2.0], [11.0, 12.0]], "bwd": [[3.0, 4.0], [13.0, 14.0]],
        "fwd_bwd": [[4.5, 6.5], [14.5, 16.5]]}
    fwd_only = timer.Timed(parts=[[1.0, 2.0]], steps=[1.0, 2.0], warmup=0, settled=False)
    assert steps.samples_of([steps.flat(fwd_only)], iters=2) == {"fwd": [[1.0, 2.0]],
                                                                 "fwd_bwd": None}


def test_the_parts_run_back_to_back_with_no_barrier_between():
    """A training step's FWD then BWD, as the seeds' scripts time it: the ranks line up once
    before the step; a barrier that takes 30 ms is in no part and not in the step."""
    t = timer.Timer("cpu", barrier=lambda: time.sleep(0.03))
    got = t.measure_steps([lambda: time.sleep(0.02), lambda: time.sleep(0.05)],
                          settle=timer.Settle(least=0, most=0), iters=2)
    fwd, bwd = got.parts
    for f, b, s in zip(fwd, bwd, got.steps):
        # the step is its parts end to end, one clock mark between them: the barrier's
        # 30 ms (before the step) is in neither part nor the step, whatever the load
        assert s == pytest.approx(f + b, abs=1e-9) and f >= 18 and b >= 45
