"""The simulator's memory model against the dry run (the real code's allocations on fake
tensors): within 10 % for every own strategy and variant, with and without GQA, bf16 and fp32,
on one node and across nodes. Memory scales exactly with S·B, so a small S stands for any."""

import pytest

from cpbench.bench import dryrun
from cpbench.bench.plan import expand_cases
from cpbench.config import AttentionConfig
from cpbench.errors import Skipped, UsageError
from cpbench.sim import model
from cpbench.topology import Topology

OWN = ("ring", "zigzag", "megatron-cp", "megatron-cp-a2a+p2p", "double-ring", "burst",
       "ulysses", "usp", "llama3", "local")
SHAPES = {  # (world, ranks per node, heads, kv heads, dtype)
    "2x2-mha-bf16": (4, 2, 4, None, "bf16"),
    "1x4-gqa-fp32": (4, 4, 8, 2, "fp32"),
    "2x4-mha-bf16": (8, 4, 8, None, "bf16"),  # usp's placements, double rings across nodes
}


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_memory_model_is_within_ten_percent_of_the_real_code(shape):
    world, rpn, heads, kv_heads, dtype = SHAPES[shape]
    topo = Topology(world_size=world, ranks_per_node=rpn)
    attn = AttentionConfig(seqlen=512, heads=heads, kv_heads=kv_heads, head_dim=64,
                           dtype=dtype, causal=True)
    off = []
    for case in expand_cases(OWN, {}, topo):
        try:
            estimate = model.memory_estimate(case.strategy, case.options, attn, topo)
        except (UsageError, Skipped):  # a case this shape cannot run: not a finding
            continue
        ranks = dryrun.distinct_ranks(case.strategy, case.options, attn, topo,
                                      kernel_name="sdpa-cpu")
        peak = max(dryrun.dry_rank(case.strategy, case.options, attn, topo, r,
                                   kernel_name="sdpa-cpu", device="cpu").peak_fwd_bwd_bytes
                   for r in ranks)
        if abs(estimate / peak - 1) > 0.10:
            off.append(f"{case.label}: model {estimate / peak - 1:+.0%}")
    assert not off, off
