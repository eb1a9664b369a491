"""ring-flash-attn and yunchang on CUDA without flash-attn: their own code over cpbench's
flash-attn 2.8.3 interface on torch's FA2 ops (``--kernel sdpa``), on fake CUDA tensors.

flash-attn is made absent the way Python itself marks a module absent: ``sys.modules[name] =
None`` for ``flash_attn`` and its compiled ``flash_attn_2_cuda`` (``import`` raises
ModuleNotFoundError, ``importlib.util.find_spec`` finds nothing), with the libraries imported
afresh; everything is restored after. The interface's outputs are held to flash-attn's own
fake implementations (installed in this venv) call for call: shapes, dtypes, strides."""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections import Counter

import pytest
import torch
from optional_libs import require

from cpbench import kernels, strategies
from cpbench.bench import dryrun, fakegrad
from cpbench.config import AttentionConfig
from cpbench.errors import UsageError
from cpbench.kernels import flash_attn_cpu as fac
from cpbench.kernels.flash_attn_cpu import _cuda
from cpbench.kernels.flash_attn_cpu import flash_attn_interface as ours
from cpbench.topology import Topology

BF16 = torch.bfloat16
_LIBS = ("flash_attn", "flash_attn_2_cuda", "flash_attn_interface", "ring_flash_attn",
         "yunchang")


@contextlib.contextmanager
def flash_attn_absent():
    """This process as a machine without flash-attn (see the module docstring)."""
    saved = {n: m for n, m in sys.modules.items() if n.split(".")[0] in _LIBS}
    for name in saved:
        del sys.modules[name]
    sys.modules["flash_attn"] = sys.modules["flash_attn_2_cuda"] = None  # type: ignore
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] in _LIBS]:
            del sys.modules[name]
        sys.modules.update(saved)


@pytest.fixture
def no_flash_attn():
    with flash_attn_absent():
        yield


@pytest.fixture
def op_calls(monkeypatch):
    """Counts of the calls the interface makes to torch's FA2 ops, by op name."""
    calls: Counter = Counter()
    real = _cuda._op

    def counted(name):
        calls[name] += 1
        return real(name)

    monkeypatch.setattr(_cuda, "_op", counted)
    return calls


def _params(fn):
    sig = inspect.signature(getattr(fn, "_init_fn", fn))  # flash-attn's are custom ops
    return [(p.name, p.default) for p in sig.parameters.values()]


@pytest.mark.parametrize("name", ["_flash_attn_forward", "_flash_attn_varlen_forward",
                                  "_flash_attn_backward", "_flash_attn_varlen_backward",
                                  "flash_attn_func", "flash_attn_varlen_func"])
def test_signatures_are_the_installed_flash_attns(flash_attn, name):
    assert _params(getattr(ours, name)) == _params(getattr(flash_attn, name))


def _meta(t):
    return (tuple(t.shape), t.dtype, t.device.type, t.stride())


def _same(a, b):
    assert [_meta(t) for t in a] == [_meta(t) for t in b]


@pytest.mark.parametrize("b,sq,sk,hk", [(1, 8192, 8192, 40), (2, 4096, 8192, 8)])
def test_dense_outputs_are_flash_attns(flash_attn, fake_cuda, op_calls, b, sq, sk, hk):
    q = torch.empty(b, sq, 40, 128, device="cuda", dtype=BF16)
    k, v = (torch.empty(b, sk, hk, 128, device="cuda", dtype=BF16) for _ in range(2))
    args = (0.0, 128 ** -0.5, True, -1, -1, 0.0, None, False)
    theirs = flash_attn._flash_attn_forward(q, k, v, *args)
    mine = ours._flash_attn_forward(q, k, v, *args)
    _same(mine, theirs)  # out (b, sq, h, d), lse (b, h, sq) fp32, S_dmask, rng_state
    assert _meta(mine[1])[:2] == ((b, 40, sq), torch.float32)
    out, lse = mine[:2]
    # ring-flash-attn's buffers: views of longer ones
    bufs = [torch.empty(b, t.shape[1] * 2, *t.shape[2:], device="cuda", dtype=BF16)
            for t in (q, k, v)]
    views = [buf[:, :t.shape[1]] for buf, t in zip(bufs, (q, k, v))]
    rest = (0.0, 128 ** -0.5, True, -1, -1, 0.0, None, False)
    d_theirs = flash_attn._flash_attn_backward(torch.empty_like(out), q, k, v, out, lse,
                                               *views, *rest)
    d_mine = ours._flash_attn_backward(torch.empty_like(out), q, k, v, out, lse, *views, *rest)
    _same([d_mine], [d_theirs])  # softmax_d (b, h, round_up(sq, 128)) fp32
    assert op_calls == {"_flash_attention_forward": 1, "_flash_attention_backward": 1}


