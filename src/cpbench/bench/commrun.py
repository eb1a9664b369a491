"""``cpbench comm``: one forward + backward of each case on N local ranks with every
torch.distributed call traced (``bench.commtrace``), summed over ranks per (phase, op, dtype),
or listed per rank and step for one case.

Each case runs once untraced first (first-call set-up: compiled helpers, lazily made groups),
then its forward and its backward are traced separately. A case that fails is reported with
its error; the others still run.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict

from cpbench import kernels, strategies
from cpbench.bench import agreement
from cpbench.bench.commtrace import Event, traced
from cpbench.bench.driver import rank_inputs
from cpbench.bench.plan import Plan
from cpbench.report.labels import row_label


def _label(strat, case) -> str:
    opts = case.options
    return row_label({"config": {"strategy": case.strategy, "options": dataclasses.asdict(opts),
                                 "option_defaults": dataclasses.asdict(type(opts)())},
                      "resolved": strat.resolved_options()})


def _build(cls, case, p: Plan, rank: int):
    return cls(p.attn_of(case), p.topo, rank, kernel=kernels.get(p.kernel_of(case)),
               options=case.options)


def _trace_case(strat, p: Plan, rank: int) -> dict[str, list[Event]]:
    x = rank_inputs(strat, p, rank)
    sinks = x.get("sinks")
    out, _ = strat.attend(x["q"], x["k"], x["v"], sinks)  # untraced: first-call set-up
    out.backward(x["dout"])
    for t in (x["q"], x["k"], x["v"], sinks):
        if t is not None:
            t.grad = None
    with traced(dispatch=not strat.compiles) as fwd:
        out, _ = strat.attend(x["q"], x["k"], x["v"], sinks)
    with traced(dispatch=not strat.compiles) as bwd:
        out.backward(x["dout"])
    return {"fwd": fwd, "bwd": bwd}


def rank_comm(rank: int, world: int, p: Plan) -> list[dict]:
    """On every rank: each case traced; on rank 0, per case, its label, every rank's events
    per phase (or the error)."""
    import torch.distributed as dist

    found = []
    for i, case in enumerate(p.cases):
        phase = agreement.Agreement(p.run.device, agreement.store(), f"comm{i}")
        cls = strategies.get(case.strategy)
        strat = phase(functools.partial(_build, cls, case, p, rank))
        events = phase(functools.partial(_trace_case, strat, p, rank))
        everyone: list[object] = [None] * world
        if not phase.broken:
            dist.all_gather_object(everyone, events)
        label = _label(strat, case) if strat is not None else case.label
        found.append({"strategy": label, "error": phase.error,
                      "events": everyone if events is not None else None})
        agreement.cleanup()
        if phase.broken:
            break
    return found if rank == 0 else []


def summarize(found: list[dict]) -> list[dict]:
    """Per case, phase, op and dtype: calls and bytes summed over ranks (JSON rows)."""
    rows = []
    for case in found:
        if case["events"] is None:
            continue
        total: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
        for per_rank in case["events"]:
            for phase, events in per_rank.items():
                for e in events:
                    cell = total[(phase, e.op, e.dtype)]
                    cell[0] += 1
                    cell[1] += e.nbytes
        for (phase, op, dtype), (calls, nbytes) in total.items():
            rows.append({"strategy": case["strategy"], "phase": phase, "op": op,
                         "dtype": dtype, "calls": calls, "bytes": nbytes})
    return rows


def steps(case: dict) -> list[str]:
    """One line per rank, phase and kernel step: what the rank sent before that step's
    kernel (step k: after k kernel calls), op, dtype, bytes, group."""
    lines = []
    for rank, per_rank in enumerate(case["events"] or []):
        for phase, events in per_rank.items():
            for e in events:
                lines.append(f"rank {rank}  {phase}  step {e.kernels_before:>2}  {e.op:<18} "
                             f"{e.dtype:<9} {e.nbytes:>12,} B  group {list(e.group)}")
    return lines
