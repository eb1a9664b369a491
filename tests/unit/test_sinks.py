"""Attention sinks (``merge.add_sink`` / ``sink_grad``) against float64 softmax with a sink
column: the correction after a merge, a flash backward fed (out', dO, lse') with the sink's
gradient (torch.autograd.gradcheck at fp64), the float64 reference's own sink, and the negative
control: a sink added to every partial block before the merge is wrong."""

from __future__ import annotations

import pytest
import torch

from cpbench.config import AttentionConfig
from cpbench.merge import add_sink, merge, sink_grad, sink_lse
from cpbench.reference import compare, reference_attention

SCALE = 0.25


def _inputs(seed, b=2, s=12, h=3, d=4, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(b, s, h, d, generator=gen, dtype=dtype) for _ in range(4))
    sinks = torch.rand(h, generator=gen, dtype=dtype) * 3  # about the rows' lse: a real share
    return q, k, v, dout, sinks


def _plain(q, k, v, causal=True):
    """Sink-free (out, lse) in the inputs' dtype: the kernel's part."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * SCALE
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]), v), lse


def _with_sink_column(q, k, v, sinks, causal=True):
    """out, lse of softmax over [scores, s_h] with V's extra row 0, written out directly."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * SCALE
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    z = torch.exp(s).sum(-1) + torch.exp(sinks).view(1, -1, 1)
    return torch.einsum("bhqk,bkhd->bqhd", torch.exp(s) / z[..., None], v), torch.log(z)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_correction_after_the_merge_is_softmax_with_the_sink(seed):
    q, k, v, _, sinks = _inputs(seed)
    want_out, want_lse = _with_sink_column(q, k, v, sinks)
    # two key blocks, merged, then the sink once: what every strategy does
    half = q.shape[1] // 2
    a, b = _masked_block(q, k, v, 0, half), _masked_block(q, k, v, half, q.shape[1])
    out, lse = add_sink(*merge(*a, *b), sinks)  # the merge computes in fp32
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-6)
    alone = add_sink(*_plain(q, k, v), sinks)  # one block: fp64 throughout
    torch.testing.assert_close(alone[0], want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(alone[1], want_lse, rtol=1e-12, atol=1e-12)
    assert torch.equal(sink_lse(lse - 0, None), lse)  # no sinks: unchanged


def _masked_block(q, k, v, start, stop):
    """Every query against keys start..stop-1 under the causal mask of the whole sequence
    (a row that sees none of them: out 0, lse -inf)."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k[:, start:stop]) * SCALE
    rows, keys = torch.arange(q.shape[1])[:, None], torch.arange(start, stop)[None]
    s = s.masked_fill(keys > rows, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.where(torch.isneginf(lse)[..., None], 0.0, torch.exp(s - lse[..., None]))
    return torch.einsum("bhqk,bkhd->bqhd", p, v[:, start:stop]), lse


def test_a_sink_added_to_every_block_before_the_merge_fails():
    """The negative control: counted once per block, the sink takes too much of a row that
    sees keys in several blocks, and the comparison with float64 says so."""
    q, k, v, _, sinks = _inputs(3)
    ref = reference_attention(q, k, v, torch.zeros_like(q), causal=True, softmax_scale=SCALE,
                              sinks=sinks)
    half = q.shape[1] // 2
    a, b = _masked_block(q, k, v, 0, half), _masked_block(q, k, v, half, q.shape[1])
    once = add_sink(*merge(*a, *b), sinks)
    twice = merge(*add_sink(*a, sinks), *add_sink(*b, sinks))
    assert compare("out", once[0], ref["out"], "fp32").passed
    assert compare("lse", once[1], ref["lse"], "fp32").passed
    assert not compare("out", twice[0], ref["out"], "fp32").passed
    assert not compare("lse", twice[1], ref["lse"], "fp32").passed


def test_a_row_that_sees_no_key_keeps_out_zero_and_gets_the_sink_alone():
    out = torch.zeros(1, 2, 2, 3)
    lse = torch.tensor([[[float("-inf"), 0.5], [float("-inf"), -1.0]]])
    sinks = torch.tensor([0.3, 2.0])
    o, l2 = add_sink(out, lse, sinks)
    assert torch.equal(o, out)
    assert torch.equal(l2[:, :, 0], sinks.view(1, 2))
    torch.testing.assert_close(l2[0, :, 1], torch.logaddexp(lse[0, :, 1], sinks))


class _FlashWithSink(torch.autograd.Function):
    """The forward without the sink, the correction, then a standard flash backward fed
    (out', dO, lse') and ``sink_grad``: what the strategies do, in float64."""

    @staticmethod
    def forward(ctx, q, k, v, sinks):
        out, lse = add_sink(*_plain(q, k, v), sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) * SCALE
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        p = torch.exp(s - lse[..., None])  # against lse': the sink's share is already out
        delta = torch.einsum("bqhd,bqhd->bhq", dout, out)
        ds = p * (torch.einsum("bqhd,bkhd->bhqk", dout, v) - delta[..., None]) * SCALE
        return (torch.einsum("bhqk,bkhd->bqhd", ds, k), torch.einsum("bhqk,bqhd->bkhd", ds, q),
                torch.einsum("bhqk,bqhd->bkhd", p, dout), sink_grad(out, dout, lse, sinks))


def test_flash_backward_on_the_corrected_result_passes_gradcheck():
    q, k, v, _, sinks = _inputs(4, b=1, s=6, h=2, d=3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    assert torch.autograd.gradcheck(_FlashWithSink.apply, leaves, eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("seed", [5, 6])
def test_gradients_match_the_float64_reference(seed):
    q, k, v, dout, sinks = _inputs(seed)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    _FlashWithSink.apply(*leaves).backward(dout)
    ref = reference_attention(q, k, v, dout, causal=True, softmax_scale=SCALE, sinks=sinks)
    for name, got in zip(("dq", "dk", "dv", "dsinks"), leaves):
        torch.testing.assert_close(got.grad, ref[name], rtol=1e-10, atol=1e-12)
    assert ref["dsinks"].abs().min() > 1e-3, "a sink that matters has a gradient that does"


def test_the_reference_sink_is_a_softmax_column_with_no_value():
    q, k, v, dout, sinks = _inputs(7)
    ref = reference_attention(q, k, v, dout, causal=True, softmax_scale=SCALE, sinks=sinks)
    out, lse = _with_sink_column(q, k, v, sinks)
    torch.testing.assert_close(ref["out"], out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ref["lse"], lse, rtol=1e-12, atol=1e-12)
    plain = reference_attention(q, k, v, dout, causal=True, softmax_scale=SCALE)
    assert "dsinks" not in plain
    # the sink takes a real share of the mass: out shrinks by well more than the tolerance
    assert (plain["out"] - ref["out"]).abs().max() > 0.05


def test_the_record_keeps_sinks_only_when_set():
    assert "sinks" not in AttentionConfig().to_dict()  # records from before the flag match
    assert AttentionConfig(sinks=True).to_dict()["sinks"] is True
    assert AttentionConfig(**AttentionConfig(sinks=True).to_dict()).sinks
