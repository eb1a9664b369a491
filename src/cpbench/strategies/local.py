"""local: no context parallelism — every rank computes the whole sequence alone, with the same
kernel and the same code path as ``ring`` (the ring algorithm where each rank is a ring of one).

It is the baseline of CP efficiency = T_local / (N · T_cp) (ring-flash-attn's README reports
90 % for zigzag on 8 GPUs): a perfect CP strategy on N ranks takes 1/N of the local time.
Every rank runs its own copy at once, so the baseline sees the same contention for memory
bandwidth (and, on CPU, cores) as the CP runs it is compared with.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpbench.strategies import register
from cpbench.strategies._kv_ring import kv_ring_lists
from cpbench.strategies.ring import Ring


@register
class Local(Ring):
    name = "local"
    description = ("no CP: each rank computes the whole sequence with the same kernel "
                   "(the baseline of CP efficiency)")

    @dataclass(frozen=True, kw_only=True)
    class Options:  # nothing to choose: ring's options are about the ring it has none of
        pass

    def __init__(self, attn, topo, rank, *, cp_lists=None, **kwargs):
        # Each rank alone in its own ring; ``cp_lists`` is ignored: there is nothing to split.
        super().__init__(attn, topo, rank, cp_lists=[[r] for r in range(topo.world_size)],
                         **kwargs)

    def group_lists(self):
        return kv_ring_lists(self.cp_lists, "shared")

    @property
    def ranks_per_problem(self) -> int:
        return 1
