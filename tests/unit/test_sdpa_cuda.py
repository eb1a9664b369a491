"""The ``sdpa`` backend (torch's CUDA FlashAttention-2) against the float64 reference on a GPU:
causal and full, GQA, batch > 1, odd lengths, fp16 and bf16, head dims 32-256, and its varlen
path (packed documents, causal bottom-right per sequence, sliding windows) that masked blocks
run on. The CUDA cases are marked gpu (skipped without a GPU; `make gpu-check` runs them
first). The same harness runs on CPU against flash-attn-cpu, the CPU implementation of the
same masking rules, so the harness is tested where no GPU is, and a wrong mask fails it."""

from __future__ import annotations

import pytest
import torch

from cpbench import kernels
from cpbench.reference import compare, reference_attention

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NO_WINDOW = (-1, -1)
# (batch, seq_q, seq_k, heads, kv_heads, head_dim, dtype, causal)
DENSE = [
    (1, 128, 128, 8, 8, 64, "bf16", True),
    (2, 257, 257, 8, 2, 128, "bf16", True),     # GQA, batch 2, odd length
    (2, 1000, 1000, 4, 1, 64, "fp16", False),   # MQA, full
    (1, 333, 333, 16, 4, 128, "fp16", True),
    (3, 77, 77, 8, 8, 32, "bf16", False),
    (1, 100, 300, 8, 2, 128, "bf16", False),    # seq_q != seq_k, full (no alignment question)
    (1, 512, 512, 4, 4, 256, "bf16", True),     # head dim 256
    (2, 200, 200, 4, 2, 72, "fp16", True),      # head dim not a power of two
]
# (q lengths, k lengths, heads, kv_heads, head_dim, dtype, causal, window (left, right))
VARLEN = [
    ((300, 17, 1000, 129), (300, 17, 1000, 129), 8, 2, 128, "bf16", True, NO_WINDOW),
    ((512, 511, 1), (512, 511, 1), 4, 4, 64, "fp16", False, NO_WINDOW),
    ((700, 300), (700, 300), 8, 2, 128, "bf16", True, (127, 0)),   # causal sliding window
    ((400, 257), (400, 257), 4, 1, 64, "fp16", False, (63, 31)),   # two-sided window
    ((64, 200), (128, 300), 8, 2, 128, "bf16", True, NO_WINDOW),   # q shorter: bottom-right
]
GPU = [pytest.mark.gpu,
       pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _dense_id(case) -> str:
    b, sq, sk, h, hk, d, dt, causal = case
    seq = sq if sq == sk else f"{sq}x{sk}"
    return f"b{b}-s{seq}-h{h}:{hk}-d{d}-{dt}-{'causal' if causal else 'full'}"


def _varlen_id(case) -> str:
    lq, lk, h, hk, d, dt, causal, window = case
    docs = "+".join(map(str, lq)) + ("" if lq == lk else "/" + "+".join(map(str, lk)))
    win = "" if window == NO_WINDOW else f"-w{window[0]},{window[1]}"
    return f"docs{docs}-h{h}:{hk}-d{d}-{dt}-{'causal' if causal else 'full'}{win}"


def _randn(*shape, dtype, device, gen):
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def _failures(got: dict, ref: dict, dtype: str) -> list[str]:
    return [c.line() for n, t in got.items() if not (c := compare(n, t, ref[n], dtype)).passed]


def dense_failures(backend, case, device: str, *, kernel_causal=None, dt=None) -> list[str]:
    """The failing comparisons of one dense forward + backward (empty: it passed).
    ``kernel_causal``: the mask the kernel is asked for, if not the reference's (a control);
    ``dt``: another dtype than the case's."""
    b, sq, sk, h, hk, d, case_dt, causal = case
    dt = dt or case_dt
    gen = torch.Generator().manual_seed(sq * 31 + h)
    dtype = DTYPES[dt]
    q, dout = (_randn(b, sq, h, d, dtype=dtype, device=device, gen=gen) for _ in range(2))
    k, v = (_randn(b, sk, hk, d, dtype=dtype, device=device, gen=gen) for _ in range(2))
    scale = d ** -0.5
    asked = causal if kernel_causal is None else kernel_causal
    out, lse = backend.forward(q, k, v, causal=asked, softmax_scale=scale)
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, causal=asked, softmax_scale=scale)
    ref = reference_attention(q, k, v, dout, causal=causal, softmax_scale=scale)
    return _failures({"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}, ref, dt)


def packed_visible(lq, lk, causal: bool, window) -> torch.Tensor:
    """(sum lq, sum lk) bool: query i of a sequence sees key j of the same sequence when
    i + sk - sq - left <= j <= i + sk - sq + right (right = 0 when causal; -1 unbounded):
    flash-attn's bottom-right rule, written out independently of any kernel."""
    vis = torch.zeros(sum(lq), sum(lk), dtype=torch.bool)
    q0 = k0 = 0
    for sq, sk in zip(lq, lk):
        diag = torch.arange(sq)[:, None] + (sk - sq)
        j = torch.arange(sk)[None, :]
        ok = torch.ones(sq, sk, dtype=torch.bool)
        left, right = window
        if causal:
            ok &= j <= diag
        if right >= 0:
            ok &= j <= diag + right
        if left >= 0:
            ok &= j >= diag - left
        vis[q0:q0 + sq, k0:k0 + sk] = ok
        q0, k0 = q0 + sq, k0 + sk
    return vis


def _cu(lengths, device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)


def varlen_failures(varlen, case, device: str, *, kernel_window=None, dt=None) -> list[str]:
    """The failing comparisons of one packed varlen forward + backward. ``varlen``: the
    backend's (varlen_forward, varlen_backward); ``kernel_window``: the window the kernel is
    asked for, if not the reference's (a control); ``dt``: another dtype than the case's."""
    lq, lk, h, hk, d, case_dt, causal, window = case
    dt = dt or case_dt
    gen = torch.Generator().manual_seed(sum(lq) + 7 * h)
    dtype = DTYPES[dt]
    q, dout = (_randn(sum(lq), h, d, dtype=dtype, device=device, gen=gen) for _ in range(2))
    k, v = (_randn(sum(lk), hk, d, dtype=dtype, device=device, gen=gen) for _ in range(2))
    cu_q, cu_k = _cu(lq, device), _cu(lk, device)
    scale = d ** -0.5
    asked = dict(causal=causal, softmax_scale=scale,
                 window=window if kernel_window is None else kernel_window)
    fwd, bwd = varlen
    out, lse = fwd(q, k, v, cu_q, cu_k, max(lq), max(lk), **asked)
    dq, dk, dv = bwd(dout, q, k, v, out, lse, cu_q, cu_k, max(lq), max(lk), **asked)
    ref = reference_attention(q[None], k[None], v[None], dout[None], causal=False,
                              softmax_scale=scale,
                              visible=packed_visible(lq, lk, causal, window).to(device))
    ref = {"out": ref["out"][0], "lse": ref["lse"][0], "dq": ref["dq"][0], "dk": ref["dk"][0],
           "dv": ref["dv"][0]}
    return _failures({"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}, ref, dt)


def cpu_varlen():
    """flash-attn-cpu's varlen functions under the backends' varlen signature."""
    from cpbench.kernels.flash_attn_cpu import _internal as fa

    def fwd(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, softmax_scale, window=NO_WINDOW):
        out, lse, *_ = fa._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0,
                                                     softmax_scale, causal, *window)
        return out, lse

    def bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, causal, softmax_scale,
            window=NO_WINDOW):
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        fa._flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q,
                                       max_k, 0.0, softmax_scale, causal, *window, 0.0, None,
                                       False)
        return dq, dk, dv

    return fwd, bwd


def _sdpa(case_dtype: str, head_dim: int, heads: int, kv_heads: int):
    backend = kernels.get("sdpa")
    why = backend.unsupported_reason(device="cuda", dtype=DTYPES[case_dtype], head_dim=head_dim,
                                     heads=heads, kv_heads=kv_heads)
    assert why is None, why  # its declaration must admit every case here on a GPU
    return backend


@pytest.mark.parametrize("case", DENSE, ids=_dense_id)
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=GPU)])
def test_sdpa_dense_matches_float64(case, device):
    backend = _sdpa(case[6], case[5], case[3], case[4])
    bad = dense_failures(backend, case, device)
    assert not bad, "; ".join(bad)


