"""The flash-attn argument mapping, checked against real signatures without flash-attn installed.

Each signature below is the parameter list of ``_flash_attn_forward`` / ``_flash_attn_backward``
copied from the flash-attention source (github.com/Dao-AILab/flash-attention) at the named tag
or commit: flash_attn/flash_attn_interface.py for FA2, hopper/flash_attn_interface.py for FA3.
A trailing "=" marks a parameter with a default (not required).
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import types

import pytest
import torch

from cpbench.kernels import flash_attn as fa
from cpbench.kernels import torch_ref


def _sig(spec: str) -> tuple[list[str], set[str]]:
    names = [s.strip() for s in spec.split(",") if s.strip()]
    return [n.rstrip("=") for n in names], {n for n in names if not n.endswith("=")}


FA2_FWD = {
    # v2.0.0 (v2.1.0, v2.2.0 identical)
    "2.0": "q, k, v, dropout_p, softmax_scale, causal, return_softmax",
    # v2.3.0
    "2.3": "q, k, v, dropout_p, softmax_scale, causal, window_size, return_softmax",
    # v2.4.0 (v2.5.x identical)
    "2.4": "q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax",
    # v2.6.0 (v2.6.3 identical)
    "2.6": "q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, "
           "return_softmax",
    # v2.7.0 (v2.8.3 and master of 2026 identical); a torch.library custom op on torch >= 2.4
    "2.7": "q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, "
           "softcap, alibi_slopes, return_softmax",
}
FA2_BWD = {
    "2.0": "dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal",
    "2.1": "dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, "
           "rng_state=",
    "2.3": "dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, "
           "window_size, rng_state=",
    "2.4": "dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, "
           "window_size, alibi_slopes, rng_state=",
    "2.5": "dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, "
           "window_size, alibi_slopes, deterministic, rng_state=",
    "2.6": "dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, "
           "window_size, softcap, alibi_slopes, deterministic, rng_state=",
    "2.7": "dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, "
           "window_size_left, window_size_right, softcap, alibi_slopes, deterministic, "
           "rng_state=",
}
FA3_FWD = {
    # 3aae9c18 (2024-07, first FA3 beta)
    "2024-07": "q, k, v, softmax_scale, causal",
    # 284e2c6e (2024-11)
    "2024-11": "q, k, v, softmax_scale, causal, window_size, descale_q=, descale_k=, "
               "descale_v=, gqa_parallel=",
    # 0165c96f (2025-09, window still a tuple)
    "2025-09": "q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, "
               "seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, "
               "leftpad_k, rotary_cos, rotary_sin, seqlens_rotary, q_descale, k_descale, "
               "v_descale, softmax_scale, causal, window_size=, attention_chunk=, softcap=, "
               "rotary_interleaved=, scheduler_metadata=, num_splits=, pack_gqa=, sm_margin=",
    # 24cc2b25 (2025-11, window split into left/right)
    "2025-11": "q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, "
               "seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, "
               "leftpad_k, rotary_cos, rotary_sin, seqlens_rotary, q_descale, k_descale, "
               "v_descale, softmax_scale, causal, window_size_left=, window_size_right=, "
               "attention_chunk=, softcap=, rotary_interleaved=, scheduler_metadata=, "
               "num_splits=, pack_gqa=, sm_margin=",
    # 0f82fead (2026-03, master): everything but q, k, v defaulted, out -> out_
    "2026-03": "q, k, v, k_new=, v_new=, qv=, out_=, cu_seqlens_q=, cu_seqlens_k=, "
               "cu_seqlens_k_new=, seqused_q=, seqused_k=, max_seqlen_q=, max_seqlen_k=, "
               "page_table=, kv_batch_idx=, leftpad_k=, rotary_cos=, rotary_sin=, "
               "seqlens_rotary=, q_descale=, k_descale=, v_descale=, softmax_scale=, causal=, "
               "window_size_left=, window_size_right=, attention_chunk=, softcap=, "
               "rotary_interleaved=, scheduler_metadata=, num_splits=, pack_gqa=, sm_margin=",
}
FA3_BWD = {
    "2024-07": "dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal",
    "2024-11": "dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, "
               "window_size, deterministic=",
    "2025-09": "dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, "
               "sequed_k, max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, causal, "
               "window_size=, softcap=, deterministic=, sm_margin=",
    # causal is spelled is_causal from here on
    "2025-11": "dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, "
               "sequed_k, max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, is_causal, "
               "window_size_left=, window_size_right=, softcap=, deterministic=, sm_margin=",
    "2026-03": "dout, q, k, v, out, softmax_lse, cu_seqlens_q=, cu_seqlens_k=, sequed_q=, "
               "sequed_k=, max_seqlen_q=, max_seqlen_k=, dq=, dk=, dv=, softmax_scale=, "
               "is_causal=, window_size_left=, window_size_right=, softcap=, deterministic=, "
               "sm_margin=",
}

T = {n: object() for n in ("q", "k", "v", "dout", "out", "lse", "dq", "dk", "dv")}
SCALE = 0.0883


def _check_common(kwargs, params, required, causal):
    assert set(kwargs) <= set(params), f"unknown: {set(kwargs) - set(params)}"
    assert required <= set(kwargs), f"missing: {required - set(kwargs)}"
    # Binding to a signature of that shape is what the real call does with keywords.
    sig = inspect.Signature([inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                               default=inspect._empty if p in required else None)
                             for p in params])
    sig.bind(**kwargs)
    for name in ("q", "k", "v"):
        assert kwargs[name] is T[name]
    assert kwargs.get("window_size", NO := (-1, -1)) == NO
    assert kwargs.get("window_size_left", -1) == -1 and kwargs.get("window_size_right", -1) == -1
    if any(p.startswith("window_size") for p in params):
        assert "window_size" in kwargs or "window_size_left" in kwargs
    assert kwargs.get("softcap", 0.0) == 0.0
    assert kwargs.get("dropout_p", 0.0) == 0.0
    assert kwargs.get("causal", kwargs.get("is_causal")) is causal
    assert kwargs.get("softmax_scale", SCALE) == SCALE and "softmax_scale" in kwargs


def _check_backward(kwargs):
    for ours, theirs in (("dout", "dout"), ("out", "out"), ("lse", "softmax_lse"),
                         ("dq", "dq"), ("dk", "dk"), ("dv", "dv")):
        assert kwargs[theirs] is T[ours]


def _bwd_tensors():
    return dict(dout=T["dout"], q=T["q"], k=T["k"], v=T["v"], out=T["out"],
                softmax_lse=T["lse"], dq=T["dq"], dk=T["dk"], dv=T["dv"])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("version", sorted(FA2_FWD))
def test_fa2_forward_mapping(version, causal):
    params, required = _sig(FA2_FWD[version])
    kwargs = fa.fa2_forward_kwargs(params, q=T["q"], k=T["k"], v=T["v"], dropout_p=0.0,
                                   softmax_scale=SCALE, causal=causal, required=required)
    _check_common(kwargs, params, required, causal)
    assert kwargs["return_softmax"] is False and kwargs.get("alibi_slopes") is None


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("version", sorted(FA2_BWD))
def test_fa2_backward_mapping(version, causal):
    params, required = _sig(FA2_BWD[version])
    kwargs = fa.fa2_backward_kwargs(params, **_bwd_tensors(), dropout_p=0.0,
                                    softmax_scale=SCALE, causal=causal, required=required)
    _check_common(kwargs, params, required, causal)
    _check_backward(kwargs)
    assert kwargs.get("deterministic", False) is False and kwargs.get("rng_state") is None


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("version", sorted(FA3_FWD))
def test_fa3_forward_mapping(version, causal):
    params, required = _sig(FA3_FWD[version])
    kwargs = fa.fa3_forward_kwargs(params, q=T["q"], k=T["k"], v=T["v"], softmax_scale=SCALE,
                                   causal=causal, required=required)
    _check_common(kwargs, params, required, causal)
    assert all(kwargs[n] is None for n in kwargs if n in fa._FA3_UNUSED_INPUTS + ("out",))
    assert kwargs.get("attention_chunk", 0) == 0


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("version", sorted(FA3_BWD))
def test_fa3_backward_mapping(version, causal):
    params, required = _sig(FA3_BWD[version])
    kwargs = fa.fa3_backward_kwargs(params, **_bwd_tensors(), softmax_scale=SCALE,
                                    causal=causal, required=required)
    _check_common(kwargs, params, required, causal)
    _check_backward(kwargs)
    assert all(kwargs[n] is None for n in kwargs if n in fa._FA3_UNUSED_INPUTS)


def test_unknown_required_parameter_fails_loudly():
    with pytest.raises(TypeError, match="new_thing"):
        fa.fa2_forward_kwargs(["q", "k", "v", "new_thing"], q=1, k=2, v=3, dropout_p=0.0,
                              softmax_scale=1.0, causal=False, required={"q", "new_thing"})


OUT, LSE = object(), object()
RETURNS = {
    # FA2 v2.0.0: out, q, k, v, out_padded, softmax_lse, S_dmask
    "fa2-2.0": (OUT, 1, 2, 3, 4, LSE, 6),
    # FA2 v2.1.0 .. v2.6.3: out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state
    "fa2-2.6": (OUT, 1, 2, 3, 4, LSE, 6, 7),
    # FA2 v2.7.0 ..: out, softmax_lse, S_dmask, rng_state
    "fa2-2.7": (OUT, LSE, 2, 3),
    # FA3 3aae9c18 / 284e2c6e: out, q, k, v, out_padded, softmax_lse, S_dmask
    "fa3-2024": (OUT, 1, 2, 3, 4, LSE, 6),
    # FA3 since 7a802796 (2025-01): out, softmax_lse, out_accum, softmax_lse_accum
    "fa3-2025": (OUT, LSE, 2, 3),
}


@pytest.mark.parametrize("version", sorted(RETURNS))
def test_unpack_forward(version):
    out, lse = fa.unpack_forward(RETURNS[version])
    assert out is OUT and lse is LSE


def test_unpack_forward_rejects_unknown_layout():
    with pytest.raises(TypeError):
        fa.unpack_forward((1, 2, 3))


def test_signature_params_reads_custom_ops():
    # flash-attn >= 2.7 and FA3 wrap the functions in torch.library.custom_op, whose own
    # signature is (*args, **kwargs): the names must come from the wrapped function/schema.
    def f(q: torch.Tensor, dropout_p: float, window_size_left: int,
          rng_state: torch.Tensor | None = None) -> torch.Tensor:
        return q.clone()

    op = torch.library.custom_op("cpbench_test::fa_sig", f, mutates_args=())
    expected = (("q", "dropout_p", "window_size_left", "rng_state"),
                frozenset({"q", "dropout_p", "window_size_left"}))
    assert fa.signature_params(f) == expected
    assert fa.signature_params(op) == expected
    assert fa.signature_params(torch.ops.cpbench_test.fa_sig) == expected
    assert fa.signature_params(torch.ops.cpbench_test.fa_sig.default) == expected
    assert op(**fa._pick({"q": torch.ones(2), "dropout_p": 0.0, "window_size_left": -1},
                         expected[0], expected[1], "f")).sum() == 2


def test_not_importable_here_without_flash_attn():
    for backend in (fa.FLASH_ATTN, fa.FLASH_ATTN3):
        if not backend.is_importable():
            assert not backend.is_available()
            assert "cannot be imported: No module named" in \
                backend.unsupported_reason(device="cuda", dtype=torch.bfloat16, head_dim=64,
                                           heads=4, kv_heads=4)


def _ref_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal):
    # what the kernels need (flash-attn >= 2.1's backward fixes only a non-unit last stride)
    assert all(t.stride(-1) == 1 for t in (dout, q, k, v, out))
    assert softmax_lse.is_contiguous() and softmax_lse.dtype == torch.float32
    grads = torch_ref.backward(dout, q, k, v, out, softmax_lse, causal=causal,
                               softmax_scale=softmax_scale)
    for buf, g in zip((dq, dk, dv), grads):
        buf.copy_(g)  # flash-attn writes into the buffers it is given


def _fake_fa2(pre_27: bool):
    """A stand-in flash_attn_interface with a real signature, computing with torch_ref."""
    if pre_27:  # v2.6.3 signatures and return layout
        def fwd(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, return_softmax):
            assert dropout_p == 0 and window_size == (-1, -1)
            out, lse = torch_ref.forward(q, k, v, causal=causal, softmax_scale=softmax_scale)
            return out, q, k, v, out, lse, None, None

        def bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                window_size, softcap, alibi_slopes, deterministic, rng_state=None):
            _ref_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal)
            return dq, dk, dv, None
    else:  # v2.7.0 signatures and return layout
        def fwd(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                softcap, alibi_slopes, return_softmax):
            assert (window_size_left, window_size_right) == (-1, -1)
            out, lse = torch_ref.forward(q, k, v, causal=causal, softmax_scale=softmax_scale)
            return out, lse, None, None

        def bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                rng_state=None):
            _ref_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal)
            return None

    return types.SimpleNamespace(_flash_attn_forward=fwd, _flash_attn_backward=bwd)


@pytest.mark.parametrize("pre_27", [True, False])
def test_backend_glue_with_stand_in_module(monkeypatch, pre_27):
    monkeypatch.setitem(sys.modules, fa.FA2_MODULE, _fake_fa2(pre_27))
    fa._load.cache_clear()
    try:
        torch.manual_seed(0)
        q = torch.randn(2, 16, 4, 8, dtype=torch.float64)
        k, v = torch.randn(2, 16, 2, 8, dtype=torch.float64), torch.randn(2, 16, 2, 8,
                                                                           dtype=torch.float64)
        dout = torch.randn(2, 16, 4, 8, dtype=torch.float64).transpose(1, 2).contiguous()
        dout = dout.transpose(1, 2)  # non-contiguous, like a slice of a merged gradient
        out, lse = fa.FLASH_ATTN.forward(q, k, v, causal=True, softmax_scale=0.3)
        ref_out, ref_lse = torch_ref.forward(q, k, v, causal=True, softmax_scale=0.3)
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(lse, ref_lse)
        grads = fa.FLASH_ATTN.backward(dout, q, k, v, out, lse, causal=True, softmax_scale=0.3)
        ref = torch_ref.backward(dout, q, k, v, out, lse, causal=True, softmax_scale=0.3)
        for g, r in zip(grads, ref):
            torch.testing.assert_close(g, r)
    finally:
        fa._load.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [fa.FLASH_ATTN, fa.FLASH_ATTN3], ids=lambda b: b.name)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_against_torch_reference_on_gpu(backend, causal, kv_heads):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not backend.is_importable():  # the one-GPU machine has neither flash-attn
        module = {fa.FLASH_ATTN.name: fa.FA2_MODULE, fa.FLASH_ATTN3.name: fa.FA3_MODULE}[
            backend.name]
        installed = importlib.util.find_spec(module.split(".")[0]) is not None
        pytest.skip(f"{backend.name} does not import: {backend.import_error()}" if installed
                    else f"{backend.name} not installed")
    dt, scale = torch.bfloat16, 128 ** -0.5
    # skipped only where the capability table says so (FA3 off sm90, an old FA3 build's
    # dtypes): a kernel that should run and raises is a failure, not a skip
    why = backend.unsupported_reason(device="cuda", dtype=dt, head_dim=128, heads=4,
                                     kv_heads=kv_heads)
    if why is not None:
        pytest.skip(why)
    torch.manual_seed(0)
    q = torch.randn(2, 256, 4, 128, device="cuda", dtype=dt)
    k, v = (torch.randn(2, 256, kv_heads, 128, device="cuda", dtype=dt) for _ in range(2))
    dout = torch.randn_like(q)
    out, lse = backend.forward(q, k, v, causal=causal, softmax_scale=scale)
    ref_out, ref_lse = torch_ref.forward(q, k, v, causal=causal, softmax_scale=scale)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 256)
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
    grads = backend.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale)
    ref = torch_ref.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale)
    for g, r in zip(grads, ref):
        assert g.shape == r.shape
        torch.testing.assert_close(g, r, atol=5e-2, rtol=5e-2)


def test_kernel_inputs_are_copied_only_when_strided_or_misaligned():
    """A view starting 8 bytes into a buffer (a packed part) is copied to an aligned one; a
    ring's half-block (strided, unit last stride, aligned) is handed over as is; lse always
    leaves dense."""
    buf = torch.zeros(4 + 2 * 25 * 5 * 8, dtype=torch.bfloat16)
    packed = buf[4:].view(2, 25, 5, 8)  # 8 bytes past an aligned base
    assert packed.data_ptr() % fa.ALIGN_BYTES == 8
    half = torch.zeros(2, 50, 5, 8, dtype=torch.bfloat16)[:, 25:]  # batch 2: strided
    (q,) = fa.forward_inputs(packed, half, half)[:1]
    assert q.data_ptr() % fa.ALIGN_BYTES == 0 and torch.equal(q, packed)
    assert fa.forward_inputs(packed, half, half)[1].data_ptr() == half.data_ptr()
    lse = torch.zeros(2, 5, 50)[:, :, 25:]
    got = fa.backward_inputs(half, half, half, half, half, lse)
    assert got[5].is_contiguous() and got[5].data_ptr() % fa.ALIGN_BYTES == 0
    assert all(t.data_ptr() == half.data_ptr() for t in got[:5])
