"""Unequal head dims (MLA: Q/K at one width, V and out at another): FLOPs counted by hand, the
CPU kernels against float64 at both widths, refusals on construction, the record's field,
and the negative control: a V silently padded to the Q/K width fails the check."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cpbench import kernels, strategies
from cpbench.config import AttentionConfig
from cpbench.errors import Skipped, UsageError
from cpbench.kernels import masked
from cpbench.mask import mask_of
from cpbench.metrics import attention_flops, pairs_flops, problem_flops
from cpbench.reference import compare, reference_attention
from cpbench.topology import Topology

TOPO = Topology(world_size=4, ranks_per_node=2)


# -- FLOPs -------------------------------------------------------------------------------------

def test_flops_by_hand_with_v_narrower_than_qk():
    # B=2, Sq=64, Sk=32, H=3, D=48, DV=32, full attention: 2*64*32*3 = 12288 pairs·heads
    kw = dict(batch=2, seqlen_q=64, seqlen_k=32, heads=3, head_dim=48, causal=False)
    pairs = 2 * 64 * 32 * 3
    # forward: QK^T 2*D, PV 2*DV per pair
    assert attention_flops(v_head_dim=32, **kw) == pairs * (2 * 48 + 2 * 32) == 1_966_080
    # backward: QK^T again (D), dV = P^T dO (DV), dP = dO V^T (DV), dQ (D), dK (D)
    assert attention_flops(v_head_dim=32, mode="bwd", **kw) == pairs * 2 * (3 * 48 + 2 * 32)
    assert attention_flops(v_head_dim=32, mode="fwd_bwd", **kw) == pairs * (160 + 416)
    causal = attention_flops(**{**kw, "causal": True}, v_head_dim=32)
    assert causal == pairs * 160 / 2


def test_flops_mla_shape_and_equal_dims_keep_the_seeds_formula():
    # DeepSeek-V3: D = 192, DV = 128, per pair and head: fwd 640, bwd 1664 = 2.6 x fwd
    assert pairs_flops(1, batch=1, heads=1, head_dim=192, v_head_dim=128) == 640
    assert pairs_flops(1, batch=1, heads=1, head_dim=192, v_head_dim=128, mode="bwd") == 1664
    # DV = D (or None): 4D and 2.5 x 4D, the seeds'
    for dv in (None, 128):
        assert pairs_flops(1, batch=1, heads=1, head_dim=128, v_head_dim=dv) == 512
        assert pairs_flops(1, batch=1, heads=1, head_dim=128, v_head_dim=dv,
                           mode="bwd") == 2.5 * 512


def test_problem_flops_under_a_mask_count_each_width():
    exact, how = problem_flops(batch=1, seqlen=8, heads=1, head_dim=4, v_head_dim=2,
                               causal=True, documents=(4, 4))
    assert how == "exact pairs" and exact == 2 * 10 * (2 * 4 + 2 * 2)  # 10 pairs a document


# -- config and record -------------------------------------------------------------------------

def test_config_resolves_v_width_and_keeps_equal_records_as_before():
    a = AttentionConfig(head_dim=48, v_head_dim=32, heads=4, kv_heads=2)
    assert a.dv == 32 and a.to_dict()["v_head_dim"] == 32
    assert a.widths == {"q": (4, 48), "k": (2, 48), "v": (2, 32), "dout": (4, 32)}
    assert AttentionConfig(**a.to_dict()) == a
    # equal widths are the same problem as none given: the same record as before the flag
    same = AttentionConfig(head_dim=48, v_head_dim=48)
    assert same.v_head_dim is None and same.dv == 48 and "v_head_dim" not in same.to_dict()
    with pytest.raises(UsageError, match="v_head_dim must be a positive"):
        AttentionConfig(v_head_dim=0)


# -- kernels against float64 -------------------------------------------------------------------

def _inputs(d: int, dv: int, heads=4, kv_heads=2, sq=40, sk=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, s, h, w, generator=g) for s, h, w in
            ((sq, heads, d), (sk, kv_heads, d), (sk, kv_heads, dv), (sq, heads, dv))]


@pytest.mark.parametrize("name", ["sdpa-cpu", "torch"])
@pytest.mark.parametrize("d,dv", [(48, 32), (16, 24)])
@pytest.mark.parametrize("causal", [True, False])
def test_cpu_kernels_compute_unequal_widths(name, d, dv, causal):
    q, k, v, dout = _inputs(d, dv)
    scale = d ** -0.5
    backend = kernels.get(name)
    out, lse = backend.forward(q, k, v, causal=causal, softmax_scale=scale)
    dq, dk, dv_ = backend.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale)
    ref = reference_attention(q, k, v, dout, causal=causal, softmax_scale=scale)
    for tensor, got in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv_)):
        c = compare(tensor, got, ref[tensor], "fp32")
        assert c.passed, c.line()
    assert out.shape[-1] == dv and dv_.shape == v.shape


def test_masked_kernel_computes_unequal_widths_under_documents():
    attn = AttentionConfig(seqlen=40, heads=4, kv_heads=2, head_dim=24, v_head_dim=16,
                           documents=(24, 16))
    m = mask_of(attn)
    pos = torch.arange(40)
    q, k, v, dout = _inputs(24, 16)
    block = masked.Block(m, pos, pos)
    backend = kernels.get("sdpa-cpu")
    out, lse = masked.block_forward(backend, block, q, k, v, softmax_scale=attn.softmax_scale)
    grads = masked.block_backward(backend, block, dout, q, k, v, out, lse,
                                  softmax_scale=attn.softmax_scale)
    ref = reference_attention(q, k, v, dout, causal=True, softmax_scale=attn.softmax_scale,
                              visible=m.visible(pos, pos))
    for tensor, got in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)):
        c = compare(tensor, got, ref[tensor], "fp32")
        assert c.passed, c.line()


def test_one_width_kernels_refuse_in_one_line():
    request = dict(device="cuda", dtype=torch.bfloat16, head_dim=192, heads=8, kv_heads=8,
                   v_head_dim=128)
    for name in ("flash-attn", "flash-attn3", "sdpa"):
        # as where the library imports and the GPU fits: the head dims alone refuse it
        installed = dataclasses.replace(kernels.get(name), import_error=None, limits=None,
                                        is_importable=lambda: True)
        why = installed.unsupported_reason(**request)
        assert why is not None and "one head dim" in why and "\n" not in why, (name, why)
    cpu = dict(request, device="cpu", dtype=torch.float32)
    assert "one head dim" in kernels.get("flash-attn-cpu").unsupported_reason(**cpu)
    assert kernels.get("sdpa-cpu").unsupported_reason(**cpu) is None
    assert kernels.resolve("auto", **cpu).name == "sdpa-cpu"


# -- strategies: refusals and the negative control ---------------------------------------------

MLA = dict(batch=1, seqlen=128, heads=4, head_dim=24, v_head_dim=16, dtype="bf16")


@pytest.mark.parametrize("name", ["rfa-ring", "rfa-zigzag", "rfa-llama3", "yunchang-usp",
                                  "torch-ring", "te-a2a", "te-all-gather"])
def test_adapters_that_cannot_refuse_on_construction(name):
    with pytest.raises(Skipped, match=r"refuses --v-head-dim: ") as e:
        strategies.get(name)(AttentionConfig(**MLA), TOPO, 0, kernel=kernels.get("sdpa-cpu"),
                             create_groups=False)
    # as the CLI prints it: "cpbench run: error: NAME: " before it, one line of 120 at most
    line = f"cpbench run: error: {name}: {e.value}"
    assert "\n" not in line and len(line) <= 120, line


def test_an_own_strategy_on_a_one_width_kernel_refuses_on_construction():
    with pytest.raises(Skipped, match="its kernel flash-attn-cpu takes one head dim"):
        strategies.get("zigzag")(AttentionConfig(**MLA), TOPO, 0,
                                 kernel=kernels.get("flash-attn-cpu"), create_groups=False)


def test_every_own_strategy_takes_unequal_widths():
    for name in strategies.own_names():
        cls = strategies.get(name)
        for opts in cls.variants(TOPO):
            cls(AttentionConfig(**MLA), TOPO, 0, kernel=kernels.get("sdpa-cpu"),
                options=opts, create_groups=False)


def test_a_v_padded_to_the_qk_width_fails_the_check():
    """Negative control: out computed with V zero-padded to the Q/K width (a strategy that
    ignores V's own width) is compared, and fails: it is not the problem's out."""
    q, k, v, dout = _inputs(24, 16)
    ref = reference_attention(q, k, v, dout, causal=True, softmax_scale=24 ** -0.5)
    padded = torch.nn.functional.pad(v, (0, 8))
    out, lse = kernels.get("sdpa-cpu").forward(q, k, padded, causal=True,
                                               softmax_scale=24 ** -0.5)
    assert compare("lse", lse, ref["lse"], "fp32").passed  # the softmax is untouched...
    bad = compare("out", out, ref["out"], "fp32")
    assert not bad.passed and "FAIL" in bad.line()  # ...but out is not V's width
    # the same out cut back to V's width is right: the check is not failing everything
    assert compare("out", out[..., :16], ref["out"], "fp32").passed
