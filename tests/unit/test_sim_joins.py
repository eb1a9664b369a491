"""Steps that wait for no other rank (``Step.joins`` False): the simulator times a run of them
by the slowest rank's own sum, not the sum of per-step maxima (``sim.terms.run``); llama3's
kernels after a gather are such a run, every other strategy's steps all join."""

from __future__ import annotations

import dataclasses

import pytest

from cpbench import ideal, strategies
from cpbench.config import AttentionConfig
from cpbench.metrics import attention_flops
from cpbench.sim import hardware, model, sharing, terms
from cpbench.strategies.base import BWD, FWD
from cpbench.topology import Topology

FAST = 1e15  # GB/s: too fast to matter


def flat(tflops: float = 1.0) -> hardware.Hardware:
    """Kernels at one rate whatever the block, free links, no step cost."""
    curve = [[1, tflops], [2, tflops]]
    return hardware.from_dict({
        "name": "flat", "gpus_per_node": 8, "nodes": 1, "memory_gib": 80.0,
        "peak_tflops_bf16": 2 * tflops,
        "kernel": {"fwd": curve, "bwd": curve, "step_overhead_us": 0.0},
        "intra_node": {"bandwidth_gbs": FAST, "latency_us": 0.0},
        "inter_node": {"bandwidth_gbs_per_gpu": FAST, "node_bandwidth_gbs": FAST,
                       "latency_us": 0.0}})


UNIT = terms.Scale(linear=1.0, square=1.0, length=1.0, share_side=1.0)
SMALL, BIG = model.RankStep(flops=1e12, side=1.0), model.RankStep(flops=2e12, side=1.0)


def _two_steps(second_joins: bool) -> tuple[model.StepLoad, model.StepLoad]:
    """Two ranks, two steps, the block sizes swapped: rank 0 big then small, rank 1 small
    then big (``who``: each rank's index into the step's views)."""
    first = model.StepLoad(FWD, (SMALL, BIG), ((1, 1),), True, (1, 0))
    second = model.StepLoad(FWD, (SMALL, BIG), ((1, 1),), second_joins, (0, 1))
    return first, second


def _compiled(steps) -> model.Compiled:
    return model.Compiled(seqlen=1, batch=1, steps=tuple(steps), memory_bytes=0.0,
                          ranks_per_problem=2, resolved={}, memory_bytes_bare=0.0)


def test_swapped_blocks_by_hand():
    """At 1 TFLOP/s: lock-step, max(2, 1) + max(1, 2) = 4 s; not joining after the first
    step, max(2 + 1, 1 + 2) = 3 s."""
    hw, attn = flat(), AttentionConfig(batch=1, seqlen=1, heads=1, head_dim=1, dtype="bf16")
    joined = model.evaluate(_compiled(_two_steps(True)), attn, hw)
    free = model.evaluate(_compiled(_two_steps(False)), attn, hw)
    assert joined.fwd_s == pytest.approx(4.0) and joined.fwd_compute_s == pytest.approx(4.0)
    assert free.fwd_s == pytest.approx(3.0) and free.fwd_compute_s == pytest.approx(3.0)
    assert dict((t, f) for t, f, _ in free.terms)["kernel"] == pytest.approx(3.0)
    assert [len(r) for r in terms.runs(_two_steps(False))] == [2]
    assert [len(r) for r in terms.runs(_two_steps(True))] == [1, 1]


def test_the_same_rank_slowest_at_both_steps_gives_the_old_sum():
    first, second = _two_steps(False)
    second = dataclasses.replace(second, who=(1, 0))  # rank 0 big both times
    assert terms.run(flat(), (first, second), 1, UNIT)[0] == pytest.approx(4.0)


def test_a_run_does_not_cross_phases():
    first, second = _two_steps(False)
    second = dataclasses.replace(second, phase=BWD)
    assert [len(r) for r in terms.runs((first, second))] == [1, 1]


CAUSAL = AttentionConfig(batch=1, seqlen=8192, heads=8, head_dim=64, dtype="bf16",
                         causal=True)


def _predict(name, attn, world, hw, **opts):
    return model.predict(name, strategies.get(name).Options(**opts), attn,
                         Topology(world_size=world, ranks_per_node=8), hw)


