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
   (``bench.memory``), time the kernel blocks alone (``bench.ideal``) and, with
   ``--profile``, profile a few steps (``bench.profiling``), each a step of its own (a
   failure there keeps the timings); on rank 0 append the record and print.

Every phase ends with all ranks agreeing on its outcome (``bench.agreement``), so an OOM or
an exception in one case becomes that row's status on every rank and the run goes on.

A rank failing inside a strategy's communication breaks the group instead; what follows
(formed again on gloo, the run stopped on NCCL) is ``bench.recovery``'s.

The driver never names a strategy: names, options, variants, ``ranks_per_problem`` and the
resolved options (``resolved_options()``) come from the registry and the strategy objects.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import statistics
import time
from typing import Any, Callable

import torch

from cpbench import kernels, metrics, results, strategies, topology
from cpbench.bench import agreement, ideal, memory, profiling, recovery, sentcount, timer
from cpbench.bench import env as env_mod
from cpbench.bench import estimate as estimate_mod
from cpbench.bench.check import check_strategy
from cpbench.bench.load import Meter
from cpbench.bench.plan import Case, Plan
from cpbench.config import RunConfig
from cpbench.reference import Comparison
from cpbench.report import console
from cpbench.strategies.base import Strategy

log = logging.getLogger("cpbench")
out_log = logging.getLogger("cpbench.out")  # results: stdout in every format (report.console)


# -- 3. on every rank ------------------------------------------------------------------------

def rank_inputs(strat, p: Plan, rank: int) -> dict:
    """This rank's shard, drawn straight from the seed at the shard's shape (never a global
    tensor: at S = 1M the global q alone would not fit on one rank)."""
    a, dev = p.attn, p.run.device
    gen = torch.Generator(device=dev).manual_seed(p.run.seed * 100_003 + rank)
    s = strat.local_seqlen

    def rand(heads, grad):
        t = torch.randn(a.batch, s, heads, a.head_dim, generator=gen, device=dev,
                        dtype=a.torch_dtype)
        return t.requires_grad_(grad)

    return {"q": rand(a.heads, True), "k": rand(a.num_kv_heads, True),
            "v": rand(a.num_kv_heads, True), "dout": rand(a.heads, False)}


def _closures(strat, x: dict) -> tuple[Callable[[], None], Callable[[], None],
                                       Callable[[], None]]:
    """(FWD alone, FWD keeping its graph, BWD on that graph) as zero-argument closures: the
    timer times a step's forward and backward apart (``timer.measure_steps``); FWD alone
    (--fwd-only) builds the graph exactly as in a step, then drops it."""
    q, k, v, dout = x["q"], x["k"], x["v"], x["dout"]
    held: dict = {}

    def fwd():
        strat.attention(q, k, v)

    def fwd_keep():
        held["out"] = strat.attention(q, k, v)[0]

    def bwd():
        held.pop("out").backward(dout)
        q.grad = k.grad = v.grad = None

    return fwd, fwd_keep, bwd


def _counts(run: RunConfig) -> tuple[int, int]:
    """(warmup, iters) of the plan's run, which RunConfig.resolved filled."""
    assert run.warmup is not None and run.iters is not None, "a resolved RunConfig"
    return run.warmup, run.iters


def _barrier(device: str) -> Callable[[], None]:
    import torch.distributed as dist

    if device == "cuda":
        return lambda: dist.barrier(device_ids=[torch.cuda.current_device()])
    return dist.barrier


