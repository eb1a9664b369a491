"""Rank bodies for the launcher / communication / group tests."""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from cpbench import comm
from cpbench.bench import memory
from cpbench.topology import Topology, contiguous_groups, new_groups, strided_groups


def ring_pass(rank, world):
    """Each rank sends its id around the whole ring, one hop per step."""
    g = new_groups(Topology(world_size=world, ranks_per_node=1), "ring", rank,
                   [list(range(world))])
    ring = comm.RingComm(g)
    x = torch.full((3,), float(rank))
    seen = [int(x[0])]
    for _ in range(world - 1):
        x = ring.send_recv(x)
        ring.commit()
        ring.wait()
        seen.append(int(x[0]))
    return seen


def a2a(rank, world, dtype):
    """x[j] on rank r = 10 r + j; after all-to-all rank r holds 10 j + r from every j.
    (Small integers: exact in bf16.)"""
    g = new_groups(Topology(world_size=world, ranks_per_node=1), "all", rank,
                   [list(range(world))])
    x = (10 * rank + torch.arange(world)).to(dtype).reshape(1, world, 1)
    y = comm.all_to_all(x, g, scatter_dim=1, gather_dim=0)
    return y.flatten().float().tolist()


def subgroups(rank, world, rpn):
    topo = Topology(world_size=world, ranks_per_node=rpn)
    node = new_groups(topo, "node", rank, contiguous_groups(world, rpn))
    cross = new_groups(topo, "cross", rank, strided_groups(world, world // rpn))
    sums = []
    for g in (node, cross):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=g.pg)
        sums.append(t.item())
    return sums, node.crosses_nodes, cross.crosses_nodes


def fail_on_rank_1(rank, world):
    if rank == 1:
        raise KeyError("boom on rank 1")
    dist.barrier()  # the others wait on a peer that already died
    return rank


def sleep_forever(rank, world):
    time.sleep(3600)


def metered_collectives(rank, world, repeats):
    """What the CPU meter sees of comm's collectives: (frees of a counted storage on another
    thread, over ``repeats`` rounds of all three; a reduce-scatter's peak; the bytes it
    needs: its input, the input's chunks made contiguous, its result)."""
    g = new_groups(Topology(world_size=world, ranks_per_node=1), "all", rank,
                   [list(range(world))])
    x = torch.randn(2, 64 * world, 4, 8)  # batch 2: the reduce-scatter's chunks are a copy
    meter, here, elsewhere = memory.StorageMeter(), threading.current_thread(), []
    freed = meter._freed

    def on_free(key):
        if threading.current_thread() is not here and key in meter.live:
            elsewhere.append(meter.live[key])
        freed(key)

    meter._freed = on_free  # type: ignore[method-assign]
    with meter:
        for _ in range(repeats):
            comm.all_to_all(x, g, scatter_dim=1, gather_dim=2)
            comm.all_gather_seq(x, g)
            comm.reduce_scatter_seq(x, g)
    rs = memory.peak_bytes(lambda: comm.reduce_scatter_seq(x, g), device="cpu", inputs=[x])
    need = 2 * comm.nbytes(x) + comm.nbytes(x) // world
    return elsewhere, rs, need


def pid(rank, world):
    """Which process ran this rank (a rank pool's processes serve several tasks)."""
    import os

    return os.getpid()


def reform(rank, world):
    """Form the process group again (as the driver's recovery does); returns the pid."""
    import os

    from cpbench.launch import reform_world

    reform_world(0, 30)
    return os.getpid()
