"""``cpbench simulate --self-check``: the simulator against fresh measurements on this machine.

``cpbench run --nproc N`` measures every strategy (and variant) at each sequence length; the
model predicts the same cases on the same topology from a preset (``cpbench calibrate``'s
for this machine). Nothing is fitted here: the preset is taken as given. What makes the
score out of sample:

- the preset's kernel curve is measured at block sides other than the check's own
  (``cpbench calibrate``'s default grid avoids every side ``block_sides`` lists); a row with
  a block at a side the preset measured (a preset calibrated with ``--sides`` holding them)
  is in-sample and scored apart;
- ``local`` (the kernel alone, the curve's own subject) and a case whose schedule the model
  cannot tell from an earlier case's (on 2 ranks usp ulysses_degree=1 is the zigzag ring,
  usp ulysses_degree=2 is Ulysses, megatron-cp-a2a+p2p is megatron-cp) are shown, not scored;
- a row's figure is the median over its rounds' iterations (each the slowest rank's), as
  ``cpbench run --rounds`` reports it; the error against the fastest iteration (the statistic
  ``cpbench calibrate`` takes) is shown beside it.

What makes the verdict repeatable on a shared virtual machine:

- rounds: every length is measured ``rounds`` times, the order reversed each round, so a
  drift lands on every length alike; the spread of the rounds' medians gives the interval
  the noise allows;
- a probe before and after each length (``calibrate.probe_ms``: one block's forward with every
  rank busy and with one alone) says whether the machine is still the one the preset
  measured: a host that now runs both ranks on one core's hyperthreads, or a slower clock,
  moves every time. A measurement whose probes moved beyond ``drift_limit`` is taken again
  (up to ``TRIES`` times), then dropped and said;
- the load meter (``bench.load``), read around each length and kept in its records
  (``env.selfcheck``): when other processes took more than ``load_limit`` of the cores while
  a length was measured, or while the preset was calibrated, the check prints its table but
  refuses to score; re-reading saved records (``--measured``) applies the same rule to the
  readings they carry, and refuses records without one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, field

from cpbench import metrics, results, strategies
from cpbench.bench import entry
from cpbench.bench import plan as planning
from cpbench.bench.load import Load, Meter
from cpbench.config import AttentionConfig, RunConfig
from cpbench.errors import UsageError
from cpbench.report import labels
from cpbench.sim import model
from cpbench.sim.hardware import Hardware
from cpbench.sim.provenance import HELD_OUT, IN_SAMPLE
from cpbench.topology import Topology

TRIES = 3
SEQLENS = (2048, 4096, 8192)  # the check's default lengths
HEADS = 2  # and heads (``cpbench calibrate``'s CPU default: the preset's own problem)


@dataclass(frozen=True)
class Row:
    label: str
    strategy: str
    seqlen: int
    phase: str  # "FWD" or "FWD+BWD"
    predicted_ms: float
    rounds_ms: tuple[float, ...]  # each round's median iteration (slowest rank)
    median_ms: float  # over every round's iterations: what cpbench run --rounds reports
    fastest_ms: float  # the fastest iteration over the rounds: calibrate's statistic
    sample: str = HELD_OUT  # IN_SAMPLE: a block at a side the preset's kernel measured
    excluded: str | None = None  # why the row is shown but not scored

    @property
    def measured_ms(self) -> float:
        return self.median_ms

    @property
    def error(self) -> float:
        """(predicted − measured) / measured, against the median."""
        return self.predicted_ms / self.median_ms - 1

    @property
    def error_fastest(self) -> float:
        return self.predicted_ms / self.fastest_ms - 1

    @property
    def interval(self) -> tuple[float, float]:
        """The errors against the slowest and the fastest round's median: what the noise
        allows."""
        return (self.predicted_ms / max(self.rounds_ms) - 1,
                self.predicted_ms / min(self.rounds_ms) - 1)


@dataclass
class Measured:
    records: list[dict] = field(default_factory=list)
    probes: list[str] = field(default_factory=list)  # one line per length measured
    dropped: list[str] = field(default_factory=list)  # lengths the probes never let through
    load: Load | None = None  # over the whole check
    # others' share of the cores while each length was measured (None: no reading)
    length_loads: list[tuple[int, float | None]] = field(default_factory=list)
    loads: list[Load | None] = field(default_factory=list)  # every try's reading
    saved: bool = False  # re-read from an earlier check's records (--measured)


@dataclass(frozen=True)
class Limits:
    load: float = 0.10  # others' share of the cores
    drift: float = 0.10  # the probe against the preset, relative


DEFAULT_LIMITS = Limits()


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


def _probe(attention: dict, nproc: int) -> tuple[float, float]:
    from cpbench.launch import run_ranks
    from cpbench.sim.calibrate import Spec, probe_ms

    spec = Spec(device="cpu", dtype=attention["dtype"], heads=attention["heads"],
                head_dim=attention["head_dim"], sides=(), ranks_per_node=nproc, iters=5)
    return run_ranks(probe_ms, nproc, spec, timeout=None)[0]


def drift(hw: Hardware, attention: dict, busy_ms: float, alone_ms: float) -> float:
    """The probe's largest relative gap to the preset's own probe (``cpbench calibrate``):
    its busy forward, per FLOP, and its idle speed-up. A preset without one (a GPU's) is
    compared on its kernel curve and idle speed-up."""
    from cpbench.sim.calibrate import PROBE_SIDE

    flops = metrics.attention_flops(batch=1, seqlen_q=PROBE_SIDE, seqlen_k=PROBE_SIDE,
                                    heads=attention["heads"], head_dim=attention["head_dim"],
                                    causal=False)
    if hw.probe is not None:
        ref_flops = metrics.attention_flops(batch=1, seqlen_q=hw.probe.side,
                                            seqlen_k=hw.probe.side, heads=hw.probe.heads,
                                            head_dim=hw.probe.head_dim, causal=False)
        ref_ms, ref_ratio = hw.probe.busy_ms * flops / ref_flops, \
            hw.probe.busy_ms / hw.probe.alone_ms
    else:
        ref_ms = flops / (hw.kernel_fwd.tflops(PROBE_SIDE) * 1e12) * 1e3 + \
            hw.step_overhead_us / 1e3
        ref_ratio = hw.idle_speedup
    return max(abs(busy_ms / ref_ms - 1), abs((busy_ms / alone_ms) / ref_ratio - 1))


def _one_length(run: RunConfig, attention: dict, options: dict, hw: Hardware,
                limits: Limits, got: Measured) -> list[dict]:
    """One length's records, taken again while the probes around them moved too far; each
    carries the load meter's reading and the probe of its length (``env.selfcheck``)."""
    seqlen, nproc = attention["seqlen"], run.nproc
    assert nproc is not None, "the self-check runs --nproc"
    for attempt in range(1, TRIES + 1):
        with Meter() as meter:
            before = _probe(attention, nproc)
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, f"{seqlen}.jsonl")
                p = planning.plan(dataclasses.replace(run, out=path), attention, options,
                                  launcher="self")
                entry.launch(p)
                records = ok_records(results.read_from(path, 0))
            after = _probe(attention, nproc)
        moved = max(drift(hw, attention, *before), drift(hw, attention, *after))
        share = None if meter.load is None else meter.load.share
        got.probes.append(f"{seqlen}: probe {before[0]:.1f}/{before[1]:.1f} ms before, "
                          f"{after[0]:.1f}/{after[1]:.1f} ms after (busy/alone), "
                          f"{moved * 100:.0f} % off the preset, try {attempt}; load "
                          + ("unknown" if share is None else f"{share * 100:.1f} %"))
        print(f"self-check: {got.probes[-1]}", file=sys.stderr, flush=True)
        got.loads.append(meter.load)
        if moved <= limits.drift:
            got.length_loads.append((seqlen, share))
            for record in records:  # before they are written: a re-read judges them too
                record["env"]["selfcheck"] = {
                    "load_share": share,
                    "wall_s": None if meter.load is None else meter.load.wall_s,
                    "probe": got.probes[-1], "drift": moved}
            return records
    got.dropped.append(f"{seqlen}: the machine's probe stayed more than "
                       f"{limits.drift * 100:.0f} % off the preset in {TRIES} tries")
    return []


