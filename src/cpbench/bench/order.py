"""The order a run times its cases in: the no-CP baseline at both ends of a run, packing after
packing, and ``--rounds K`` in A B … B A order. Each answers the same problem: the machine's
load drifts over a run, and a case's time should not depend on where in the run it fell."""

from __future__ import annotations

import dataclasses
from typing import Any


def bracket_baselines(built: list[tuple[Any, Any]]) -> list:
    """With a no-CP baseline and a CP strategy in one run: the baselines first and again last,
    the CP cases between them in their order. The machine's load drifts over a run; timing the
    baseline at both ends lets the report pool both and warn when they disagree."""
    base = [case for case, strat in built if strat.ranks_per_problem == 1]
    cp = [case for case, strat in built if strat.ranks_per_problem > 1]
    return base + cp + base if base and cp else [case for case, _ in built]


def in_rounds(cases: list, rounds: int) -> list:
    """``--rounds K``: the cases K times, alternate rounds reversed (A B … B A), each tagged
    with its round. A linear drift of the machine over the run then adds the same to every
    case's pooled time, where one pass would hand it all to the cases that ran last."""
    if rounds == 1:
        return cases
    return [dataclasses.replace(c, round=k) for k in range(rounds)
            for c in (cases if k % 2 == 0 else cases[::-1])]


def in_packing(built: list[tuple[Any, Any]], packing: int | None) -> list:
    """The cases of packing ``packing`` (None: no --packings): the plan runs them packing
    after packing, every strategy on one packing before the next."""
    return built if packing is None else [(dataclasses.replace(c, packing=packing), st)
                                          for c, st in built]