def test_varlen_outputs_are_flash_attns(flash_attn, fake_cuda, op_calls):
    seqs = [4096, 2048, 2048]
    cu = torch.tensor([0, 4096, 6144, 8192], dtype=torch.int32, device="cuda")
    q = torch.empty(8192, 40, 128, device="cuda", dtype=BF16)
    k, v = (torch.empty(8192, 8, 128, device="cuda", dtype=BF16) for _ in range(2))
    args = (cu, cu, max(seqs), max(seqs), 0.0, 128 ** -0.5, True)
    theirs = flash_attn._flash_attn_varlen_forward(q, k, v, *args)
    mine = ours._flash_attn_varlen_forward(q, k, v, *args)
    _same(mine, theirs)
    assert _meta(mine[1])[:2] == ((40, 8192), torch.float32)  # (nheads, total_q)
    out, lse = mine[:2]
    grads = [torch.empty_like(t) for t in (q, k, v)]
    rest = (0.0, 128 ** -0.5, True, -1, -1, 0.0, None, False)
    d_theirs = flash_attn._flash_attn_varlen_backward(torch.empty_like(out), q, k, v, out, lse,
                                                      *grads, *args[:4], *rest)
    d_mine = ours._flash_attn_varlen_backward(torch.empty_like(out), q, k, v, out, lse, *grads,
                                              *args[:4], *rest)
    _same([d_mine], [d_theirs])  # softmax_d (h, total_q + 128 * batch)
    assert op_calls == {"_flash_attention_forward": 1, "_flash_attention_backward": 1}


def test_sdpa_is_refused_where_flash_attn_is_installed(flash_attn, fake_pg):
    """The library would call the installed flash-attn, not torch's kernel."""
    fake_pg(0, 2)
    attn = AttentionConfig(batch=1, seqlen=4096, heads=8, kv_heads=8, head_dim=128,
                           dtype="bf16", causal=True)
    with pytest.raises(UsageError, match="a flash-attn is installed here.*--kernel flash-attn"):
        strategies.get("rfa-zigzag")(attn, Topology(world_size=2, ranks_per_node=2), 0,
                                     kernel=kernels.get("sdpa"))


S, H, HK, D, N = 64 * 1024, 40, 8, 128, 8
ATTN = AttentionConfig(batch=1, seqlen=S, heads=H, kv_heads=HK, head_dim=D, dtype="bf16",
                       causal=True)
TOPO = Topology(world_size=N, ranks_per_node=N)


