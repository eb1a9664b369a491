"""The benchmark driver behind ``cpbench run`` and ``torchrun -m cpbench.run``.

1. ``bench.plan`` validates everything before any process group exists (see there).
2. ``bench.entry``: ``launch`` (``--nproc``: local gloo ranks, ``cpbench.launch.run_ranks``) or
   ``torchrun_main`` (init from torchrun's environment: nccl on CUDA, gloo on CPU). Every
   process group, the strategies' subgroups included, times out after the case's collective
   timeout: ``--collective-timeout``, or by default one derived per case from a pessimistic
   estimate of its step time, at least 60 s (``bench.plan.case_waits``).
3. ``rank_main`` on every rank, per (strategy, options) case: build the strategy (its groups),
   ``--check`` against the float64 reference, build this rank's input shard straight from
   the seed, time FWD and gather its samples, time FWD+BWD and gather its samples (each
   timed step's bytes counted: ``bench.sentcount``), then measure peak memory
   (``bench.memory``), time the ideal block alone (``bench.ideal``) and, with
   ``--profile``, profile a few steps (``bench.profiling``), each a step of its own (a
   failure there keeps the timings); on rank 0 append the record and print (``bench.runlog``).

Every phase ends with all ranks agreeing on its outcome (``bench.agreement``), so an OOM or
an exception in one case becomes that row's status on every rank and the run goes on.

A rank failing inside a strategy's communication breaks the group instead; what follows
(formed again on gloo, the run stopped on NCCL) is ``bench.recovery``'s.

The driver never names a strategy: names, options, variants, ``ranks_per_problem`` and the
resolved options (``resolved_options()``) come from the registry and the strategy objects.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from typing import Any, Callable

import torch

from cpbench import kernels, results, strategies, threadmail, topology
from cpbench.bench import (
    agreement,
    eta,
    ideal,
    memory,
    profiling,
    recovery,
    runlog,
    sentcount,
    steps,
    timer,
)
from cpbench.bench import env as env_mod
from cpbench.bench.check import check_strategy, sink_logits
from cpbench.bench.plan import Case, Plan
from cpbench.config import RunConfig
from cpbench.report import console
from cpbench.strategies.base import Strategy

log = logging.getLogger("cpbench")


# -- 3. on every rank ------------------------------------------------------------------------

def rank_inputs(strat, p: Plan, rank: int) -> dict:
    """This rank's shard, drawn straight from the seed at the shard's shape (never a global
    tensor: at S = 1M the global q alone would not fit on one rank)."""
    a, dev = p.attn, p.run.device
    gen = torch.Generator(device=dev).manual_seed(p.run.seed * 100_003 + rank)
    s = strat.local_seqlen

    def rand(name):
        t = torch.randn(a.batch, s, *a.widths[name], generator=gen, device=dev,
                        dtype=a.torch_dtype)
        return t.requires_grad_(name != "dout")

    x = {name: rand(name) for name in ("q", "k", "v", "dout")}
    if a.sinks:  # the same on every rank: one parameter, replicated
        x["sinks"] = sink_logits(a, torch.Generator().manual_seed(p.run.seed)).to(
            dev).requires_grad_()
    return x


def _counts(run: RunConfig) -> tuple[int, int]:
    """(warmup, iters) of the plan's run, which RunConfig.resolved filled."""
    assert run.warmup is not None and run.iters is not None, "a resolved RunConfig"
    return run.warmup, run.iters


def _barrier(device: str) -> Callable[[], None]:
    import torch.distributed as dist

    if device == "cuda":
        return lambda: dist.barrier(device_ids=[torch.cuda.current_device()])
    return dist.barrier


