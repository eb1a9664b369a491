"""A third-party strategy for the physics guards' test, registered through the
``cpbench.strategies`` entry-point group (the ``.dist-info`` beside this file): zigzag's
schedule, which sends K/V round the ring, but an attention that sends nothing (each rank
attends to its own keys alone): CP silently off, as Megatron-Bridge's ``a2a+p2p`` ran; and
one that claims to share the problem and computes all of it on every rank."""

from __future__ import annotations

import torch.nn.functional as F

from cpbench.strategies.local import Local
from cpbench.strategies.zigzag import Zigzag


class SilentZigzag(Zigzag):
    name = "test-silent-zigzag"
    description = "declares zigzag's ring, sends nothing (test)"
    returns_lse = False

    def attention(self, q, k, v):
        def heads_first(t):
            return t.transpose(1, 2)

        out = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v),
                                             is_causal=self.attn.causal)
        return heads_first(out), None


class CpOff(Local):
    """The baseline's code (every rank attends to the whole sequence alone) under a CP
    strategy's claim that the ranks share one problem: CP silently off."""

    name = "test-cp-off"
    description = "each rank computes the whole problem, claiming to share it (test)"

    @property
    def ranks_per_problem(self) -> int:
        return self.world_size
