"""Attention sinks on real gloo ranks: every cpbench strategy (and its variants: Ulysses with
K/V heads replicated, USP's three ring strategies, double ring and burst on one and two
levels, llama3's layouts and head chunks, TE's a2a+p2p) adds the sink once per query and
returns its gradient, compared with the float64 reference (out, lse, dq, dk, dv, dsinks)
plain, under documents and under a window, and held to its declared schedule (sinks add no
traffic: their gradient's sum over the ranks is the data-parallel reduction's). The negative
control: ring with the sink added to each block before the merge fails the check."""

from __future__ import annotations

import pytest
from rankpool import run_ranks
from sink_bodies import per_block_sink_check
from strategy_matrix import check_named_cases

from cpbench import strategies
from cpbench.config import AttentionConfig

pytestmark = pytest.mark.multirank

S = 64  # 4 ranks: shards of 16, zigzag chunks of 8


def _attn(**kw):
    return AttentionConfig(**{**dict(batch=1, seqlen=S, heads=4, kv_heads=2, head_dim=8,
                                     dtype="fp32", causal=True, sinks=True), **kw})


def _case(name, attn=None, **opts):
    return name, attn or _attn(), strategies.get(name).Options(**opts)


def _cases():
    own = [n for n in strategies.names() if strategies.get(n).upstream is None]
    assert all(strategies.get(n).takes_sinks for n in own), "every cpbench strategy"
    cases = [_case(n) for n in own]
    masks = {"documents": dict(documents=(24, 8, 32)), "window": dict(window_size=(5, 0))}
    cases += [_case(n, _attn(**masks[kind])) for n in own
              for kind in sorted(strategies.get(n).masks)]
    cases += [
        _case("ring", _attn(causal=False, batch=2)),
        _case("zigzag", _attn(dtype="bf16")),
        _case("ulysses", _attn(kv_heads=1)),  # K/V replicated 4 times
        _case("usp", _attn(kv_heads=None), ulysses_degree=2, ring_impl="ring"),
        _case("usp", _attn(kv_heads=None), ulysses_degree=2, ring_impl="double-ring"),
        _case("usp", _attn(kv_heads=None, window_size=(5, 0)), ulysses_degree=4),
        _case("double-ring", window=4),
        _case("burst", double_ring=False, opt_bwd=False),
        _case("llama3", layout="contiguous", heads_k_stride=1),
    ]
    return cases


def test_every_strategy_adds_the_sink_once_per_query():
    failures = run_ranks(check_named_cases, 4, 2, _cases(), timeout=600)[0]
    assert not failures, "\n".join(failures)


def test_a_sink_added_once_per_block_fails_the_check():
    verdicts = run_ranks(per_block_sink_check, 4, 2, _attn(), 11)[0]
    assert set(verdicts) == {"out", "lse", "dq", "dk", "dv", "dsinks"}
    assert not verdicts["out"] and not verdicts["lse"] and not verdicts["dsinks"], verdicts
