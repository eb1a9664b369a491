"""cpbench's flash-attn 2.8.3 interface on CUDA (kernels/flash_attn_cpu/_cuda.py), checked on
CPU: every call it makes to torch's FA2 ops is bound to the installed op's schema, and the op
is played by aten's CPU flash kernel under FA2's masking rules, so the whole mapping (layouts,
scale and window arguments, varlen offsets, gradients written into the caller's buffers,
refusals) is held against the float64 reference without a GPU.

What this cannot show: torch's CUDA kernel itself (its numbers come from the GPU; the
fake-GPU layer holds shapes, dtypes and strides to flash-attn's own fake implementations,
tests/fake_gpu/test_fake_upstream_sdpa.py)."""

from __future__ import annotations

import ast
import importlib.util
import os

import pytest
import torch
from mask_helpers import fa_visible
from test_flash_attn_cpu import _assert_close, _inputs, _masked_reference

from cpbench.errors import UsageError
from cpbench.kernels import flash_attn_cpu as fac
from cpbench.kernels.flash_attn_cpu import _cuda, _kernel
from cpbench.kernels.flash_attn_cpu import flash_attn_interface as fai
from cpbench.reference import reference_attention

FWD, BWD = "_flash_attention_forward", "_flash_attention_backward"
NAN = float("nan")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _bind(name: str, args, kwargs) -> dict:
    """The call's arguments by the installed op's schema: a wrong count, an unknown keyword
    or a positional-only argument passed by name fails here, as at the real op."""
    schema = getattr(torch.ops.aten, name).default._schema
    positional = [a for a in schema.arguments if not a.kwarg_only]
    assert len(args) <= len(positional), f"{name}: {len(args)} positional arguments"
    bound = {a.name: value for a, value in zip(positional, args)}
    by_name = {a.name: a for a in schema.arguments}
    for key, value in kwargs.items():
        assert key in by_name and by_name[key].kwarg_only, f"{name}: keyword {key!r}"
        bound[key] = value
    for a in schema.arguments:
        if a.name not in bound:
            assert a.has_default_value(), f"{name}: {a.name} not given"
            bound[a.name] = a.default_value
    return bound


def _segments(a: dict):
    cq, ck = a["cum_seq_q"].tolist(), a["cum_seq_k"].tolist()
    used = a.get("seqused_k")
    for i in range(len(cq) - 1):
        k_end = ck[i] + int(used[i]) if used is not None else ck[i + 1]
        yield cq[i], cq[i + 1], ck[i], k_end


