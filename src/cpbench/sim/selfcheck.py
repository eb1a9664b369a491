"""``cpbench simulate --self-check``: the simulator against fresh measurements on this machine.

``cpbench run --nproc N`` measures every strategy (and variant) at each sequence length; the
model predicts the same cases on the same topology from a preset (``cpbench calibrate``'s
for this machine); the table prints both and the relative error, FWD and FWD+BWD, and last
the worst one. Nothing is fitted here: the preset is taken as given.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from typing import Sequence

from cpbench import metrics, results, strategies
from cpbench.bench import entry
from cpbench.bench import plan as planning
from cpbench.config import AttentionConfig, RunConfig
from cpbench.errors import UsageError
from cpbench.report import labels
from cpbench.sim import model
from cpbench.sim.hardware import Hardware
from cpbench.topology import Topology


@dataclass(frozen=True)
class Row:
    label: str
    seqlen: int
    phase: str  # "FWD" or "FWD+BWD"
    predicted_ms: float
    measured_ms: float
    spread: float  # (max − min) / median of the measured iterations (slowest rank each)

    @property
    def error(self) -> float:
        """(predicted − measured) / measured."""
        return self.predicted_ms / self.measured_ms - 1


@contextlib.contextmanager
def _stdout_to_stderr():
    """The ranks' own tables go to stderr (progress), the comparison alone to stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def measure(names: tuple[str, ...], attention: dict, options: dict, seqlens: list[int], *,
            nproc: int, warmup: int, iters: int, out: str | None = None) -> list[dict]:
    """``cpbench run --nproc`` at each length; the records of the rows that ran (also
    appended to ``out`` when given, so a later check can re-read them)."""
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for seqlen in seqlens:
            path = out or os.path.join(tmp, f"{seqlen}.jsonl")
            offset = os.path.getsize(path) if os.path.exists(path) else 0
            run = RunConfig(strategy=names, nproc=nproc, warmup=warmup, iters=iters, out=path)
            p = planning.plan(run, {**attention, "seqlen": seqlen}, options, launcher="self")
            with _stdout_to_stderr():
                entry.launch(p)
            records += ok_records(results.read_from(path, offset))
    return records


def ok_records(records: list[dict]) -> list[dict]:
    """The measured rows that ran to completion (no predictions)."""
    return [r for r in records if r["status"] == results.OK
            and not r.get("env", {}).get("simulated") and not r["env"].get("kernel_bench")]


def compare(records: list[dict], hw: Hardware) -> tuple[list[Row], list[str]]:
    """Predicted vs measured, per record and phase, on each record's own topology; and the
    rows the model cannot predict, with why."""
    rows, skipped = [], []
    for r in records:
        cfg, topo = r["config"], r["topology"]
        label, seqlen = labels.row_label(r), cfg["attention"]["seqlen"]
        cls = strategies.get(cfg["strategy"])
        if cls.upstream is not None:  # a library's own code: no declared schedule to price
            skipped.append(f"{label} at {seqlen}: runs {cls.upstream.package}'s own code; "
                           f"the simulator models its twin, {cls.upstream.twin or 'none'}")
            continue
        options = cls.Options(**cfg["options"])
        try:
            p = model.predict(cfg["strategy"], options, AttentionConfig(**cfg["attention"]),
                              Topology(world_size=topo["world_size"],
                                       ranks_per_node=topo["ranks_per_node"]), hw)
        except UsageError as e:
            skipped.append(f"{label} at {seqlen}: {e}")
            continue
        d, samples = r["derived"], r["samples_ms"]
        rows.append(Row(label, seqlen, "FWD", p.fwd_s * 1e3, d["fwd_ms"],
                        _spread(samples["fwd"])))
        if d.get("fwd_bwd_ms"):
            rows.append(Row(label, seqlen, "FWD+BWD", p.fwd_bwd_s * 1e3, d["fwd_bwd_ms"],
                            _spread(samples["fwd_bwd"])))
    return rows, skipped


def _spread(samples_by_rank) -> float:
    per_iter = metrics.slowest_per_iter(samples_by_rank)
    return (max(per_iter) - min(per_iter)) / statistics.median(per_iter)


def render(rows: list[Row], hw: Hardware, nproc: int, skipped: Sequence[str] = ()) -> str:
    if not rows:
        raise UsageError("no case ran to completion: nothing to compare")
    width = max(len(r.label) for r in rows)
    head = (f"Simulator self-check: {hw.name} predicted vs measured by cpbench run --nproc "
            f"{nproc} on this machine (spread: (max - min) / median of the measured "
            f"iterations)")
    lines = [head, "", f"{'Strategy':<{width}}  {'Seq Len':>7}  {'phase':<7}  "
             f"{'predicted ms':>12}  {'measured ms':>11}  {'spread':>7}  {'error':>8}"]
    for r in rows:
        lines.append(f"{r.label:<{width}}  {r.seqlen:>7}  {r.phase:<7}  "
                     f"{r.predicted_ms:>12.2f}  {r.measured_ms:>11.2f}  "
                     f"{r.spread * 100:>6.0f}%  {r.error * 100:>+7.1f}%")
    if skipped:
        lines += ["", "not predicted:", *(f"  {why}" for why in skipped)]
    errors = sorted(abs(r.error) for r in rows)
    within = sum(abs(r.error) <= 0.15 for r in rows)
    worst = max(rows, key=lambda r: abs(r.error))
    lines += ["", f"median |error| {statistics.median(errors) * 100:.1f} %, "
                  f"{within} of {len(rows)} within 15 %",
              f"worst |error| {abs(worst.error) * 100:.1f} % ({worst.label}, "
              f"{worst.seqlen}, {worst.phase})"]
    return "\n".join(lines) + "\n"