def _agree_max(device: str) -> Callable[[float], float]:
    """The largest of every rank's value (an all-reduce): the warm-up's end is decided on
    the slowest rank's step times, the same on every rank."""
    import torch.distributed as dist

    def agree(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    return agree


def _meter(rank: int, launcher: str):
    """Rank 0: the load meter (``bench.load``) over the timing; ours is the tree of the
    process that started the ranks (torchrun's agent, the forkserver), or this process
    where the ranks are its threads."""
    if rank != 0 or not Meter.available():
        return contextlib.nullcontext()
    return Meter(period=1.0, root=os.getpid() if launcher == "threads" else os.getppid())


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
    estimate: estimate_mod.Estimate | None = None  # the plan's (rank 0's) for this case
    load: dict | None = None  # the record's sections measured while timing (rank 0)
    timing: dict | None = None
    paces: list = dataclasses.field(default_factory=list)  # seconds of each step so far
    t0: float = dataclasses.field(default_factory=time.monotonic)
    last_step: float | None = None  # when the timer last began a step

    def left(self) -> float | None:
        """Seconds the case still needs: its estimate, scaled by the pace of the steps
        timed so far (none yet: as estimated), less the time it has run."""
        if self.estimate is None:
            return None
        pace = 1.0
        if self.paces and self.estimate.step_s > 0:
            pace = statistics.median(self.paces[-5:]) / self.estimate.step_s
        return max(0.0, self.estimate.case_s * pace - (time.monotonic() - self.t0))

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
        step (``timer.measure_steps``), gathered once timed; and the closure the memory step
        measures. A step that ran out of memory leaves the forward timed alone, a phase of
        its own, so the row keeps its FWD (as an OOM in a backward always did)."""
        run = self.p.run
        self.status("drawing this rank's inputs")
        self.inputs = self.phase(lambda: rank_inputs(self.strat, self.p, self.rank))
        if self.inputs is None:
            return {"fwd": None, "fwd_bwd": None}, None
        fwd, fwd_keep, bwd = _closures(self.built, self.inputs)
        warmup, _ = _counts(run)
        self.sent = {"fwd": sentcount.StepBytes(self.built, warmup)}
        if run.fwd_only:
            parts = [self.sent["fwd"].wrap(fwd)]
        else:
            self.sent["bwd"] = sentcount.StepBytes(self.built, warmup)
            parts = [self.sent["fwd"].wrap(fwd_keep), self.sent["bwd"].wrap(bwd)]
        samples = self._gathered(self._measure(parts))
        if samples["fwd"] is None and not run.fwd_only and self.phase.status == results.OOM \
                and not self.phase.broken:
            samples["fwd"] = self._forward_alone(fwd, store, key)

        def step():
            fwd_keep()
            bwd()

        return samples, fwd if run.fwd_only else step

    def _measure(self, parts: list[Callable[[], None]]) -> timer.Timed | None:
        """The timed steps (a phase), the load meter running on rank 0 meanwhile."""
        run = self.p.run
        warmup, iters = _counts(run)
        self.status(f"timing {'FWD' if len(parts) == 1 else 'FWD and BWD'}")
        tm = timer.Timer(run.device, _barrier(run.device), _agree_max(run.device))
        with _meter(self.rank, self.p.launcher) as meter:
            got = self.phase(lambda: tm.measure_steps(
                parts, settle=timer.warmup_rule(warmup, iters), iters=iters,
                progress=self.progress))
        if meter is not None and meter.load is not None:
            local = self.p.ranks_per_node if self.p.launcher == "torchrun" else \
                self.p.world_size
            self.load = {**meter.load.to_dict(), "ranks_cores": min(
                meter.load.cpus, local * torch.get_num_threads())}
        if got is not None:
            for sent in self.sent.values():
                sent.warmup = got.warmup  # the timed calls follow the warm-up steps run
            self.timing = {"warmup": got.warmup, "settled": got.settled,
                           "warmup_least": warmup, "warmup_most":
                               timer.warmup_rule(warmup, iters).most,
                           "split": len(parts) > 1}
        return got

    def _gathered(self, got: timer.Timed | None) -> dict:
        """Every rank's samples per phase: FWD, BWD and the whole step, or FWD alone."""
        run = self.p.run
        if got is None:  # the phase failed: nothing to gather, no collective
            return {"fwd": None, "fwd_bwd": None}
        mine = [v for part in got.parts for v in part] + (
            got.steps if len(got.parts) > 1 else [])
        everyone = self.phase(lambda: timer.gather_samples(mine, run.device))
        if everyone is None:
            return {"fwd": None, "fwd_bwd": None}
        n = _counts(run)[1]
        cut = [[r[i * n:(i + 1) * n] for r in everyone] for i in range(len(everyone[0]) // n)]
        if len(cut) == 1:
            return {"fwd": cut[0], "fwd_bwd": None}
        return {"fwd": cut[0], "bwd": cut[1], "fwd_bwd": cut[2]}

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

    def progress(self, what: str, step: int, most: int) -> None:
        """The timer's word before each step: the status line, and the steps' pace (the
        time since the last word) for the case's time left."""
        now = time.monotonic()
        if self.last_step is not None:
            self.paces.append(now - self.last_step)
        self.last_step = now
        self.status(f"{what} step {step}" + (f"/{most}" if what == "timed" else
                                             f" (at most {most}, until the time settles)"))

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
        how = sentcount.how_counted(self.built, _counts(self.p.run)[0])
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
        """The case's kernel blocks timed alone on rank 0 (``bench.ideal``; the others wait,
        so nothing shares its device or CPUs) as a phase of its own: the record's
        ``ideal`` section, or why there is none."""
        self.status("timing the kernel blocks alone")
        p, run, case = self.p, self.p.run, self.case
        ph = agreement.Agreement(run.device, store, f"{key}/ideal", self.grace_s, self.phase.case)
        warmup, iters = _counts(run)
        section = ph(lambda: ideal.measure(
            case.strategy, case.options, p.attn_of(case), p.topo, p.kernel_of(case),
            device=run.device, warmup=warmup, iters=iters, fwd_only=run.fwd_only)
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


def _traceback(*phases: agreement.Agreement | None) -> str | None:
    """The traceback of the first phase that failed (an OOM keeps none)."""
    return next((ph.traceback for ph in phases
                 if ph is not None and ph.status == results.FAILED), None)


def _usable(*phases: agreement.Agreement | None) -> bool:
    return all(ph is None or (ph.status == results.OK and not ph.broken) for ph in phases)


def run_case(p: Plan, case: Case, rank: int, env: dict, ref_cache: dict, *, store=None,
             key: str = "", prefix: str = "", index: int = 1) -> tuple[dict, str | None]:
    """Every phase of case ``index`` (1-based) on this rank (collective): (the record,
    complete on rank 0; None, or what broke: "group" or "device", a sticky CUDA error).
    Rank 0 shows its progress meanwhile (``report.console.Ticker``)."""
    grace_s: float | None  # None: no grace (below)
    timeout_s, grace_s = p.waits[index - 1]
    # NCCL: closing a communicator does not free the peers blocked on it; they wait out the
    # timeout, so a failing rank waits for them as long (no grace)
    grace_s = grace_s if p.run.device == "cpu" else None
    topology.set_timeout(timeout_s)
    who = (case.label, p.keys()[index - 1])  # what a failing rank names (bench.failures)
    phase = agreement.Agreement(p.run.device, store, key, grace_s, who)
    c = _CaseRun(p, case, rank, phase, lambda text: None, grace_s, timeout_s,
                 estimate=p.estimates[index - 1] if p.estimates else None)
    with console.Ticker(prefix or case.label, left=c.left) as ticker:
        c.status = ticker.set
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
    mem, memory_bytes = c.memory(step, store, key) if _usable(phase) else (None, None)
    # a failed memory step leaves the group usable (it is agreed on); a broken one does not
    ideal_ph, ideal_section = c.ideal(store, key) if _usable(phase) and not (
        mem and mem.broken) else (None, None)
    prof, profile = c.profile(step, store, key, index) \
        if p.run.profile and _usable(phase) and not any(
            ph and ph.broken for ph in (mem, ideal_ph)) else (None, None)
    ranks_per_problem = c.strat.ranks_per_problem if c.strat is not None else p.world_size
    balance = c.strat.balance() if c.strat is not None and rank == 0 else None
    padding = c.strat.padding() if c.strat is not None else None
    c.strat = c.inputs = step = None  # free the shards and graphs before the next case
    agreement.cleanup()
    record = results.make_record(
        strategy=case.strategy, options=case.options, attention=p.attn_of(case), run=p.run,
        kernel=p.kernel_of(case), world_size=p.world_size, ranks_per_node=p.ranks_per_node,
        ranks_per_problem=ranks_per_problem, env=env, status=phase.status,
        error=phase.error, traceback=_traceback(phase, mem, prof), resolved=resolved,
        check=checks, upstream=upstream,
        samples_ms=samples if any(samples.values()) else None, memory_bytes=memory_bytes,
        memory_status=mem.status if mem is not None else None,
        memory_error=mem.error if mem is not None else None, profile=profile,
        balance=balance, padding=padding, packing=p.packing_of(case), round=p.round_of(case),
        comm=comm, sizes=sizes, ideal=ideal_section, load=c.load, timing=c.timing,
        estimate=c.estimate.to_dict() if c.estimate else None)
    broke = [ph for ph in (phase, mem, ideal_ph, prof) if ph is not None and ph.broken]
    return record, ("device" if any(ph.sticky for ph in broke) else "group") if broke else None


def _say_record(p: Plan, record: dict, prefix: str, seconds: float) -> None:
    """Rank 0: append the record and print its detail block (or its checks)."""
    from cpbench import report

    if p.out:
        results.append(p.out, record)
    est = record.get("estimate")
    log.info("%s: %s in %s%s", prefix,
             record["status"] if record["status"] != results.OK else "done",
             metrics.duration(seconds),
             f" (estimated {metrics.duration(est['case_s'])})" if est else "")
    if p.run.format == "table":
        out_log.info(report.detail(record))
    elif record.get("check"):
        for c in record["check"]:
            log.info("  %s", Comparison(**c).line())


def _run_cases(p: Plan, rank: int, env: dict) -> tuple[list[dict], bool, bool]:
    """(rank 0's records, whether any failed, whether the process group broke for good)."""
    ref_cache: dict = {}  # check_strategy's: the last problem's reference
    records, failed = [], False
    for i, case in enumerate(p.cases, 1):
        prefix = f"[{i}/{len(p.cases)}] {case.label}"
        est = p.estimates[i - 1] if p.estimates else None
        log.info("%s%s", prefix, f": {est.line()}" if est else "")
        t0 = time.perf_counter()
        record, broken = run_case(p, case, rank, env, ref_cache, store=agreement.store(),
                                  key=str(i), prefix=prefix, index=i)
        failed |= results.FAILED in (record["status"], record["memory_status"])
        failed |= bool((record.get("profile") or {}).get("error"))
        failed |= record["derived"]["check_passed"] is False
        if rank == 0:
            _say_record(p, record, prefix, time.perf_counter() - t0)
            records.append(record)
        if broken and not recovery.go_on_after(p, i, broken):
            return records, failed, True
    return records, failed, False


def _header(p: Plan, world: int) -> None:
    topo = p.topo
    log.info("cpbench: %d case(s) on %d ranks (%d node(s) × %d), %s on %s, %s",
             len(p.cases), world, topo.num_nodes, topo.ranks_per_node, p.kernel, p.run.device,
             ", ".join(f"{k}={v}" for k, v in p.attn.to_dict().items()))
    if p.estimates:  # bench.estimate's, made before any rank started
        log.info("estimated %s in all (%s)", metrics.duration(sum(e.case_s for e in p.estimates)),
                 p.estimates[0].rate.text())
    if p.packed:  # the documents above are the first packing's
        log.info("%d packings of %s (seeds %d..%d), each strategy on each", len(p.packed),
                 p.documents_spec, p.run.seed, p.run.seed + len(p.packed) - 1)
    for reason in p.skipped:
        log.info("skipped %s", reason)


def _footer(p: Plan, records: list[dict], failed: bool, broken: bool) -> None:
    from cpbench import report

    out_log.info(report.summary(records, p.run.format).rstrip("\n"))
    if p.out:
        log.info("records: %s  (re-render: cpbench report %s)", p.out, p.out)
    if broken:
        log.info("FAILED: a collective failed and the run stopped there (see above)")
    elif failed:
        log.info("FAILED: a strategy raised or a check failed (see above)")


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
    _header(p, world)
    for line in env_mod.cpu_warnings(hostnames, cpus):
        log.info("%s", line)
    records, failed, broken = _run_cases(p, rank, env)
    if rank == 0:
        _footer(p, records, failed, broken)
    if not broken:
        try:
            _barrier(p.run.device)()  # leave together: gloo can abort when peers close first
        except Exception:  # a peer is gone; nothing left to agree on
            broken = True
    return (1 if failed or broken else 0), broken
