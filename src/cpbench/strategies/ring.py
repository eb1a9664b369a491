"""ring: contiguous shards, K/V circulate around the ring (the imbalanced baseline).

Ring position r holds tokens [r·S/N, (r+1)·S/N) and meets every other position's K/V block
once as it passes (the pass itself is ``_kv_ring``). Under causal masking a block from a
later position is entirely in the future and skipped, so position N-1 works N times as much
as position 0: the imbalance zigzag fixes.
"""

from __future__ import annotations

import torch

from cpbench.strategies import register
from cpbench.strategies._kv_ring import KVRing
from cpbench.strategies.layout import Block, check_divisible, contiguous_index


@register
class Ring(KVRing):
    name = "ring"
    description = "contiguous shards, K/V ring; causal skips future blocks (imbalanced baseline)"

    def validate(self) -> None:
        check_divisible(self.attn.seqlen, self.cp_size, f"ring over {self.cp_size} ranks")

    def seq_index(self, rank: int) -> torch.Tensor:
        return contiguous_index(self.attn.seqlen, self.cp_size, self.cp_index(rank))

    def block(self, me: int, src: int, local_len: int) -> Block | None:
        every = slice(0, local_len)
        if self.attn.causal and src > me:
            return None  # all of src's tokens come after all of ours
        return Block(every, every, self.attn.causal and src == me)
