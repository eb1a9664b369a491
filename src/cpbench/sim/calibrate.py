"""``cpbench calibrate``: measure this machine and write a simulator hardware preset.

Run on every rank at once (local gloo ranks, or a torchrun job), so each figure is taken
under the contention the benchmark itself sees:

- the kernel curve: the attention kernel ``cpbench run`` would use (``auto``), on full and
  on causal square blocks of each side, timed by ``cpbench run``'s timer (barrier,
  per-iteration samples, the slowest rank's median, the points timed in round-robin
  passes), forward and backward, each call timed alone (a difference of two noisy
  medians can even come out negative on a shared machine);
- the per-step overhead: the same kernel on a block of 16 tokens, whose FLOPs are nothing:
  what any step pays (calls, allocation, dispatch). The curve is the rate of the rest,
  flops / (t − overhead), so the model (flops / rate + overhead) gives back the time measured;
- links: ``batch_isend_irecv`` exchanges with a partner (the call the rings use) inside a
  node and, when there are several nodes, across them, and ``all_to_all_single`` over the
  world, at message sizes from 4 KiB to 16 MiB; latency and bandwidth are the least-squares
  line t = latency + bytes / bandwidth through the medians.
"""

from __future__ import annotations

import socket
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cpbench import metrics
from cpbench.bench import env as env_mod
from cpbench.bench import kernelbench
from cpbench.bench.timer import Timer, gather_samples

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


def _median_ms(fn, spec: Spec, timer: Timer, iters: int | None = None) -> float:
    samples = timer.measure(fn, warmup=spec.warmup, iters=iters or spec.iters)
    return metrics.step_time(gather_samples(samples, spec.device))


def kernel_times(spec: Spec, timer: Timer) -> dict[bool, dict[int, tuple[float, float]]]:
    """Causal? → side → (FWD ms, BWD ms) of the ``auto`` kernel on a square block, each call
    timed alone, every rank at once; the tiny overhead block is full only. Round robin: each
    pass times every block once (the tiny one 10 times), so a burst of load from outside
    lands on all the points alike instead of bending the curve at one of them; a point is
    its median."""
    points = [(False, TINY)] + [(c, s) for c in (False, True) for s in spec.sides]
    closures = {}
    for causal, side in points:
        case = kernelbench.Case(seqlen=side, heads=spec.heads, head_dim=spec.head_dim,
                                dtype=_torch_dtype(spec.dtype), causal=causal)
        closures[causal, side] = kernelbench.forward_backward("auto", case, spec.device)
    samples: dict[tuple, tuple[list, list]] = {p: ([], []) for p in points}
    for i in range(spec.iters):
        for p in points:
            reps = 10 if p[1] == TINY else 1
            for fn, kept in zip(closures[p], samples[p]):
                times = timer.measure(fn, warmup=spec.warmup if i == 0 else 0, iters=reps)
                kept += metrics.slowest_per_iter(gather_samples(times, spec.device))
    out: dict[bool, dict[int, tuple[float, float]]] = {False: {}, True: {}}
    for (causal, side), (fwd, bwd) in samples.items():
        out[causal][side] = (statistics.median(fwd), statistics.median(bwd))
    return out


def _torch_dtype(name: str) -> torch.dtype:
    from cpbench.config import DTYPES

    return DTYPES[name]


def _exchange(partner: int | None, nbytes: int, device: str):
    send = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)

    def fn():
        if partner is None:
            return
        ops = [dist.P2POp(dist.isend, send, partner), dist.P2POp(dist.irecv, recv, partner)]
        for req in dist.batch_isend_irecv(ops):
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
    """Per link kind, [(bytes, median ms)]; a kind with no pair on this topology is absent."""
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
            points.append((nbytes, _median_ms(fn, spec, timer, iters=2 * spec.iters + 1)))
        out[kind] = points
    return out


def rank_calibrate(rank: int, world: int, spec: Spec) -> dict | None:
    """Every rank measures; rank 0 returns what was measured (the others None)."""
    timer = Timer(spec.device, _barrier)
    kernel = kernel_times(spec, timer)
    links = link_times(spec, timer, rank, world)
    if rank != 0:
        return None
    env = env_mod.capture(device=spec.device, launcher="calibrate",
                          hostnames=[socket.gethostname()], world_size=world,
                          ranks_per_node=spec.ranks_per_node)
    return {"kernel_ms": kernel, "links_ms": links, "env": env, "world": world,
            "threads_per_rank": torch.get_num_threads()}
