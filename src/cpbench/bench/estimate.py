"""What a case will take, said before it runs (a run refused when that is too long:
``bench.refusal``).

The kernel's rate on this machine comes from a probe: the plan's kernel backend runs one
full (non-causal) block's forward and backward, at the case's heads, head dim and dtype, on
the device, sized to take ``PROBE_S`` (a quick probe; a second, larger one where the case comes
near the limit, since small blocks run below the kernel's rate). On CPU the probe reads its
thread's CPU time, not the wall clock: the rate of a core of its own, whatever others run
meanwhile (a wall-clock probe of 50 ms on a shared core read 0.015 to 0.09 TFLOP/s within
minutes here), so others' load enters once, through the load meter. A case's step is then its
FLOPs (``metrics``: the mask's attended pairs, backward 2.5× the forward) on its slowest rank
(the mean rank's share × the strategy's imbalance) at that rate, the rank's share of the
device: on CPU the local ranks share what others' processes leave of the cores, read by the
load meter while the probe runs (``under_load``, ``loaded``).
Communication, the merge and the layout are not counted: the estimate is a floor on big
problems' steps, not a prediction (``cpbench simulate`` predicts; ``cpbench dryrun`` sizes
memory).

The case, in parts (``Estimate.parts``): its set-up (``CASE_SETUP_S``, CPU work of every
rank at once, slowed on a busy machine to what others leave of the cores) with the memory
step and ``--profile``'s; its warm-up as the settle rule runs it (``warmup_steps``) and timed
steps; ``--check``'s step and, where the problem is new, its float64 reference; the ideal
block timed alone (``bench.ideal``). ``bench.eta`` adds the command's start-up and
re-estimates each part of what is left from the load and what that part took.

Under torchrun only rank 0 estimates (and may refuse, exit 2, before any collective; torchrun
then stops the other ranks): a probe's time differs between ranks, and ranks that each
decided on their own could disagree.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from cpbench import kernels, launch, metrics
from cpbench.bench import ideal, timer
from cpbench.config import DTYPES, AttentionConfig, RunConfig
from cpbench.metrics import duration

# seconds one probe's forward + backward should take: the quick one, the refined one
PROBE_S = {"cpu": (0.05, 0.3), "cuda": (0.002, 0.05)}
# FLOP/s the probe's side is chosen by (the probe measures the real one)
NOMINAL_FLOPS = {"cpu": 20e9, "cuda": 200e12}
SIDES = (128, 32768)  # the probe's least and largest block side
# a case estimated above this share of the limit, or above REFINE_S, is probed again, larger
REFINE_ABOVE, REFINE_S = 0.25, 60.0
# --check's float64 reference (``reference.reference_by_head``) against the kernel's rate,
# on every pair of the S x S (it masks after computing them all): measured here on one core
# in CPU time, 14x at S = 1K and 11.6x at 2K (8 heads of 64, fp32's sdpa-cpu probe)
REFERENCE_SLOWDOWN = 12.0
PROFILED_STEPS = 3  # bench.profiling's
# a case's work beyond its steps, whatever its size, on every rank at once: its groups,
# the inputs, the agreements, and above all the garbage collection that frees its graphs
# before the next (``agreement.cleanup``: 0.09 s of CPU time in a bare process here, 0.3-0.9 s
# of wall time in a case with 4 ranks on 2 shared cores); and the first case's besides (the
# memory meter's first dispatch mode: 0.9 s of CPU time here): seconds of a rank on a core of
# its own (the record's ``parts_s`` says where a case's time went)
CASE_SETUP_S, FIRST_CASE_S = 0.15, 1.0
# the first case's first warm-up step besides: the process's first autograd graph, the
# group's first collectives, the kernel's first calls (measured here, 2 ranks at 2K: its
# warm-up took 0.2-0.5 s more than its steps at the later cases' rate); in its steps, so that
# ``bench.eta`` reads the steps' error from it as from the rest
FIRST_STEPS_S = 0.35
# --check's step: the strategy's on the global inputs (with its lse), then the gathers and
# rank 0's comparisons, as long again (0.2-0.27 s where a step took 0.08-0.13 s here)
CHECK_STEPS = 2
# the least part of a core a thread of ours is counted to get: what others leave is read as a
# difference of two near-equal figures on a full machine, where it can come out at nothing
MIN_CORE = 0.05
# the load meter's least window at the plan: the probes alone take ~0.2 s, in which one burst
# of others' work read 1.4 cores busy where the next minutes had 0.9-1.1
PLAN_METER_S = 1.0


@dataclass(frozen=True)
class Rate:
    """The probe's result: FLOP/s of the forward and the backward on one block."""

    fwd: float
    bwd: float
    side: int
    kernel: str
    threads: int  # the probe's CPU threads

    def text(self) -> str:
        return (f"{self.kernel} at {self.fwd / 1e12:.3g} / {self.bwd / 1e12:.3g} TFLOP/s "
                f"fwd / bwd on a probed {self.side}-block")


