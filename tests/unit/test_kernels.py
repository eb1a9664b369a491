"""Every runnable kernel backend against the float64 reference, and the measured properties
of aten's CPU flash kernel that the sdpa-cpu backend and the strategies rely on."""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from cpbench import kernels
from cpbench.kernels.base import check_shapes
from cpbench.reference import TOLERANCES, compare, reference_attention

RUNNABLE = kernels.available("cpu")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _inputs(b, sq, sk, h, hk, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g).to(dtype)
    k = torch.randn(b, sk, hk, d, generator=g).to(dtype)
    v = torch.randn(b, sk, hk, d, generator=g).to(dtype)
    dout = torch.randn(b, sq, h, d, generator=g).to(dtype)
    return q, k, v, dout


def _check(backend, q, k, v, dout, causal, dtype_name):
    scale = q.shape[-1] ** -0.5
    out, lse = backend.forward(q, k, v, causal=causal, softmax_scale=scale)
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert out.shape == q.shape and out.dtype == q.dtype
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale)
    assert dk.shape == k.shape and dv.shape == v.shape  # GQA: grads come back with kv heads
    ref = reference_attention(q, k, v, dout, causal=causal, softmax_scale=scale)
    got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    bad = [c.line() for n, t in got.items() if not (c := compare(n, t, ref[n], dtype_name)).passed]
    assert not bad, f"{backend.name}: " + "; ".join(bad)


def test_cpu_backends_available():
    assert {"torch", "sdpa-cpu"} <= set(RUNNABLE)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", RUNNABLE)
def test_causal_gqa_matches_reference(name, causal, dtype_name):
    # a seed fixed per case (hash() of a str changes per process)
    seed = zlib.crc32(f"{name}/{causal}".encode()) % 1000
    q, k, v, dout = _inputs(2, 33, 33, 8, 2, 32, DTYPES[dtype_name], seed=seed)
    _check(kernels.get(name), q, k, v, dout, causal, dtype_name)


@pytest.mark.parametrize("name", RUNNABLE)
@pytest.mark.parametrize("seed", range(4))
def test_random_shapes(name, seed):
    g = torch.Generator().manual_seed(seed)
    b, h = int(torch.randint(1, 3, (1,), generator=g)), 4
    hk = [1, 2, 4][int(torch.randint(0, 3, (1,), generator=g))]
    sq, sk = (int(x) for x in torch.randint(1, 70, (2,), generator=g))
    d = [8, 16, 40, 64][int(torch.randint(0, 4, (1,), generator=g))]
    # Unequal lengths are non-causal: causal blocks in strategies are always square.
    q, k, v, dout = _inputs(b, sq, sk, h, hk, d, torch.float32, seed)
    _check(kernels.get(name), q, k, v, dout, False, "fp32")
    q, k, v, dout = _inputs(b, sq, sq, h, hk, d, torch.float32, seed + 100)
    _check(kernels.get(name), q, k, v, dout, True, "fp32")


@pytest.mark.parametrize("sq,sk", [(5, 9), (9, 5)])
@pytest.mark.parametrize("name", [n for n in RUNNABLE if kernels.get(n).causal_unequal])
def test_causal_unequal_is_top_left_where_declared(name, sq, sk):
    backend = kernels.get(name)
    assert name in ("torch", "sdpa-cpu")  # the CPU backends that align top-left
    # (flash-attn-cpu is bottom-right, as flash-attn: tests/unit/test_flash_attn_cpu.py)
    q, k, v, dout = _inputs(1, sq, sk, 4, 2, 16, torch.float32, seed=sq)
    _check(backend, q, k, v, dout, True, "fp32")


def test_tolerances_are_stated_for_every_dtype():
    assert set(TOLERANCES) == {"fp32", "bf16", "fp16"}


# -- properties of aten's CPU flash kernel (documented in kernels/sdpa_cpu.py) ----------------

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def test_sdpa_cpu_causal_unequal_is_top_left_aligned():
    q, k, v, _ = _inputs(1, 5, 9, 2, 2, 8, torch.float32, seed=3)
    out, lse = _FWD(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, True)
    ref_top_left = torch.ones(5, 9, dtype=torch.bool).tril()
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * 8 ** -0.5
    ref_lse = s.masked_fill(~ref_top_left, float("-inf")).logsumexp(-1)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_sdpa_cpu_fully_masked_row_returns_zero_not_minus_inf():
    q, k, v, _ = _inputs(1, 4, 4, 1, 1, 8, torch.float32, seed=4)
    mask = torch.zeros(1, 1, 4, 4)
    mask[..., 1, :] = float("-inf")
    out, lse = _FWD(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, False,
                    attn_mask=mask)
    # The hazard strategies must avoid: an "empty" row looks like a real one with lse 0.
    assert lse[0, 0, 1].item() == 0.0
    assert torch.count_nonzero(out[0, 0, 1]).item() == 0
    assert torch.isfinite(lse).all()


