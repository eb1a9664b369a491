"""The communication probe behind ``cpbench doctor``: point-to-point and all-to-all between
the local ranks, with the strategies' own calls (``comm.RingComm``, ``comm.all_to_all``), so
what it measures is what a ring or a Ulysses step would get.

Latency: the median time of a small ring exchange (each rank sends to the next and receives
from the previous). Bandwidth: bytes a rank sends over the median time of a large exchange;
all-to-all counts the (n - 1)/n of the buffer that leaves the rank, all-reduce 2(n - 1)/n of
it (nccl-tests' "bus bandwidth").
"""

from __future__ import annotations

import statistics
import time

import torch

from cpbench import comm, topology

SMALL_BYTES = 4 * 2 ** 10
LARGE_BYTES = {"cpu": 4 * 2 ** 20, "cuda": 256 * 2 ** 20}
ITERS = 10


def _timed(fn, device: str, barrier) -> float:
    """Median seconds of ``fn`` over ITERS runs (after one warm-up), each between barriers."""
    fn()
    times = []
    for _ in range(ITERS):
        barrier()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _ring_exchange(group: topology.Group, buf: torch.Tensor):
    ring = comm.RingComm(group)

    def step():
        ring.send_recv(buf)
        ring.commit()
        ring.wait()

    return step


def probe(rank: int, world: int, device: str = "cpu") -> dict:
    """Collective over the default group: {"p2p_latency_us", "p2p_gb_s", "a2a_gb_s",
    sizes}; the slowest rank's figures (a collective step waits for it)."""
    import torch.distributed as dist

    topo = topology.Topology(world_size=world, ranks_per_node=world)
    group = topology.new_groups(topo, "doctor", rank, [list(range(world))])
    large = LARGE_BYTES[device]
    small_buf = torch.ones(SMALL_BYTES // 4, device=device)
    large_buf = torch.ones(large // 4, device=device)

    def barrier():
        dist.barrier(group=group.pg)

    latency = _timed(_ring_exchange(group, small_buf), device, barrier)
    p2p = _timed(_ring_exchange(group, large_buf), device, barrier)
    a2a_in = torch.ones(world, large // 4 // world, device=device)
    a2a = _timed(lambda: comm.all_to_all(a2a_in, group, scatter_dim=0, gather_dim=0),
                 device, barrier)
    reduce = _timed(lambda: dist.all_reduce(large_buf, group=group.pg), device, barrier)
    mine = torch.tensor([latency, p2p, a2a, reduce], dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the slowest rank's
    latency, p2p, a2a, reduce = mine.tolist()
    return {"ranks": world, "small_bytes": SMALL_BYTES, "large_bytes": large,
            "p2p_latency_us": latency * 1e6, "p2p_gb_s": large / p2p / 1e9,
            "a2a_gb_s": large * (world - 1) / world / a2a / 1e9,
            "all_reduce_gb_s": large * 2 * (world - 1) / world / reduce / 1e9}
