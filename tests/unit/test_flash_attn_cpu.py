"""cpbench's CPU implementation of flash-attn 2.8.3's interface against the float64 reference.

``cpbench.reference`` aligns causal masks top-left; flash-attn aligns causal masks and windows
bottom-right, so those cases build the float64 reference from an explicit mask (mask_helpers)
from flash-attn's documented rule (flash_attn_func's docstring, flash_attn_interface.py v2.8.3
lines 1154-1172): query i sees keys [i + sk - sq - left, i + sk - sq + right], -1 unbounded.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from mask_helpers import fa_visible

from cpbench.kernels import flash_attn_cpu as fac
from cpbench.kernels.flash_attn_cpu import flash_attn_interface as fai
from cpbench.reference import TOLERANCES, compare, reference_attention

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
INF = float("inf")


def _inputs(shape_q, shape_kv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape_q, generator=g).to(dtype)
    k = torch.randn(*shape_kv, generator=g).to(dtype)
    v = torch.randn(*shape_kv, generator=g).to(dtype)
    dout = torch.randn(*shape_q, generator=g).to(dtype)
    return q, k, v, dout


def _masked_reference(q, k, v, dout, visible, scale):
    """float64 out, lse (+inf on rows that see nothing, as flash-attn), dq, dk, dv; bshd."""
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    ke, ve = kd.repeat_interleave(group, 2), vd.repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", qd, ke) * scale
    empty = ~visible.any(1)
    # Empty rows get finite stand-in scores so no NaN reaches autograd; their p is zeroed.
    s = torch.where(visible, s, -INF).masked_fill(empty[:, None], 0.0)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1)) * visible
    out = torch.einsum("bhqk,bkhd->bqhd", p, ve)
    dq, dk, dv = torch.autograd.grad(out, (qd, kd, vd), dout.double())
    lse = lse.detach().masked_fill(empty, INF)
    return {"out": out.detach(), "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def _assert_close(got: dict, ref: dict, dtype_name: str, empty_rows=None):
    """compare() everything; lse only on rows that see a key, those must be +inf exactly."""
    if empty_rows is not None and bool(empty_rows.any()):
        assert torch.equal(got["lse"][..., empty_rows], ref["lse"][..., empty_rows])
        assert not got["out"][:, empty_rows].any() and not got["dq"][:, empty_rows].any()
        got = dict(got, lse=got["lse"][..., ~empty_rows])
        ref = dict(ref, lse=ref["lse"][..., ~empty_rows])
    bad = [c.line() for n in ("out", "lse", "dq", "dk", "dv")
           if not (c := compare(n, got[n], ref[n], dtype_name)).passed]
    assert not bad, "; ".join(bad)


def _run(q, k, v, dout, causal, left=-1, right=-1, scale=0.3):
    out, lse, s_dmask, rng_state = fai._flash_attn_forward(
        q, k, v, 0.0, scale, causal, left, right, 0.0, None, False)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert s_dmask.numel() == 0 and rng_state.shape == (2,)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fai._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, scale, causal, left,
                             right, 0.0, None, False)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


# --- dense (batch) interface ---------------------------------------------------------------


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("causal", [True, False])
def test_square_gqa_matches_reference(causal, dtype_name):
    q, k, v, dout = _inputs((2, 40, 4, 16), (2, 40, 2, 16), DTYPES[dtype_name], seed=1)
    ref = reference_attention(q, k, v, dout, causal=causal, softmax_scale=0.3)
    _assert_close(_run(q, k, v, dout, causal), ref, dtype_name)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("sq,sk", [(7, 19), (19, 7), (1, 9), (12, 12)])
@pytest.mark.parametrize("causal", [True, False])
def test_unequal_lengths_are_bottom_right(sq, sk, causal, dtype_name):
    q, k, v, dout = _inputs((2, sq, 4, 16), (2, sk, 1, 16), DTYPES[dtype_name], seed=sq * 31 + sk)
    visible = fa_visible(sq, sk, causal=causal)
    ref = _masked_reference(q, k, v, dout, visible, 0.3)
    _assert_close(_run(q, k, v, dout, causal), ref, dtype_name, ~visible.any(1))


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("left,right,causal", [
    (3, -1, False), (-1, 2, False), (5, 1, False), (4, -1, True), (0, 0, False),
    (-1, 0, False), (100, 100, False),  # bounds >= seqlen_k count as unbounded
])
@pytest.mark.parametrize("sq,sk", [(70, 70), (40, 70)])
def test_sliding_windows(sq, sk, left, right, causal, dtype_name):
    # Windows of a few keys are far smaller than the CPU kernel's blocks (tens of rows).
    q, k, v, dout = _inputs((1, sq, 2, 16), (1, sk, 2, 16), DTYPES[dtype_name], seed=left + 7)
    visible = fa_visible(sq, sk, left, right, causal)
    ref = _masked_reference(q, k, v, dout, visible, 0.3)
    _assert_close(_run(q, k, v, dout, causal, left, right), ref, dtype_name, ~visible.any(1))


def test_left_window_alone_bounds_the_right_by_seqlen_k():
    # flash_api.cpp set_params_fprop (v2.8.3 line 142): with only a left window, right becomes
    # seqlen_k, not infinity. With sq > sk + 1 that hides every key from the first rows.
    sq, sk = 12, 4
    q, k, v, dout = _inputs((1, sq, 2, 8), (1, sk, 2, 8), torch.float32, seed=3)
    visible = fa_visible(sq, sk, left=1, right=sk)
    assert not visible[:4].any() and visible[4:].any(1).all()
    ref = _masked_reference(q, k, v, dout, visible, 0.3)
    _assert_close(_run(q, k, v, dout, False, 1, -1), ref, "fp32", ~visible.any(1))


def test_a_bound_reaching_seqlen_k_is_dropped():
    # flash_api.cpp mha_fwd (v2.8.3 lines 399-400): window_size_right >= seqlen_k becomes -1
    # before anything else, so (-1, 5) with sk = 4 is full attention, even where the
    # docstring's rule would hide keys from the first rows (sq > sk).
    sq, sk = 12, 4
    q, k, v, dout = _inputs((1, sq, 2, 8), (1, sk, 2, 8), torch.float32, seed=2)
    ref = reference_attention(q, k, v, dout, causal=False, softmax_scale=0.3)
    _assert_close(_run(q, k, v, dout, False, -1, 5), ref, "fp32")


def test_fully_masked_rows_give_zero_out_and_inf_lse():
    # causal with sq > sk: the first sq - sk rows see no key (flash_attn_func's docstring).
    q, k, v, dout = _inputs((2, 9, 2, 8), (2, 4, 2, 8), torch.float32, seed=4)
    got = _run(q, k, v, dout, causal=True)
    assert torch.equal(got["lse"][:, :, :5], torch.full((2, 2, 5), INF))
    assert not got["out"][:, :5].any() and not got["dq"][:, :5].any()
    assert all(bool(torch.isfinite(t).all()) for n, t in got.items() if n != "lse")
    # A merged (finite) lse for those rows, as a ring passes it, still gives them no gradient.
    lse = got["lse"].clone()
    lse[:, :, :5] = 1.0
    dq = torch.empty_like(q)
    fai._flash_attn_backward(dout, q, k, v, got["out"], lse, dq, None, None, 0.0, 0.3, True, -1,
                             -1, 0.0, None, False)
    assert not dq[:, :5].any() and torch.allclose(dq[:, 5:], got["dq"][:, 5:])


def test_no_keys_at_all():
    q, k, v, dout = _inputs((1, 3, 2, 8), (1, 0, 2, 8), torch.float32, seed=5)
    got = _run(q, k, v, dout, causal=False)
    assert not got["out"].any() and bool(torch.isposinf(got["lse"]).all())


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_backward_writes_into_strided_views(dtype_name):
    """ring-flash-attn's zigzag passes dq_buffer[:, :seqlen_q] of a longer buffer, batch > 1."""
    dtype = DTYPES[dtype_name]
    q, k, v, dout = _inputs((2, 6, 4, 16), (2, 10, 2, 16), dtype, seed=6)
    out, lse, _, _ = fai._flash_attn_forward(q, k, v, 0.0, 0.3, False, -1, -1, 0.0, None, False)
    bufs = [torch.full((2, 13, *t.shape[2:]), 7.0, dtype=dtype) for t in (q, k, v)]
    views = [b[:, :n] for b, n in zip(bufs, (6, 10, 10))]
    assert not views[0].is_contiguous()
    softmax_d = fai._flash_attn_backward(dout, q, k, v, out, lse, *views, 0.0, 0.3, False, -1,
                                         -1, 0.0, None, False)
    ref = reference_attention(q, k, v, dout, causal=False, softmax_scale=0.3)
    for name, view in zip(("dq", "dk", "dv"), views):
        assert compare(name, view, ref[name], dtype_name).passed
    assert all(bool((b[:, n:] == 7.0).all()) for b, n in zip(bufs, (6, 10, 10)))
    # softmax_d: rowsum(dout * out) in fp32, (b, h, sq rounded up to 128), zero-padded.
    assert softmax_d.shape == (2, 4, 128) and softmax_d.dtype == torch.float32
    d = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    assert torch.allclose(softmax_d[..., :6], d) and not softmax_d[..., 6:].any()


