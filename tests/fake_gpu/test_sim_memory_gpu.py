"""The simulator's memory model against the dry run on fake CUDA (flash-attn's interface on
fake tensors), where the masks run on the GPU's varlen path the model describes and the
backward holds FlashAttention-2's own buffers: every own strategy and variant under packed
documents, under a sliding window and under GQA (whose expanded dK / dV are 20-35 % of a
rank's peak here), within 10 %."""

from __future__ import annotations

import pytest
from optional_libs import require
from sim_memory_helpers import model_errors

from cpbench.config import AttentionConfig
from cpbench.topology import Topology

require("flash-attn")  # the dry runs below run flash-attn's interface on fake CUDA

MASKS = {"documents": dict(documents=(2048, 1024, 512, 512)), "window": dict(window_size=(511, 0))}


@pytest.mark.parametrize("mask", MASKS)
def test_memory_model_under_masks_is_within_ten_percent(mask):
    attn = AttentionConfig(seqlen=4096, heads=8, head_dim=64, dtype="bf16", causal=True,
                           **MASKS[mask])
    compared, off = model_errors(attn, Topology(world_size=4, ranks_per_node=2),
                                 kernel="flash-attn", device="cuda")
    assert compared >= 8 and not off, (compared, off)


def test_memory_model_under_gqa_is_within_ten_percent():
    attn = AttentionConfig(seqlen=4096, heads=8, kv_heads=2, head_dim=64, dtype="bf16",
                           causal=True)
    compared, off = model_errors(attn, Topology(world_size=4, ranks_per_node=2),
                                 kernel="flash-attn", device="cuda")
    assert compared >= 10 and not off, (compared, off)