class TorchFa2OnCpu:
    """torch's ``_flash_attention_forward`` / ``_backward`` played on CPU tensors: aten's CPU
    flash kernel under FA2's masks (``_kernel``), the op's layouts and fresh outputs, rows no
    sequence covers left NaN (the op leaves them unset)."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    def op(self, name):
        return lambda *args, **kwargs: getattr(self, name)(_bind(name, args, kwargs))

    def _window(self, a, seqlen_k):
        left, right = (-1 if a[n] is None else a[n] for n in ("window_size_left",
                                                              "window_size_right"))
        return _kernel.key_window(a["is_causal"], left, right, seqlen_k)

    def _flash_attention_forward(self, a):
        self.calls.append((FWD, a))
        q, k, v = a["query"], a["key"], a["value"]
        assert all(t.stride(-1) == 1 for t in (q, k, v)) and a["dropout_p"] == 0.0
        if a["cum_seq_q"] is None:
            out, lse = _kernel.forward(q, k, v, a["scale"], *self._window(a, k.shape[1]))
        else:
            assert a["cum_seq_q"].dtype == a["cum_seq_k"].dtype == torch.int32
            out = torch.full_like(q, NAN)
            lse = torch.full((q.shape[1], q.shape[0]), NAN)
            window = self._window(a, a["max_k"])
            for qs, qe, ks, ke in _segments(a):
                o, lse_ = _kernel.forward(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke],
                                          a["scale"], *window)
                out[qs:qe], lse[:, qs:qe] = o[0], lse_[0]
        return out, lse, torch.empty(2), torch.empty(()), torch.empty(0)

    def _flash_attention_backward(self, a):
        self.calls.append((BWD, a))
        t = [a[n] for n in ("grad_out", "query", "key", "value", "out", "logsumexp")]
        assert all(x.stride(-1) == 1 for x in t[:5]) and t[5].is_contiguous()
        assert isinstance(a["rng_state"], torch.Tensor)  # no default in the schema
        if a["cum_seq_q"] is None:
            return _kernel.backward(*t, a["scale"], *self._window(a, t[2].shape[1]))
        dout, q, k, v, out, lse = t
        grads = [torch.full_like(x, NAN) for x in (q, k, v)]
        window = self._window(a, a["max_k"])
        for qs, qe, ks, ke in _segments(a):
            g = _kernel.backward(dout[None, qs:qe], q[None, qs:qe], k[None, ks:ke],
                                 v[None, ks:ke], out[None, qs:qe], lse[None, :, qs:qe],
                                 a["scale"], *window)
            for buf, grad, (s, e) in zip(grads, g, ((qs, qe), (ks, ke), (ks, ke))):
                buf[s:e] = grad[0]
        return tuple(grads)


@pytest.fixture
def torch_op(monkeypatch):
    """CPU tensors routed to the CUDA mapping, its op played by ``TorchFa2OnCpu``."""
    fake = TorchFa2OnCpu()
    monkeypatch.setattr(_cuda, "runs", lambda q: True)
    monkeypatch.setattr(_cuda, "_op", fake.op)
    return fake


def _run(q, k, v, dout, causal, left=-1, right=-1, scale=0.3):
    out, lse, s_dmask, rng_state = fai._flash_attn_forward(
        q, k, v, 0.0, scale, causal, left, right, 0.0, None, False)
    b, sq, h, _ = q.shape
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, q.dtype, (b, h, sq),
                                                            torch.float32)
    assert s_dmask.numel() == 0 and (rng_state.shape, rng_state.dtype) == ((2,), torch.int64)
    # ring-flash-attn's zigzag: views of longer buffers; their tails must stay as they were
    bufs = [torch.full((b, t.shape[1] + 3, *t.shape[2:]), 7.0, dtype=q.dtype) for t in (q, k, v)]
    views = [buf[:, :t.shape[1]] for buf, t in zip(bufs, (q, k, v))]
    softmax_d = fai._flash_attn_backward(dout, q, k, v, out, lse, *views, 0.0, scale, causal,
                                         left, right, 0.0, None, False)
    assert all(bool((buf[:, -3:] == 7.0).all()) for buf in bufs)
    assert softmax_d.shape == (b, h, -(-sq // 128) * 128) and softmax_d.isnan().all()
    return {"out": out, "lse": lse, "dq": views[0], "dk": views[1], "dv": views[2]}


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("sq,sk,left,right,causal", [
    (40, 40, -1, -1, True), (40, 40, -1, -1, False), (7, 19, -1, -1, True),
    (19, 7, -1, -1, True), (70, 70, 4, -1, True), (40, 70, 5, 1, False), (70, 70, 100, 100, False),
])
def test_dense_through_torchs_op_matches_float64(torch_op, sq, sk, left, right, causal,
                                                 dtype_name):
    q, k, v, dout = _inputs((2, sq, 4, 16), (2, sk, 2, 16), DTYPES[dtype_name], seed=sq + sk)
    visible = fa_visible(sq, sk, left, right, causal) if (left, right) != (100, 100) else \
        torch.ones(sq, sk, dtype=torch.bool)  # bounds >= seqlen_k are dropped
    ref = _masked_reference(q, k, v, dout, visible, 0.3)
    _assert_close(_run(q, k, v, dout, causal, left, right), ref, dtype_name, ~visible.any(1))
    (fwd, a), (bwd, b) = torch_op.calls
    assert (fwd, bwd) == (FWD, BWD) and a["cum_seq_q"] is None and b["cum_seq_q"] is None
    for x in (a, b):
        assert (x["scale"], x["window_size_left"], x["window_size_right"],
                x["is_causal"]) == (0.3, left, right, causal)


def test_inputs_with_a_strided_last_dim_are_made_contiguous(torch_op):
    """flash-attn's maybe_contiguous: the kernels take any strides but the last."""
    q, k, v, dout = _inputs((1, 16, 2, 32), (1, 16, 2, 32), torch.bfloat16, seed=3)
    q, k, v, dout = (t[..., ::2] for t in (q, k, v, dout))
    ref = reference_attention(q, k, v, dout, causal=True, softmax_scale=0.3)
    _assert_close(_run(q, k, v, dout, True), ref, "bf16")