def test_sdpa_cpu_accepts_strided_views_and_gqa():
    q, k, v, dout = _inputs(2, 16, 16, 4, 1, 16, torch.float32, seed=5)
    assert not q.transpose(1, 2).is_contiguous()
    _check(kernels.get("sdpa-cpu"), q, k, v, dout, True, "fp32")


def test_sdpa_cpu_lse_is_fp32_for_bf16_inputs():
    q, k, v, _ = _inputs(1, 8, 8, 2, 2, 16, torch.bfloat16, seed=6)
    out, lse = kernels.get("sdpa-cpu").forward(q, k, v, causal=True, softmax_scale=0.25)
    assert lse.dtype == torch.float32 and out.dtype == torch.bfloat16


# -- selection ---------------------------------------------------------------------------------

def test_auto_picks_sdpa_cpu_on_cpu():
    b = kernels.resolve("auto", device="cpu", dtype=torch.float32, head_dim=64, heads=8, kv_heads=8)
    assert b.name == "sdpa-cpu"


def test_causal_unequal_is_refused_where_not_declared(monkeypatch):
    request = dict(device="cpu", dtype=torch.float32, head_dim=16, heads=4, kv_heads=4)
    square_only = dataclasses.replace(kernels.get("torch"), name="square-only",
                                      causal_unequal=False)
    assert square_only.unsupported_reason(**request, seqlen_q=8, seqlen_k=8, causal=True) is None
    assert square_only.unsupported_reason(**request, seqlen_q=5, seqlen_k=9) is None
    assert "causal attention with seqlen_q 5 != seqlen_k 9" in square_only.unsupported_reason(
        **request, seqlen_q=5, seqlen_k=9, causal=True)
    monkeypatch.setitem(kernels._BACKENDS, square_only.name, square_only)
    with pytest.raises(ValueError, match="seqlen_q 5 != seqlen_k 9; use --kernel torch or "
                                         "sdpa-cpu"):
        kernels.resolve("square-only", **request, seqlen_q=5, seqlen_k=9, causal=True)
    # the internal invariant behind it, for a strategy that asks anyway
    q, k, v, _ = _inputs(1, 5, 9, 4, 4, 16, torch.float32, seed=0)
    with pytest.raises(AssertionError, match="equal q/k length"):
        check_shapes(q, k, v, True)


def test_flash_attn_declares_no_causal_unequal():
    from cpbench.kernels.flash_attn import FLASH_ATTN, FLASH_ATTN3

    assert not FLASH_ATTN.causal_unequal and not FLASH_ATTN3.causal_unequal  # bottom-right


def test_unsupported_request_names_working_backends():
    with pytest.raises(ValueError, match="sdpa-cpu|torch"):
        kernels.resolve("flash-attn", device="cpu", dtype=torch.bfloat16, head_dim=64, heads=8,
                        kv_heads=8)
    with pytest.raises(ValueError, match="unknown kernel"):
        kernels.get("nope")


# -- choice on CUDA (mocked: no GPU here) --------------------------------------------------------

CUDA_BF16 = dict(device="cuda", dtype=torch.bfloat16, head_dim=128, heads=8, kv_heads=8)


@pytest.fixture
def fake_flash(monkeypatch):
    """flash-attn 2 and FA3 as if installed (a 2025 FA3 unless told), on a GPU of the given
    capability; set ``state["broken"][module]`` to make one fail to import."""
    from cpbench.kernels import flash_attn as fa

    state = {"capability": (9, 0), "fa3_params": ("q", "k", "v", "cu_seqlens_q"), "broken": {}}

    def load(module):
        if module in state["broken"]:
            raise state["broken"][module]
        params = state["fa3_params"] if module == fa.FA3_MODULE else ("q", "k", "v")
        return None, (params, frozenset()), None, (params, frozenset())

    monkeypatch.setattr(fa, "_load", load)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: state["capability"])
    return state


def test_auto_on_hopper_picks_fa3_and_elsewhere_flash_attn_2_with_a_note(fake_flash):
    assert kernels.resolve("auto", **CUDA_BF16).name == "flash-attn3"
    fake_flash["capability"] = (8, 0)  # A100
    notes = []
    assert kernels.resolve("auto", **CUDA_BF16, notes=notes).name == "flash-attn"
    assert notes == ["flash-attn3 (flash-attn3 needs a Hopper GPU (sm90); this one is sm80): "
                     "using flash-attn"]


