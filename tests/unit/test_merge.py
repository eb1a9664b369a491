"""The LSE merge of partial results equals attention over the concatenated keys."""

from __future__ import annotations

import torch

from cpbench.kernels import torch_ref
from cpbench.merge import OutLseAccumulator, merge
from cpbench.reference import reference_attention


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_merge_of_two_halves_equals_attention_over_all_keys():
    b, sq, sk, h, d = 2, 11, 24, 3, 16
    q, k, v = _rand(b, sq, h, d, seed=1), _rand(b, sk, h, d, seed=2), _rand(b, sk, h, d, seed=3)
    scale = d ** -0.5
    oa, la = torch_ref.forward(q, k[:, :10], v[:, :10], causal=False, softmax_scale=scale)
    ob, lb = torch_ref.forward(q, k[:, 10:], v[:, 10:], causal=False, softmax_scale=scale)
    out, lse = merge(oa, la, ob, lb)
    ref = reference_attention(q, k, v, torch.zeros_like(q).normal_(), causal=False,
                              softmax_scale=scale)
    torch.testing.assert_close(out.double(), ref["out"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref["lse"], atol=1e-5, rtol=1e-5)


def test_merge_is_overflow_safe_for_huge_lse():
    b, s, h, d = 1, 4, 2, 8
    oa, ob = _rand(b, s, h, d, seed=4), _rand(b, s, h, d, seed=5)
    la = torch.full((b, h, s), 1e4)
    lb = torch.full((b, h, s), 1e4 + 2.0)
    out, lse = merge(oa, la, ob, lb)
    w_b = torch.sigmoid(torch.tensor(2.0))
    torch.testing.assert_close(out, oa * (1 - w_b) + ob * w_b)
    want = 1e4 + torch.logaddexp(torch.tensor(0.0), torch.tensor(2.0))
    torch.testing.assert_close(lse, want.expand(b, h, s))


def test_minus_inf_blocks_merge_without_nan():
    b, s, h, d = 1, 6, 2, 4
    oa, ob = _rand(b, s, h, d, seed=6), _rand(b, s, h, d, seed=7)
    la, lb = _rand(b, h, s, seed=8), _rand(b, h, s, seed=9)
    la[:, :, :2] = float("-inf")  # rows with no visible key in block a
    lb[:, :, 4:] = float("-inf")  # ... and in block b
    out, lse = merge(oa, la, ob, lb)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out[:, :2], ob[:, :2])
    torch.testing.assert_close(out[:, 4:], oa[:, 4:])
    torch.testing.assert_close(lse[:, :, :2], lb[:, :, :2])
    both = merge(oa, torch.full_like(la, float("-inf")), ob, torch.full_like(lb, float("-inf")))
    assert not torch.isnan(both[0]).any() and torch.isneginf(both[1]).all()


def test_accumulator_merges_into_a_slice():
    b, s, h, d = 1, 8, 2, 4
    q = _rand(b, s, h, d, seed=10)
    k, v = _rand(b, 2 * s, h, d, seed=11), _rand(b, 2 * s, h, d, seed=12)
    acc = OutLseAccumulator(b, s, h, d, "cpu")
    o1, l1 = torch_ref.forward(q, k[:, :s], v[:, :s], causal=False, softmax_scale=0.5)
    acc.update(o1, l1)
    o2, l2 = torch_ref.forward(q[:, 4:], k[:, s:], v[:, s:], causal=False, softmax_scale=0.5)
    acc.update(o2, l2, seq=slice(4, None))
    out, lse = acc.result(torch.float32)
    full, full_lse = torch_ref.forward(q[:, 4:], k, v, causal=False, softmax_scale=0.5)
    torch.testing.assert_close(out[:, 4:], full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[:, :, 4:], full_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[:, :4], o1[:, :4])
