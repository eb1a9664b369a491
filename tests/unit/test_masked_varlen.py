"""The GPU path of masked blocks, on the CPU: tiles classified as flash-attn varlen sequences
(checked pair by pair against the mask's visibility matrix, on random documents, windows and
layouts), and the varlen path's maths (gather, one call per group, lse scatter-merge, backward
index_add) against the float64 reference, through a test-only CPU varlen backend and through
the flash-attn 2 mapping onto cpbench's CPU flash-attn 2.8.3 interface."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from mask_helpers import fa_visible

from cpbench import kernels
from cpbench.errors import UsageError
from cpbench.kernels import flash_attn, masked, masked_varlen
from cpbench.kernels.base import KernelBackend
from cpbench.kernels.flash_attn_cpu import _internal
from cpbench.kernels.flash_attn_cpu._kernel import key_window, visible_keys
from cpbench.mask import Mask
from cpbench.reference import reference_attention


def random_case(rng: random.Random, s: int):
    """A random mask and a layout: queries a zigzag-like subset, keys shuffled chunks."""
    cuts = sorted(rng.sample(range(1, s), rng.randint(0, 4)))
    docs = tuple(b - a for a, b in zip([0, *cuts], [*cuts, s]))
    window = rng.choice([None, (rng.randint(0, 20), rng.choice([-1, 0, rng.randint(0, 9)])),
                         (-1, rng.randint(0, 9))])
    mask = Mask(rng.random() < 0.6, docs if rng.random() < 0.8 else None, window)
    chunk = s // 8
    order = list(range(8))
    rng.shuffle(order)
    chunks = [torch.arange(c * chunk, (c + 1) * chunk) for c in order]
    q_pos = torch.cat(chunks[:rng.randint(1, 8)])
    k_pos = torch.cat(rng.sample(chunks, rng.randint(1, 8)))
    return mask, q_pos, k_pos


@pytest.mark.parametrize("seed", range(40))
def test_tiles_cover_the_visibility_exactly_as_varlen_sequences(seed):
    """Every visible pair in exactly one tile; each tile's pairs are exactly its varlen mask,
    both in the pure bottom-right semantics and in flash-attn's (windows rewritten against
    the max_seqlen_k the call passes)."""
    _covers_exactly(*random_case(random.Random(seed), 96))


@pytest.mark.parametrize("seed", range(10))
def test_repeated_keys_are_planned_as_well(seed):
    """Keys held twice (overlapping key runs: the planner's every-pair path)."""
    mask, q_pos, k_pos = random_case(random.Random(seed), 96)
    _covers_exactly(mask, q_pos, torch.cat([k_pos, k_pos[: len(k_pos) // 2]]))


def _covers_exactly(mask, q_pos, k_pos):
    want = mask.visible(q_pos, k_pos)
    got = torch.zeros(want.shape, dtype=torch.int64)
    vplan = masked_varlen.plan(mask, q_pos, k_pos)
    assert bool(vplan) == bool(want.any()) == bool(masked.Block(mask, q_pos, k_pos))
    for g in vplan.groups:
        for t, pairs in zip(g.tiles, g.pairs.tolist()):
            sq, sk = t.q1 - t.q0, t.k1 - t.k0
            mine = fa_visible(sq, sk, *g.window, causal=g.causal)
            assert pairs == int(mine.sum())  # what the simulator weighs a tile by
            assert torch.equal(want[t.q0:t.q1, t.k0:t.k1], mine), (t, mask)
            fa = visible_keys(sq, sk, *key_window(g.causal, *g.window, g.max_k))
            assert torch.equal(mine, torch.ones_like(mine) if fa is None else fa), (t, g.max_k)
            assert mine.any(1).all() and mine.any(0).all()  # cropped
            got[t.q0:t.q1, t.k0:t.k1] += mine.long()
    assert torch.equal(got, want.long())


def test_classify_each_kind_and_a_refusal():
    def of(m):
        lo = torch.tensor([int(r.nonzero()[0]) for r in m])
        hi = torch.tensor([int(r.nonzero()[-1]) for r in m])
        return masked_varlen.classify(lo, hi, m.shape[1])

    assert of(torch.ones(3, 5, dtype=torch.bool)) == (False, (-1, -1))
    assert of(fa_visible(4, 6, causal=True)) == (True, (-1, 0))  # causal, bottom-right
    assert of(fa_visible(5, 5, 2, -1, causal=True)) == (True, (2, 0))
    assert of(fa_visible(6, 4, 1, 2, causal=False)) == (False, (1, 2))
    assert of(fa_visible(4, 9, 3, -1, causal=False)) == (False, (3, -1))
    top_left = torch.ones(4, 6, dtype=torch.bool).tril()  # query i sees keys 0..i
    assert of(top_left) is None


def test_a_tile_no_varlen_call_expresses_is_refused(monkeypatch):
    # under cpbench's masks every tile is one; a classifier that finds none must refuse
    monkeypatch.setattr(masked_varlen, "_kinds", lambda lo, hi, off, sq, sk: (
        np.zeros(len(sq), bool), np.zeros(len(sq), bool), -np.ones_like(sq), -np.ones_like(sq)))
    with pytest.raises(UsageError, match="no varlen kernel call expresses"):
        masked_varlen.plan(Mask(True, (32, 32), (4, 0)), torch.arange(64), torch.arange(64))


def test_a_backend_without_varlen_is_refused_off_the_cpu():
    block = masked.Block(Mask(True, (8, 8), None), torch.arange(16), torch.arange(16))
    x = torch.zeros(1, 16, 2, 8)
    with pytest.raises(UsageError, match="flash-attn"):
        masked.block_forward(kernels.get("sdpa-cpu"), block, x, x, x, softmax_scale=1.0,
                             varlen=True)
    assert masked_varlen.device_refusal(kernels.get("sdpa-cpu"), "cuda")
    assert masked_varlen.device_refusal(flash_attn.FLASH_ATTN, "cuda") is None


# -- the varlen maths on the CPU -----------------------------------------------------------


def _segments(cu_q, cu_k):
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return [(cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(cq) - 1)]


def _probs(q, k, scale, causal, window):
    """float64 (h, sq, sk) probabilities exp(s - lse) of one sequence, k repeated (GQA)."""
    ke = k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), ke) * scale
    s = s.masked_fill(~fa_visible(q.shape[0], k.shape[0], *window, causal=causal), float("-inf"))
    return s, ke


def ref_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, softmax_scale,
                       window=(-1, -1)):
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64)
    for qs, qe, ks, ke in _segments(cu_q, cu_k):
        assert qe - qs <= max_q and ke - ks <= max_k
        s, _ = _probs(q[qs:qe], k[ks:ke], softmax_scale, causal, window)
        ve = v[ks:ke].double().repeat_interleave(q.shape[1] // v.shape[1], 1)
        lse[:, qs:qe] = torch.logsumexp(s, -1)
        out[qs:qe] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), ve)
    return out.to(q.dtype), lse.float()