def test_auto_checks_the_fa3_builds_api_generation(fake_flash):
    fake_flash["fa3_params"] = ("q", "k", "v", "softmax_scale", "causal")  # a 2024 build
    notes = []
    assert kernels.resolve("auto", **CUDA_BF16, notes=notes).name == "flash-attn"
    assert "backward in fp16 only" in notes[0]
    fp16_d256 = {**CUDA_BF16, "dtype": torch.float16, "head_dim": 256}
    assert "backward up to 128" in kernels.get("flash-attn3").unsupported_reason(**fp16_d256)
    assert kernels.resolve("auto", **{**fp16_d256, "head_dim": 128}).name == "flash-attn3"


def test_auto_on_cuda_never_falls_back_to_the_reference(fake_flash, monkeypatch):
    """A broken install keeps its real exception; fp32 says why; neither picks torch. On a
    CPU build of torch (sdpa cannot run: a CUDA build would take it, as the next test shows)."""
    from cpbench.kernels import flash_attn as fa

    monkeypatch.setattr(torch.version, "cuda", None)

    fake_flash["broken"] = {
        fa.FA2_MODULE: OSError("libcudart.so.12: cannot open shared object file"),
        fa.FA3_MODULE: ModuleNotFoundError("No module named 'flash_attn_interface'")}
    with pytest.raises(ValueError) as e:
        kernels.resolve("auto", **CUDA_BF16)
    msg = str(e.value)
    assert "flash-attn cannot be imported: OSError: libcudart.so.12" in msg
    assert "--kernel torch" in msg and "no flash kernel" in msg
    with pytest.raises(ValueError, match="libcudart.so.12"):  # asked for by name: the same
        kernels.resolve("flash-attn", **CUDA_BF16)
    fake_flash["broken"] = {}
    with pytest.raises(ValueError, match="flash-attn does not support fp32.*--dtype bf16"):
        kernels.resolve("auto", **{**CUDA_BF16, "dtype": torch.float32})
    assert kernels.resolve("torch", **{**CUDA_BF16, "dtype": torch.float32}).name == "torch"


def test_the_kernels_distribution_is_found_by_its_module(monkeypatch):
    """FA3's module is flash_attn_interface whatever its distribution is called."""
    from importlib import metadata

    from cpbench.kernels import flash_attn as fa

    monkeypatch.setattr(fa, "_importable", lambda module: True)
    monkeypatch.setattr(fa.importlib, "import_module",
                        lambda m: type("M", (), {"__file__": f"/site/{m}.py"}))
    monkeypatch.setattr(metadata, "packages_distributions",
                        lambda: {"flash_attn_interface": ["flashattn-hopper"]})
    monkeypatch.setattr(metadata, "version", lambda d: "3.0.0b1")
    assert fa.provenance(fa.FA3_MODULE) == {
        "module": "flash_attn_interface", "distribution": "flashattn-hopper",
        "version": "3.0.0b1", "path": "/site/flash_attn_interface.py"}


def test_auto_on_cuda_ends_with_torchs_flash_kernel(fake_flash, monkeypatch):
    """Without flash-attn, auto takes torch's own CUDA flash op (``sdpa``), with a note for
    each installed one it passed over; the order is FA3, flash-attn, sdpa."""
    from cpbench.kernels import flash_attn as fa

    assert kernels.AUTO_ORDER["cuda"] == ("flash-attn3", "flash-attn", "sdpa")
    monkeypatch.setattr(torch.version, "cuda", "12.4")  # a CUDA build of torch
    fake_flash["broken"] = {fa.FA2_MODULE: ModuleNotFoundError("No module named 'flash_attn'"),
                            fa.FA3_MODULE: ModuleNotFoundError("no flash_attn_interface")}
    notes = []
    assert kernels.resolve("auto", **CUDA_BF16, notes=notes).name == "sdpa"
    assert notes == []  # neither is installed: nothing to explain
    fake_flash["broken"] = {fa.FA3_MODULE: ModuleNotFoundError("no flash_attn_interface")}
    assert kernels.resolve("auto", **CUDA_BF16).name == "flash-attn"
    assert kernels.resolve("sdpa", **CUDA_BF16).name == "sdpa"


def _adapter_kernel(name, backend, **kw):
    from cpbench import strategies
    from cpbench.strategies._upstream import case_kernel

    return case_kernel(strategies.get(name), kernels.get(backend), CUDA_BF16, **kw)


@pytest.mark.parametrize("name", ["rfa-zigzag", "rfa-llama3", "yunchang-usp"])
def test_auto_fa3_keeps_the_adapters_on_flash_attn_2(fake_flash, name):
    """FA3 is auto's pick on Hopper; the libraries call flash-attn 2's interface: they run on
    flash-attn (installed here), with a note, instead of being skipped."""
    assert kernels.resolve("auto", **CUDA_BF16).name == "flash-attn3"
    backend, note = _adapter_kernel(name, "flash-attn3", auto=True)
    assert backend.name == "flash-attn" and note.startswith("flash-attn3 for " + name)
    assert _adapter_kernel(name, "flash-attn3", auto=False) == (kernels.get("flash-attn3"),
                                                                None)  # asked for by name
    assert _adapter_kernel(name, "flash-attn", auto=True) == (kernels.get("flash-attn"), None)
    assert _adapter_kernel("ring", "flash-attn3", auto=True) == (kernels.get("flash-attn3"),
                                                                 None)  # cpbench's own: any


