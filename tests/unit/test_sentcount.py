"""Counting the bytes of the timed step: per message, from any thread, warm-up excluded."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from cpbench import comm
from cpbench.bench.sentcount import StepBytes
from cpbench.topology import Group

RING = Group("ring", (0, 1), 0, False)


def test_counting_sees_sends_from_another_thread():
    # a CUDA backward runs on autograd's device thread, where a ContextVar is unset
    with comm.counting() as c:
        comm._record("p2p", RING, 100)
        t = threading.Thread(target=comm._record, args=("p2p", RING, 28))
        t.start()
        t.join()
    comm._record("p2p", RING, 1000)  # after the block: not counted
    assert c.nbytes == 128


def _own():
    return SimpleNamespace(upstream=None, compiles=False)


def test_timed_steps_are_counted_without_the_warmup():
    sizes = iter([999, 64, 64, 64])  # a first call that sends more (set-up), then steady

    def step():
        comm._record("p2p", RING, next(sizes))

    sb = StepBytes(_own(), warmup=1)
    wrapped = sb.wrap(step)
    for _ in range(4):
        wrapped()
    assert sb.counted() == (64, False)


def test_timed_steps_that_differ_are_said():
    sizes = iter([64, 0, 64])
    sb = StepBytes(_own(), warmup=0)
    wrapped = sb.wrap(lambda: comm._record("p2p", RING, next(sizes)))
    for _ in range(3):
        wrapped()
    assert sb.counted() == (64, True)
    assert StepBytes(_own(), warmup=2).counted() is None  # nothing timed
