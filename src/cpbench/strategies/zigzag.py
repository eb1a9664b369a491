"""zigzag: ring attention on the load-balanced zigzag layout (ring-flash-attention).

The sequence is cut into 2N chunks and ring position r holds chunk r and its mirror 2N-1-r,
so under causal masking every position does the same work at every step
(layout.zigzag_block):
- step 0: the local block against itself, diagonal mask;
- K/V from an earlier position: all local queries see only its first chunk;
- K/V from a later position: only the local second chunk sees it, and sees all of it.
Each is half of a full (2c x 2c) block, so no rank idles, unlike ``ring``. Non-causal: every
step is the full block.
The ring pass itself (double-buffered K/V ring forward; K/V and fp32 dK/dV rings backward on
one process group, as ring-flash-attn; dQ local) is shared with ``ring`` in ``_kv_ring``.
"""

from __future__ import annotations

from cpbench.strategies import register
from cpbench.strategies._kv_ring import KVRing
from cpbench.strategies.layout import Block, ZigzagLayout, zigzag_block


@register
class Zigzag(ZigzagLayout, KVRing):
    name = "zigzag"
    description = "zigzag layout (chunks r and 2N-1-r), K/V ring: causal work balanced over ranks"

    def block(self, me: int, src: int, local_len: int) -> Block:
        return zigzag_block(me, src, local_len, self.attn.causal)