def _varlen(lens_q, lens_k, dtype, seed):
    cu_q = torch.tensor([0, *lens_q]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lens_k]).cumsum(0).to(torch.int32)
    q, k, v, dout = _inputs((int(cu_q[-1]), 4, 16), (int(cu_k[-1]), 2, 16), dtype, seed)
    return q, k, v, dout, cu_q, cu_k


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (2, -1))])
def test_varlen_through_torchs_op_matches_each_sequence(torch_op, causal, window):
    lens_q, lens_k = [1, 5, 1, 9, 3], [1, 8, 4, 9, 2]
    q, k, v, dout, cu_q, cu_k = _varlen(lens_q, lens_k, torch.bfloat16, seed=8)
    out, lse, _, _ = fai._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 9, 9, 0.0, 0.3,
                                                    causal, *window)
    assert (lse.shape, lse.dtype) == ((4, q.shape[0]), torch.float32)  # (nheads, total_q)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    softmax_d = fai._flash_attn_varlen_backward(dout, q, k, v, out, lse, *grads, cu_q, cu_k, 9,
                                                9, 0.0, 0.3, causal, *window, 0.0, None, False)
    assert softmax_d.shape == (4, q.shape[0] + 128 * len(lens_q)) and softmax_d.isnan().all()
    for i, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        qs, ks = int(cu_q[i]), int(cu_k[i])
        visible = fa_visible(sq, sk, *window, causal=causal)
        ref = _masked_reference(q[None, qs:qs + sq], k[None, ks:ks + sk], v[None, ks:ks + sk],
                                dout[None, qs:qs + sq], visible, 0.3)
        got = {"out": out[None, qs:qs + sq], "lse": lse[None, :, qs:qs + sq],
               "dq": grads[0][None, qs:qs + sq], "dk": grads[1][None, ks:ks + sk],
               "dv": grads[2][None, ks:ks + sk]}
        _assert_close(got, ref, "bf16", ~visible.any(1))
    assert [c[1]["max_q"] for c in torch_op.calls] == [9, 9]


def test_varlen_zero_tensors_clears_rows_outside_every_sequence(torch_op):
    q, k, v, dout, cu_q, cu_k = _varlen([3, 2], [3, 2], torch.bfloat16, seed=9)
    pad = torch.zeros(2, *q.shape[1:], dtype=q.dtype)
    q2, dout2 = torch.cat([q, pad]), torch.cat([dout, pad])  # 2 rows past cu_seqlens_q[-1]
    out, lse, _, _ = fai._flash_attn_varlen_forward(q2, k, v, cu_q, cu_k, 3, 3, 0.0, 0.3, True,
                                                    zero_tensors=True)
    assert not out[5:].any() and bool(torch.isneginf(lse[:, 5:]).all())
    assert not out[:5].isnan().any() and not lse[:, :5].isnan().any()
    dq = torch.full_like(q2, 5.0)
    fai._flash_attn_varlen_backward(dout2, q2, k, v, out, lse, dq, None, None, cu_q, cu_k, 3, 3,
                                    0.0, 0.3, True, -1, -1, 0.0, None, False, None, True)
    assert not dq[5:].any() and not dq[:5].isnan().any()
    # without zero_tensors those rows hold what the op left there (unset), as documented
    out, _, _, _ = fai._flash_attn_varlen_forward(q2, k, v, cu_q, cu_k, 3, 3, 0.0, 0.3, True)
    assert out[5:].isnan().all()


def test_seqused_k_reaches_the_op(torch_op):
    q, k, v, dout, cu_q, cu_k = _varlen([2, 3], [6, 6], torch.bfloat16, seed=10)
    used = torch.tensor([4, 6], dtype=torch.int32)
    out, lse, _, _ = fai._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 3, 6, 0.0, 0.3, False,
                                                    seqused_k=used)
    ref = _masked_reference(q[None, :2], k[None, :4], v[None, :4], dout[None, :2],
                            torch.ones(2, 4, dtype=torch.bool), 0.3)
    _assert_close({"out": out[None, :2], "lse": lse[None, :, :2], "dq": ref["dq"],
                   "dk": ref["dk"], "dv": ref["dv"]}, ref, "bf16")


def test_flash_attn_func_pads_the_head_dim_as_upstream(torch_op):
    q, k, v, dout = _inputs((2, 8, 4, 12), (2, 11, 2, 12), torch.bfloat16, seed=11)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = fac.flash_attn_func(*leaves, causal=True, return_attn_probs=True)
    out.backward(dout)
    assert torch_op.calls[0][1]["query"].shape[-1] == 16  # the op saw 12 padded to 16
    assert torch_op.calls[0][1]["scale"] == 12 ** -0.5  # the scale of the real head dim
    ref = _masked_reference(q, k, v, dout, fa_visible(8, 11, causal=True), 12 ** -0.5)
    _assert_close({"out": out.detach(), "lse": lse.detach(), "dq": leaves[0].grad,
                   "dk": leaves[1].grad, "dv": leaves[2].grad}, ref, "bf16")


def _dense_call(q, k, v, **over):
    args = dict(dropout_p=0.0, softmax_scale=0.3, causal=True, window_size_left=-1,
                window_size_right=-1, softcap=0.0, alibi_slopes=None)
    args.update(over)
    return fai._flash_attn_forward(q, k, v, **args, return_softmax=False)


