"""ulysses' declared schedule against hand-computed all-to-all volumes (no processes), and its
pure pieces: K/V replication for GQA and the validation message."""

from __future__ import annotations

import pytest
import torch
from schedule_helpers import build, totals

from cpbench import kernels, strategies
from cpbench.config import AttentionConfig
from cpbench.strategies.ulysses import _RepeatKV, kv_replicas
from cpbench.topology import Topology


def _build(world, rpn, rank=0, **attn):
    return build("ulysses", world, rpn, rank, **attn)


def _totals(st):
    return totals(st, ("phase", "op", "group"))


@pytest.mark.parametrize("kv_heads,kv_per_rank_total", [(None, 8), (8, 8), (4, 4), (2, 4), (1, 4)])
def test_bytes_hand_computed(kv_heads, kv_per_rank_total):
    """N=4, S=64 → s=16 local tokens; every all-to-all keeps 1/N of its buffer at home.
    K/V heads after replication: lcm(kv_heads, N) (kv_per_rank_total here)."""
    b, S, h, d, elt, n = 2, 64, 8, 16, 2, 4
    s = S // n
    st = _build(n, 2, batch=b, seqlen=S, heads=h, kv_heads=kv_heads, head_dim=d, dtype="bf16")
    q = (n - 1) * b * s * h * d * elt // n  # q, out, dout, dq each
    kv = (n - 1) * 2 * b * s * kv_per_rank_total * d * elt // n  # k and v (or dk and dv)
    # the lse goes back only for a check (not timed): yunchang, DeepSpeed and TE send out alone
    assert _totals(st) == {("fwd", "a2a", "ulysses"): q + kv + q,
                           ("bwd", "a2a", "ulysses"): q + q + kv}
    # concretely, MHA: q = 3/4 · 2·16·8·16·2 = 6144 bytes
    if kv_heads is None:
        assert q == 6144 and kv == 12288


def test_messages_exposed_and_node_crossing():
    for rpn, crosses in ((2, True), (4, False)):
        st = _build(4, rpn, rank=3, batch=1, seqlen=64, heads=4, head_dim=8)
        msgs = [m for step in st.schedule() for m in step.messages]
        assert len(msgs) == 8  # q, k, v, out; dout, dq, dk, dv
        assert all(m.op == "a2a" and m.group == "ulysses" for m in msgs)
        assert all(m.crosses_nodes is crosses and not m.overlapped for m in msgs)


@pytest.mark.parametrize("causal", [True, False])
def test_flops_are_a_slice_of_heads(causal):
    b, S, h, d, n = 1, 64, 8, 16, 4
    st = _build(n, 2, batch=b, seqlen=S, heads=h, head_dim=d, causal=causal)
    fwd = 4 * b * S * S * (h // n) * d / (2 if causal else 1)
    assert sum(s.flops for s in st.schedule() if s.phase == "fwd") == fwd
    assert sum(s.flops for s in st.schedule() if s.phase == "bwd") == 2.5 * fwd


def test_kv_replicas():
    assert kv_replicas(8, 4) == 1  # split
    assert kv_replicas(2, 4) == 2  # each K/V head to the 2 ranks whose queries read it
    assert kv_replicas(1, 8) == 8  # MQA
    assert kv_replicas(3, 4) == 4  # 12 heads: one copy per query head on 12-head models
    assert kv_replicas(6, 4) == 2


def test_replica_gradients_sum_in_fp32():
    kv = torch.randn(1, 3, 2, 4, dtype=torch.bfloat16, requires_grad=True)
    rep = _RepeatKV.apply(kv, 3)
    assert torch.equal(rep, kv.repeat_interleave(3, dim=2))
    grad = torch.randn(rep.shape, dtype=torch.bfloat16)
    rep.backward(grad)
    want = grad.float().unflatten(2, (2, 3)).sum(3).to(torch.bfloat16)
    assert torch.equal(kv.grad, want)


def test_heads_must_divide_by_ranks():
    # what works: usp's split of these ranks into Ulysses groups and a ring; no
    # flag for the rank count (run's --nproc, dryrun's --nodes x --gpus-per-node differ)
    with pytest.raises(ValueError, match=r"heads \(6\) divisible by 4, "
                                         r"or --strategy usp --ulysses-degree 2$"):
        _build(4, 2, batch=1, seqlen=64, heads=6, head_dim=8)
    with pytest.raises(ValueError, match=r"divisible by 8, or --strategy usp --ulysses-degree 4$"):
        _build(8, 4, batch=1, seqlen=64, heads=4, head_dim=8)
    with pytest.raises(ValueError, match="try --seqlen 64"):
        _build(4, 2, batch=1, seqlen=66, heads=4, head_dim=8)


def test_layout_contiguous_over_cp_lists():
    topo = Topology(world_size=4, ranks_per_node=2)
    st = strategies.get("ulysses")(AttentionConfig(seqlen=16, heads=4), topo, 3,
                                   kernel=kernels.get("sdpa-cpu"), create_groups=False,
                                   cp_lists=[[3, 2], [1, 0]])
    assert st.groups["ulysses"].ranks == (3, 2)
    assert st.seq_index(3).tolist() == list(range(8))  # first in its list
    assert st.seq_index(0).tolist() == list(range(8, 16))
