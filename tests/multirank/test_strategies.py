"""Every registered strategy × world size × causal/non-causal × GQA × dtype, gathered into
global order and compared with the float64 single-process reference (out, lse, dq, dk, dv);
and every strategy's declared communication schedule against the bytes it really sends and
where it sends them (before or after each step's kernel, which the simulator reads).
One launch per (strategy, topology) runs all of its cases: starting ranks is the slow part."""

from __future__ import annotations

import pytest
from rankpool import run_ranks
from strategy_matrix import check_cases, check_each_strategy

from cpbench import kernels, strategies
from cpbench.config import AttentionConfig
from cpbench.topology import Topology

# (world, ranks per node): world 1 is the degenerate ring of one; world 4 = 2 nodes × 2, world 8
# = 2 × 4 and 4 × 2, so two-level strategies really have several inner rings.
TOPOLOGIES = [(1, 1), (2, 1), (4, 2), (8, 4), (8, 2)]
SEQLEN = 96  # divisible by 2·N·(ulysses splits) for every world size here; small but not tiny
# 8 query heads divide every world size (Ulysses runs at world 8); 2 KV heads exercise GQA and,
# at world 4 and 8, Ulysses' K/V head replication. Every variant a strategy offers must run.
HEADS, GQA_KV_HEADS = 8, 2
# every strategy of cpbench's own, llama3 included, at every topology
MATRIX = list(strategies.own_names())
DTYPE_CASES = ((None, "fp32"), (GQA_KV_HEADS, "fp32"), (None, "bf16"), (GQA_KV_HEADS, "fp16"))


def _layout(cls, topo) -> list:
    """What a topology changes for a strategy: each variant's resolved options and groups."""
    attn = AttentionConfig(batch=1, seqlen=SEQLEN, heads=HEADS, head_dim=16, dtype="bf16")
    out = []
    for opts in cls.variants(topo):
        st = cls(attn, topo, 0, kernel=kernels.get("sdpa-cpu"), options=opts,
                 create_groups=False)
        out.append((st.resolved_options(), {n: g.ranks for n, g in st.groups.items()}))
    return out


def _node_blind(cls, world, rpn) -> bool:
    """Whether another node size at this world changes nothing the strategy does (then the
    8-rank matrix runs once, on 2 nodes x 4: 8-rank launches are the slow part on 2 cores)."""
    return rpn != 4 and _layout(cls, Topology(world_size=world, ranks_per_node=rpn)) == \
        _layout(cls, Topology(world_size=world, ranks_per_node=4))


def _cases(cls, topo):
    cases, traffic = [], []
    for opts in cls.variants(topo):
        for causal in (True, False):
            if cls.causal_only and not causal:
                continue
            for kv_heads, dtype in DTYPE_CASES:  # every one at 8 ranks too (fp16 GQA there)
                attn = AttentionConfig(batch=2, seqlen=SEQLEN, heads=HEADS, kv_heads=kv_heads,
                                       head_dim=16, dtype=dtype, causal=causal)
                cases.append((attn, opts))
        # bf16 so byte counts would expose a message sent in the wrong dtype
        traffic.append((AttentionConfig(batch=1, seqlen=SEQLEN, heads=HEADS,
                                        kv_heads=GQA_KV_HEADS, head_dim=8, dtype="bf16",
                                        causal=True), opts))
    return cases, traffic


@pytest.mark.parametrize("world,rpn", TOPOLOGIES, ids=lambda x: str(x))
@pytest.mark.parametrize("name", MATRIX)
def test_matches_reference_and_schedule(name, world, rpn):
    cls = strategies.get(name)
    if world == 8 and _node_blind(cls, world, rpn):
        pytest.skip(f"{name} does the same on 4 x 2 as on 2 x 4 (checked there)")
    topo = Topology(world_size=world, ranks_per_node=rpn)
    cases, traffic = _cases(cls, topo)
    assert cases and traffic
    failures = [f for rank_failures in run_ranks(check_cases, world, name, rpn, cases, traffic,
                                                 timeout=240)
                for f in rank_failures]
    assert not failures, "\n".join(failures)


# Option sets no strategy offers as a variant, and the plain-torch kernel: checked once on
# 2 nodes × 4 so two-level rings and both placements are real.
EXTRA_OPTIONS = {
    "usp": [dict(ring_impl="ring"), dict(ring_impl="ring", placement="ring-first"),
            dict(ulysses_degree=2, placement="ring-first", ring_impl="double-ring")],
    "burst": [dict(double_ring=True, opt_bwd=False), dict(double_ring=False, opt_bwd=True)],
    "double-ring": [dict(window=1), dict(window=8)],
    "llama3": [dict(heads_k_stride=1)],
}


def _kernel_and_option_cases(name: str, topo: Topology) -> tuple[list, list]:
    cls = strategies.get(name)
    kernel_cases, option_cases = [], []
    for causal, kv_heads, dtype in ((True, GQA_KV_HEADS, "fp32"), (False, None, "bf16")):
        if cls.causal_only and not causal:
            continue
        attn = AttentionConfig(batch=1, seqlen=SEQLEN, heads=HEADS, kv_heads=kv_heads,
                               head_dim=16, dtype=dtype, causal=causal)
        kernel_cases.append((attn, cls.variants(topo)[0]))
        option_cases += [(attn, cls.Options(**o)) for o in EXTRA_OPTIONS.get(name, [])]
    return kernel_cases, option_cases


def test_torch_kernel_and_extra_options():
    """Every strategy with the plain-torch kernel, and the extra option sets: two 8-rank
    launches for all of them (a launch each would cost CI time for nothing more)."""
    topo = Topology(world_size=8, ranks_per_node=4)
    split = {name: _kernel_and_option_cases(name, topo) for name in MATRIX}
    kernel = [(name, k, []) for name, (k, _) in split.items()]
    options = [(name, o, o[:1]) for name, (_, o) in split.items() if o]
    assert len(kernel) == len(MATRIX) and options
    failures = run_ranks(check_each_strategy, 8, 4, kernel, "torch", timeout=480)[0]
    failures += run_ranks(check_each_strategy, 8, 4, options, timeout=480)[0]
    assert not failures, "\n".join(failures)
