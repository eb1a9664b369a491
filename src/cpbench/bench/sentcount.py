"""The bytes each rank really sends in the timed step, for the record's ``comm`` section.

cpbench's own strategies send through ``cpbench.comm``, which adds each message's size to a
counter in Python as it posts it: every timed iteration is counted, at one addition per
message (no sync, no dispatch mode). The upstream adapters call torch.distributed from their
libraries' code, so their bytes come from the trace ``cpbench comm`` takes
(``bench.commtrace``); that trace's dispatch mode costs time on every op, so it counts the
last of the least warm-up steps (the same closure, untimed; more warm-up may follow until the
step settles), or the first timed one without warm-up. The driver times a step's forward and
backward as two closures: each is counted, and FWD+BWD is their sum, call by call.

What the strategy declares (``Strategy.schedule()``: its messages' bytes per phase) goes
beside it; ``cpbench.guards`` flags any difference.
"""

from __future__ import annotations

from typing import Callable

from cpbench import comm
from cpbench.bench.commtrace import traced
from cpbench.errors import UsageError
from cpbench.strategies.base import Strategy


def declared(strat: Strategy) -> dict[str, int] | None:
    """Bytes per phase the strategy's schedule says this rank sends (None: it declares none,
    as the upstream adapters)."""
    try:
        steps = strat.schedule()
    except UsageError:
        return None
    total = {"fwd": 0, "bwd": 0}
    for s in steps:
        total[s.phase] += sum(m.nbytes for m in s.messages)
    return total


class StepBytes:
    """Wraps a step closure so its sends are counted; ``counted()`` after the timing."""

    def __init__(self, strat: Strategy, warmup: int):
        self.own = strat.upstream is None
        self.dispatch = not strat.compiles  # torch.compile refuses to run under a mode
        self.traced_call = max(warmup, 1)  # the adapters' one traced call
        self.warmup = warmup
        self.calls = 0
        self.per_call: list[int] = []  # own: every call's bytes, warm-up first

    def wrap(self, fn: Callable[[], None]) -> Callable[[], None]:
        def counted_step():
            self.calls += 1
            if self.own:
                with comm.counting() as c:
                    fn()
                self.per_call.append(c.nbytes)
            elif self.calls == self.traced_call:
                with traced(dispatch=self.dispatch) as events:
                    fn()
                self.per_call.append(sum(e.nbytes for e in events))
            else:
                fn()

        return counted_step

    def timed(self) -> list[int]:
        """Each counted timed call's bytes (after ``warmup`` calls; set it to the warm-up
        steps run once they are known)."""
        return self.per_call[self.warmup:] if self.own else self.per_call

    def counted(self) -> tuple[int, bool] | None:
        """(bytes of the last counted step, whether the timed steps differed), or None."""
        timed = self.timed()
        if not timed:
            return None
        return timed[-1], len(set(timed)) > 1


def how_counted(strat: Strategy, warmup: int, *, timed: bool = True) -> str:
    """Which steps' bytes the record holds; ``timed``: False with ranks as threads, where a
    case runs one untimed step."""
    how = "cpbench.comm" if strat.upstream is None else "torch.distributed trace"
    if not timed:
        return f"one untimed step ({how}; ranks as threads)"
    if strat.upstream is None:
        return f"every timed step ({how})"
    return (f"warm-up step {warmup}" if warmup else "the first timed step") + f" ({how})"


def _step(sent: dict[str, StepBytes], phase: str) -> tuple[int, bool] | None:
    """A phase's (bytes, varied): FWD+BWD from its forward's and backward's calls summed
    where the two were counted apart."""
    if phase in sent:
        return sent[phase].counted()
    if phase != "fwd_bwd" or not {"fwd", "bwd"} <= set(sent):
        return None
    fwd, bwd = sent["fwd"].timed(), sent["bwd"].timed()
    steps = [f + b for f, b in zip(fwd, bwd)]
    return (steps[-1], len(set(steps)) > 1) if steps else None


def figures(sent: dict[str, StepBytes], strat: Strategy) -> list[int]:
    """This rank's figures for ``results.comm_section``: [FWD bytes, FWD varied, FWD+BWD
    bytes, FWD+BWD varied, declared fwd, declared bwd] (-1: not counted / not declared)."""
    mine = []
    for phase in ("fwd", "fwd_bwd"):
        got = _step(sent, phase)
        mine += [-1, 0] if got is None else [got[0], int(got[1])]
    want = declared(strat)
    return mine + ([-1, -1] if want is None else [want["fwd"], want["bwd"]])