def ref_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, causal,
                        softmax_scale, window=(-1, -1)):
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    for qs, qe, ks, ke in _segments(cu_q, cu_k):
        s, kx = _probs(q[qs:qe], k[ks:ke], softmax_scale, causal, window)
        p = torch.exp(s - lse[:, qs:qe].double()[..., None])  # against the final lse
        do, o = dout[qs:qe].double(), out[qs:qe].double()
        vx = v[ks:ke].double().repeat_interleave(g, 1)
        dp = torch.einsum("qhd,khd->hqk", do, vx)
        ds = p * (dp - (do * o).sum(-1).T[..., None]) * softmax_scale
        dq[qs:qe] = torch.einsum("hqk,khd->qhd", ds, kx)
        n = ke - ks
        dk[ks:ke] = torch.einsum("hqk,qhd->khd", ds, q[qs:qe].double()).view(n, -1, g,
                                                                            q.shape[2]).sum(2)
        dv[ks:ke] = torch.einsum("hqk,qhd->khd", p, do).view(n, -1, g, q.shape[2]).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _backend(fwd, bwd) -> KernelBackend:
    def never(*a, **kw):
        raise AssertionError("the varlen path called the dense kernel")

    return KernelBackend(name="varlen-test", description="test-only CPU varlen", forward=never,
                         backward=never, devices=frozenset({"cpu"}),
                         dtypes=frozenset({torch.float32}), varlen_forward=fwd,
                         varlen_backward=bwd)