@dataclass(frozen=True)
class Estimate:
    """A case's estimate: one step (FWD+BWD, or FWD with --fwd-only) of its slowest rank,
    the whole case, and the rate both come from."""

    step_s: float
    case_s: float
    rate: Rate
    start_s: float = 0.0  # the command's start-up, on the first case's (``bench.eta``)
    busy: str = ""  # what the load meter saw others take, on the first case's
    comm_from: str = ""  # the simulator's preset that priced what is beyond the kernel
    machine: Machine | None = None  # as the estimate saw it: ``bench.eta`` re-prices the load
    # case_s in parts, each re-priced from what it took (``bench.eta.Tally``): "setup" (with
    # the memory step), "steps" (warm-up and timed), "check" (with the reference), "ideal"
    parts: dict[str, float] = dataclasses.field(default_factory=dict)
    counts: tuple[int, int] = (0, 0)  # the warm-up steps and the timed ones "steps" counts
    ranks: int = 0  # ranks per problem: 1, no communication in a step

    def line(self) -> str:
        return f"estimated {duration(self.step_s)} a step, {duration(self.case_s)} for the case"

    def plus(self, part: str, seconds: float) -> Estimate:
        """This estimate with ``seconds`` more in ``part``."""
        parts = {**self.parts, part: self.parts.get(part, 0.0) + seconds}
        return dataclasses.replace(self, case_s=self.case_s + seconds, parts=parts)

    def to_dict(self) -> dict[str, Any]:
        """The record's ``estimate`` section."""
        out = {"step_s": self.step_s, "case_s": self.case_s, "probe": self.rate.text()}
        return {**out, "parts": dict(self.parts)} if self.parts else out


def _block_seconds(backend, device: str, side: int, heads: int, kv_heads: int,
                   head_dim: int, dtype: torch.dtype,
                   clock: Callable[[], float]) -> tuple[float, float]:
    """(forward s, backward s) of one full block: its second call (the first pays the
    kernel's set-up), read on ``clock`` (a test gives its own)."""
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(h):
        return torch.randn(1, side, h, head_dim, generator=gen, device=device, dtype=dtype)

    q, k, v, dout = rand(heads), rand(kv_heads), rand(kv_heads), rand(heads)
    scale = head_dim ** -0.5
    best = (math.inf, math.inf)
    for i in range(2):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = clock()
        out, lse = backend.forward(q, k, v, causal=False, softmax_scale=scale)
        if device == "cuda":
            torch.cuda.synchronize()
        t1 = clock()
        backend.backward(dout, q, k, v, out, lse, causal=False, softmax_scale=scale)
        if device == "cuda":
            torch.cuda.synchronize()
        t2 = clock()
        if i:  # the first call pays the kernel's set-up
            best = (min(best[0], t1 - t0), min(best[1], t2 - t1))
    return best


def probe_side(device: str, heads: int, head_dim: int, target_s: float, largest: int) -> int:
    """The power-of-two block side whose forward + backward would take ``target_s`` at the
    nominal rate, within ``SIDES`` and at most ``largest`` (the case's own block)."""
    per_pair = metrics.pairs_flops(1, batch=1, heads=heads, head_dim=head_dim, mode="fwd_bwd")
    side = 2 ** round(math.log2(math.sqrt(target_s * NOMINAL_FLOPS[device] / per_pair)))
    return int(min(max(SIDES[0], side), SIDES[1], max(largest, SIDES[0])))