def test_backward_allocates_missing_buffers_and_returns_only_softmax_d():
    q, k, v, dout = _inputs((1, 5, 2, 8), (1, 5, 2, 8), torch.float32, seed=7)
    out, lse, _, _ = fai._flash_attn_forward(q, k, v, 0.0, 0.3, True, -1, -1, 0.0, None, False)
    res = fai._flash_attn_backward(dout, q, k, v, out, lse, None, None, None, 0.0, 0.3, True,
                                   -1, -1, 0.0, None, False)
    assert isinstance(res, torch.Tensor) and res.shape == (1, 2, 128)
    with pytest.raises(ValueError, match="dq must have shape"):
        fai._flash_attn_backward(dout, q, k, v, out, lse, q[:, :4].clone(), None, None, 0.0,
                                 0.3, True, -1, -1, 0.0, None, False)


# --- varlen -------------------------------------------------------------------------------


def _varlen_case(lens_q, lens_k, dtype, seed, h=4, hk=2, d=16):
    cu_q = torch.tensor([0, *lens_q]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lens_k]).cumsum(0).to(torch.int32)
    q, k, v, dout = _inputs((int(cu_q[-1]), h, d), (int(cu_k[-1]), hk, d), dtype, seed)
    return q, k, v, dout, cu_q, cu_k


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (2, -1))])
def test_varlen_matches_each_sequence(causal, window, dtype_name):
    lens_q, lens_k = [1, 5, 1, 9, 3], [1, 8, 4, 9, 2]  # length-1 sequences, sq < sk, sq > sk
    q, k, v, dout, cu_q, cu_k = _varlen_case(lens_q, lens_k, DTYPES[dtype_name], seed=8)
    out, lse, _, _ = fai._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 9, 9, 0.0, 0.3, causal,
                                                    *window)
    assert lse.shape == (4, q.shape[0]) and lse.dtype == torch.float32  # (nheads, total_q)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    softmax_d = fai._flash_attn_varlen_backward(dout, q, k, v, out, lse, *grads, cu_q, cu_k, 9,
                                                9, 0.0, 0.3, causal, *window, 0.0, None, False)
    assert softmax_d.shape == (4, q.shape[0] + 128 * len(lens_q))
    for i, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        qs, ks = int(cu_q[i]), int(cu_k[i])
        seg = [t[None, qs:qs + sq] for t in (q, dout)] + [t[None, ks:ks + sk] for t in (k, v)]
        visible = fa_visible(sq, sk, *window, causal=causal)
        ref = _masked_reference(seg[0], seg[2], seg[3], seg[1], visible, 0.3)
        got = {"out": out[None, qs:qs + sq], "lse": lse[None, :, qs:qs + sq],
               "dq": grads[0][None, qs:qs + sq], "dk": grads[1][None, ks:ks + sk],
               "dv": grads[2][None, ks:ks + sk]}
        _assert_close(got, ref, dtype_name, ~visible.any(1))
        d = (seg[1].float() * out[None, qs:qs + sq].float()).sum(-1)[0].T
        assert torch.allclose(softmax_d[:, qs + 128 * i:qs + 128 * i + sq], d)


