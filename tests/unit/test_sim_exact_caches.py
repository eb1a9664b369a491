"""The simulator's caches give what they stand for: each memoized or deduplicated value
equals the one computed afresh (simulate's output must not change by a byte)."""

import pytest
import torch

from cpbench.config import DTYPE_NAMES, AttentionConfig
from cpbench.errors import Skipped
from cpbench.sim import memory, model
from cpbench.topology import Topology, node_local_block

STRATEGIES = ("ring", "zigzag", "usp", "double-ring", "burst", "llama3", "megatron-cp")


def test_element_size_is_the_torch_dtypes_itemsize():
    for name in DTYPE_NAMES:
        attn = AttentionConfig(seqlen=64, heads=2, head_dim=16, dtype=name)
        assert attn.element_size == attn.torch_dtype.itemsize
        assert attn.element_size == torch.tensor([], dtype=attn.torch_dtype).element_size()


@pytest.mark.parametrize("world,rpn", [(8, 4), (12, 4), (16, 8), (6, 3), (8, 1)])
def test_node_local_block_equals_its_definition(world, rpn):
    topo = Topology(world_size=world, ranks_per_node=rpn)
    strided = [list(range(s, world, 2)) for s in range(2)] if world % 2 == 0 else None
    for rings in ([list(range(world))], [list(range(world))[::-1]], strided):
        if rings is None:
            continue
        n = len(rings[0])
        for also in (None, 2, 3, 4):
            # the largest d dividing n (and ``also``) whose blocks of d stay in a node
            want = max(d for d in range(1, n + 1) if n % d == 0
                       and (also is None or also % d == 0)
                       and all(len({r // rpn for r in ring[s:s + d]}) == 1
                               for ring in rings for s in range(0, n, d)))
            assert node_local_block(topo, rings, also_divides=also) == want
            assert node_local_block(topo, rings, also_divides=also) == want  # cached


@pytest.mark.parametrize("documents", [None, (96, 32, 128)])
def test_memory_peaks_of_distinct_ranks_equal_every_ranks_peak(documents):
    attn = AttentionConfig(seqlen=256, heads=4, kv_heads=2, head_dim=16, dtype="bf16",
                           causal=True, documents=documents)
    topo = Topology(world_size=8, ranks_per_node=4)
    checked = 0
    for name in STRATEGIES:
        try:
            ranks = [model.build(name, None, attn, topo, r) for r in range(topo.world_size)]
        except (Skipped, ValueError):  # one that refuses this case (UsageError is one)
            continue
        checked += 1
        schedules = [s.schedule() for s in ranks]
        for s in ranks:  # the cached local length is the layout's
            assert s.local_seqlen == len(s.seq_index(s.rank))
        want = tuple(max(memory.peak_bytes(s, sched, buffers)
                         for s, sched in zip(ranks, schedules)) for buffers in (True, False))
        assert memory.peaks(ranks, schedules) == want, name
    assert checked >= 5

