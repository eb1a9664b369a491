"""The default collective timeout scales with the case (a pessimistic step estimate, at least
60 s) instead of a flat 600 s; --collective-timeout overrides it; the grace a failing rank
gives its peers on gloo is one estimated step, at least 5 s."""

from __future__ import annotations

import dataclasses

import pytest

from cpbench.bench import plan as planning
from cpbench.config import AttentionConfig, RunConfig

CPU = RunConfig(strategy=("zigzag",)).resolved("cpu")
GPU = RunConfig(strategy=("zigzag",)).resolved("cuda")


def test_small_cases_get_the_floor_and_large_ones_scale():
    tiny = AttentionConfig(batch=1, seqlen=512, heads=8, head_dim=64, dtype="fp32",
                           causal=True)
    assert planning.case_waits(tiny, CPU, 2) == (60.0, 5.0)
    # S = 2K on 2 CPU ranks: 4·S²·H·D/2·3.5 = 15 GFLOP, 7.5 GFLOP a rank at 1 GFLOP/s
    small = dataclasses.replace(tiny, seqlen=2048)
    assert planning.case_waits(small, CPU, 2) == pytest.approx((75.16192768, 7.516192768))
    big = AttentionConfig(batch=1, seqlen=1 << 20, heads=40, head_dim=128, dtype="bf16",
                          causal=True)
    timeout, grace = planning.case_waits(big, GPU, 32)
    # 1M causal fwd+bwd = 4·S²·H·D/2·3.5 FLOPs; /32 ranks at 20 TFLOP/s; ten steps behind
    step = 4 * (1 << 20) ** 2 * 40 * 128 / 2 * 3.5 / 32 / 20e12
    assert (timeout, grace) == pytest.approx((10 * step, step)) and 600 < timeout < 3600
    # a baseline does it all on one rank
    assert planning.case_waits(big, GPU, 1)[0] == pytest.approx(32 * timeout)


def test_the_flag_overrides_and_check_adds_the_reference():
    attn = AttentionConfig(batch=1, seqlen=65536, heads=8, head_dim=64, dtype="fp32",
                           causal=True)
    assert planning.case_waits(attn, dataclasses.replace(CPU, collective_timeout=30.0),
                               2) == (30.0, 30.0)
    plain = planning.case_waits(attn, CPU, 2)[0]
    assert planning.case_waits(attn, dataclasses.replace(CPU, check=True), 2)[0] > plain


def test_the_plan_holds_one_wait_per_case():
    p = planning.plan(RunConfig(strategy=("zigzag", "local"), nproc=2, out="none"),
                      {"seqlen": 2048}, {}, launcher="self")
    # local, zigzag, local (the baseline at both ends): local does it all on one rank
    assert [c.strategy for c in p.cases] == ["local", "zigzag", "local"]
    assert p.waits[0] == p.waits[2] and p.waits[0][1] == 2 * p.waits[1][1]
    assert p.init_timeout == max(w[0] for w in p.waits)
    assert p.run.collective_timeout is None  # the record says: the default, per case