@functools.lru_cache(maxsize=64)
def probe(kernel: str, device: str, dtype: str, heads: int, kv_heads: int, head_dim: int,
          side: int, clock: Callable[[], float] | None = None) -> Rate:
    """The kernel's FLOP/s on one full block of ``side`` (cached per process). On CPU on one
    thread: a rank's share is then counted in cores (``Machine.share``), and a parallel
    region's threads waiting on each other while other work holds a core, which the ranks'
    single threads do not, cannot slow the probe. Read on ``clock``: by default the thread's
    CPU time on CPU (a core of its own, see the module docstring), the wall clock on a GPU."""
    if clock is None:
        clock = time.thread_time if device == "cpu" else time.perf_counter
    backend = kernels.get(kernel)
    threads = torch.get_num_threads()
    with launch.torch_threads(1 if device == "cpu" else None):
        t_fwd, t_bwd = _block_seconds(backend, device, side, heads, kv_heads, head_dim,
                                      DTYPES[dtype], clock)
    fwd = metrics.pairs_flops(side * side, batch=1, heads=heads, head_dim=head_dim)
    return Rate(fwd=fwd / t_fwd, bwd=fwd * metrics.BWD_FACTOR / t_bwd, side=side,
                kernel=kernel, threads=1 if device == "cpu" else threads)


@dataclass(frozen=True)
class Machine:
    """What the ranks of a run share: the device, the local ranks and each one's threads."""

    device: str
    local_ranks: int
    threads_per_rank: int
    cpus: int
    others: float = 0.0  # cores others keep busy beside the run (``loaded``)
    seen: float = 0.0  # the same, as the load meter read it: what the first line says
    beside: int = 1  # threads of ours the meter read ``others`` beside

    def thread_share(self, others: float | None = None, ours: int | None = None) -> float:
        """The part of a core each of ``ours`` runnable threads (default: every local
        rank's) gets (1 on a GPU) where others keep ``others`` (default: ``self.others``)
        cores busy beside ``self.beside`` threads of ours: at most a core, at least MIN_CORE.

        Beside as many threads as read it, what others left. Beside fewer (the probe's one),
        two bounds: others keep what they took (Linux shares the cores between sessions,
        ``sched_autogroup``, on here), or every runnable thread gets an equal part (their
        ``d`` threads from ``d · n / (d + b) = c``). Measured here, with 2 ranks on 2 cores
        where the probe saw others on 1.5-1.8, each rank got 0.15 to 0.4 of a core, as often
        near one bound as the other: the estimate takes the middle."""
        if self.device == "cuda":
            return 1.0
        ours = max(1, self.local_ranks * self.threads_per_rank if ours is None else ours)
        n, c, b = self.cpus, max(0.0, self.others if others is None else others), self.beside
        left = n - c
        demand = c if c + b <= n else (c * b / (n - c) if c < n else math.inf)
        fair = min(ours, n * ours / (min(demand, 4.0 * n) + ours))
        total = left if ours == b else (max(0.0, min(ours, left)) + fair) / 2
        return min(1.0, max(MIN_CORE, total / ours))

    def share(self, rate: Rate) -> float:
        """A rank's part of what the probe had: its threads' cores over the probe's (one
        core of its own on CPU: its CPU time; the whole device on a GPU)."""
        if self.device == "cuda":
            return 1.0
        return self.threads_per_rank * self.thread_share() / max(rate.threads, 1)

    def cores(self, ours: int) -> float:
        """The cores ``ours`` threads get together (on a GPU 1: the device)."""
        return 1.0 if self.device == "cuda" else ours * self.thread_share(ours=ours)

    def alone(self, rate: Rate) -> float:
        """``share`` for a rank running while its peers wait: the ideal block's on rank 0,
        the slowest rank's in an imbalanced step."""
        if self.device == "cuda":
            return 1.0
        return (self.threads_per_rank * self.thread_share(ours=self.threads_per_rank)
                / max(rate.threads, 1))

    def busy_text(self) -> str:
        """"others keep 1.6 of 2 cores busy" where the meter saw them use a tenth of the
        cores or more (the run's guard, ``guards.busy``, allows as much)."""
        if self.device == "cuda" or self.seen < 0.1 * self.cpus:
            return ""
        return f"others keep {self.seen:.1f} of {self.cpus} cores busy"


def loaded(machine: Machine, others_cores: float | None, beside: int = 1) -> Machine:
    """``machine`` with the cores the load meter saw others keep busy beside ``beside``
    threads of ours (the probe's one; a case's ranks'; None: no meter)."""
    if others_cores is None or machine.device == "cuda":
        return machine
    c = max(0.0, others_cores)
    return dataclasses.replace(machine, others=c, seen=c, beside=beside)