def test_varlen_rows_outside_sequences_and_zero_tensors():
    q, k, v, dout, cu_q, cu_k = _varlen_case([3, 2], [3, 2], torch.float32, seed=9)
    pad = torch.zeros(2, *q.shape[1:])
    q2, dout2 = torch.cat([q, pad]), torch.cat([dout, pad])  # 2 rows past cu_seqlens_q[-1]
    out, lse, _, _ = fai._flash_attn_varlen_forward(q2, k, v, cu_q, cu_k, 3, 3, 0.0, 0.3, True)
    assert not out[5:].any() and bool(torch.isneginf(lse[:, 5:]).all())
    dq = torch.full_like(q2, 5.0)
    fai._flash_attn_varlen_backward(dout2, q2, k, v, out, lse, dq, None, None, cu_q, cu_k, 3, 3,
                                    0.0, 0.3, True, -1, -1, 0.0, None, False, None, True)
    assert not dq[5:].any()  # zero_tensors=True zeroed the rows no sequence writes


def test_varlen_leftpad_and_seqused_k():
    # BlockInfo: sequence i's keys are [cu_k[i] + leftpad_k[i], cu_k[i] + seqused_k[i]).
    q, k, v, dout, cu_q, cu_k = _varlen_case([2, 3], [6, 6], torch.float32, seed=10)
    leftpad, used = torch.tensor([1, 2], dtype=torch.int32), torch.tensor([4, 6], dtype=torch.int32)
    out, lse, _, _ = fai._flash_attn_varlen_forward(
        q, k, v, cu_q, cu_k, 3, 6, 0.0, 0.3, False, leftpad_k=leftpad, seqused_k=used)
    for (qs, qe), (ks, ke) in zip([(0, 2), (2, 5)], [(1, 4), (8, 12)]):
        ref = reference_attention(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke],
                                  dout[None, qs:qe], causal=False, softmax_scale=0.3)
        assert compare("out", out[None, qs:qe], ref["out"], "fp32").passed
        assert compare("lse", lse[None, :, qs:qe], ref["lse"], "fp32").passed