@dataclasses.dataclass
class _CaseRun:
    """One case on this rank: its phases, each agreed on by every rank."""

    p: Plan
    case: Case
    rank: int
    phase: agreement.Agreement
    status: Callable[[str], None]
    grace_s: float | None = None  # see agreement.Agreement
    timeout_s: float | None = None  # the groups' collective timeout in this case
    strat: Strategy | None = None
    inputs: dict | None = None
    sent: dict = dataclasses.field(default_factory=dict)  # phase -> sentcount.StepBytes
    pace: steps.Pace = dataclasses.field(default_factory=lambda: steps.Pace(None))
    load: dict | None = None  # the record's sections measured while timing (rank 0)
    timing: dict | None = None

    @property
    def built(self) -> Strategy:
        """The strategy build() made: a phase after it runs only once it has."""
        assert self.strat is not None, "built: the phases after build() run only then"
        return self.strat

    def build(self) -> tuple[dict | None, dict | None]:
        """(the options as resolved, the library that runs: see Strategy.provenance)."""
        def build():
            cls = strategies.get(self.case.strategy)
            topo = dataclasses.replace(self.p.topo, group_timeout_s=self.timeout_s)
            self.strat = cls(self.p.attn_of(self.case), topo, self.rank,
                             kernel=kernels.get(self.p.kernel_of(self.case)),
                             options=self.case.options)
            return self.strat.resolved_options(), self.strat.provenance()

        self.status("building groups")
        return self.phase(build) or (None, None)

    def check(self, ref_cache: dict) -> list[dict] | None:
        self.status("checking against the float64 reference")
        run = self.p.run
        return self.phase(lambda: [dataclasses.asdict(c) for c in check_strategy(
            self.built, run.seed, device=run.device, cache=ref_cache)])

    def time(self, store, key: str) -> tuple[dict, Callable[[], None] | None]:
        """Samples per phase, each iteration's forward and backward timed apart within one
        step (``bench.steps``), gathered once timed; and the closure the memory step
        measures. A step that ran out of memory leaves the forward timed alone, a phase of
        its own, so the row keeps its FWD (as an OOM in a backward always did)."""
        run = self.p.run
        self.status("drawing this rank's inputs")
        self.inputs = self.phase(lambda: rank_inputs(self.strat, self.p, self.rank))
        if self.inputs is None:
            return {"fwd": None, "fwd_bwd": None}, None
        fwd, fwd_keep, bwd = steps.closures(self.built, self.inputs)
        if not self.p.timed:
            return self._untimed(fwd, steps.whole(fwd_keep, bwd))
        warmup, iters = _counts(run)
        self.sent = {"fwd": sentcount.StepBytes(self.built, warmup)}
        if not run.fwd_only:
            self.sent["bwd"] = sentcount.StepBytes(self.built, warmup)
        parts = [self.sent["fwd"].wrap(fwd)] if run.fwd_only else \
            [self.sent["fwd"].wrap(fwd_keep), self.sent["bwd"].wrap(bwd)]
        self.status(f"timing {'FWD' if run.fwd_only else 'FWD and BWD'}")
        tm = timer.Timer(run.device, _barrier(run.device), steps.agree_max(run.device))
        with steps.meter(self.rank, self.p.launcher) as m:
            got = self.phase(lambda: tm.measure_steps(
                parts, settle=timer.warmup_rule(warmup, iters), iters=iters,
                progress=lambda *word: self.status(self.pace.step(*word))))
        self.load = steps.load_section(m, self.p.ranks_per_node if self.p.launcher ==
                                       "torchrun" else self.p.world_size)
        samples: dict = {"fwd": None, "fwd_bwd": None}
        if got is not None:  # else the phase failed on some rank: no collective follows
            for sent in self.sent.values():
                sent.warmup = got.warmup  # the timed calls follow the warm-up steps run
            self.timing = steps.timing_section(got, run, split=len(parts) > 1)
            everyone = self.phase(lambda: timer.gather_samples(steps.flat(got), run.device))
            samples = steps.samples_of(everyone, iters) if everyone else samples
        elif not run.fwd_only and self.phase.status == results.OOM and not self.phase.broken:
            samples["fwd"] = self._forward_alone(fwd, store, key)
        return samples, fwd if run.fwd_only else steps.whole(fwd_keep, bwd)

    def _forward_alone(self, fwd: Callable[[], None], store, key: str
                       ) -> list[list[float]] | None:
        """FWD timed alone after the step ran out of memory (a phase of its own)."""
        run = self.p.run
        warmup, iters = _counts(run)
        self.status("timing FWD alone (FWD+BWD ran out of memory)")
        ph = agreement.Agreement(run.device, store, f"{key}/fwd", self.grace_s, self.phase.case)
        tm = timer.Timer(run.device, _barrier(run.device))
        mine = ph(lambda: tm.measure(fwd, warmup=warmup, iters=iters))
        return ph(lambda: timer.gather_samples(mine, run.device))

    def _untimed(self, fwd, fwd_bwd) -> tuple[dict, None]:
        """Ranks as threads sharing one device (``Plan.timed``): one untimed step of each
        phase through the timed path, its bytes counted; no samples, nothing to measure."""
        for phase, what, step in (("fwd", "FWD", fwd), ("fwd_bwd", "FWD+BWD", fwd_bwd)):
            if step is None or (phase == "fwd_bwd" and self.p.run.fwd_only):
                continue
            self.status(f"one untimed {what} step")
            self.sent[phase] = sentcount.StepBytes(self.built, 0)
            self.phase(self.sent[phase].wrap(step))
        return {"fwd": None, "fwd_bwd": None}, None

    def comm(self) -> tuple[dict | None, dict | None]:
        """The record's ``comm`` and ``sizes`` sections (a collective: every rank's figures):
        the bytes each timed step sent and what the schedule declares; the world this rank
        ran in, its CP ring's size and the tokens of its shard."""
        import torch.distributed as dist

        everyone = self.phase(lambda: timer.gather_samples(
            sentcount.figures(self.sent, self.built) + [
                dist.get_world_size(), self.built.cp_size, self.built.local_seqlen],
            self.p.run.device)) if self.sent else None
        if everyone is None:
            return None, None
        how = sentcount.how_counted(self.built, _counts(self.p.run)[0], timed=self.p.timed)
        return (results.comm_section([r[:6] for r in everyone], how),
                {k: [int(r[i]) for r in everyone]
                 for i, k in enumerate(("world", "cp", "local_seqlen"), 6)})

    def memory(self, step: Callable[[], None] | None, store, key: str
               ) -> tuple[agreement.Agreement, list[int] | None]:
        """Peak memory per rank as its own phase (its own status: the timings stay)."""
        inputs = self.inputs
        assert step is not None and inputs is not None, "after time() succeeded"
        self.status("measuring memory")
        dev = self.p.run.device
        mem = agreement.Agreement(dev, store, f"{key}/memory", self.grace_s, self.phase.case)
        peak = mem(lambda: memory.peak_bytes(step, device=dev, inputs=inputs.values()))
        return mem, mem(lambda: [int(v[0]) for v in timer.gather_samples([peak], dev)])

    def ideal(self, store, key: str) -> tuple[agreement.Agreement, dict]:
        """The case's ideal block timed alone on rank 0 (``bench.ideal``; the others wait,
        so nothing shares its device or CPUs) as a phase of its own: the record's
        ``ideal`` section, or why there is none."""
        self.status("timing the ideal block alone")
        p, run, case = self.p, self.p.run, self.case
        ph = agreement.Agreement(run.device, store, f"{key}/ideal", self.grace_s, self.phase.case)
        section = ph(lambda: ideal.measure(
            p.attn_of(case), self.built.ranks_per_problem, p.kernel_of(case), run)
            if self.rank == 0 else None)
        return ph, section if ph.status == results.OK else {"none": f"{ph.status}: {ph.error}"}

    def profile(self, step: Callable[[], None] | None, store, key: str, index: int
                ) -> tuple[agreement.Agreement, dict]:
        """A few profiled steps as their own phase (a failure leaves the timings): the
        record's ``profile`` section, or its error."""
        self.status("profiling")
        run = self.p.run
        assert step is not None and run.profile is not None, "after time(), under --profile"
        prof = agreement.Agreement(run.device, store, f"{key}/profile", self.grace_s,
                                   self.phase.case)
        paths = profiling.trace_paths(run.profile, index, self.case.strategy,
                                      self.p.world_size, self.p.keys()[index - 1])
        mine = prof(lambda: profiling.profile_rank(step, path=paths[self.rank],
                                                   device=run.device,
                                                   barrier=_barrier(run.device)))
        everyone = prof(lambda: profiling.gather(mine))
        if everyone is None:
            return prof, {"error": prof.error or "not profiled", "traces": paths}
        return prof, profiling.section(everyone, paths)


