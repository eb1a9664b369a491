"""rfa-zigzag, rfa-ring, rfa-stripe: ring-flash-attention's own functions (zhuzilin/
ring-flash-attention, the ``ring-flash-attn`` package), run as they are.

Each calls ``zigzag_ring_flash_attn_func`` / ``ring_flash_attn_func`` /
``stripe_flash_attn_func`` with the CP process group and ``return_attn_probs=True`` (which
hands back the lse for ``--check``); the library does its own ring (K and V as two messages,
a dK/dV ring in fp32 behind it) and calls flash-attn's interface for every block: on GPU
flash-attn itself, on CPU cpbench's CPU implementation of that interface
(``kernels.flash_attn_cpu``, the aten CPU flash kernel ``sdpa-cpu`` uses).

Layouts, as the library's own tests shard inputs: zigzag, chunks r and 2N-1-r of 2N (its
twin ``zigzag``); ring, contiguous shards (``ring``); stripe, token i on rank i mod N. Zigzag
and stripe are causal only (the library asserts it).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from cpbench.strategies import register
from cpbench.strategies._upstream import (
    check_flash_kernel,
    device_of,
    flash_attn_beneath,
    import_algorithms,
    no_schedule,
    unsupported_dtype,
)
from cpbench.strategies.base import Strategy, Upstream
from cpbench.strategies.layout import ZigzagLayout, check_divisible, contiguous_index

PACKAGE, MODULE = "ring-flash-attn", "ring_flash_attn"


class _RingFlashAttn(Strategy):
    """One of ring-flash-attn's functions over the CP group."""

    module: ClassVar[str]  # the library's file of the algorithm
    function: ClassVar[str]

    def __init__(self, *args, create_groups: bool = True, **kwargs):
        super().__init__(*args, create_groups=create_groups, **kwargs)
        self.beneath = None
        if create_groups:  # about to run: the library and the flash-attn under it
            self.beneath = flash_attn_beneath(device_of(self.kernel))
            self.fn = getattr(import_algorithms(MODULE, self.module), self.function)

    def validate(self) -> None:
        check_flash_kernel(self)
        unsupported_dtype(self)
        super().validate()

    def group_lists(self):
        return {"rfa": self.cp_lists}

    def attention(self, q, k, v):
        out, lse, _ = self.fn(q, k, v, softmax_scale=self.attn.softmax_scale,
                              causal=self.attn.causal, return_attn_probs=True,
                              group=self.groups["rfa"].pg)
        return out, lse

    def provenance(self) -> dict:
        return {**super().provenance(), "flash_attn": self.beneath}

    def schedule(self):
        no_schedule(self)


@register
class RfaZigzag(ZigzagLayout, _RingFlashAttn):
    name = "rfa-zigzag"
    description = "ring-flash-attn's zigzag_ring_flash_attn_func (the library's own code)"
    upstream = Upstream(PACKAGE, MODULE, twin="zigzag")
    causal_only = True
    module, function = "zigzag_ring_flash_attn", "zigzag_ring_flash_attn_func"


@register
class RfaRing(_RingFlashAttn):
    name = "rfa-ring"
    description = "ring-flash-attn's ring_flash_attn_func (the library's own code)"
    upstream = Upstream(PACKAGE, MODULE, twin="ring")
    module, function = "ring_flash_attn", "ring_flash_attn_func"

    def validate(self) -> None:
        super().validate()
        check_divisible(self.attn.seqlen, self.cp_size, f"{self.name} over {self.cp_size} "
                        f"ranks")

    def seq_index(self, rank: int) -> torch.Tensor:
        return contiguous_index(self.attn.seqlen, self.cp_size, self.cp_index(rank))


@register
class RfaStripe(_RingFlashAttn):
    name = "rfa-stripe"
    description = ("ring-flash-attn's stripe_flash_attn_func: token i on rank i mod N "
                   "(the library's own code)")
    upstream = Upstream(PACKAGE, MODULE)
    causal_only = True
    module, function = "stripe_flash_attn", "stripe_flash_attn_func"

    def validate(self) -> None:
        super().validate()
        check_divisible(self.attn.seqlen, self.cp_size, f"{self.name} over {self.cp_size} "
                        f"ranks")

    def seq_index(self, rank: int) -> torch.Tensor:
        return torch.arange(self.cp_index(rank), self.attn.seqlen, self.cp_size)