def measure(names: tuple[str, ...], attention: dict, options: dict, seqlens: list[int], *,
            nproc: int, warmup: int, iters: int | None, rounds: int, hw: Hardware,
            limits: Limits = DEFAULT_LIMITS, out: str | None = None) -> Measured:
    """``cpbench run --nproc`` at each length, ``rounds`` times (``iters`` None: per length,
    ``auto_iters``); the records that ran (also appended to ``out`` when given, so a later
    check can re-read them)."""
    got = Measured()
    # the ranks' own tables to stderr: the forkserver the first probe starts keeps the fd 1
    # it was started with, so the whole loop runs redirected
    with _stdout_to_stderr():
        for r in range(rounds):
            for seqlen in (seqlens if r % 2 == 0 else seqlens[::-1]):
                problem = {**attention, "seqlen": seqlen}
                run = RunConfig(strategy=names, nproc=nproc, warmup=warmup,
                                iters=iters or auto_iters(problem, nproc, hw))
                records = _one_length(run, problem, options, hw, limits, got)
                got.records += records
                if out is not None:
                    for record in records:
                        results.append(out, record)
    readings = [x for x in got.loads if x is not None]
    if readings and len(readings) == len(got.loads):  # the whole check, every try
        got.load = Load(sum(x.foreign_cpu_s for x in readings),
                        sum(x.wall_s for x in readings), readings[0].cpus)
    return got


def from_records(records: list[dict]) -> Measured:
    """What saved records say of how they were measured: their lengths' load readings and
    probes (``env.selfcheck``; a record without one counts as unknown)."""
    got = Measured(records=records, saved=True)
    seen = set()
    for r in records:
        mark = r["env"].get("selfcheck") or {}
        key = mark.get("probe") or id(r)
        if key in seen:
            continue
        seen.add(key)
        if mark.get("probe"):
            got.probes.append(mark["probe"])
        got.length_loads.append((r["config"]["attention"]["seqlen"], mark.get("load_share")))
    return got


