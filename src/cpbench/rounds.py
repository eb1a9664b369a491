"""A case timed in several rounds (``cpbench run --rounds K``): its records pooled into one,
and the drift between the rounds.

A run of K rounds writes one record per case and round, each with ``round`` =
{"index", "count"}. Every reader (the report tables, ``--best``, ``compare``) pools a
case's rounds of one run into one record first: the per-rank samples of every round joined in
round order, so the case's median is over all its iterations. Records without ``round`` (one
pass, or records older than the option) pass through unchanged.

The drift is each round's median beside the others: with A B … B A order a machine that
slows down steadily adds about the same to every case's pooled time, but a large drift still
says that a single pass of this machine would have been unfair, and by how much.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from cpbench import metrics
from cpbench.results import OK, derive, record_key


def _run_of(record: dict[str, Any]) -> str | None:
    return (record.get("env") or {}).get("utc")  # a run's records share its start time


def _group_key(record: dict[str, Any]) -> str:
    return json.dumps([record_key(record), _run_of(record)])


def _pooled_samples(rounds: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Each phase's per-rank samples of every round joined; None when the rounds' shapes
    differ (another world size cannot happen within a run: then nothing is pooled)."""
    first = rounds[0]["samples_ms"]
    merged = {}
    for phase, by_rank in first.items():
        parts = [r["samples_ms"].get(phase) for r in rounds]
        if not by_rank or any(not p or len(p) != len(by_rank) for p in parts):
            if any(parts):
                return None
            merged[phase] = by_rank
            continue
        merged[phase] = [[t for p in parts for t in p[rank]] for rank in range(len(by_rank))]
    return merged


def _poolable(record: dict[str, Any]) -> bool:
    return bool(record.get("round")) and record["status"] == OK and bool(record.get("samples_ms"))


def pool(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records with each case's rounds of one run pooled into one record, placed where
    the case's first round was. Only rounds that ran (status ok, with samples) are pooled; a
    round that failed stays a record of its own, so its failure still shows."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if _poolable(r):
            groups.setdefault(_group_key(r), []).append(r)
    out, placed = [], set()
    for r in records:
        key = _group_key(r) if _poolable(r) else None
        if key is None:
            out.append(r)
        elif key not in placed:
            placed.add(key)
            out.append(_merge(groups[key]) if len(groups[key]) > 1 else r)
    return out


def _merge(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    rounds = sorted(rounds, key=lambda r: r["round"]["index"])
    samples = _pooled_samples(rounds)
    if samples is None:
        return rounds[-1]
    first = rounds[0]
    merged = {**first, "samples_ms": samples,
              "round": {"index": None, "count": first["round"]["count"],
                        "pooled": [r["round"]["index"] for r in rounds],
                        "medians_ms": {phase: [_median(r, phase) for r in rounds]
                                       for phase in samples}},
              "check": next((r["check"] for r in rounds if r.get("check")), None)}
    merged["derived"] = derive(merged)
    return merged


def _median(record: dict[str, Any], phase: str) -> float | None:
    by_rank = (record.get("samples_ms") or {}).get(phase)
    return metrics.step_time(by_rank) if by_rank else None


def drift(record: dict[str, Any]) -> tuple[str, list[float]] | None:
    """A pooled record's (phase, median of each round): FWD+BWD where timed, else FWD; None
    for a record that pooled no rounds."""
    medians = ((record.get("round") or {}).get("medians_ms")) or {}
    for phase in ("fwd_bwd", "fwd"):
        if medians.get(phase) and all(m is not None for m in medians[phase]):
            return phase, medians[phase]
    return None


def drift_lines(records: list[dict[str, Any]], label: Callable[[dict[str, Any]], str]
                ) -> list[str]:
    """One line per pooled case: each round's median and the spread between them, largest
    first ((max − min) / min)."""
    rows = []
    for r in pool(records):
        found = drift(r)
        if found is None:
            continue
        phase, medians = found
        spread = max(medians) / min(medians) - 1
        rows.append((spread, f"  {label(r)}: {'FWD+BWD' if phase == 'fwd_bwd' else 'FWD'} "
                             f"{' → '.join(f'{m:.2f}' for m in medians)} ms by round "
                             f"(drift {100 * spread:.1f} %)"))
    if not rows:
        return []
    rows.sort(key=lambda x: -x[0])
    return ["Drift between rounds (each round's median; the rows pool all rounds):"] + \
        [text for _, text in rows]