def warmup_steps(run: RunConfig, machine: Machine) -> int:
    """The warm-up steps the settle rule is expected to run (``timer.warmup_rule``): it
    stops once ``window`` steps lie within its tolerance, so not before ``max(least,
    window)``, and at ``most`` whatever they do. A busy machine's steps jitter past the
    tolerance more often: of 115 cases measured here with others on 0.1 to 1.4 of 2 cores,
    half ran ``most`` (7), the rest anywhere from 3, mean 5.5: there, three quarters of the
    way up; on idle cores they stopped anywhere between (3 to 6 of at most 7, mean 4.2):
    there, the middle. ``bench.eta`` counts what the done cases ran."""
    assert run.warmup is not None and run.iters is not None, "a resolved RunConfig"
    rule = timer.warmup_rule(run.warmup, run.iters)
    least = min(rule.most, max(rule.least, rule.window))
    if machine.device == "cpu" and machine.seen >= 0.1 * machine.cpus:
        return (least + 3 * rule.most + 2) // 4
    return (least + rule.most + 1) // 2


def case_estimate(attn: AttentionConfig, run: RunConfig, ranks_per_problem: int,
                  imbalance: float, rate: Rate, machine: Machine, *, has_ideal: bool,
                  extra: tuple[float, float] = (0.0, 0.0), reference: bool = True) -> Estimate:
    """The step and the case (see the module docstring). ``extra``: (FWD s, BWD s) a step
    spends beyond its kernel on a GPU, the simulator's (``Problem.extra_s``); ``reference``:
    --check computes the float64 reference (rank 0 keeps the last problem's)."""
    def flops(mode: str, masked: bool = True) -> float:
        return metrics.problem_flops(batch=attn.batch, seqlen=attn.seqlen, heads=attn.heads,
                                     head_dim=attn.head_dim, causal=attn.causal and masked,
                                     documents=attn.documents if masked else None,
                                     window=attn.window_size if masked else None,
                                     mode=mode, v_head_dim=attn.v_head_dim)[0]


    def kernel_s(part: float) -> float:  # a rank's kernel seconds on a core of its own
        return flops("fwd") * part / rate.fwd + (0.0 if run.fwd_only else
                                                 flops("bwd") * part / rate.bwd)

    # the slowest rank's part of the problem (the mean's × the layout's imbalance), at as
    # much of the cores as it can take; or, the longer, the mean rank's at its equal part: a
    # rank that waits for its peers leaves them its part (gloo's waits block), so on cores
    # shared with others it is the ranks' work together that counts (measured here, llama3's
    # contiguous layout, 1.5 imbalanced, took its balanced layout's time, 0.6-1.1x, on 2
    # shared cores)
    slowest = kernel_s(imbalance / ranks_per_problem) / machine.alone(rate)
    step = max(slowest, kernel_s(1 / ranks_per_problem) / machine.share(rate)) \
        + extra[0] + (0.0 if run.fwd_only else extra[1])
    assert run.warmup is not None and run.iters is not None, "a resolved RunConfig"
    warmup = warmup_steps(run, machine)
    # the set-up is CPU work of every rank at once, at its part of what others leave of the
    # cores; with it the memory step and --profile's
    parts = {"setup": CASE_SETUP_S / machine.thread_share()
             + (1 + (PROFILED_STEPS if run.profile else 0)) * step,
             "steps": (warmup + run.iters) * step, "check": 0.0, "ideal": 0.0}
    if run.check:  # the strategy's step on the global inputs; rank 0's reference at its
        # own threads (bench.check: every core stalled under load), every pair at float64
        ref = flops("fwd_bwd", masked=False) * REFERENCE_SLOWDOWN / rate.fwd
        parts["check"] = CHECK_STEPS * step + (ref / machine.cores(machine.threads_per_rank)
                                               if reference else 0.0)
    if has_ideal:  # rank 0's ideal block alone (1 / N² of the problem), warmed up and timed
        block = (flops("fwd") / rate.fwd + flops("bwd") / rate.bwd) / ranks_per_problem ** 2
        parts["ideal"] = block / machine.alone(rate) * (
            min(max(1, run.warmup), ideal.MAX_WARMUP) + min(max(1, run.iters), ideal.MAX_ITERS))
    return Estimate(step_s=step, case_s=sum(parts.values()), rate=rate, machine=machine,
                    parts=parts, counts=(warmup, run.iters), ranks=ranks_per_problem)


