"""Validate a ``cpbench run`` request before any process group exists.

Strategy names, options, topology, kernel and dtype, each strategy's own ``validate()`` (built
with ``create_groups=False`` for every rank), sizes that obviously cannot fit, and the
``--out`` file. A bad request is one ValueError whose message says the fix. Variants a
strategy suggests (and, under ``all``, whole strategies) that the config does not allow or
that cannot fit are skipped with a note (which cases run: ``bench.cases``).

Under torchrun every rank plans on its own, so every verdict must come out the same on every
rank: each is computed from the request and fixed facts of the machine (total memory, not
what happens to be free). The exceptions are ``--out``, opened by rank 0 alone (only it
writes), and the estimate, a probe of the kernel on rank 0 alone; if either fails, rank 0 exits
2 and torchrun stops the others.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cpbench import kernels, metrics, results, strategies
from cpbench.bench import env as env_mod
from cpbench.bench import estimate, eta, ideal, memory, order, outputs
from cpbench.bench.cases import Case, expand_cases, request, runnable, shape
from cpbench.config import (
    AttentionConfig,
    RunConfig,
    default_attention,
    packed_problems,
)
from cpbench.errors import UsageError
from cpbench.mask import size_text
from cpbench.topology import Topology, divisors

DEFAULT_NPROC = 4
THREADS = "threads"  # Plan.launcher of --launcher threads

# The default collective timeout of a case: its step's FLOPs at a pessimistic rate (a few
# per cent of a data-centre GPU's; a slow CPU core), times the steps a peer can be behind
# (warm-up, timing skew, the memory step), plus --check's float64 reference on rank 0. A
# failing case then costs about as long as it could legitimately take, not a flat 600 s.
MIN_COLLECTIVE_TIMEOUT_S = 60.0
PESSIMISTIC_FLOPS = {"cuda": 20e12, "cpu": 1e9}  # per rank and second
REFERENCE_FLOPS = {"cuda": 1e12, "cpu": 0.5e9}  # float64, on rank 0
STEPS_BEHIND = 10
MIN_GRACE_S = 5.0


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A validated run: what every rank executes."""

    attn: AttentionConfig
    run: RunConfig  # resolved: concrete device, warmup, iters
    world_size: int
    ranks_per_node: int
    kernel: str  # the resolved backend's name
    cases: tuple[Case, ...]
    out: str | None
    launcher: str  # "torchrun", "self" (--nproc processes) or "threads" (--launcher threads)
    skipped: tuple[str, ...] = ()  # variants the config does not allow, and why
    # per case: (collective timeout, how long a rank that failed by itself waits for its
    # peers in the agreement on gloo), in seconds; see case_waits
    waits: tuple[tuple[float, float], ...] = ()
    # under --packings K: each packing's problem (``attn`` is the first), and the spec
    packed: tuple[AttentionConfig, ...] = ()
    documents_spec: str | None = None
    # per case, what it should take (bench.estimate): on the rank that prints, else empty
    estimates: tuple[estimate.Estimate, ...] = ()

    def attn_of(self, case: Case) -> AttentionConfig:
        """The problem ``case`` runs: its packing's under --packings, else ``attn``."""
        return self.attn if case.packing is None else self.packed[case.packing]

    def round_of(self, case: Case) -> dict | None:
        """The record's ``round`` section under --rounds K: which round, of how many."""
        return None if case.round is None else {"index": case.round, "count": self.run.rounds}

    def packing_of(self, case: Case) -> dict | None:
        """The record's ``packing`` section: which packing, of how many, its seed."""
        if case.packing is None:
            return None
        return {"index": case.packing, "count": len(self.packed),
                "seed": self.run.seed + case.packing, "documents": self.documents_spec}

    @property
    def topo(self) -> Topology:
        return Topology(world_size=self.world_size, ranks_per_node=self.ranks_per_node,
                        group_timeout_s=self.init_timeout)

    @property
    def init_timeout(self) -> float:
        """The process group's timeout before the first case sets its own."""
        return max((w[0] for w in self.waits), default=MIN_COLLECTIVE_TIMEOUT_S)

    @property
    def timed(self) -> bool:
        """Whether the cases are timed and measured: not with ranks as threads sharing one
        device (``guards.not_measured``), where a case builds, checks and runs one untimed
        step."""
        return self.launcher != THREADS

    def kernel_of(self, case: Case) -> str:
        """The backend ``case`` runs on."""
        return case.kernel or self.kernel

    def keys(self) -> tuple[str, ...]:
        """``results.record_key`` of every row this plan records, in order."""
        run = self.run.to_dict()
        return tuple(results.case_key(strategy=c.strategy, options=dataclasses.asdict(c.options),
                                      attention=self.attn_of(c).to_dict(), run=run,
                                      world_size=self.world_size,
                                      ranks_per_node=self.ranks_per_node)
                     for c in self.cases)


