"""``cpbench.bench.dryrun`` on fake CUDA with kernel flash-attn at a production size: every own
strategy (each variant its class offers on the topology, but those declared refused with their
exception in ``fake_variants``) runs forward and backward as every distinct rank (ranks alike
in shard, groups and schedule run once), with status ok, and the bytes it sends per phase,
collective and group equal its declared schedule."""

from __future__ import annotations

from collections import Counter

import fake_variants
import pytest

from cpbench import kernels, strategies
from cpbench.bench import dryrun
from cpbench.config import AttentionConfig
from cpbench.topology import Topology

ATTN = AttentionConfig(batch=1, seqlen=512 * 1024, heads=40, kv_heads=40, head_dim=128,
                       dtype="bf16", causal=True)
TOPO = Topology(world_size=32, ranks_per_node=8)  # 4 nodes x 8
KERNEL = "flash-attn"
# commtrace's op names → the schedule's
_OPS = {"p2p": "p2p", "all_to_all_single": "a2a", "all_gather": "ag",
        "reduce_scatter_tensor": "rs"}


def declared(name, opts, rank, attn=ATTN, topo=TOPO, kernel=KERNEL) -> Counter:
    """The schedule's bytes per (phase, op, group members)."""
    st = strategies.get(name)(attn, topo, rank, kernel=kernels.get(kernel), options=opts,
                              create_groups=False)
    out = Counter()
    for step in st.schedule():
        for m in step.messages:
            members = tuple(sorted(st.groups[m.group].ranks))
            out[(step.phase, m.op, members)] += m.nbytes
    return out


def measured(result) -> Counter:
    out = Counter()
    for phase, events in result.events.items():
        for e in events:
            out[(phase, _OPS[e.op], tuple(sorted(e.group)))] += e.nbytes
    return out


@pytest.mark.parametrize("name,opts", fake_variants.params(TOPO))
def test_every_distinct_rank_runs_forward_and_backward(name, opts, flash_attn):
    if not fake_variants.builds(name, opts, ATTN, TOPO, KERNEL):
        return  # its declared refusal, raised as declared (fake_variants.REFUSED)
    # no fake_streams fixture: dry_rank brings its own stream stand-ins on CUDA
    reps = dryrun.distinct_ranks(name, opts, ATTN, TOPO, kernel_name=KERNEL)
    assert sorted(r for ranks in reps.values() for r in ranks) == list(range(TOPO.world_size))
    for rank in reps:
        r = dryrun.dry_rank(name, opts, ATTN, TOPO, rank, kernel_name=KERNEL, device="cuda")
        assert r.status == "ok", (rank, r.error, r.where)
        assert set(r.events) == {"fwd", "bwd"}
        assert 0 < r.peak_fwd_bytes <= r.peak_fwd_bwd_bytes
        assert measured(r) == {k: v for k, v in declared(name, opts, rank).items() if v}, rank


# torch's own CUDA kernel (kernels.sdpa): dense, and varlen under documents and a window
SMALL = Topology(world_size=8, ranks_per_node=4)
PLAIN = AttentionConfig(batch=1, seqlen=64 * 1024, heads=40, kv_heads=40, head_dim=128,
                        dtype="bf16", causal=True)
MASKED = AttentionConfig(batch=1, seqlen=64 * 1024, heads=40, kv_heads=40, head_dim=128,
                         dtype="bf16", causal=True, documents=(32768, 16384, 8192, 8192),
                         window_size=(4096, 0))


@pytest.mark.parametrize("attn", [PLAIN, MASKED], ids=["plain", "documents+window"])
@pytest.mark.parametrize("name", ["zigzag", "ring", "megatron-cp", "llama3", "usp"])
def test_own_strategies_on_the_sdpa_kernel(name, attn):
    opts = strategies.get(name).Options()
    for rank in dryrun.distinct_ranks(name, opts, attn, SMALL, kernel_name="sdpa"):
        r = dryrun.dry_rank(name, opts, attn, SMALL, rank, kernel_name="sdpa", device="cuda")
        assert r.status == "ok", (rank, r.error, r.where)
        assert 0 < r.peak_fwd_bytes <= r.peak_fwd_bwd_bytes
        want = declared(name, opts, rank, attn, SMALL, "sdpa")
        assert measured(r) == {k: v for k, v in want.items() if v}, rank
