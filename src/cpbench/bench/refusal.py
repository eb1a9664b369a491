"""A run refused because a case would take longer than ``--max-minutes``, in at most three
lines of at most 120 columns, first thing on stderr (under torchrun, before torchrun's own
report).

Its suggestions keep the user's question, the same ranks (and nodes) and the same shape: a
shorter ``--seqlen`` that fits here, or ``cpbench simulate`` of that very case on a GPU preset
that the line names (a preset models bf16/fp16 kernels, so an fp32 question is priced in bf16,
and the line says so). Three lines, as two commands do not fit; the simulate line holds the
command alone, to be copied.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from cpbench.bench.estimate import FIRST_CASE_S, FIRST_STEPS_S, Estimate, Machine, Problem, estimate
from cpbench.config import GPU_ATTENTION, AttentionConfig, RunConfig
from cpbench.errors import UsageError
from cpbench.mask import size_text as size
from cpbench.metrics import duration

MAX_COLUMNS = 120
DEFAULT_PRESET = "a800-sxm"  # cpbench simulate's default --hardware
SHAPE_FLAGS = ("batch", "heads", "kv_heads", "head_dim")


def refuse_over(problems: Sequence[Problem], ests: Sequence[Estimate], run: RunConfig,
                machine: Machine) -> None:
    """UsageError when a case's estimate is over ``--max-minutes`` (0: no limit), in three
    lines: the longest such case and its estimate; a shorter length or no limit; the
    ``cpbench simulate`` of that case on a named preset (``suggestion``)."""
    limit_s = run.max_minutes * 60
    over = [(pr, est) for pr, est in zip(problems, ests) if limit_s and est.case_s > limit_s]
    if not over:
        return
    pr, est = max(over, key=lambda pair: pair[1].case_s)
    names = ",".join(dict.fromkeys(p.label.split(" ")[0] for p, _ in over))
    many = f"{len(over)} of {len(problems)} cases are over; the longest, " if len(over) > 1 \
        else ""
    case = f"{many}{pr.label} at seqlen {size(pr.attn.seqlen)} on {pr.ranks_per_problem} ranks"
    limit = f"over --max-minutes {run.max_minutes:g}"
    first = _fit(f"{case}: ~{duration(est.case_s)} here ({duration(est.step_s)} a step), {limit}",
                 f"{case}: ~{duration(est.case_s)} here, {limit}", first=True)
    fits = _fitting_seqlen(pr, est, run, machine)
    shorter = f"try --seqlen {size(fits[0])} (~{duration(fits[1])}) or" if fits else "give"
    preset, command = suggestion(names, pr, run, ests[0].comm_from)
    second = _fit(f"{shorter} --max-minutes 0 (no limit); or predict it on "
                  f"{pr.ranks_per_problem} GPUs of preset {preset}:",
                  f"{shorter} --max-minutes 0 (no limit); or predict it on preset {preset}:")
    raise UsageError(first, second, command)


def suggestion(names: str, pr: Problem, run: RunConfig, preset: str = "") -> tuple[str, str]:
    """(the preset, the ``cpbench simulate`` command) that predicts the same case: the same
    ranks, nodes, length and shape, on a GPU preset (the estimate's, else simulate's
    default); an fp32 question in bf16, which the presets model (said in the line)."""
    preset = preset if preset and preset != "none" else DEFAULT_PRESET
    hardware = "" if preset == DEFAULT_PRESET else f" --hardware {preset}"
    bf16 = "" if pr.attn.dtype in ("bf16", "fp16") else " in bf16"
    return preset + bf16, (f"cpbench simulate{hardware} "
                           f"{_where(pr.ranks_per_problem, run.ranks_per_node)} --strategy "
                           f"{names} --seqlen {size(pr.attn.seqlen)}"
                           + _flags(pr.attn, GPU_ATTENTION))


def _fit(line: str, shorter: str, *, first: bool = False) -> str:
    """``line`` where it fits in MAX_COLUMNS (the first line after its "cpbench run: error: "
    prefix, the others after their indent), else ``shorter``."""
    room = MAX_COLUMNS - (len("cpbench run: error: ") if first else 2)
    return line if len(line) <= room else shorter


def _where(ranks: int, ranks_per_node: int | None) -> str:
    per_node = math.gcd(ranks, ranks_per_node or ranks)
    return f"--nodes {ranks // per_node} --gpus-per-node {per_node}"


def _flags(attn: AttentionConfig, defaults: dict) -> str:
    """The flags that make a command's default problem ``attn``'s (length and dtype apart)."""
    given = [(n, getattr(attn, n)) for n in SHAPE_FLAGS
             if getattr(attn, n) is not None and getattr(attn, n) != defaults.get(n)]
    if not attn.causal:
        given.append(("no_causal", None))
    return "".join(f" --{n.replace('_', '-')}" + ("" if v is None else f" {v}")
                   for n, v in given)


def _fitting_seqlen(pr: Problem, est: Estimate, run: RunConfig, machine: Machine
                    ) -> tuple[int, float] | None:
    """The largest power-of-two --seqlen below the case's whose estimate fits the limit
    (time grows about as S²; the case's imbalance kept), and its estimate; None when none
    from 1k up does, or the problem is documents (its lengths fix the sequence)."""
    if pr.attn.documents:
        return None
    limit_s = run.max_minutes * 60
    seqlen = 2 ** int(math.log2(pr.attn.seqlen * math.sqrt(limit_s / est.case_s)))
    while seqlen >= 1024:
        smaller = dataclasses.replace(pr, attn=dataclasses.replace(pr.attn, seqlen=seqlen))
        got = estimate(smaller, run, machine, refined=True)
        first = got.case_s + FIRST_CASE_S + FIRST_STEPS_S  # were it the run's first case
        if first <= limit_s:
            return seqlen, first
        seqlen //= 2
    return None