def run_case(p: Plan, case: Case, rank: int, env: dict, ref_cache: dict, *, store=None,
             key: str = "", prefix: str = "", index: int = 1) -> tuple[dict, str | None]:
    """Every phase of case ``index`` (1-based) on this rank (collective): (the record,
    complete on rank 0; None, or what broke: "group" or "device", a sticky CUDA error).
    Rank 0 shows its progress meanwhile (``report.console.Ticker``)."""
    grace_s: float | None  # None: no grace (below)
    timeout_s, grace_s = p.waits[index - 1]
    # NCCL: closing a communicator does not free the peers blocked on it; they wait out the
    # timeout, so a failing rank waits for them as long (no grace)
    # (ranks as threads: a failing rank gives up on its world and its peers' waits fail at
    # once, as on gloo)
    grace_s = grace_s if p.run.device == "cpu" or not p.timed else None
    topology.set_timeout(timeout_s)
    threadmail.begin_case()  # ranks as threads: this case's messages are its own
    who = (case.label, p.keys()[index - 1])  # what a failing rank names (bench.failures)
    phase = agreement.Agreement(p.run.device, store, key, grace_s, who)
    c = _CaseRun(p, case, rank, phase, lambda text: None, grace_s, timeout_s,
                 pace=steps.Pace(p.estimates[index - 1] if p.estimates else None))
    with console.Ticker(prefix or case.label, left=c.pace.left) as ticker:
        c.status = lambda text: ticker.set(c.pace.mark(text))
        return _phases(c, env, ref_cache, store, key, index)


