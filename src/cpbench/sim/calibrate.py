"""``cpbench calibrate``: measure this machine and write a simulator hardware preset.

Run on every rank at once (local gloo ranks, or a torchrun job), so each figure is taken
under the contention the benchmark itself sees:

- the kernel curve: the attention kernel ``cpbench run`` would use (``auto``), on full and
  on causal square blocks of each side, timed by ``cpbench run``'s timer (barrier,
  per-iteration samples, the slowest rank's, the points timed in round-robin passes),
  forward and backward, each call timed alone (a difference of two noisy times can even
  come out negative on a shared machine);
- the per-step overhead: the same kernel on a block of 16 tokens, whose FLOPs are nothing:
  what any step pays (calls, allocation, dispatch). The curve is the rate of the rest,
  flops / (t − overhead), so the model (flops / rate + overhead) gives back the time measured;
- how ranks share the machine (``sharing``): a kernel's speed-up when the other ranks idle,
  and the share of an exchange that hides behind a kernel;
- links: ``batch_isend_irecv`` exchanges with a partner (the call the rings use) inside a
  node and, when there are several nodes, across them, and ``all_to_all_single`` over the
  world, at message sizes from 4 KiB to 16 MiB; latency and bandwidth are the least-squares
  line t = latency + bytes / bandwidth through the points.

Every figure is the fastest of its iterations, not their median: on a virtual machine the
host's other tenants slow whole seconds of a run (a 4K-token forward took 105 ms and 173 ms
minutes apart on an otherwise idle 2-core VM, with no steal time the guest could see); the
fastest iteration is what the machine does undisturbed, and comes back run after run. The
self-check scores against the median ``cpbench run`` reports and shows the error against the
fastest iteration beside it.
"""

from __future__ import annotations

import dataclasses
import socket
import statistics
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cpbench import metrics
from cpbench.bench import env as env_mod
from cpbench.bench import kernelbench
from cpbench.bench.timer import Timer, gather_samples
from cpbench.report import console

TINY = 16  # tokens: the overhead probe
MESSAGE_BYTES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)


@dataclass(frozen=True)
class Spec:
    device: str
    dtype: str
    heads: int
    head_dim: int
    sides: tuple[int, ...]
    ranks_per_node: int
    warmup: int = 1
    iters: int = 3


def _barrier() -> None:
    dist.barrier()


def _best_ms(fn, spec: Spec, timer: Timer, iters: int | None = None) -> float:
    """The fastest iteration (each the slowest rank's): see the module docstring."""
    samples = timer.measure(fn, warmup=spec.warmup, iters=iters or spec.iters)
    return min(metrics.slowest_per_iter(gather_samples(samples, spec.device)))


def kernel_times(spec: Spec, timer: Timer, say=lambda text: None
                 ) -> dict[bool, dict[int, tuple[float, float]]]:
    """Causal? → side → (FWD ms, BWD ms) of the ``auto`` kernel on a square block, each call
    timed alone, every rank at once; the tiny overhead block is full only. Round robin: each
    pass times every block once (the tiny one 10 times), so a burst of load from outside
    lands on all the points alike instead of bending the curve at one of them; a point is
    its fastest pass. Each call starts with cold caches (``_cache_flush``), as a CP step's
    kernel meets blocks that just arrived."""
    points = [(False, TINY)] + [(c, s) for c in (False, True) for s in spec.sides]
    closures = {}
    for causal, side in points:
        case = kernelbench.Case(seqlen=side, heads=spec.heads, head_dim=spec.head_dim,
                                dtype=_torch_dtype(spec.dtype), causal=causal)
        closures[causal, side] = kernelbench.forward_backward("auto", case, spec.device)
    for fns in closures.values():
        for fn in fns:
            timer.measure(fn, warmup=spec.warmup, iters=0)
    flush = _cache_flush(spec.device)
    samples: dict[tuple, tuple[list, list]] = {p: ([], []) for p in points}
    for i in range(spec.iters):
        say(f"kernel curve: pass {i + 1}/{spec.iters} over {len(points)} blocks")
        for p in points:
            reps = 10 if p[1] == TINY else 1
            for fn, kept in zip(closures[p], samples[p]):
                if reps == 1:
                    flush()
                times = timer.measure(fn, warmup=0, iters=reps)
                kept += metrics.slowest_per_iter(gather_samples(times, spec.device))
    out: dict[bool, dict[int, tuple[float, float]]] = {False: {}, True: {}}
    for (causal, side), (fwd, bwd) in samples.items():
        out[causal][side] = (min(fwd), min(bwd))
    return out


