"""Unequal head dims (MLA: Q/K 24, V 16; and V wider than Q/K) on 4 real ranks (2 nodes x 2):
every variant of every cpbench strategy against the float64 reference (out, lse, dq, dk, dv),
causal and full, GQA, fp32 and bf16, packed documents where a strategy takes them; and each
one's declared schedule against the bytes it really sends (K and V each at its own width).
A ring that pads V to the Q/K width on its way fails (the negative control)."""

from __future__ import annotations

from head_dim_bodies import check_padded_v
from rankpool import run_ranks
from strategy_matrix import check_each_strategy

from cpbench import strategies
from cpbench.config import AttentionConfig
from cpbench.topology import Topology

WORLD, RPN = 4, 2
SEQLEN, HEADS = 96, 8


def _attn(**kw) -> AttentionConfig:
    return AttentionConfig(**{**dict(batch=1, seqlen=SEQLEN, heads=HEADS, head_dim=24,
                                     v_head_dim=16, dtype="fp32", causal=True), **kw})


def _cases(name: str) -> tuple[list, list]:
    cls = strategies.get(name)
    topo = Topology(world_size=WORLD, ranks_per_node=RPN)
    problems = [_attn(kv_heads=2), _attn(head_dim=16, v_head_dim=24, dtype="bf16")]
    if not cls.causal_only:
        problems.append(_attn(causal=False, kv_heads=4))
    if "documents" in cls.masks:
        problems.append(_attn(documents=(48, 24, 24), kv_heads=2))
    cases = [(a, opts) for opts in cls.variants(topo) for a in problems]
    # bf16: a message in the wrong dtype or at the wrong width shows in the bytes
    traffic = [(_attn(kv_heads=2, dtype="bf16"), opts) for opts in cls.variants(topo)]
    return cases, traffic


def test_every_strategy_matches_float64_and_its_schedule_at_unequal_widths():
    per_strategy = [(name, *_cases(name)) for name in strategies.own_names()]
    failures = run_ranks(check_each_strategy, WORLD, RPN, per_strategy, timeout=480)[0]
    assert not failures, "\n".join(failures)


def test_a_ring_padding_v_to_the_qk_width_fails_the_check():
    """Negative control: the same ring with V padded to the Q/K width and read back at V's
    shape (``head_dim_bodies.RingPaddingV``): the check FAILs out and the gradients, and
    passes the lse, which V does not touch (the check does not fail everything)."""
    verdicts = run_ranks(check_padded_v, WORLD, RPN, _attn(kv_heads=2), timeout=240)[0]
    assert verdicts["lse"] is True, verdicts
    assert not any(verdicts[t] for t in ("out", "dq", "dk", "dv")), verdicts