def _phases(c: _CaseRun, env: dict, ref_cache: dict, store, key: str, index: int
            ) -> tuple[dict, str | None]:
    """run_case's phases, each agreed on; the record and what broke."""
    p, case, rank, phase = c.p, c.case, c.rank, c.phase
    resolved, upstream = c.build()
    # --rounds K: the result does not change between rounds, only the timings: check once
    checks = c.check(ref_cache) if p.run.check and not case.round else None
    samples, step = c.time(store, key)
    comm, sizes = c.comm()
    phase(threadmail.end_case)  # ranks as threads: no mail left undelivered
    # ranks as threads: nothing timed, nothing measured (guards.not_measured)
    mem, memory_bytes = c.memory(step, store, key) if agreement.usable(phase) and p.timed \
        else (None, None)
    # a failed memory step leaves the group usable (it is agreed on); a broken one does not
    ideal_ph, ideal_section = c.ideal(store, key) if agreement.usable(phase) and p.timed and not (
        mem and mem.broken) else (None, None)
    prof, profile = c.profile(step, store, key, index) \
        if p.run.profile and agreement.usable(phase) and not any(
            ph and ph.broken for ph in (mem, ideal_ph)) else (None, None)
    c.status("writing the record")
    ranks_per_problem = c.strat.ranks_per_problem if c.strat is not None else p.world_size
    balance = c.strat.balance() if c.strat is not None and rank == 0 else None
    padding = c.strat.padding() if c.strat is not None else None
    c.strat = c.inputs = step = None  # free the shards and graphs before the next case
    agreement.cleanup()
    record = results.make_record(
        strategy=case.strategy, options=case.options, attention=p.attn_of(case), run=p.run,
        kernel=p.kernel_of(case), world_size=p.world_size, ranks_per_node=p.ranks_per_node,
        ranks_per_problem=ranks_per_problem, env=env, status=phase.status,
        error=phase.error, traceback=agreement.first_traceback(phase, mem, prof), resolved=resolved,
        check=checks, upstream=upstream,
        samples_ms=samples if any(samples.values()) else None, memory_bytes=memory_bytes,
        memory_status=mem.status if mem is not None else None,
        memory_error=mem.error if mem is not None else None, profile=profile,
        balance=balance, padding=padding, packing=p.packing_of(case), round=p.round_of(case),
        comm=comm, sizes=sizes, ideal=ideal_section, load=c.load, timing=c.timing,
        estimate=c.pace.section())
    broke = [ph for ph in (phase, mem, ideal_ph, prof) if ph is not None and ph.broken]
    return record, ("device" if any(ph.sticky for ph in broke) else "group") if broke else None