def failure_record(p: Plan, index: int, status: str, error: str, **sections) -> dict:
    """The record of case ``index`` of ``p`` when its launch ended without one (the ranks
    died, or a sweep's case timed out): no measurements, the status and why."""
    from cpbench.bench.env import cpus_usable, utc_now

    case = p.cases[index]
    strat = strategies.get(case.strategy)(p.attn_of(case), p.topo, 0,
                                          kernel=kernels.get(p.kernel_of(case)),
                                          options=case.options, create_groups=False)
    env = {"utc": utc_now(), "launcher": p.launcher, "cpus_usable": cpus_usable(),
           "slurm_job_id": os.environ.get("SLURM_JOB_ID")}
    return results.make_record(
        strategy=case.strategy, options=case.options, attention=p.attn_of(case), run=p.run,
        kernel=p.kernel_of(case), world_size=p.world_size, ranks_per_node=p.ranks_per_node,
        ranks_per_problem=strat.ranks_per_problem, env=env, status=status, error=error,
        packing=p.packing_of(case), round=p.round_of(case), **sections)


def case_waits(attn: AttentionConfig, run: RunConfig, ranks_per_problem: int,
               sharing: int = 1) -> tuple[float, float]:
    """(collective timeout, agreement grace) of a case in seconds; ``run.collective_timeout``
    overrides the timeout. The grace, on gloo: how long a rank that failed by itself waits
    for its peers to agree before it decides they are stuck waiting on it (a step).
    ``sharing``: ranks sharing one device (threads), each computing that much slower."""
    flops = metrics.attention_flops(batch=attn.batch, seqlen_q=attn.seqlen,
                                    seqlen_k=attn.seqlen, heads=attn.heads,
                                    head_dim=attn.head_dim, causal=attn.causal,
                                    mode="fwd" if run.fwd_only else "fwd_bwd",
                                    v_head_dim=attn.v_head_dim)
    step_s = flops / ranks_per_problem / PESSIMISTIC_FLOPS[run.device] * sharing
    wait = STEPS_BEHIND * step_s
    if run.check:
        wait += metrics.attention_flops(batch=attn.batch, seqlen_q=attn.seqlen,
                                        seqlen_k=attn.seqlen, heads=attn.heads,
                                        head_dim=attn.head_dim, causal=attn.causal,
                                        mode="fwd_bwd", v_head_dim=attn.v_head_dim
                                        ) / REFERENCE_FLOPS[run.device]
    timeout = run.collective_timeout or max(MIN_COLLECTIVE_TIMEOUT_S, wait)
    return timeout, min(timeout, max(MIN_GRACE_S, step_s))


def check_gpu_count(local_ranks: int, visible: int) -> None:
    """Under torchrun on CUDA every local rank needs its own GPU: LOCAL_RANK indexes them."""
    if local_ranks > visible:
        raise UsageError(
            f"{local_ranks} ranks on this node, {visible} GPU(s) visible (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use --nproc-per-node {visible}")


def _launcher(run: RunConfig, launcher: str) -> str:
    """The plan's launcher: torchrun's, or how --nproc starts its ranks."""
    if run.launcher != THREADS:
        return launcher
    if launcher == "torchrun":
        raise UsageError("--launcher threads starts its ranks itself, in one process; under "
                         "torchrun drop --launcher (or run without torchrun)")
    if run.profile is not None:
        raise UsageError("--launcher threads times nothing (the ranks share one device), so "
                         "there is nothing to profile: drop --profile, or profile with "
                         "--launcher processes or torchrun")
    if run.rounds > 1:
        raise UsageError("--rounds orders timed cases; --launcher threads times nothing: "
                         "drop --rounds")
    return THREADS


def _device(run: RunConfig, launcher: str) -> str:
    device = _pick_device(run, launcher)
    if device == "cuda" and launcher == "torchrun":
        check_gpu_count(env_mod.torchrun_world()[2], torch.cuda.device_count())
    return device


def _pick_device(run: RunConfig, launcher: str) -> str:
    if run.device == "auto":
        return "cuda" if launcher in ("torchrun", THREADS) and torch.cuda.is_available() \
            else "cpu"
    if run.device == "cuda" and launcher == "self":
        raise UsageError("--nproc runs CPU ranks; GPUs: torchrun --nproc-per-node N "
                         "benchmarks/run.py, or --launcher threads")
    if run.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but no CUDA device is visible here; use --device cpu")
    return run.device