@pytest.mark.parametrize("shape,dtype,match", [
    ((1, 8, 2, 16), torch.float32, "fp16 and bf16 only"),
    ((1, 8, 2, 12), torch.bfloat16, "multiple of 8 up to 256, got 12"),
    ((1, 8, 2, 264), torch.bfloat16, "multiple of 8 up to 256, got 264"),
])
def test_what_flash_attn_refuses_on_cuda_is_refused(torch_op, shape, dtype, match):
    q = torch.zeros(shape, dtype=dtype)
    with pytest.raises(ValueError, match=match):
        _dense_call(q, q, q)
    assert not torch_op.calls


def test_what_torchs_op_cannot_do_is_refused(torch_op):
    q, k, v, dout, cu_q, cu_k = _varlen([4], [4], torch.bfloat16, seed=12)
    with pytest.raises(NotImplementedError, match="leftpad_k"):
        fai._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 4, 4, 0.0, 0.3, False,
                                       leftpad_k=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_q must be contiguous int32"):
        fai._flash_attn_varlen_forward(q, k, v, cu_q.long(), cu_k, 4, 4, 0.0, 0.3, False)
    out, lse, _, _ = fai._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 4, 4, 0.0, 0.3, False)
    args = (cu_q, cu_k, 4, 4, 0.0, 0.3, False, -1, -1, 0.0, None)
    with pytest.raises(ValueError, match=r"softmax_lse must be float32 \(h, total_q\)"):
        fai._flash_attn_varlen_backward(dout, q, k, v, out, lse[None], None, None, None, *args,
                                        False)
    with pytest.raises(NotImplementedError, match="use_deterministic_algorithms"):
        fai._flash_attn_varlen_backward(dout, q, k, v, out, lse, None, None, None, *args, True)
    torch.use_deterministic_algorithms(True)  # the op's own switch: then it is deterministic
    try:
        fai._flash_attn_varlen_backward(dout, q, k, v, out, lse, None, None, None, *args, True)
    finally:
        torch.use_deterministic_algorithms(False)
    wide = torch.zeros(q.shape[0], 4, 32, dtype=q.dtype)[..., ::2]  # last dim strided
    with pytest.raises(ValueError, match="contiguous last dim"):
        fai._flash_attn_varlen_backward(dout, q, k, v, out, lse, wide, None, None, *args, False)


def test_import_error_names_what_this_torch_lacks(monkeypatch):
    if torch.version.cuda is None:
        assert "build without CUDA" in _cuda.import_error()
    monkeypatch.setattr(_cuda, "_KEYWORDS", ("scale", "window_size_middle"))
    assert "takes no window_size_middle" in _cuda.import_error()


def test_the_adapters_refuse_sdpa_where_torch_cannot_run_it(monkeypatch):
    from cpbench import kernels
    from cpbench.strategies._upstream import flash_attn_beneath

    monkeypatch.setattr(fac, "cuda_import_error", lambda: "torch 2.0 has no aten.x")
    with pytest.raises(UsageError, match="cannot run on CUDA here: torch 2.0 has no aten.x"):
        flash_attn_beneath(kernels.get("sdpa"))


def _library_files(package: str):
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{package} is not installed")
    root = spec.submodule_search_locations[0]
    for folder, _, files in os.walk(root):
        yield from (os.path.join(folder, f) for f in files if f.endswith(".py"))


@pytest.mark.parametrize("package", ["ring_flash_attn", "yunchang"])
def test_the_libraries_discard_softmax_d(package):
    """The CUDA mapping returns softmax_d as NaN (torch's op does not return it): every call
    of the backward functions in the installed library must be a statement of its own."""
    names = {"_flash_attn_backward", "_flash_attn_varlen_backward"}
    statements, calls = 0, 0
    for path in _library_files(package):
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in names:
                calls += 1
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and \
                    getattr(node.value.func, "id", None) in names:
                statements += 1
    assert calls > 0 and statements == calls, (package, calls, statements)


def test_yunchang_imported_before_the_interface_is_refused(own_modules, monkeypatch):
    """yunchang decides at its first import whether flash-attn exists (HAS_FLASH_ATTN): one
    imported before the interface was installed would fail at its first call."""
    import sys

    from cpbench import kernels, strategies
    from cpbench.config import AttentionConfig
    from cpbench.topology import Topology

    for name in [n for n in sys.modules if n.split(".")[0] in ("yunchang", "flash_attn")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # absent at yunchang's import
    yunchang_globals = pytest.importorskip("yunchang.globals")
    assert not yunchang_globals.HAS_FLASH_ATTN
    attn = AttentionConfig(batch=1, seqlen=64, heads=4, kv_heads=4, head_dim=16, dtype="bf16",
                           causal=True)
    cls = strategies.get("yunchang-usp")
    st = cls(attn, Topology(world_size=2, ranks_per_node=2), 0, kernel=kernels.get("sdpa-cpu"),
             options=cls.Options(ulysses_degree=1), create_groups=False)
    with pytest.raises(UsageError, match="yunchang was imported in this process before"):
        st._layer()