# --- public functions ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_flash_attn_func_autograd(dtype_name):
    q, k, v, dout = _inputs((2, 8, 4, 16), (2, 11, 2, 16), DTYPES[dtype_name], seed=11)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse, s_dmask = fac.flash_attn_func(*leaves, causal=True, return_attn_probs=True)
    out.backward(dout)
    ref = _masked_reference(q, k, v, dout, fa_visible(8, 11, causal=True), 16 ** -0.5)
    got = {"out": out.detach(), "lse": lse.detach(), "dq": leaves[0].grad,
           "dk": leaves[1].grad, "dv": leaves[2].grad}
    _assert_close(got, ref, dtype_name)
    assert s_dmask.numel() == 0  # upstream returns mha_fwd's empty p without dropout


def test_flash_attn_varlen_func_autograd():
    q, k, v, dout, cu_q, cu_k = _varlen_case([4, 1, 6], [4, 3, 6], torch.float32, seed=12)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fac.flash_attn_varlen_func(*leaves, cu_q, cu_k, 6, 6, causal=True)
    out.backward(dout)
    for i in range(3):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        visible = fa_visible(qe - qs, ke - ks, causal=True)
        ref = _masked_reference(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke],
                                dout[None, qs:qe], visible, 16 ** -0.5)
        for name, got in (("out", out.detach()[qs:qe]), ("dq", leaves[0].grad[qs:qe]),
                          ("dk", leaves[1].grad[ks:ke]), ("dv", leaves[2].grad[ks:ke])):
            assert compare(name, got[None], ref[name], "fp32").passed, name