@pytest.mark.parametrize("name,options", [
    ("rfa-zigzag", None), ("yunchang-usp", {"ring_impl": "zigzag", "ulysses_degree": 4}),
    ("yunchang-usp", {"ring_impl": "basic", "ulysses_degree": 2}),
])
def test_forward_and_backward_through_the_library(name, options, no_flash_attn, op_calls,
                                                  fake_pg, fake_streams):
    """The strategy's own call on fake CUDA, rank 3 of 8, and the backward through its
    autograd Function: out as q, rfa's lse flash-attn's (1, h, s) fp32, gradients as q, k, v
    (yunchang returns no lse: its ring hands the lse back to the interface's backward, which
    checks it is flash-attn's (b, h, s) fp32)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cls = strategies.get(name)
    require(cls.upstream.package)  # the library's own code is what runs here
    fake_pg(3, N)
    opts = dryrun.case_options(name, options) if options else None
    st = cls(ATTN, TOPO, 3, kernel=kernels.get("sdpa"), options=opts)
    assert fac.is_cpu_interface(sys.modules["flash_attn"])
    assert "torch's FA2 ops" in st.provenance()["flash_attn"]
    # TorchScript's fusers off, as the dry run does (ring-flash-attn scripts its lse merge)
    with FakeTensorMode(), dryrun._fusers_off():
        x = torch.empty(1, S, H, D, device="cuda", dtype=BF16)
        kv = torch.empty(1, S, HK, D, device="cuda", dtype=BF16)
        q = st.shard(x).clone().requires_grad_()
        k, v = (st.shard(kv).clone().requires_grad_() for _ in range(2))
        with fakegrad.recording():
            out, lse = st.attention(q, k, v)
        assert _meta(out)[:3] == _meta(q)[:3]
        if lse is not None:
            assert _meta(lse)[:3] == ((1, H, S // N), torch.float32, "cuda")
        fakegrad.backward(out, torch.empty_like(out))
    for g, t in ((q.grad, q), (k.grad, k), (v.grad, v)):
        assert _meta(g)[:3] == _meta(t)[:3]
    assert op_calls["_flash_attention_forward"] > 0 and op_calls["_flash_attention_backward"] > 0
    if name == "rfa-zigzag":  # one block a step: N forward and N backward calls
        assert op_calls == {"_flash_attention_forward": N, "_flash_attention_backward": N}


def _measured(r) -> Counter:
    """Bytes per (phase, collective, group members), as the dry run traced them."""
    out: Counter = Counter()
    for phase, events in r.events.items():
        for e in events:
            out[(phase, e.op, tuple(sorted(e.group)))] += e.nbytes
    return out


SMALL = Topology(world_size=4, ranks_per_node=4)
DOCS = AttentionConfig(batch=1, seqlen=32 * 1024, heads=H, kv_heads=HK, head_dim=D,
                       dtype="bf16", causal=True, documents=(16384, 8192, 8192))
WINDOW = AttentionConfig(batch=1, seqlen=32 * 1024, heads=H, kv_heads=HK, head_dim=D,
                         dtype="bf16", causal=True, window_size=(4096, 0))
PLAIN = AttentionConfig(batch=1, seqlen=32 * 1024, heads=H, kv_heads=HK, head_dim=D,
                        dtype="bf16", causal=True)
UPSTREAM = [("rfa-zigzag", PLAIN), ("rfa-zigzag", DOCS), ("rfa-ring", PLAIN), ("rfa-ring", DOCS),
            ("rfa-stripe", PLAIN), ("rfa-llama3", DOCS), ("rfa-llama3", WINDOW),
            ("yunchang-usp", PLAIN)]


def _id(name, attn):
    return f"{name}-{'docs' if attn.documents else 'window' if attn.window_size else 'plain'}"


# what the library's own code does on either kernel, found by the dry run: ring-flash-attn
# 0.1.8's zigzag varlen function reads cu_seqlens[-1].item() at every call (get_half_index)
LIBRARY_SYNCS = {"rfa-zigzag-docs": "ring_flash_attn/zigzag_ring_flash_attn_varlen.py:31"}


@pytest.mark.parametrize("name,attn", UPSTREAM, ids=[_id(*c) for c in UPSTREAM])
def test_dry_run_of_every_rank_on_sdpa_is_the_run_on_flash_attn(name, attn, flash_attn):
    """``cpbench dryrun``'s engine, every rank: on sdpa without flash-attn each runs forward
    and backward and sends the same bytes per phase, collective and group as on flash-attn
    (the library's own code above either), or stops where it stops on flash-attn."""
    require(strategies.get(name).upstream.package)
    opts = strategies.get(name).Options()
    on_fa = [dryrun.dry_rank(name, opts, attn, SMALL, rank, kernel_name="flash-attn",
                             device="cuda") for rank in range(SMALL.world_size)]
    with flash_attn_absent():
        on_sdpa = [dryrun.dry_rank(name, opts, attn, SMALL, rank, kernel_name="sdpa",
                                   device="cuda") for rank in range(SMALL.world_size)]
    for fa, r in zip(on_fa, on_sdpa):
        assert (r.status, r.error, r.where) == (fa.status, fa.error, fa.where), r.rank
        if _id(name, attn) in LIBRARY_SYNCS:
            assert r.error.startswith("host sync") and r.where == LIBRARY_SYNCS[_id(name, attn)]
            continue
        assert r.status == "ok", (r.rank, r.error, r.where)
        assert set(r.events) == {"fwd", "bwd"}
        assert 0 < r.peak_fwd_bytes <= r.peak_fwd_bwd_bytes
        assert _measured(r) == _measured(fa), r.rank
