"""A strategy refuses what it cannot compute wherever it is built from, not only in the driver:
built through the Python API (as a third-party harness would), a strategy raises on
construction under a mask it does not declare, and a causal-only one on full attention,
before any group or library is touched. (burst under documents once gave a right forward and
gradients wrong by 10^7 relative; torch-ring a wrong forward.)"""

from __future__ import annotations

import pytest

from cpbench import kernels, strategies
from cpbench.config import AttentionConfig
from cpbench.errors import Skipped, UsageError
from cpbench.mask import mask_of
from cpbench.topology import Topology

TOPO = Topology(world_size=4, ranks_per_node=2)
MASKS = {"documents": dict(documents=(96, 24, 8)), "window": dict(window_size=(16, 0))}


def _attn(**kw) -> AttentionConfig:
    return AttentionConfig(**{**dict(batch=1, seqlen=128, heads=4, head_dim=16, dtype="bf16",
                                     causal=True), **kw})


def _build(name: str, attn: AttentionConfig, create_groups: bool = False):
    return strategies.get(name)(attn, TOPO, 0, kernel=kernels.get("sdpa-cpu"),
                                create_groups=create_groups)


@pytest.mark.parametrize("name", ["burst", "torch-ring"])
def test_burst_and_torch_ring_refuse_documents_on_construction(name):
    with pytest.raises(Skipped, match="does not support --documents"):
        _build(name, _attn(**MASKS["documents"]))
    # with groups asked for too: the refusal comes first (no process group exists here)
    with pytest.raises(Skipped, match="does not support --documents"):
        _build(name, _attn(**MASKS["documents"]), create_groups=True)


def test_every_strategy_refuses_every_mask_it_does_not_declare():
    refused = []
    for name in strategies.names():
        cls = strategies.get(name)
        for kind in sorted(set(MASKS) - cls.masks):
            with pytest.raises(Skipped) as e:
                _build(name, _attn(**MASKS[kind]))
            assert str(e.value) == cls.unsupported_mask(mask_of(_attn(**MASKS[kind]))), name
            refused.append((name, kind))
    assert ("burst", "documents") in refused and ("torch-ring", "window") in refused


def test_causal_only_strategies_refuse_full_attention_on_construction():
    causal_only = [n for n in strategies.names() if strategies.get(n).causal_only]
    assert causal_only
    for name in causal_only:
        with pytest.raises(UsageError, match="only runs causal"):
            _build(name, _attn(causal=False))


def test_strategies_that_cannot_add_sinks_refuse_them_on_construction():
    """The library adapters (te, rfa, yunchang-usp, torch-ring, torch-flex) take no attention
    sink; each says so in one line, before any group is made. cpbench's own take them."""
    refused = []
    for name in strategies.names():
        if strategies.get(name).takes_sinks:
            assert strategies.get(name).upstream is None, name
            _build(name, _attn(sinks=True))
            continue
        with pytest.raises(Skipped, match="cannot add attention sinks once per query") as e:
            _build(name, _attn(sinks=True), create_groups=True)
        assert "\n" not in str(e.value) and len(f"error: {e.value}") <= 120, str(e.value)
        refused.append(name)
    assert {"te-p2p", "rfa-ring", "yunchang-usp", "torch-ring", "torch-flex"} <= set(refused)