def _world(run: RunConfig, launcher: str) -> tuple[int, int]:
    """(world size, default ranks per node)."""
    if launcher == "torchrun":
        if run.nproc is not None:
            raise UsageError("--nproc starts ranks itself; under torchrun the world is "
                             "--nnodes × --nproc-per-node: drop --nproc")
        _, world, local = env_mod.torchrun_world()
        return world, local
    nproc = run.nproc or DEFAULT_NPROC
    limit = env_mod.max_local_ranks()
    if nproc > limit:
        raise UsageError(f"--nproc {nproc}: this machine runs at most {limit} ranks "
                         f"({os.cpu_count()} cores); use --nproc {limit} or fewer, or torchrun")
    # >= 2 emulated nodes wherever possible, so inter-node placements really differ
    return nproc, max([d for d in divisors(nproc) if nproc // d >= 2] or [nproc])


def _reference_fits(attn: AttentionConfig, device: str, local_ranks: int,
                    capacity: int | None, threads: int = 1) -> None:
    """``--check``'s global tensors and rank 0's float64 reference must fit too
    (``threads``: ranks sharing one device as threads)."""
    if capacity is None:
        return
    per_rank, reference = memory.check_bytes(seqlen=attn.seqlen, **shape(attn))
    sharing = local_ranks if device == "cpu" else threads  # ranks sharing rank 0's memory
    if per_rank * sharing + reference > capacity * sharing:
        raise UsageError(
            f"--check at {size_text(attn.seqlen)} needs "
            f"~{metrics.gib(per_rank * sharing + reference)} (fp64 reference), "
            f"{metrics.gib(capacity * sharing)} here; check at 8k, time this without it")


def _kernel(run: RunConfig, device: str, attn: AttentionConfig, notes: list[str], *,
            elsewhere: bool):
    """The kernel backend. ``elsewhere``: a GPU job planned off its nodes (a sweep checked
    on a login node), where ``auto`` is decided by the job itself: validate as flash-attn 2."""
    try:
        return kernels.resolve(run.kernel, **request(attn, device), notes=notes)
    except UsageError:
        if not (elsewhere and device == "cuda" and run.kernel == kernels.AUTO):
            raise
        return kernels.get("flash-attn")


def plan(run: RunConfig, attention: dict, options: dict, *, launcher: str,
         job: tuple[int, int] | None = None, baseline_both_ends: bool = True, comm=None) -> Plan:
    """Validate a request and resolve its defaults. ``attention``: the AttentionConfig fields
    given on the command line; ``options``: the strategy options given. Pure apart from
    reading the machine and creating the ``--out`` file (empty, on rank 0); raises
    ValueError with the fix for anything it cannot run.

    ``job``: (world size, ranks per node) of a torchrun job planned from outside it (a sweep
    validating GPU cases on another host): memory fit is then left to the job's own plan.
    ``baseline_both_ends``: see ``bracket_baselines`` (off: each case once). ``comm``: on a
    GPU, the simulator's (FWD s, BWD s) beyond the kernel (``sim.comm_estimate``; from above)."""
    launcher = _launcher(run, launcher) if job is None else launcher
    device = _device(run, launcher) if job is None else (
        "cuda" if run.device == "auto" else run.device)
    run = run.resolved(device)
    given = {**default_attention(device), **attention}
    problems = packed_problems(given, run.seed, run.packings)
    attn = problems[0]
    world, default_rpn = _world(run, launcher) if job is None else job
    topo = Topology(world_size=world, ranks_per_node=run.ranks_per_node or default_rpn)
    if launcher == "torchrun" and run.deadline is not None:
        raise UsageError("--deadline stops --nproc's ranks; under torchrun drop it, use the "
                         "scheduler's limit (sbatch --time)")
    run = dataclasses.replace(run, ranks_per_node=topo.ranks_per_node,
                              nproc=None if launcher == "torchrun" else world)
    kernel_notes: list[str] = []
    backend = _kernel(run, device, attn, kernel_notes, elsewhere=job is not None)
    local_ranks = topo.ranks_per_node if launcher == "torchrun" else world
    # ranks as threads share one device: a GPU's memory too
    sharing = world if launcher == THREADS else 1
    capacity = memory.capacity_bytes(device, local_ranks) if job is None else None
    if capacity is not None and device == "cuda":
        capacity //= sharing
    strat_of: dict[Case, Any]  # case -> rank 0's strategy of it (runnable's pairs)
    cases, skipped, strat_of = [], [], {}
    for i, problem in enumerate(problems):
        built, notes = runnable(expand_cases(run.strategy, options, topo), run.strategy,
                                problem, topo, backend, device, capacity,
                                auto=run.kernel == kernels.AUTO, elsewhere=job is not None,
                                threads=launcher == THREADS)
        built = order.in_packing(built, i if len(problems) > 1 else None)
        # rounds alternate the order already: a baseline at both ends of each would be twice;
        # a baseline brackets timings against drift: none under threads
        bracket = baseline_both_ends and run.rounds == 1 and launcher != THREADS
        cases += order.bracket_baselines(built) if bracket else [c for c, _ in built]
        skipped += [n for n in notes if n not in skipped]
        strat_of.update(built)
    cases = order.in_rounds(cases, run.rounds)
    if run.check:
        _reference_fits(attn, device, local_ranks, capacity, sharing)
    out = None if (run.out or "").lower() == "none" else (run.out or outputs.default_out(run, attn))
    writer = job is None and (launcher != "torchrun" or env_mod.torchrun_world()[0] == 0)
    # nothing is timed with ranks as threads (Plan.timed): a case's time is its check's
    estimates = _estimates(cases, strat_of, problems, run, backend.name, topo, local_ranks,
                           launcher, comm) if writer and launcher != THREADS else ()
    if out is not None and writer:
        outputs.open_out(out)
    if run.profile is not None:
        # absolute, so the record's trace paths still lead to the traces from elsewhere
        profile = str(Path(run.profile).resolve())
        run = dataclasses.replace(run, profile=profile)
        if writer:
            outputs.open_profile_dir(profile)
    return Plan(attn=attn, run=run, world_size=world, ranks_per_node=topo.ranks_per_node,
                kernel=backend.name, cases=tuple(cases), out=out, launcher=launcher,
                skipped=(*kernel_notes, *skipped),
                waits=tuple(case_waits(attn, run, strat_of[dataclasses.replace(
                    c, round=None)].ranks_per_problem, sharing) for c in cases),
                packed=problems if len(problems) > 1 else (),
                documents_spec=given["documents"] if len(problems) > 1 else None,
                estimates=estimates)


def _estimates(cases: list[Case], strat_of: dict, problems: tuple[AttentionConfig, ...],
               run: RunConfig, kernel: str, topo: Topology, local_ranks: int, launcher: str,
               comm) -> tuple[estimate.Estimate, ...]:
    """Each case's estimate (``bench.estimate``); UsageError for a case over the limit."""
    # each rank's threads: cpbench.launch.run_ranks' default; under torchrun this is a rank
    threads = max(1, (os.cpu_count() or 1) // topo.world_size) if launcher == "self" else \
        torch.get_num_threads()
    machine = estimate.Machine(device=run.device, local_ranks=local_ranks,
                               threads_per_rank=threads, cpus=env_mod.cpus_usable())
    found, comm = [], comm if run.device == "cuda" else None  # the simulator prices GPUs
    for c in cases:
        strat = strat_of[dataclasses.replace(c, round=None)]
        attn = problems[c.packing or 0]
        imbalance = _imbalance(c, strat, attn, topo, c.kernel or kernel)
        found.append(estimate.Problem(
            label=c.label, attn=attn, ranks_per_problem=strat.ranks_per_problem,
            imbalance=imbalance, kernel=c.kernel or kernel,
            has_ideal=ideal.none_reason(attn) is None, checked=not c.round,
            extra_s=comm(c.strategy, c.options, attn, topo) if comm else (0.0, 0.0)))
    return eta.planned(found, run, machine, launcher, comm=comm)


BALANCE_SEQLEN = 16384  # a layout's imbalance, computed at this length (it costs ~S log S)


def _imbalance(c: Case, strat, attn: AttentionConfig, topo: Topology, kernel: str) -> float:
    """The strategy's max / mean attended area over ranks (``Strategy.balance``); a long
    plain sequence's from its layout at BALANCE_SEQLEN; 1.0 where it cannot say."""
    try:
        if not attn.documents and attn.seqlen > BALANCE_SEQLEN:
            short = dataclasses.replace(attn, seqlen=BALANCE_SEQLEN)
            strat = strategies.get(c.strategy)(short, topo, 0, kernel=kernels.get(kernel),
                                               options=c.options, create_groups=False)
        return float(strat.balance()["imbalance"])
    except Exception:  # noqa: BLE001 - an estimate, not a check
        return 1.0