REFERENCE = _backend(ref_varlen_forward, ref_varlen_backward)
# flash-attn 2's mapping (kernels.flash_attn) onto cpbench's CPU flash-attn 2.8.3 interface,
# which reproduces flash-attn's window rewriting against max_seqlen_k
_FA_CPU = flash_attn._make_varlen_fns("cpu", loader=lambda: (
    _internal._flash_attn_varlen_forward,
    flash_attn.signature_params(_internal._flash_attn_varlen_forward),
    _internal._flash_attn_varlen_backward,
    flash_attn.signature_params(_internal._flash_attn_varlen_backward)))
FA_MAPPING = _backend(*_FA_CPU)


@pytest.mark.parametrize("backend", [REFERENCE, FA_MAPPING], ids=["reference", "fa-mapping"])
# seeds 0 and 1 in make test-fast; the other four (seconds of CPU each) in CI
@pytest.mark.parametrize("seed", [0, 1, *(pytest.param(s, marks=pytest.mark.slow)
                                          for s in range(2, 6))])
def test_varlen_path_matches_the_float64_reference(backend, seed):
    rng = random.Random(100 + seed)
    s, b, h, hk, d = 96, 2, 4, 2, 16
    mask, q_pos, _ = random_case(rng, s)
    k_pos = torch.randperm(s, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(b, len(q_pos), h, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, s, hk, d, generator=gen) for _ in range(2))
    block, scale = masked.Block(mask, q_pos, k_pos), d ** -0.5
    out, lse = masked.block_forward(backend, block, q, k, v, softmax_scale=scale, varlen=True)
    dq, dk, dv = masked.block_backward(backend, block, dout, q, k, v, out, lse,
                                       softmax_scale=scale, varlen=True)
    # the reference over the whole sequence in global order; the queries are rows of it
    order = k_pos.argsort()
    full_q = torch.zeros(b, s, h, d)
    full_q[:, q_pos] = q
    full_do = torch.zeros(b, s, h, d)
    full_do[:, q_pos] = dout
    ref = reference_attention(full_q, k[:, order], v[:, order], full_do, causal=mask.causal,
                              softmax_scale=scale,
                              visible=mask.visible(torch.arange(s), torch.arange(s)))
    tol = 1e-4
    assert torch.allclose(out.double(), ref["out"][:, q_pos], atol=tol)
    assert torch.allclose(lse.double(), ref["lse"][..., q_pos], atol=tol)
    assert torch.allclose(dq.double(), ref["dq"][:, q_pos], atol=tol)
    assert torch.allclose(dk.double(), ref["dk"][:, k_pos], atol=tol)
    assert torch.allclose(dv.double(), ref["dv"][:, k_pos], atol=tol)


def test_a_cuda_kernel_without_varlen_is_skipped_before_the_run():
    from cpbench import strategies
    from cpbench.bench.cases import _no_masked_kernel
    from cpbench.config import AttentionConfig

    docs = AttentionConfig(seqlen=4096, documents=(2048, 2048))
    zigzag, te = strategies.get("zigzag"), strategies.get("te-p2p")
    assert "flash-attn" in _no_masked_kernel(zigzag, docs, flash_attn.FLASH_ATTN3, "cuda")
    assert _no_masked_kernel(zigzag, docs, flash_attn.FLASH_ATTN, "cuda") is None
    assert _no_masked_kernel(zigzag, docs, kernels.get("sdpa-cpu"), "cpu") is None
    assert _no_masked_kernel(te, docs, flash_attn.FLASH_ATTN3, "cuda") is None  # its own
    assert _no_masked_kernel(zigzag, AttentionConfig(seqlen=4096), flash_attn.FLASH_ATTN3,
                             "cuda") is None
