"""The upstream libraries' own code as strategies, on real gloo ranks: every adapter that runs
on CPU × world × causal / full × GQA × dtype, gathered into global order and compared with the
float64 reference (out, dq, dk, dv, and lse where the library returns it); the layouts are the
libraries' own (yunchang's helpers, torch's load balancer)."""

from __future__ import annotations

import pytest
from rankpool import run_ranks
from strategy_matrix import check_cases
from upstream_bodies import yunchang_groups_across_builds, yunchang_layout_matches_its_helpers

from cpbench import strategies, torchcompat
from cpbench.config import AttentionConfig
from cpbench.topology import Topology

SEQLEN, HEADS, GQA_KV_HEADS = 96, 8, 2
# ring-flash-attn and yunchang are written for flash-attn (bf16 / fp16; wrong in fp32, which
# the strategies refuse); torch's ring takes fp32 too
DTYPES = {"torch-ring": ("fp32", "bf16")}
OPTIONS = {"torch-ring": [{}, {"rotate_method": "alltoall"}]}


def _cases(name: str, topo: Topology) -> list:
    """Every variant × causal / full × MHA / GQA × dtype."""
    cls = strategies.get(name)
    dtypes = DTYPES.get(name, ("bf16", "fp16"))
    options = [cls.Options(**o) for o in OPTIONS[name]] if name in OPTIONS \
        else cls.variants(topo)
    cases = []
    for opts in options:
        for causal in (True, False):
            for kv_heads in (None, GQA_KV_HEADS):
                for dtype in dtypes:
                    attn = AttentionConfig(batch=2, seqlen=SEQLEN, heads=HEADS, kv_heads=kv_heads,
                                           head_dim=16, dtype=dtype, causal=causal)
                    if _runs(cls, attn, topo, opts):
                        cases.append((attn, opts))
    return cases


def _runs(cls, attn, topo, opts) -> bool:
    """Whether the strategy takes this config (what it refuses is tested in the unit layer)."""
    from cpbench import kernels
    from cpbench.errors import UsageError

    if cls.causal_only and not attn.causal:
        return False
    try:
        cls(attn, topo, 0, kernel=kernels.get("sdpa-cpu"), options=opts, create_groups=False)
    except UsageError:
        return False
    return True


ON_CPU = ["rfa-zigzag", "rfa-ring", "rfa-stripe", "yunchang-usp", "torch-ring"]
# checked in test_mask_matrix.py instead, in its launches (causal and full, documents, windows)
ELSEWHERE = {"rfa-llama3"}


# every adapter at 8 ranks too: ring-flash-attn's rings take more steps there (zigzag's
# halves and stripe's strides over 8), not only the meshes of yunchang and torch
@pytest.mark.parametrize("world,rpn", [(2, 1), (4, 2), (8, 4)], ids=str)
@pytest.mark.parametrize("name", ON_CPU)
def test_upstream_matches_reference(name, world, rpn):
    if why := strategies.get(name).unavailable("cpu"):  # torch-ring below torch 2.10
        pytest.skip(why)
    topo = Topology(world_size=world, ranks_per_node=rpn)
    cases = _cases(name, topo)
    assert cases, f"{name} runs no case on {topo.describe()}"
    failures = [f for rank_failures in run_ranks(check_cases, world, name, rpn, cases, [],
                                                 timeout=240)
                for f in rank_failures]
    assert not failures, "\n".join(failures)


def test_every_adapter_that_runs_on_cpu_is_covered():
    adapters = set(strategies.names()) - set(strategies.own_names())
    on_cpu = {n for n in adapters if strategies.get(n).unavailable("cpu") is None}
    # torch's own CP from 2.10 only (torchcompat.CP_SINCE): below, skipped naming it
    older = set() if torchcompat.VERSION >= torchcompat.CP_SINCE else {"torch-ring"}
    assert on_cpu == (set(ON_CPU) | ELSEWHERE) - older


@pytest.mark.parametrize("options", [
    dict(ring_impl="zigzag", placement="head-first"), dict(ring_impl="zigzag",
                                                           placement="ring-first"),
    dict(ring_impl="basic", placement="head-first")], ids=str)
def test_yunchang_layout_is_its_own_helpers(options):
    """The layout cpbench shards yunchang-usp's inputs by is what yunchang's own helpers
    (EXTRACT_FUNC_DICT, as its tests use them) give every rank."""
    for got, want in run_ranks(yunchang_layout_matches_its_helpers, 4, 2, options, timeout=120):
        assert got == want


def test_yunchang_makes_its_groups_once_through_the_cache():
    """yunchang's set_seq_parallel_pg calls new_group at every build; through cpbench's group
    cache the communicators are made once and reused by later cases (they do not pile up),
    and they are the cache's, so each case's timeout applies to them."""
    for counts, same, cached in run_ranks(yunchang_groups_across_builds, 4, timeout=120):
        assert counts[0] == counts[1] == counts[2], counts
        assert same and cached