@pytest.mark.parametrize("chunks", [1, 2])
def test_llama3_zigzag_is_one_ranks_work_on_free_links(chunks):
    """Zigzag gives every rank the same causal area: with free links and a flat rate, each
    phase lasts a rank's FLOPs (1 / N of the problem's) over the rate; lock-step, more."""
    model.clear_cache()
    hw, n = flat(100.0), 8
    p = _predict("llama3", CAUSAL, n, hw, layout="zigzag", heads_k_stride=8 // chunks)
    for phase, got in ((FWD, p.fwd_s), (BWD, p.bwd_s)):
        work = attention_flops(batch=1, seqlen_q=CAUSAL.seqlen, seqlen_k=CAUSAL.seqlen,
                               heads=CAUSAL.heads, head_dim=CAUSAL.head_dim, causal=True,
                               mode=phase) / n
        assert got == pytest.approx(work / 100e12, rel=1e-9), phase
    lockstep = _old_rule(_compiled_llama3(hw, chunks), CAUSAL, hw)
    assert lockstep[0] > p.fwd_s * 1.2 and lockstep[1] > p.bwd_s * 1.2


def _compiled_llama3(hw, chunks) -> model.Compiled:
    opts = strategies.get("llama3").Options(layout="zigzag", heads_k_stride=8 // chunks)
    return model.compiled_for("llama3", opts, CAUSAL, Topology(world_size=8, ranks_per_node=8))


def _scale(c: model.Compiled, attn) -> terms.Scale:
    linear = (attn.batch / c.batch) * (attn.seqlen / c.seqlen)
    return terms.Scale(linear=linear, square=linear * attn.seqlen / c.seqlen,
                       length=attn.seqlen / c.seqlen,
                       share_side=ideal.share(attn, c.ranks_per_problem)[0])


def _old_rule(c: model.Compiled, attn, hw) -> tuple[float, float]:
    """Lock-step at every step: the sum of the steps' slowest ranks, plus the sinks."""
    scale = _scale(c, attn)
    total = {FWD: 0.0, BWD: 0.0}
    for step in c.steps:
        total[step.phase] += terms.step(hw, step, attn.head_dim, scale)[0]
    return tuple(total[ph] + sharing.sinks_s(hw, ph, attn, c.ranks_per_problem)
                 for ph in (FWD, BWD))


def test_llama3_steps_after_a_chunks_first_do_not_join():
    c = _compiled_llama3(flat(), 2)
    joins = [s.joins for s in c.steps]
    per_chunk = len(joins) // 4  # two phases, two head chunks
    assert joins == ([True] + [False] * (per_chunk - 1)) * 4 and per_chunk > 1


def test_llama3_on_h100_by_each_ranks_sum():
    """On a real preset (step costs, curves, gathers): the prediction is the slowest rank's
    sum over each head chunk's run, followed rank by rank, below the lock-step sum."""
    model.clear_cache()
    hw = hardware.load("h100-sxm")
    p = _predict("llama3", CAUSAL, 8, hw, layout="zigzag", heads_k_stride=4)
    c = _compiled_llama3(hw, 2)
    scale = _scale(c, CAUSAL)
    expected = {FWD: 0.0, BWD: 0.0}
    for run in terms.runs(c.steps):
        per_rank = [sum(terms.step(hw, dataclasses.replace(s, ranks=(s.ranks[s.who[r]],),
                                                           nodes=((1,),)),
                                   CAUSAL.head_dim, scale)[0] for s in run)
                    for r in range(8)]
        expected[run[0].phase] += max(per_rank)
    assert p.fwd_s == pytest.approx(expected[FWD], rel=1e-12)
    assert p.bwd_s == pytest.approx(expected[BWD], rel=1e-12)
    old = _old_rule(c, CAUSAL, hw)
    assert p.fwd_s < old[0] and p.bwd_s < old[1]


@pytest.mark.parametrize("name,opts", [
    ("ring", {}), ("zigzag", {}), ("ulysses", {}), ("usp", {"ulysses_degree": 4}),
    ("double-ring", {}), ("burst", {}), ("megatron-cp", {}),
    ("megatron-cp-a2a+p2p", {})])
@pytest.mark.parametrize("preset,world", [("h100-sxm", 8), ("a800-sxm", 16)])
def test_every_other_strategy_is_lock_step_as_before(name, opts, preset, world):
    """Every step of theirs joins, and the prediction is exactly the old rule's."""
    model.clear_cache()
    hw = hardware.load(preset)
    attn = dataclasses.replace(CAUSAL, seqlen=65536)
    topo = Topology(world_size=world, ranks_per_node=8)
    cls = strategies.get(name)
    try:
        p = model.predict(name, cls.Options(**opts), attn, topo, hw)
    except ValueError as e:  # a variant this world does not take
        pytest.skip(str(e))
    c = model.compiled_for(name, cls.Options(**opts), attn, topo)
    assert all(s.joins for s in c.steps)
    assert (p.fwd_s, p.bwd_s) == _old_rule(c, attn, hw)
