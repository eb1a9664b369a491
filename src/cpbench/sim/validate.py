"""``cpbench simulate --validate FILE.csv``: published rows against the simulator.

A validation CSV has one published measurement per row (configs/validation/ holds seed 000's
and seed 001's): ``implementation`` (as published), ``strategy`` and ``options`` (``k=v;k=v``:
the cpbench strategy that runs that algorithm), the problem (``seqlen``, ``batch``, ``heads``,
``kv_heads``, ``head_dim``, ``dtype``, ``causal``), the topology (``nodes``,
``gpus_per_node``), the published ``fwd_ms``, ``fwd_bwd_ms`` and ``tflops`` (per GPU,
FWD+BWD), ``score`` (no: shown, left out of the statistics, with the reason in ``note``),
``printed_tflops``, ``source`` and optionally ``kernel`` (the attention kernel the published
run used, as ``--kernel`` names it: the headline says how many rows ran another than the
one simulated), ``documents`` and ``packings`` (a packed-document row: ``--documents``'
spec, sampled ``packings`` times with seeds 0, 1, ...; ``packing_lines``).

What is scored is per-GPU FWD+BWD TFLOP/s, both sides from cpbench's one FLOP formula (the
published column where it is consistent with the published time; the note says where it was
not). Ranking: at each sequence length, every pair of implementations whose published values
differ by more than ``RANK_TOLERANCE`` must come out in the same order; closer pairs are
within the tables' own run-to-run noise and are not a ranking. A user picks a strategy from
the ranking, so the headline gives it beside the error. Both are given apart for the rows
that shaped the preset (in-sample: its ``fit:`` section names them, ``sim.provenance``) and
for the rows nothing was fitted to (held out).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cpbench import strategies
from cpbench.config import AttentionConfig, packed_problems
from cpbench.errors import UsageError
from cpbench.mask import parse_documents
from cpbench.metrics import attention_flops, fwd_bwd_rate, problem_flops, tflops_per_gpu
from cpbench.report import cells, tables
from cpbench.report.placements import ModelError
from cpbench.report.render import Fit, prose
from cpbench.sim import model

if TYPE_CHECKING:
    from _typeshed import DataclassInstance
from cpbench.sim.hardware import Hardware
from cpbench.sim.provenance import HELD_OUT, IN_SAMPLE
from cpbench.strategies.base import BWD, FWD
from cpbench.topology import Topology

RANK_TOLERANCE = 0.05
_REQUIRED = ("implementation", "strategy", "options", "seqlen", "nodes", "gpus_per_node",
             "batch", "heads", "kv_heads", "head_dim", "dtype", "causal", "tflops")
_BOOL = {"true": True, "yes": True, "false": False, "no": False}
_FLAG = {**_BOOL, "1": True, "0": False}


@dataclass(frozen=True)
class Row:
    implementation: str
    strategy: str
    options: DataclassInstance  # the strategy's Options
    attn: AttentionConfig
    topo: Topology
    published: float  # TFLOP/s per GPU, FWD+BWD
    published_fwd_ms: float | None
    scored: bool
    note: str
    kernel: str | None = None  # the published run's kernel, where the file says
    documents: str | None = None  # the ``documents`` column: packed documents' spec
    packed: tuple[AttentionConfig, ...] = ()  # under documents: each packing (attn: the 1st)


@dataclass(frozen=True)
class Result:
    row: Row
    prediction: model.Prediction  # under documents: the first packing's
    packed: tuple[model.Prediction, ...] = ()  # under documents: every packing's

    @property
    def predicted(self) -> float:
        """Simulated TFLOP/s per GPU, FWD+BWD. Under documents as MagiAttention publishes
        them: each phase's TFLOP/s (the real mask area's FLOPs) averaged over the packings,
        then joined as one FWD+BWD figure, 3.5 / (1 / fwd + 2.5 / bwd)."""
        if not self.packed:
            a = self.row.attn
            flops = attention_flops(batch=a.batch, seqlen_q=a.seqlen, seqlen_k=a.seqlen,
                                    heads=a.heads, head_dim=a.head_dim, causal=a.causal,
                                    mode="fwd_bwd")
            return tflops_per_gpu(flops, self.prediction.ranks_per_problem,
                                  self.prediction.fwd_bwd_s)
        fwd, bwd = (statistics.fmean(
            tflops_per_gpu(_mask_flops(a, phase), p.ranks_per_problem, seconds(p))
            for a, p in zip(self.row.packed, self.packed))
            for phase, seconds in ((FWD, lambda p: p.fwd_s), (BWD, lambda p: p.bwd_s)))
        return fwd_bwd_rate(fwd, bwd)

    @property
    def fwd_ms(self) -> float:
        """Simulated FWD ms (under documents: the mean over the packings)."""
        return 1e3 * statistics.fmean(p.fwd_s for p in self.packed or (self.prediction,))

    @property
    def error(self) -> float:
        return self.predicted / self.row.published - 1


def _mask_flops(a: AttentionConfig, phase: str) -> float:
    """The FLOPs of ``phase`` over the mask's real (unpadded) area."""
    return problem_flops(batch=a.batch, seqlen=a.seqlen, heads=a.heads, head_dim=a.head_dim,
                         causal=a.causal, documents=a.documents, window=a.window_size,
                         mode=phase, v_head_dim=a.v_head_dim)[0]