# --- the interface itself -----------------------------------------------------------------

# Parameter lists and defaults of flash_attn/flash_attn_interface.py at tag v2.8.3 (commit
# 060c9188beec3a8b62b33a3bfa6d5d2d44975fab): _flash_attn_forward line 77, _flash_attn_varlen_forward
# 143, _flash_attn_backward 238, _flash_attn_varlen_backward 330, flash_attn_func 1135,
# flash_attn_varlen_func 1370. Note _flash_attn_forward has no defaults at all in 2.8.3.
_BWD = ["dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv"]
_COMMON = ["dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right",
           "softcap", "alibi_slopes"]
_CU = ["cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"]
_PUBLIC_TAIL = ["dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes",
                "deterministic", "return_attn_probs"]
_PUBLIC_DEFAULTS = (0.0, None, False, (-1, -1), 0.0, None, False, False)
SIGNATURES = {
    "_flash_attn_forward": (["q", "k", "v", *_COMMON, "return_softmax"], None),
    "_flash_attn_varlen_forward": (
        ["q", "k", "v", *_CU, *_COMMON, "return_softmax", "block_table", "leftpad_k",
         "seqused_k", "zero_tensors"],
        (-1, -1, 0.0, None, False, None, None, None, False)),
    "_flash_attn_backward": ([*_BWD, *_COMMON, "deterministic", "rng_state"], (None,)),
    "_flash_attn_varlen_backward": (
        [*_BWD, *_CU, *_COMMON, "deterministic", "rng_state", "zero_tensors"], (None, False)),
    "flash_attn_func": (["q", "k", "v", *_PUBLIC_TAIL], _PUBLIC_DEFAULTS),
    "flash_attn_varlen_func": (["q", "k", "v", *_CU, *_PUBLIC_TAIL, "block_table"],
                               (*_PUBLIC_DEFAULTS, None)),
}


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_signatures_are_flash_attn_2_8_3(name):
    spec = inspect.getfullargspec(getattr(fai, name))
    assert (spec.args, spec.defaults) == SIGNATURES[name]
    assert spec.varargs is None and spec.varkw is None and not spec.kwonlyargs


def _ring_flash_attn_utils():
    """ring-flash-attn's utils.py, loaded alone: its package __init__ needs transformers."""
    spec = importlib.util.find_spec("ring_flash_attn")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("ring-flash-attn is not installed")
    path = os.path.join(spec.submodule_search_locations[0], "utils.py")
    mod_spec = importlib.util.spec_from_file_location("_ring_flash_attn_utils", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_ring_flash_attn_get_default_args_works():
    get_default_args = _ring_flash_attn_utils().get_default_args
    params = get_default_args(fai._flash_attn_forward).copy()
    assert set(params) == set(SIGNATURES["_flash_attn_forward"][0]) and params["softcap"] == 0.0
    q, k, v, _ = _inputs((1, 4, 2, 8), (1, 4, 2, 8), torch.float32, seed=13)
    params.update(q=q, k=k, v=v, dropout_p=0.0, softmax_scale=0.3, causal=True,
                  alibi_slopes=None, return_softmax=False, window_size_left=-1,
                  window_size_right=-1)
    assert len(fai._flash_attn_forward(**params)) == 4
    for name in ("_flash_attn_backward", "_flash_attn_varlen_forward",
                 "_flash_attn_varlen_backward"):
        assert list(get_default_args(getattr(fai, name))) == SIGNATURES[name][0]


@pytest.mark.parametrize("kwargs,match", [
    ({"dropout_p": 0.1}, "dropout"), ({"alibi_slopes": torch.ones(2)}, "alibi"),
    ({"softcap": 30.0}, "softcap")])
def test_unsupported_features_are_refused(kwargs, match):
    q, k, v, dout = _inputs((1, 4, 2, 8), (1, 4, 2, 8), torch.float32, seed=14)
    args = dict(dropout_p=0.0, softmax_scale=0.3, causal=False, window_size_left=-1,
                window_size_right=-1, softcap=0.0, alibi_slopes=None)
    args.update(kwargs)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4)
    calls = [
        lambda: fai._flash_attn_forward(q, k, v, **args, return_softmax=False),
        lambda: fai._flash_attn_backward(dout, q, k, v, q, None, None, None, None, **args,
                                         deterministic=False),
        lambda: fai._flash_attn_varlen_forward(q[0], k[0], v[0], **varlen, **args),
        lambda: fai._flash_attn_varlen_backward(dout[0], q[0], k[0], v[0], q[0], None, None,
                                                None, None, **varlen, **args,
                                                deterministic=False),
    ]
    for call in calls:
        with pytest.raises(NotImplementedError, match=match):
            call()
    with pytest.raises(NotImplementedError, match="block_table"):
        fai._flash_attn_varlen_forward(q[0], k[0], v[0], cu, cu, 4, 4, 0.0, 0.3, False,
                                       block_table=cu)