def _run_cases(p: Plan, rank: int, env: dict) -> tuple[list[dict], bool, bool]:
    """(rank 0's records, whether any failed, whether the process group broke for good)."""
    ref_cache: dict = {}  # check_strategy's: the last problem's reference
    records, failed, tally = [], False, eta.Tally(p.estimates)
    for i, case in enumerate(p.cases, 1):
        prefix = f"[{i}/{len(p.cases)}] {case.label}"
        est = tally.before(i - 1)  # re-estimated from what the cases so far took
        log.info("%s%s", prefix, f": {est.line()}" if est else "")
        t0 = time.perf_counter()
        record, broken = run_case(p, case, rank, env, ref_cache, store=agreement.store(),
                                  key=str(i), prefix=prefix, index=i)
        failed |= results.FAILED in (record["status"], record["memory_status"])
        failed |= bool((record.get("profile") or {}).get("error"))
        failed |= record["derived"]["check_passed"] is False
        if rank == 0:
            took = tally.done(i - 1, record, time.perf_counter() - t0)
            runlog.say_record(p, record, prefix, took)
            records.append(record)
        if broken and not recovery.go_on_after(p, i, broken):
            return records, failed, True
    return records, failed, False


def rank_main(rank: int, world: int, p: Plan) -> int:
    """Run every case of the plan on this rank (process group initialised); exit status.
    Leaves together with the other ranks (a barrier) unless the process group broke."""
    return _rank_main(rank, world, p)[0]


def _rank_main(rank: int, world: int, p: Plan) -> tuple[int, bool]:
    """(exit status, whether the process group broke)."""
    import torch.distributed as dist

    console.setup(rank, p.run.format)
    where: list[Any] = [None] * world  # each rank's (hostname, cpus), all-gathered
    dist.all_gather_object(where, (socket.gethostname(), env_mod.cpus_usable()))
    hostnames, cpus = [h for h, _ in where], [c for _, c in where]
    env = env_mod.capture(device=p.run.device, launcher=p.launcher, hostnames=hostnames,
                          world_size=world, ranks_per_node=p.ranks_per_node,
                          cpus=cpus, kernel_package=kernels.get(p.kernel).provenance()
                          ) if rank == 0 else {}
    runlog.header(p, world)
    for line in env_mod.cpu_warnings(hostnames, cpus) if p.timed else ():
        log.info("%s", line)
    records, failed, broken = _run_cases(p, rank, env)
    if rank == 0:
        runlog.footer(p, records, failed, broken)
    if not broken:
        try:
            _barrier(p.run.device)()  # leave together: gloo can abort when peers close first
        except Exception:  # a peer is gone; nothing left to agree on
            broken = True
    return (1 if failed or broken else 0), broken