@pytest.mark.parametrize("name", ["rfa-zigzag", "rfa-llama3", "yunchang-usp"])
def test_without_flash_attn_auto_runs_the_adapters_on_torchs_fa2(name, monkeypatch):
    """No flash-attn on a CUDA build: the libraries run on cpbench's interface over torch's
    FA2 ops, so auto gives them sdpa, and sdpa asked for by name is accepted."""
    from cpbench import strategies
    from cpbench.config import AttentionConfig
    from cpbench.kernels import flash_attn as fa
    from cpbench.topology import Topology

    monkeypatch.setattr(fa, "_load", lambda module: (_ for _ in ()).throw(ImportError(module)))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    backend, note = _adapter_kernel(name, "flash-attn3", auto=True)
    assert backend.name == "sdpa" and "using sdpa" in note
    attn = AttentionConfig(batch=1, seqlen=64, heads=4, kv_heads=4, head_dim=16, dtype="bf16",
                           causal=True)
    strategies.get(name)(attn, Topology(world_size=2, ranks_per_node=2), 0,
                         kernel=kernels.get("sdpa"), create_groups=False)  # validates


def test_auto_gives_torch_ring_torchs_flash_op_on_cuda(fake_flash, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU build first: sdpa cannot run
    assert _adapter_kernel("torch-ring", "flash-attn3", auto=True)[0].name == "flash-attn3"
    monkeypatch.setattr(torch.version, "cuda", "12.4")  # now sdpa can run
    backend, note = _adapter_kernel("torch-ring", "flash-attn", auto=True)
    assert backend.name == "sdpa" and "using sdpa" in note
    # planned off the job's nodes (a sweep on a login node): the job decides availability
    monkeypatch.setattr(torch.version, "cuda", None)
    assert _adapter_kernel("torch-ring", "flash-attn", auto=True, elsewhere=True)[0].name \
        == "sdpa"


@pytest.mark.parametrize("name,kernel,hint", [
    ("torch-ring", "flash-attn", "use --kernel sdpa (or auto), not flash-attn"),
    ("torch-ring", "torch", "use --kernel sdpa on CUDA, sdpa-cpu on CPU (or auto)"),
    ("torch-ring", "flash-attn-cpu", "use --kernel sdpa-cpu (or auto)"),
    ("rfa-ring", "flash-attn3", "use --kernel flash-attn or sdpa (or auto), not flash-attn3"),
    ("yunchang-usp", "torch", "use --kernel flash-attn or sdpa on CUDA, sdpa-cpu or "
                              "flash-attn-cpu on CPU (or auto)"),
])
def test_each_refusal_names_kernels_of_the_device(name, kernel, hint):
    """A hint names only kernels that run where the refused one runs (torch-ring said sdpa-cpu
    on CUDA)."""
    from cpbench import strategies
    from cpbench.config import AttentionConfig
    from cpbench.errors import UsageError
    from cpbench.topology import Topology

    attn = AttentionConfig(batch=1, seqlen=64, heads=4, kv_heads=4, head_dim=16, dtype="bf16",
                           causal=True)
    with pytest.raises(UsageError, match=hint.replace("(", r"\(").replace(")", r"\)")):
        strategies.get(name)(attn, Topology(world_size=2, ranks_per_node=2), 0,
                             kernel=kernels.get(kernel), create_groups=False)


def test_a_plan_under_auto_runs_the_adapters_on_their_kernels(fake_flash):
    """``--strategy all --kernel auto`` on Hopper with FA3: the adapters are planned on
    flash-attn, torch-ring on sdpa, cpbench's own on FA3; the records name each."""
    from cpbench.bench import plan as planning
    from cpbench.config import RunConfig

    p = planning.plan(RunConfig(out="none", strategy=("all",), device="cuda", kernel="auto"),
                      {"seqlen": 4096}, {}, launcher="torchrun", job=(8, 8))
    assert p.kernel == "flash-attn3"
    by = {c.strategy: p.kernel_of(c) for c in p.cases}
    assert by["rfa-zigzag"] == by["yunchang-usp"] == "flash-attn"
    assert by["torch-ring"] == "sdpa" and by["ring"] == "flash-attn3"
    assert any(s.startswith("flash-attn3 for rfa-zigzag") for s in p.skipped)