def parse_options(name: str, text: str):
    """``k=v;k=v`` → the strategy's Options (true/false and integers read as such)."""
    cls = strategies.get(name)
    given = {}
    for item in filter(None, (p.strip() for p in (text or "").split(";"))):
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"option {item!r} is not key=value")
        value = value.strip()
        parsed: bool | int | str
        if value.lower() in _BOOL:
            parsed = _BOOL[value.lower()]
        elif value.lstrip("-").isdigit():
            parsed = int(value)
        else:
            parsed = value
        given[key.strip().replace("-", "_")] = parsed
    return strategies.make_options(cls, given)


def _flag(value: str | None, column: str, default: bool | None = None) -> bool:
    text = (value or "").strip().lower()
    if not text and default is not None:
        return default
    if text not in _FLAG:
        raise UsageError(f"{column} must be true or false, got {value!r}")
    return _FLAG[text]


def load(path: str) -> list[Row]:
    """The rows of a validation CSV, each checked; ValueError naming file:line otherwise."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in _REQUIRED if c not in (reader.fieldnames or ())]
        if missing:
            raise UsageError(f"{path}: missing column(s) {', '.join(missing)}; see "
                             f"configs/validation/seed001_a800_4x8.csv")
        rows = []
        for line, r in enumerate(reader, start=2):
            try:
                row = _row(r)
                model.build(row.strategy, row.options, row.attn, row.topo)  # it can run
            except (KeyError, ValueError, TypeError) as e:
                raise UsageError(f"{path}:{line}: {e}") from None
            rows.append(row)
    if not rows:
        raise UsageError(f"{path}: no rows")
    return rows


def _row(r: dict) -> Row:
    attention = dict(batch=int(r["batch"]), seqlen=int(r["seqlen"]), heads=int(r["heads"]),
                     kv_heads=int(r["kv_heads"]), head_dim=int(r["head_dim"]),
                     dtype=r["dtype"], causal=_flag(r["causal"], "causal"))
    spec = (r.get("documents") or "").strip() or None
    packings = int((r.get("packings") or "").strip() or 1)
    if packings < 1 or (packings > 1 and spec is None):
        raise UsageError(f"packings {packings}: give 1 or more, and more than 1 only with a "
                         f"documents distribution")
    packed = () if spec is None else packed_problems(
        {**attention, "documents": parse_documents(spec)}, 0, packings)
    attn = packed[0] if packed else AttentionConfig(**attention)
    gpn = int(r["gpus_per_node"])
    topo = Topology(world_size=int(r["nodes"]) * gpn, ranks_per_node=gpn)
    if not float(r["tflops"]) > 0:
        raise UsageError(f"tflops must be a positive number, got {r['tflops']!r}")
    fwd = r.get("fwd_ms") or ""
    return Row(r["implementation"], r["strategy"], parse_options(r["strategy"], r["options"]),
               attn, topo, float(r["tflops"]), float(fwd) if fwd.strip() else None,
               _flag(r.get("score"), "score", default=True),
               (r.get("note") or "").strip(), (r.get("kernel") or "").strip() or None,
               spec, packed)


def run(rows: list[Row], hw: Hardware) -> list[Result]:
    out = []
    for row in rows:
        preds = tuple(model.predict(row.strategy, row.options, a, row.topo, hw)
                      for a in row.packed or (row.attn,))
        out.append(Result(row, preds[0], preds if row.packed else ()))
    return out


def packing_lines(results: list[Result]) -> list[str]:
    """One line per documents spec the file's rows pack: how they were sampled and how
    their simulated figure is formed (``Result.predicted``)."""
    specs: dict[tuple[str, int], int] = {}
    for r in results:
        if r.row.documents:
            key = (r.row.documents, len(r.row.packed))
            specs[key] = specs.get(key, 0) + 1
    return [f"documents: {n} rows packed as --documents {spec}, {k} packings (seeds 0-{k - 1}"
            f"); FLOPs by the mask's real area, each phase's TFLOP/s the mean over the "
            f"packings, FWD+BWD 3.5 / (1/fwd + 2.5/bwd)" for (spec, k), n in specs.items()]


def ranked_pairs(results: list[Result]) -> list[tuple[Result, Result]]:
    """Pairs (same seqlen, mask, documents and topology, both scored) that published
    clearly ordered: the higher first, more than ``RANK_TOLERANCE`` above the lower."""
    scored = [r for r in results if r.row.scored]
    pairs = []
    for i, a in enumerate(scored):
        for b in scored[i + 1:]:
            if (a.row.attn.seqlen, a.row.attn.causal, a.row.topo, a.row.documents) != \
                    (b.row.attn.seqlen, b.row.attn.causal, b.row.topo, b.row.documents):
                continue
            hi, lo = (a, b) if a.row.published >= b.row.published else (b, a)
            if hi.row.published > lo.row.published * (1 + RANK_TOLERANCE):
                pairs.append((hi, lo))
    return pairs


def rank_violations(results: list[Result]) -> list[tuple[Result, Result]]:
    """The clearly ordered pairs (``ranked_pairs``) the simulator orders the other way."""
    return [(hi, lo) for hi, lo in ranked_pairs(results) if hi.predicted <= lo.predicted]


def samples(results: list[Result], hw: Hardware, table: str) -> list[str]:
    """Each row's ``IN_SAMPLE`` / ``HELD_OUT`` from the preset's ``fit:`` section (a preset
    with none was fitted to no published row: every row held out)."""
    if hw.fit is None:
        return [HELD_OUT] * len(results)
    return [hw.fit.sample(table, r.row.implementation, r.row.attn.seqlen) for r in results]


def _errors_line(results: list[Result], tolerance: float) -> str:
    errors = [abs(r.error) for r in results]
    worst = max(results, key=lambda r: abs(r.error))
    within = sum(e <= tolerance for e in errors)
    return (f"{within} of {len(errors)} within {100 * tolerance:.0f} %, median |error| "
            f"{100 * statistics.median(errors):.1f} %, worst {100 * abs(worst.error):.1f} % "
            f"({worst.row.implementation}, {worst.row.attn.seqlen})")


_MEANING = {IN_SAMPLE: "rows the preset's fit used", HELD_OUT: "rows nothing was fitted to"}


def summary(results: list[Result], sample: list[str], tolerance: float = 0.15) -> list[str]:
    """The headline: the error of the in-sample and of the held-out scored rows apart, and
    the ranking agreement (each pair in-sample, held out or mixed), with the pairs the
    simulator orders otherwise."""
    lines = []
    for label in (IN_SAMPLE, HELD_OUT):
        group = [r for r, s in zip(results, sample) if s == label and r.row.scored]
        if group:
            lines.append(f"error, {label} ({len(group)} {_MEANING[label]}): "
                         f"{_errors_line(group, tolerance)}")
    scored = [r for r in results if r.row.scored]
    if len(lines) > 1:
        lines.append(f"error, all ({len(scored)} scored rows): {_errors_line(scored, tolerance)}")
    where = {id(r): s for r, s in zip(results, sample)}

    def kind(pair):
        a, b = (where[id(r)] for r in pair)
        return a if a == b else "mixed"

    pairs, bad = ranked_pairs(results), rank_violations(results)
    head = (f"ranking (pairs at one sequence length published > {100 * RANK_TOLERANCE:.0f} "
            f"% apart): ")
    if not pairs:
        return lines + [head + "none"]
    split = []
    for k in (IN_SAMPLE, HELD_OUT, "mixed"):
        of = [p for p in pairs if kind(p) == k]
        if of:
            good = sum(hi.predicted > lo.predicted for hi, lo in of)
            split.append(f"{k} {good} of {len(of)}")
    lines.append(head + f"{len(pairs) - len(bad)} of {len(pairs)} ordered as published ("
                 + ", ".join(split) + ")" + ("; not:" if bad else ""))
    lines += [f"  {hi.row.attn.seqlen}: published {hi.row.implementation} "
              f"{hi.row.published:.1f} > {lo.row.implementation} {lo.row.published:.1f}, "
              f"simulated {hi.predicted:.1f} <= {lo.predicted:.1f} ({kind((hi, lo))})"
              for hi, lo in bad]
    return lines


def kernel_lines(results: list[Result], hw: Hardware) -> list[str]:
    """One line per kernel the file names other than the one simulated: those rows measure
    another kernel than the model prices."""
    other: dict[str, int] = {}
    for r in results:
        if r.row.scored and r.row.kernel and r.row.kernel != hw.kernel_name:
            other[r.row.kernel] = other.get(r.row.kernel, 0) + 1
    has = {name for name, _, _ in hw.kernel_choices}
    return [f"kernel: {n} scored rows were published with {k}, simulated with "
            f"{hw.kernel_name}" + (f" (--kernel {k})" if k in has else
                                   f" ({hw.name} has no {k} curves)")
            for k, n in sorted(other.items())]


def machine(results: list[Result], hw: Hardware, table: str, fmt: str,
            tolerance: float = 0.15) -> str:
    """``--validate --format csv|json``: one row per published row, its sample (in-sample,
    held out, or not scored, with the reason in ``note``); JSON adds the headline."""
    sample = samples(results, hw, table)
    rows = []
    for r, s in zip(results, sample):
        rows.append({
            "implementation": r.row.implementation, "cpbench": _label(r.row),
            "seqlen": r.row.attn.seqlen, "nodes": r.row.topo.num_nodes,
            "gpus_per_node": r.row.topo.ranks_per_node,
            "published_fwd_ms": r.row.published_fwd_ms,
            "simulated_fwd_ms": float(cells.sig(r.fwd_ms)),
            "published_tflops": r.row.published,
            "simulated_tflops": float(cells.sig(r.predicted)),
            "error_pct": round(100 * r.error, 1), "sample": s if r.row.scored else NOT_SCORED,
            "scored": r.row.scored, "note": r.row.note or None,
            "preset": hw.name, "kernel": hw.kernel_name, "published_kernel": r.row.kernel})
    if fmt == "json":
        return json.dumps({"table": table, "preset": hw.name, "kernel": hw.kernel_name,
                           "rows": rows, "summary": summary(results, sample, tolerance)
                           + kernel_lines(results, hw) + packing_lines(results)},
                          indent=1) + "\n"
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


NOT_SCORED = "not scored"


def stated_error(hw: Hardware) -> ModelError | None:
    """The model's error on ``hw`` as its validation states it: the held-out rows' median
    |error| of the preset's ``evidence:`` (``Hardware.stated_error``, which a test holds
    equal to what ``--validate`` scores); None for a preset validated on no held-out row."""
    if hw.stated_error is None:
        return None
    return ModelError(hw.stated_error, f"median |error| {100 * hw.stated_error:.1f} % held "
                                       f"out; {hw.evidence}")


def report(results: list[Result], hw: Hardware, table: str, tolerance: float = 0.15,
           fmt: str = "table") -> str:
    """The table (each row labelled in-sample / held out from the preset's ``fit:``), then
    the headline: error and ranking agreement, per sample; ``fmt`` csv or json: the rows as
    data (``machine``)."""
    if fmt in ("csv", "json"):
        return machine(results, hw, table, fmt, tolerance)
    sample = samples(results, hw, table)
    rows = []
    for r, s in zip(results, sample):
        rows.append({
            "Implementation": r.row.implementation, "cpbench": _label(r.row),
            "Seq Len": str(r.row.attn.seqlen), "Nodes×GPUs": r.row.topo.describe(),
            "FWD (ms) pub / sim": f"{_num(r.row.published_fwd_ms)} / "
                                  f"{cells.sig(r.fwd_ms)}",
            "TFLOPs/s published": f"{r.row.published:.2f}",
            "TFLOPs/s simulated": cells.sig(r.predicted),
            "Rel. error": f"{100 * r.error:+.1f} %",
            "Sample": s if r.row.scored else NOT_SCORED,
        })
    fit = "" if hw.fit is None else f"; shaped by {hw.fit.file} (in-sample)"
    lines = [f"Validation against published rows ({table}) — simulated on {hw.name}{fit}",
             *tables.render(None, rows, "table", _FIT), *summary(results, sample, tolerance),
             *kernel_lines(results, hw), *packing_lines(results)]
    notes = [(r.row.implementation, r.row.attn.seqlen, r.row.note) for r in results if r.row.note]
    if hw.fit is not None:
        notes += [(i, s, f"in-sample: {w}") for i, s, w in hw.fit.measured_on
                  if any((r.row.implementation, r.row.attn.seqlen) == (i, s)
                         and hw.fit.sample(table, i, s) == IN_SAMPLE for r in results)]
    if notes:
        lines += ["notes:"] + [f"  {impl} {s}: {n}" for impl, s, n in notes]
    return "\n".join(prose(lines)) + "\n"


_FIT = Fit(lift=("Nodes×GPUs",), wrap=("Implementation", "cpbench"), drop=("FWD (ms) pub / sim",),
           short={"TFLOPs/s published": "TFLOPs/s pub", "TFLOPs/s simulated": "TFLOPs/s sim"})


def _label(row: Row) -> str:
    opts = {k: v for k, v in dataclasses.asdict(row.options).items()
            if v != getattr(type(row.options)(), k)}
    return row.strategy + (" " + " ".join(f"{k}={v}" for k, v in opts.items()) if opts else "")


def _num(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def evidence(hw: Hardware, files: list[str]) -> dict:
    """A preset's ``evidence:`` figures for its kernel: the scored rows of ``files``, how
    many in-sample and held out, and each group's median |error| in percent (one decimal),
    as ``report`` scores them."""
    errors: dict[str, list[float]] = {IN_SAMPLE: [], HELD_OUT: []}
    for path in files:
        results = run(load(path), hw)
        for r, s in zip(results, samples(results, hw, path)):
            if r.row.scored:
                errors[s].append(abs(r.error))
    out: dict = {"rows": sum(map(len, errors.values()))}
    for key, label in (("in_sample", IN_SAMPLE), ("held_out", HELD_OUT)):
        out[key] = len(errors[label])
        if errors[label]:
            out[f"{key}_median"] = round(100 * statistics.median(errors[label]), 1)
    return out