@pytest.mark.parametrize("case", VARLEN, ids=_varlen_id)
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=GPU)])
def test_sdpa_varlen_matches_float64(case, device):
    backend = _sdpa(case[5], case[4], case[2], case[3])
    bad = varlen_failures((backend.varlen_forward, backend.varlen_backward), case, device)
    assert not bad, "; ".join(bad)


# --- the harness on CPU: flash-attn-cpu under the same shapes and masks, in fp32 (the CPU
# kernel's halves are slow; the masks and the reference are what is tested here); ~10 s of CPU


@pytest.mark.slow
@pytest.mark.parametrize("case", [DENSE[1], DENSE[5]], ids=_dense_id)
def test_harness_dense_on_cpu(case):
    assert not dense_failures(kernels.get("flash-attn-cpu"), case, "cpu", dt="fp32")


@pytest.mark.slow
@pytest.mark.parametrize("case", VARLEN, ids=_varlen_id)
def test_harness_varlen_on_cpu(case):
    assert not varlen_failures(cpu_varlen(), case, "cpu", dt="fp32")


@pytest.mark.slow
def test_harness_fails_a_kernel_with_the_wrong_mask():
    """Negative controls: a causal kernel against the full reference, a window off by one;
    and the control itself can pass (causal is the window (-1, 0))."""
    fa_cpu = kernels.get("flash-attn-cpu")
    assert dense_failures(fa_cpu, DENSE[4], "cpu", kernel_causal=True, dt="fp32")
    assert varlen_failures(cpu_varlen(), VARLEN[3], "cpu", kernel_window=(62, 31), dt="fp32")
    assert not varlen_failures(cpu_varlen(), VARLEN[4], "cpu", kernel_window=(-1, 0),
                               dt="fp32")
