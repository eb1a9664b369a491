"""torch-flex's layouts, planned on the host without compiling anything: each balancer's
permutation is torch's own (its classes called as torch's CP calls them), and the block
counts PTRR reads are computed from cpbench's mask; held here equal to the counts of torch's
own ``create_block_mask`` of the same mask (run eagerly at a small size)."""

from __future__ import annotations

import pytest
import torch

from cpbench import kernels, strategies
from cpbench.config import AttentionConfig
from cpbench.errors import Skipped, UsageError
from cpbench.mask import mask_of
from cpbench.strategies import torch_flex
from cpbench.topology import Topology

S = 1024
TOPO = Topology(world_size=4, ranks_per_node=2)


def _attn(**kw) -> AttentionConfig:
    return AttentionConfig(**{**dict(batch=1, seqlen=S, heads=4, head_dim=16, dtype="bf16",
                                     causal=True), **kw})


def _every_rank(attn, balancer):
    cls = strategies.get("torch-flex")
    return [cls(attn, TOPO, r, kernel=kernels.get("sdpa-cpu"),
                options=cls.Options(load_balancer=balancer), create_groups=False)
            for r in range(TOPO.world_size)]


@pytest.mark.parametrize("mask", [dict(), dict(documents=(512, 136, 376)),
                                  dict(window_size=(200, 0)), dict(causal=False),
                                  dict(documents=(300, 600, 124), window_size=(150, 7))])
def test_ptrr_block_counts_are_torchs(mask):
    from torch.nn.attention.flex_attention import create_block_mask

    m = mask_of(_attn(**mask))
    bm = create_block_mask(torch_flex._mask_mod(m, S, "cpu"), 1, 1, S, S, device="cpu",
                           _compile=False)
    want = (bm.kv_num_blocks + bm.full_kv_num_blocks).flatten()
    assert torch.equal(torch_flex._block_counts(m, S), want.long())


@pytest.mark.parametrize("balancer", torch_flex.BALANCERS)
def test_every_balancer_is_a_permutation_of_the_sequence(balancer):
    attn = _attn(documents=(512, 136, 376))
    held = torch.cat([st.seq_index(st.rank) for st in _every_rank(attn, balancer)])
    assert torch.equal(held.sort().values, torch.arange(S))
    if balancer == "head-tail":  # llama3's zigzag layout, its twin
        llama3 = strategies.get("llama3")(attn, TOPO, 0, kernel=kernels.get("sdpa-cpu"),
                                          create_groups=False)
        assert all(torch.equal(llama3.seq_index(r), st.seq_index(r))
                   for r, st in enumerate(_every_rank(attn, balancer)))


def test_what_torch_cannot_take_is_refused_on_construction():
    with pytest.raises(UsageError, match="multiple of 4 ranks x 128"):
        _every_rank(_attn(seqlen=768), "head-tail")
    with pytest.raises(Skipped, match="divides by 8"):
        _every_rank(_attn(documents=(500, 524)), "per-document")
    with pytest.raises(Skipped, match="without --documents"):
        _every_rank(_attn(), "per-document")


def test_refused_on_cpu_with_the_reason():
    why = strategies.get("torch-flex").unavailable("cpu")
    assert "no backward on cpu" in why