def block_sides(attention: dict, seqlens, nproc: int) -> tuple[int, ...]:
    """The kernel blocks' sides sqrt(seqlen_q · seqlen_k) that every own strategy's schedule
    (each variant) declares at these lengths on ``nproc`` local ranks: the sides ``cpbench
    calibrate``'s default curve keeps away from, so the check is scored out of sample."""
    from cpbench.bench.cases import expand_cases
    from cpbench.errors import Skipped

    topo = Topology(world_size=nproc, ranks_per_node=1)
    sides = set()
    for case in expand_cases(("all",), {}, topo):
        if strategies.get(case.strategy).upstream is not None:
            continue
        for seqlen in seqlens:
            try:
                c = model.compiled_for(case.strategy, case.options,
                                       AttentionConfig(**{**attention, "seqlen": seqlen}),
                                       topo)
            except (Skipped, UsageError):
                continue
            scale = seqlen / c.seqlen
            sides |= {round(r.side * scale) for step in c.steps for r in step.ranks if r.side}
    return tuple(sorted(sides))


AUTO_SECONDS = 1.0  # timed work a case gets with iters=None


def auto_iters(attention: dict, nproc: int, hw: Hardware) -> int:
    """Enough iterations that a case times about ``AUTO_SECONDS`` of the baseline's work (3 at
    least): a short case gets more draws at the machine's undisturbed speed."""
    local = model.predict("local", strategies.get("local").Options(),
                          AttentionConfig(**attention),
                          Topology(world_size=nproc, ranks_per_node=1), hw)
    return max(3, min(30, math.ceil(AUTO_SECONDS / local.fwd_bwd_s)))


def ok_records(records: list[dict]) -> list[dict]:
    """The measured rows that ran to completion (no predictions)."""
    return [r for r in records if r["status"] == results.OK
            and not r.get("env", {}).get("simulated") and not r["env"].get("kernel_bench")]


def _sample(steps, hw: Hardware) -> str:
    """``IN_SAMPLE`` when a kernel block of the schedule has a side the preset's curve was
    measured at (the curve then gives back that measurement), else ``HELD_OUT``."""
    points = {side for curve in hw.curves() for side, _ in curve.points}
    sides = {r.side for step in steps for r in step.ranks if r.side}
    return IN_SAMPLE if any(abs(s - p) < 1 for s in sides for p in points) else HELD_OUT


def _predicted(record: dict, hw: Hardware):
    """(prediction, the compiled schedule's steps) of a record's case."""
    cfg, topo = record["config"], record["topology"]
    cls = strategies.get(cfg["strategy"])
    args = (cfg["strategy"], cls.Options(**cfg["options"]), AttentionConfig(**cfg["attention"]),
            Topology(world_size=topo["world_size"], ranks_per_node=topo["ranks_per_node"]))
    return model.predict(*args, hw), model.compile_schedule(*args).steps


def compare(records: list[dict], hw: Hardware) -> tuple[list[Row], list[str]]:
    """Predicted vs measured per case and phase, on each record's own topology (records of
    the same case are its rounds); and the cases the model cannot predict, with why. A row
    says whether the preset measured one of its blocks (``sample``) and why it is not scored
    (``excluded``): the no-CP baseline, or a schedule identical to an earlier case's."""
    cases: dict[tuple, list[dict]] = {}
    for r in records:
        cases.setdefault((labels.row_label(r), r["config"]["attention"]["seqlen"]), []).append(r)
    rows, skipped = [], []
    first: dict[tuple, str] = {}  # (problem, topology, schedule) -> the first case's label
    for (label, seqlen), rounds in cases.items():
        cfg = rounds[0]["config"]
        cls = strategies.get(cfg["strategy"])
        if cls.upstream is not None:  # a library's own code: no declared schedule to price
            skipped.append(f"{label} at {seqlen}: runs {cls.upstream.package}'s own code; "
                           f"the simulator models its twin, {cls.upstream.twin or 'none'}")
            continue
        try:
            p, steps = _predicted(rounds[0], hw)
        except UsageError as e:
            skipped.append(f"{label} at {seqlen}: {e}")
            continue
        key = (str(sorted(cfg["attention"].items())), str(rounds[0]["topology"]), steps)
        excluded = None
        if rounds[0]["ranks_per_problem"] == 1:
            excluded = "no CP: the kernel alone, what the preset's curve measures"
        elif key in first:
            excluded = f"the same schedule as {first[key]}: counted once"
        first.setdefault(key, label)
        for phase, name, predicted in (("FWD", "fwd", p.fwd_s), ("FWD+BWD", "fwd_bwd",
                                                                 p.fwd_bwd_s)):
            per_round = [metrics.slowest_per_iter(r["samples_ms"][name]) for r in rounds
                         if r["samples_ms"].get(name)]
            if per_round:
                pooled = [t for it in per_round for t in it]
                rows.append(Row(label, cfg["strategy"], seqlen, phase, predicted * 1e3,
                                tuple(statistics.median(it) for it in per_round),
                                statistics.median(pooled), min(pooled), _sample(steps, hw),
                                excluded))
    return rows, skipped