def _cache_flush(device: str):
    """A write over twice the last-level cache (64 MiB when unknown; 256 MiB on a GPU, as
    Triton's do_bench flushes L2), untimed, so the next call reads its inputs from memory:
    on this 2-core VM a warm 512-token forward is 9 % faster than a cold one, no different
    from 2048 tokens up."""
    size = 256 << 20 if device == "cuda" else 2 * _last_level_cache_bytes()
    junk = torch.empty(size, dtype=torch.uint8, device=device)
    return lambda: junk.fill_(1)


def _last_level_cache_bytes() -> int:
    import glob

    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        with open(path) as f:
            text = f.read().strip()
        units = {"K": 1 << 10, "M": 1 << 20}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=32 << 20)


def _torch_dtype(name: str) -> torch.dtype:
    from cpbench.config import DTYPES

    return DTYPES[name]


def _exchange(partner: int | None, nbytes: int, device: str):
    post = _posted(partner, nbytes, device)

    def fn():
        for req in post():
            req.wait()
    return fn


def _all_to_all(nbytes: int, world: int, device: str):
    send = torch.zeros(nbytes // world * world, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    return lambda: dist.all_to_all_single(recv, send)


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(latency µs, bandwidth GB/s) of the line ms = a + bytes · b through (bytes, ms) points,
    least squares in relative error (weights 1/ms²), so the small messages that set the
    latency count as much as the large ones that set the bandwidth; a clipped at 0."""
    if len({x for x, _ in points}) < 2:  # one size: no latency to tell from the rate
        x, y = points[0]
        return 0.0, x / max(y, 1e-12) / 1e9 * 1e3
    w = [1.0 / max(y, 1e-9) ** 2 for _, y in points]
    sw = sum(w)
    mx = sum(wi * x for wi, (x, _) in zip(w, points)) / sw
    my = sum(wi * y for wi, (_, y) in zip(w, points)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, points))
    slope = sum(wi * (x - mx) * (y - my) for wi, (x, y) in zip(w, points)) / sxx
    slope = max(slope, 1e-15)
    intercept = max(0.0, my - slope * mx)
    return intercept * 1e3, 1.0 / slope / 1e9 * 1e3  # ms per byte → GB/s


def _partners(rank: int, world: int, rpn: int) -> tuple[int | None, int | None]:
    """A partner inside the node (pairs 0-1, 2-3, …) and one on the next node (same slot)."""
    slot, node = rank % rpn, rank // rpn
    inside = None
    if rpn >= 2:
        mate = slot ^ 1
        inside = node * rpn + mate if mate < rpn else None
    nodes = world // rpn
    across = None
    if nodes >= 2:
        mate = node ^ 1
        across = mate * rpn + slot if mate < nodes else None
    return inside, across


def link_times(spec: Spec, timer: Timer, rank: int, world: int) -> dict[str, list]:
    """Per link kind, [(bytes, fastest ms)]; a kind with no pair on this topology is
    absent."""
    inside, across = _partners(rank, world, spec.ranks_per_node)
    nodes = world // spec.ranks_per_node
    kinds: dict[str, int | None] = {"all_to_all": None}  # kind -> partner rank
    if spec.ranks_per_node >= 2:
        kinds["intra"] = inside
    if nodes >= 2:
        kinds["inter"] = across
    out = {}
    for kind, partner in kinds.items():
        points = []
        for nbytes in MESSAGE_BYTES:
            fn = _all_to_all(nbytes, world, spec.device) if kind == "all_to_all" else \
                _exchange(partner, nbytes, spec.device)
            points.append((nbytes, _best_ms(fn, spec, timer, iters=2 * spec.iters + 1)))
        out[kind] = points
    return out


def _probe_sides(spec: Spec) -> tuple[int, ...]:
    """The curve's sides from 512 to 4096 that are a power of two or 1.5 times one: blocks
    whose kernels are long enough to time an exchange or an idle neighbour against, and a
    few of them (``--sides`` may hold the odd sides of every schedule)."""
    def grid(s: int) -> bool:
        return s & (s - 1) == 0 or (s % 3 == 0 and (s // 3) & (s // 3 - 1) == 0)
    return tuple(s for s in sorted(spec.sides) if 512 <= s <= 4096 and grid(s)) \
        or tuple(spec.sides)


def sharing(spec: Spec, timer: Timer, rank: int, world: int) -> dict:
    """How the ranks of a node share it, at the blocks of ``_probe_sides``:

    - ``idle_speedup``: the forward with every rank busy over the same with rank 0 alone
      (the others wait in the timer's barrier, as a rank waits in a collective), the median;
    - ``overlapped``: what a partner exchange of the block's K and V (``batch_isend_irecv``,
      the rings' call) adds to the forward when it is posted before it and awaited after
      (the step's time less the forward's), over the same exchange's time alone: the median.
    """
    inside, _ = _partners(rank, world, spec.ranks_per_node)
    speedups: list[float] = []
    exposed: list[float] = []
    for side in _probe_sides(spec):
        case = kernelbench.Case(seqlen=side, heads=spec.heads, head_dim=spec.head_dim,
                                dtype=_torch_dtype(spec.dtype), causal=False)
        fwd, _ = kernelbench.forward_backward("auto", case, spec.device)
        nbytes = 2 * side * spec.heads * spec.head_dim * _torch_dtype(spec.dtype).itemsize
        both = _overlapped(_posted(inside, nbytes, spec.device), fwd)
        exchange = _exchange(inside, nbytes, spec.device)

        def alone(fwd=fwd):
            if rank == 0:
                fwd()
        t_busy, t_alone, t_both, t_x = _interleaved((fwd, alone, both, exchange), spec, timer)
        speedups.append(t_busy / t_alone)
        exposed.append((t_both - t_busy) / max(t_x, 1e-9))
    # the model takes idle_speedup >= 1 and overlapped >= 0: a reading outside is clamped,
    # and the preset and calibrate's stderr say so (``clamped``)
    idle = statistics.median(speedups)
    ov = statistics.median(exposed) if inside is not None else None
    clamped = {k: v for k, v, bound in (("idle_speedup", idle, 1.0), ("overlapped", ov, 0.0))
               if v is not None and v < bound}
    return {"idle_speedup": max(1.0, idle), "overlapped": None if ov is None else max(0.0, ov),
            "clamped": clamped}


def _interleaved(fns, spec: Spec, timer: Timer) -> list[float]:
    """Each closure's fastest iteration, the closures taken in turn every iteration, so a
    moment the machine runs slower lands on all of them alike (their ratios are read)."""
    for fn in fns:
        timer.measure(fn, warmup=spec.warmup, iters=0)
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(2 * spec.iters + 1):
        for fn, kept in zip(fns, samples):
            kept += metrics.slowest_per_iter(gather_samples(
                timer.measure(fn, warmup=0, iters=1), spec.device))
    return [min(kept) for kept in samples]


PROBE_SIDE = 2048


def memory_passes(spec: Spec, timer: Timer) -> dict[str, list[tuple[int, float]]]:
    """What a CP step does around its kernel call, per size: ``merge``, the log-sum-exp merge
    of a block's (out, lse) into the rank's fp32 accumulator (every ring step's forward), and
    ``accumulate``, an fp32 ``+=`` (the backward's dq, dk, dv partial sums); as
    [(elements, fastest ms)] on blocks of ``_probe_sides`` rows, all heads."""
    from cpbench.merge import OutLseAccumulator

    out: dict[str, list[tuple[int, float]]] = {"merge": [], "accumulate": []}
    for rows in _probe_sides(spec):
        acc = OutLseAccumulator(1, rows, spec.heads, spec.head_dim, spec.device)
        block = torch.randn(1, rows, spec.heads, spec.head_dim, device=spec.device,
                            dtype=_torch_dtype(spec.dtype))
        lse = torch.randn(1, spec.heads, rows, device=spec.device)
        total = torch.zeros(block.shape, dtype=torch.float32, device=spec.device)
        elements = block.numel()
        out["merge"].append((elements, _best_ms(lambda a=acc, b=block, x=lse: a.update(b, x),
                                                spec, timer, iters=2 * spec.iters + 1)))
        out["accumulate"].append((elements, _best_ms(lambda t=total, b=block: t.add_(b),
                                                     spec, timer, iters=2 * spec.iters + 1)))
    return out


def probe_ms(rank: int, world: int, spec: Spec) -> tuple[float, float] | None:
    """(forward with every rank busy, the same with rank 0 alone) on a full block of
    ``PROBE_SIDE``, the fastest of 5: the reading of the machine's state before and after
    a calibration and each self-check measurement (rank 0 returns it)."""
    probe = _probe(rank, spec, Timer(spec.device, _barrier))
    return probe if rank == 0 else None


def _probe(rank: int, spec: Spec, timer: Timer) -> tuple[float, float]:
    case = kernelbench.Case(seqlen=PROBE_SIDE, heads=spec.heads, head_dim=spec.head_dim,
                            dtype=_torch_dtype(spec.dtype), causal=False)
    fwd, _ = kernelbench.forward_backward("auto", case, spec.device)

    def alone():
        if rank == 0:
            fwd()
    busy, idle = _interleaved((fwd, alone), dataclasses.replace(spec, iters=3), timer)
    return busy, idle


def _overlapped(post, fwd):
    def both():
        reqs = post()
        fwd()
        for req in reqs:
            req.wait()
    return both


def _posted(partner: int | None, nbytes: int, device: str):
    send = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)

    def post():
        if partner is None:
            return []
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, partner),
                                       dist.P2POp(dist.irecv, recv, partner)])
    return post


TRIES = 3
STEADY = 0.10  # the probes around a calibration may differ by this much, relative


def steady(before: tuple[float, float], after: tuple[float, float]) -> bool:
    """Whether two probes (busy ms, alone ms) read the same machine: the busy forward and
    the idle speed-up each within ``STEADY``."""
    return (abs(after[0] / before[0] - 1) <= STEADY
            and abs((after[0] / after[1]) / (before[0] / before[1]) - 1) <= STEADY)


def verdict(ok: bool, device: str) -> torch.Tensor:
    """Rank 0's ``ok`` on every rank (a collective), so every rank decides as rank 0 saw it.
    The flag lives on ``device``, the group's: NCCL takes no CPU tensor."""
    flag = torch.tensor([float(ok)], device=device)
    dist.broadcast(flag, 0)
    return flag


def _measured(rank: int, world: int, spec: Spec, timer: Timer, say) -> tuple:
    """One try: (probe before, kernel curve, sharing, memory passes, links, probe after)."""
    say("the probe before")
    before = _probe(rank, spec, timer)
    kernel = kernel_times(spec, timer, say=say)
    say("ranks sharing the device")
    shared = sharing(spec, timer, rank, world)
    say("memory passes")
    passes = memory_passes(spec, timer)
    say("links")
    links = link_times(spec, timer, rank, world)
    say("the probe after")
    return before, kernel, shared, passes, links, _probe(rank, spec, timer)


def rank_calibrate(rank: int, world: int, spec: Spec) -> dict | None:
    """Every rank measures; rank 0 returns what was measured (the others None). A probe
    before and after (``probe_ms``) must read the same machine: a virtual machine's host
    may move both ranks onto one core's hyperthreads in the middle (the busy forward 1.6-1.9x
    slower); then everything is measured again, up to ``TRIES`` times, and the preset says
    when it could not be measured steady."""
    timer = Timer(spec.device, _barrier)
    console.setup(rank, "json")  # rank 0's progress on stderr; the preset goes to stdout
    with console.Ticker("calibrate") as ticker:
        tries = 0
        while tries < TRIES:
            tries += 1
            got = _measured(rank, world, spec, timer, lambda text, n=tries: ticker.set(
                f"try {n}: {text}"))
            before, kernel, shared, passes, links, after = got
            flags = verdict(rank != 0 or steady(before, after), spec.device)
            if rank == 0:
                console.end_status()
                print(f"calibrate: try {tries}: probe busy/alone {before[0]:.1f}/"
                      f"{before[1]:.1f} ms before, {after[0]:.1f}/{after[1]:.1f} ms after: "
                      f"{'steady' if flags.item() else 'the machine changed'}",
                      file=sys.stderr, flush=True)
            if flags.item():
                break
    if rank != 0:
        return None
    env = env_mod.capture(device=spec.device, launcher="calibrate",
                          hostnames=[socket.gethostname()], world_size=world,
                          ranks_per_node=spec.ranks_per_node)
    return {"kernel_ms": kernel, "links_ms": links, "sharing": shared, "passes_ms": passes,
            "probe_ms": {"before": before, "after": after, "tries": tries,
                         "steady": bool(flags.item())},
            "env": env, "world": world, "threads_per_rank": torch.get_num_threads()}