@dataclass(frozen=True)
class Problem:
    """One case as the estimate sees it: its label, problem, ranks, imbalance, kernel."""

    label: str
    attn: AttentionConfig
    ranks_per_problem: int
    imbalance: float
    kernel: str
    has_ideal: bool
    # on a GPU a preset matches: what a step spends beyond its kernel (sim.comm_estimate)
    extra_s: tuple[float, float] = (0.0, 0.0)
    checked: bool = True  # --check runs (under --rounds, in the first round only)


def estimate(pr: Problem, run: RunConfig, machine: Machine, *, refined: bool = False,
             reference: bool = True) -> Estimate:
    a = pr.attn
    largest = max(1, a.seqlen // max(pr.ranks_per_problem, 1))
    side = probe_side(machine.device, a.heads, a.head_dim,
                      PROBE_S[machine.device][1 if refined else 0], largest)
    rate = probe(pr.kernel, machine.device, a.dtype, a.heads, a.num_kv_heads, a.head_dim, side)
    checked = dataclasses.replace(run, check=run.check and pr.checked)
    return case_estimate(a, checked, pr.ranks_per_problem, pr.imbalance, rate, machine,
                         has_ideal=pr.has_ideal, extra=pr.extra_s, reference=reference)


def under_load(problems: Sequence[Problem], run: RunConfig, machine: Machine,
               meter: Callable[[], Any], *, least_s: float | None = None,
               clock: Callable[[], float] = time.monotonic) -> Machine:
    """Probe every case's kernel (cached for ``estimates``) while ``meter`` (a
    ``bench.load.Meter``; a test gives its own) reads what others' processes use: the
    machine as they leave it (``loaded``). The reading lasts ``least_s`` at least, this
    thread kept runnable meanwhile as the probe's was (idle, it would leave others more);
    by default ``PLAN_METER_S``, or 5 % of the run on idle cores where less: its cost in
    proportion (the tests' small plans pay nothing)."""
    t0 = clock()
    with meter() as m:
        idle_s = sum(estimate(pr, run, machine).case_s for pr in problems)
        least_s = min(PLAN_METER_S, 0.05 * idle_s) if least_s is None else least_s
        while machine.device == "cpu" and clock() - t0 < least_s:
            pass
    reading = m.load
    return loaded(machine, reading.cores if reading is not None else None)


def estimates(problems: Sequence[Problem], run: RunConfig, machine: Machine
              ) -> tuple[Estimate, ...]:
    """Each case's estimate: the quick probe's, or the larger probe's for a long case or one
    near or over ``run.max_minutes`` (by the quick probe, or already at the nominal rate: then
    one probe). --check's reference where the problem is not the last checked one's (rank 0
    keeps that one: ``bench.check``); the first case's first calls in its set-up and steps."""
    limit_s = run.max_minutes * 60
    bar = min(REFINE_S, REFINE_ABOVE * limit_s) if limit_s else REFINE_S
    out, last = [], None
    for i, pr in enumerate(problems):
        new = pr.attn != last
        long = _nominal(pr, run, machine).case_s > bar
        est = estimate(pr, run, machine, refined=long, reference=new)
        if not long and est.case_s > bar:
            est = estimate(pr, run, machine, refined=True, reference=new)
        last = pr.attn if run.check and pr.checked else last
        if i == 0:
            est = est.plus("setup", FIRST_CASE_S / machine.thread_share()).plus(
                "steps", FIRST_STEPS_S / machine.thread_share())
        out.append(est)
    return tuple(out)


def _nominal(pr: Problem, run: RunConfig, machine: Machine) -> Estimate:
    """The estimate at the nominal rate, no probe."""
    nominal = NOMINAL_FLOPS[machine.device]
    rate = Rate(fwd=nominal, bwd=nominal, side=0, kernel=pr.kernel, threads=machine.cpus)
    return case_estimate(pr.attn, run, pr.ranks_per_problem, pr.imbalance, rate, machine,
                         has_ideal=pr.has_ideal, extra=pr.extra_s)
