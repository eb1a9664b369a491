"""The simulator's memory model against the dry run on fake CUDA (flash-attn's interface on
fake tensors), where the masks run on the GPU's varlen path the model describes: every own
strategy and variant under packed documents and under a sliding window, within 10 %."""

from __future__ import annotations

import pytest

from cpbench.bench import dryrun
from cpbench.bench.plan import expand_cases
from cpbench.config import AttentionConfig
from cpbench.errors import Skipped, UsageError
from cpbench.sim import model
from cpbench.topology import Topology

OWN = ("ring", "zigzag", "megatron-cp", "megatron-cp-a2a+p2p", "double-ring", "burst",
       "ulysses", "usp", "llama3", "local")
TOPO = Topology(world_size=4, ranks_per_node=2)
MASKS = {"documents": dict(documents=(2048, 1024, 512, 512)), "window": dict(window_size=(511, 0))}


@pytest.mark.parametrize("mask", MASKS)
def test_memory_model_under_masks_is_within_ten_percent(mask):
    attn = AttentionConfig(seqlen=4096, heads=8, head_dim=64, dtype="bf16", causal=True,
                           **MASKS[mask])
    off, held = [], 0
    for case in expand_cases(OWN, {}, TOPO):
        try:
            estimate = model.memory_estimate(case.strategy, case.options, attn, TOPO)
        except (UsageError, Skipped):  # a strategy that does not take this mask
            continue
        ranks = dryrun.distinct_ranks(case.strategy, case.options, attn, TOPO,
                                      kernel_name="flash-attn")
        peak = max(dryrun.dry_rank(case.strategy, case.options, attn, TOPO, r,
                                   kernel_name="flash-attn", device="cuda").peak_fwd_bwd_bytes
                   for r in ranks)
        held += 1
        if abs(estimate / peak - 1) > 0.10:
            off.append(f"{case.label}: model {estimate / peak - 1:+.0%}")
    assert held >= 8 and not off, (held, off)
