"""``cpbench simulate --self-check``: the simulator against fresh measurements on this machine.

``cpbench run --nproc N`` measures every strategy (and variant) at each sequence length; the
model predicts the same cases on the same topology from a preset (``cpbench calibrate``'s
for this machine). Nothing is fitted here: the preset is taken as given. What makes the
verdict repeatable on a shared virtual machine:

- rounds: every length is measured ``rounds`` times, the order reversed each round, so a
  drift lands on every length alike; a row's figure is its fastest iteration (the slowest
  rank's) over the rounds, the statistic ``cpbench calibrate`` takes (see its docstring), and
  the spread of the rounds gives the interval the noise allows;
- a probe before and after each length (``calibrate.probe_ms``: one block's forward with every
  rank busy and with one alone) says whether the machine is still the one the preset
  measured: a host that now runs both ranks on one core's hyperthreads, or a slower clock,
  moves every time. A measurement whose probes moved beyond ``drift_limit`` is taken again
  (up to ``TRIES`` times), then dropped and said;
- the load meter (``bench.load``): when other processes took more than ``load_limit`` of the
  cores while it measured, the check prints its table but refuses to score.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
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
    rounds_ms: tuple[float, ...]  # each round's fastest iteration (slowest rank)

    @property
    def measured_ms(self) -> float:
        return min(self.rounds_ms)

    @property
    def error(self) -> float:
        """(predicted − measured) / measured."""
        return self.predicted_ms / self.measured_ms - 1

    @property
    def interval(self) -> tuple[float, float]:
        """The errors against the slowest and the fastest round: what the noise allows."""
        return (self.predicted_ms / max(self.rounds_ms) - 1,
                self.predicted_ms / min(self.rounds_ms) - 1)


@dataclass
class Measured:
    records: list[dict] = field(default_factory=list)
    probes: list[str] = field(default_factory=list)  # one line per length measured
    dropped: list[str] = field(default_factory=list)  # lengths the probes never let through
    load: Load | None = None


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
    """One length's records, taken again while the probes around them moved too far."""
    seqlen, nproc = attention["seqlen"], run.nproc
    assert nproc is not None, "the self-check runs --nproc"
    for attempt in range(1, TRIES + 1):
        before = _probe(attention, nproc)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, f"{seqlen}.jsonl")
            p = planning.plan(dataclasses.replace(run, out=path), attention, options,
                              launcher="self")
            with _stdout_to_stderr():
                entry.launch(p)
            records = ok_records(results.read_from(path, 0))
        after = _probe(attention, nproc)
        moved = max(drift(hw, attention, *before), drift(hw, attention, *after))
        got.probes.append(f"{seqlen}: probe {before[0]:.1f}/{before[1]:.1f} ms before, "
                          f"{after[0]:.1f}/{after[1]:.1f} ms after (busy/alone), "
                          f"{moved * 100:.0f} % off the preset, try {attempt}")
        print(f"self-check: {got.probes[-1]}", file=sys.stderr, flush=True)
        if moved <= limits.drift:
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
    with Meter() as meter:
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
    got.load = meter.load
    return got


def block_sides(attention: dict, seqlens, nproc: int) -> tuple[int, ...]:
    """The kernel blocks' sides sqrt(seqlen_q · seqlen_k) that every own strategy's schedule
    (each variant) declares at these lengths on ``nproc`` local ranks: where ``cpbench
    calibrate`` measures the curve for a self-check, so no block is priced between points."""
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


def _best(samples_by_rank) -> float:
    return min(metrics.slowest_per_iter(samples_by_rank))


def compare(records: list[dict], hw: Hardware) -> tuple[list[Row], list[str]]:
    """Predicted vs measured per case and phase, on each record's own topology (records of
    the same case are its rounds); and the cases the model cannot predict, with why."""
    cases: dict[tuple, list[dict]] = {}
    for r in records:
        cases.setdefault((labels.row_label(r), r["config"]["attention"]["seqlen"]), []).append(r)
    rows, skipped = [], []
    for (label, seqlen), rounds in cases.items():
        cfg, topo = rounds[0]["config"], rounds[0]["topology"]
        cls = strategies.get(cfg["strategy"])
        if cls.upstream is not None:  # a library's own code: no declared schedule to price
            skipped.append(f"{label} at {seqlen}: runs {cls.upstream.package}'s own code; "
                           f"the simulator models its twin, {cls.upstream.twin or 'none'}")
            continue
        try:
            p = model.predict(cfg["strategy"], cls.Options(**cfg["options"]),
                              AttentionConfig(**cfg["attention"]),
                              Topology(world_size=topo["world_size"],
                                       ranks_per_node=topo["ranks_per_node"]), hw)
        except UsageError as e:
            skipped.append(f"{label} at {seqlen}: {e}")
            continue
        for phase, key, predicted in (("FWD", "fwd", p.fwd_s), ("FWD+BWD", "fwd_bwd",
                                                                p.fwd_bwd_s)):
            measured = [_best(r["samples_ms"][key]) for r in rounds if r["samples_ms"].get(key)]
            if measured:
                rows.append(Row(label, cfg["strategy"], seqlen, phase, predicted * 1e3,
                                tuple(measured)))
    return rows, skipped