def test_version_and_marker():
    assert fac.__version__ == "2.8.3" and fac.CPBENCH_CPU_INTERFACE is True
    assert fai.CPBENCH_CPU_INTERFACE is True
    assert fac.is_cpu_interface(fac) and fac.is_cpu_interface(fai)
    assert not fac.is_cpu_interface(torch) and not fac.is_cpu_interface(None)


def _python(code: str, *, path_extra: str | None = None) -> str:
    env = dict(os.environ)
    if path_extra:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [path_extra, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.slow  # a fresh interpreter importing torch
def test_install_never_shadows_a_real_flash_attn(tmp_path):
    fake = tmp_path / "flash_attn"
    fake.mkdir()
    (fake / "__init__.py").write_text("__version__ = 'real'\n")
    (fake / "flash_attn_interface.py").write_text("REAL = True\n")
    out = _python("""
        from cpbench.kernels.flash_attn_cpu import install
        first, second = install(), install()
        import flash_attn, flash_attn.flash_attn_interface as fi
        print(first, second, flash_attn.__version__, getattr(fi, "REAL", False))
    """, path_extra=str(tmp_path))
    assert out == "False False real True"


@pytest.mark.slow  # a fresh interpreter importing torch
def test_install_gives_the_cpu_interface_where_none_exists():
    out = _python("""
        import importlib.util
        assert importlib.util.find_spec("flash_attn") is None
        from cpbench.kernels.flash_attn_cpu import install, is_cpu_interface
        first, second = install(), install()
        import flash_attn
        from flash_attn.flash_attn_interface import _flash_attn_forward, _flash_attn_backward
        from flash_attn import flash_attn_func
        from cpbench.kernels.flash_attn_cpu import _internal
        print(first, second, flash_attn.__version__, is_cpu_interface(flash_attn),
              _flash_attn_forward is _internal._flash_attn_forward)
    """)
    assert out == "True True 2.8.3 True True"


# --- the kernel backend -------------------------------------------------------------------


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("causal", [True, False])
def test_kernel_backend_matches_reference(causal, dtype_name):
    backend = fac.FLASH_ATTN_CPU
    assert backend.is_available("cpu") and not backend.causal_unequal
    q, k, v, dout = _inputs((2, 33, 8, 32), (2, 33, 2, 32), DTYPES[dtype_name], seed=15)
    out, lse = backend.forward(q, k, v, causal=causal, softmax_scale=0.2)
    # The backward takes out as an fp32 merge would hand it over.
    dq, dk, dv = backend.backward(dout, q, k, v, out.float(), lse, causal=causal,
                                  softmax_scale=0.2)
    ref = reference_attention(q, k, v, dout, causal=causal, softmax_scale=0.2)
    _assert_close({"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}, ref, dtype_name)
    reason = backend.unsupported_reason(device="cpu", dtype=DTYPES[dtype_name], head_dim=32,
                                        heads=8, kv_heads=2, seqlen_q=5, seqlen_k=9, causal=True)
    assert reason is not None and "seqlen_q 5 != seqlen_k 9" in reason


def test_tolerances_cover_the_dtypes_tested():
    assert set(DTYPES) <= set(TOLERANCES)
