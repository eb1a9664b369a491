"""cpbench's own strategies on fake CUDA with kernel flash-attn, at a production size: groups
built on torch's fake process group, the forward run on fake tensors, what it sends traced
(cpbench.comm's trace by group name, cpbench.bench.commtrace's at torch.distributed) and held
to the strategy's declared schedule (the CPU suite does the same at small sizes with real
numbers: tests/multirank/strategy_matrix.py)."""

from __future__ import annotations

from collections import Counter

import fake_variants
import pytest
import torch
from schedule_helpers import volume

from cpbench import comm, kernels, strategies
from cpbench.bench.commtrace import traced
from cpbench.config import AttentionConfig
from cpbench.strategies.base import FWD
from cpbench.topology import Topology

S, H, D = 512 * 1024, 40, 128
ATTN = AttentionConfig(batch=1, seqlen=S, heads=H, kv_heads=H, head_dim=D, dtype="bf16",
                       causal=True)
TOPO = Topology(world_size=32, ranks_per_node=8)  # 4 nodes x 8
# commtrace's op names → the schedule's
_OPS = {"p2p": "p2p", "all_to_all_single": "a2a", "all_gather": "ag",
        "reduce_scatter_tensor": "rs"}


def run_forward(name, options, world, rpn, rank):
    """Strategy ``name`` for ``rank`` on the (already initialized) fake process group, its
    forward run on fake CUDA; returns (strategy, out, lse, comm trace, commtrace events)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cls = strategies.get(name)
    st = cls(ATTN, Topology(world_size=world, ranks_per_node=rpn), rank,
             kernel=kernels.get("flash-attn"), options=options)
    with FakeTensorMode():
        x = torch.empty(ATTN.batch, S, H, D, device="cuda", dtype=torch.bfloat16)
        q, k, v = (st.shard(x).clone().requires_grad_() for _ in range(3))
        with traced() as events, comm.trace() as sent:
            out, lse = st.attention(q, k, v)
    return st, q, out, lse, sent, events


def test_zigzag_forward_at_512k_on_8_ranks(flash_attn, fake_pg):
    fake_pg(3, 8)
    st, q, out, lse, sent, events = run_forward("zigzag", None, 8, 8, 3)
    assert (out.shape, out.dtype, out.device.type) == (q.shape, torch.bfloat16, "cuda")
    assert q.shape == (1, S // 8, H, D)
    assert lse.shape == (1, H, S // 8) and lse.dtype == torch.float32
    kv = 2 * (S // 8) * H * D * 2  # K and V of one rank, bf16
    assert volume(st, FWD) == {("p2p", "ring"): 7 * kv}  # N-1 hops
    check_traffic(st, sent, events)
    # each of the 8 steps calls the kernel once (zigzag's causal halves: one call a step)
    assert sum(s.op == comm.KERNEL for s in sent) == 8


def check_traffic(st, sent, events):
    """Both traces against the declared forward schedule."""
    got = Counter()
    for s in sent:
        if s.op != comm.KERNEL:
            got[(s.op, s.group)] += s.nbytes
    want = volume(st, FWD)
    assert dict(got) == want
    # at torch.distributed: the same bytes per op, each on the members of a group of ours
    at_dist = Counter()
    for e in events:
        at_dist[_OPS[e.op]] += e.nbytes
    per_op = Counter()
    for (op, _), n in want.items():
        per_op[op] += n
    assert dict(at_dist) == dict(per_op)
    members = {tuple(sorted(g.ranks)) for g in st.groups.values()}
    assert {tuple(sorted(e.group)) for e in events} <= members


@pytest.mark.parametrize("name,options", fake_variants.params(TOPO))
def test_forward_of_every_own_strategy_on_4_nodes_of_8(name, options, flash_attn, fake_pg,
                                                       fake_streams):
    if not fake_variants.builds(name, options, ATTN, TOPO, "flash-attn"):
        return  # its declared refusal, raised as declared (fake_variants.REFUSED)
    # ranks 0 and 13 (second node, mid-ring): the fake group gives every rank's view alone
    for rank in (0, 13):
        fake_pg(rank, 32)
        st, q, out, lse, sent, events = run_forward(name, options, 32, 8, rank)
        assert (out.shape, out.dtype, out.device.type) == (q.shape, torch.bfloat16, "cuda")
        if lse is not None:
            assert lse.shape == (1, H, q.shape[1]) and lse.device.type == "cuda"
        check_traffic(st, sent, events)


# MLA's widths (DeepSeek-V3: Q/K 192, V 128) on the plain-torch kernel, the CUDA kernel that
# takes them (the flash kernels take one head dim and refuse)
MLA = AttentionConfig(batch=1, seqlen=64 * 1024, heads=H, head_dim=192, v_head_dim=128,
                      dtype="bf16", causal=True)


@pytest.mark.parametrize("name,options", fake_variants.params(TOPO))
def test_forward_at_unequal_head_dims_on_fake_cuda(name, options, fake_pg, fake_streams):
    if not fake_variants.builds(name, options, MLA, TOPO, "torch"):
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_pg(13, 32)
    st = strategies.get(name)(MLA, TOPO, 13, kernel=kernels.get("torch"), options=options)
    with FakeTensorMode():
        q, k, v = (st.shard(torch.empty(1, MLA.seqlen, h, d, device="cuda",
                                        dtype=torch.bfloat16)).clone().requires_grad_()
                   for h, d in (MLA.widths[n] for n in ("q", "k", "v")))
        with traced() as events, comm.trace() as sent:
            out, _ = st.attention(q, k, v)
    assert out.shape == (*q.shape[:3], 128) and out.dtype == torch.bfloat16
    check_traffic(st, sent, events)  # K and V at their own widths, as declared
