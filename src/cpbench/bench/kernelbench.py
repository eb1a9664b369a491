"""Single-device attention kernels, timed as ``cpbench run`` times a strategy (seed 003).

A target is either one of cpbench's kernel backends (``cpbench.kernels``: explicit forward
and backward returning (out, lse)) or one of PyTorch's own SDPA backends / flex_attention
(autograd). Each is handed to the same ``Timer`` as zero-argument closures (a step's FWD,
then BWD on the graph or the out and lse it left, timed apart: ``Timer.measure_steps``), its
peak memory is taken by the same meter, and its FLOPs come from
``cpbench.metrics``. A case whose estimated footprint exceeds the memory cap is skipped with
that reason before anything is allocated; one that runs out of memory anyway is an OOM row,
and one that raises anything else a failed row with its error (the grid goes on).
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch

from cpbench import kernels
from cpbench.bench import agreement, memory
from cpbench.bench.timer import Timer, warmup_rule
from cpbench.kernels.base import dtype_name

# (FWD keeping what its backward needs, BWD on it): one step, each part timed on its own
Closures = tuple[Callable[[], object], Callable[[], object]]


@dataclass(frozen=True)
class Case:
    """One row of the grid (query heads = key/value heads)."""

    seqlen: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    causal: bool
    batch: int = 1

    def elements(self) -> int:
        return self.batch * self.seqlen * self.heads * self.head_dim


@dataclass(frozen=True)
class Measured:
    """What one case gave: samples in ms (None where not reached), peak bytes, status
    ("ok", "OOM", "failed", "skipped"), why (one line), a failure's traceback, and whether
    it left the GPU unusable (a CUDA error no later call survives)."""

    fwd_ms: list[float] | None = None
    bwd_ms: list[float] | None = None
    fwd_bwd_ms: list[float] | None = None
    peak_bytes: int | None = None
    status: str = "ok"
    reason: str | None = None
    traceback: str | None = None
    sticky: bool = False


# PyTorch's SDPA backends by our name: (SDPBackend member, devices it runs on)
_SDPA = {"sdpa-math": ("MATH", ("cpu", "cuda")), "sdpa-flash": ("FLASH_ATTENTION", ("cpu", "cuda")),
         "sdpa-efficient": ("EFFICIENT_ATTENTION", ("cuda",)),
         "sdpa-cudnn": ("CUDNN_ATTENTION", ("cuda",))}
FLEX = "flex"
# materialise the S×S scores (probabilities, their gradient): memory grows with S² (flex
# would too uncompiled; it runs compiled, FlexAttention's own kernel)
QUADRATIC = frozenset({"torch", "sdpa-math"})


def _has_flex() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def names() -> list[str]:
    """Every target: cpbench's backends (``auto`` first), then PyTorch's."""
    return [*kernels.names(), *_SDPA, *([FLEX] if _has_flex() else [])]


def unsupported_reason(name: str, case: Case, device: str) -> str | None:
    """Why ``name`` cannot run ``case`` on ``device``; None when it can."""
    if name in _SDPA:
        devices = _SDPA[name][1]
        return None if device in devices else f"{name} runs on {' or '.join(devices)} only"
    if name == FLEX:  # torch's flex_attention has no CPU backward
        return None if device == "cuda" else "flex runs on cuda only (no CPU backward)"
    try:
        kernels.resolve(name, device=device, dtype=case.dtype, head_dim=case.head_dim,
                        heads=case.heads, kv_heads=case.heads)
    except ValueError as e:  # UsageError: the backend's own reason
        return str(e).split(";")[0]
    return None


def resolved_name(name: str, case: Case, device: str) -> str:
    """The backend ``auto`` stands for here (other names are themselves)."""
    if name != kernels.AUTO:
        return name
    return kernels.resolve(name, device=device, dtype=case.dtype, head_dim=case.head_dim,
                           heads=case.heads, kv_heads=case.heads).name


def estimate_bytes(name: str, case: Case) -> int:
    """A rough peak for one FWD+BWD: q, k, v, out, dout, dq, dk, dv and fp32 accumulators;
    plus, for kernels that materialise them, about four fp32 S×S matrices per head (scores,
    probabilities, their gradient, a temporary)."""
    es = torch.empty((), dtype=case.dtype).element_size()
    linear = case.elements() * (8 * es + 8)
    if name in QUADRATIC:
        return linear + 4 * 4 * case.batch * case.heads * case.seqlen * case.seqlen
    return linear


def _inputs(case: Case, device: str, bhsd: bool, seed: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (case.batch, case.heads, case.seqlen, case.head_dim) if bhsd else \
        (case.batch, case.seqlen, case.heads, case.head_dim)

    def rand(grad):
        return torch.randn(shape, generator=gen, device=device, dtype=case.dtype
                           ).requires_grad_(grad)

    return {"q": rand(bhsd), "k": rand(bhsd), "v": rand(bhsd), "dout": rand(False)}


def _backend_closures(backend, x: dict, case: Case) -> Closures:
    scale = 1.0 / math.sqrt(case.head_dim)
    q, k, v, dout = x["q"], x["k"], x["v"], x["dout"]
    held: dict = {}

    def fwd():
        held["out"] = backend.forward(q, k, v, causal=case.causal, softmax_scale=scale)

    def bwd():
        out, lse = held.pop("out")
        backend.backward(dout, q, k, v, out, lse, causal=case.causal, softmax_scale=scale)

    return fwd, bwd


def _autograd_closures(call: Callable, x: dict) -> Closures:
    """The forward builds the graph, the backward runs it, as the driver's do."""
    q, k, v, dout = x["q"], x["k"], x["v"], x["dout"]
    held: dict = {}

    def fwd():
        held["out"] = call(q, k, v)

    def bwd():
        held.pop("out").backward(dout)
        q.grad = k.grad = v.grad = None

    return fwd, bwd


def _sdpa_call(name: str, case: Case) -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, _SDPA[name][0])

    def call(q, k, v):
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                    is_causal=case.causal)
    return call


def _flex_call(case: Case, device: str) -> Callable:
    """FlexAttention compiled, as torch documents it: uncompiled, flex_attention is an unfused
    reference that materialises the S×S scores (and torch warns so)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = None
    if case.causal:
        mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None,
                                 case.seqlen, case.seqlen, device=device)
    # every case is a compile of its own (dynamic=False: the shapes are constants); dynamo
    # runs a function eagerly, unfused, once it was recompiled recompile_limit (8) times,
    # which a grid of more shapes reaches: each case starts from clean caches
    torch._dynamo.reset()
    fn = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    return lambda q, k, v: fn(q, k, v, block_mask=mask)


def forward_backward(name: str, case: Case, device: str, seed: int = 0) -> Closures:
    """(forward, backward) of one of cpbench's backends, each alone: the backward gets the
    forward's out and lse, computed once (as a CP step's backward gets them)."""
    backend = kernels.get(resolved_name(name, case, device))
    x = _inputs(case, device, bhsd=False, seed=seed)
    scale = 1.0 / math.sqrt(case.head_dim)
    out, lse = backend.forward(x["q"], x["k"], x["v"], causal=case.causal, softmax_scale=scale)

    def fwd():
        return backend.forward(x["q"], x["k"], x["v"], causal=case.causal, softmax_scale=scale)

    def bwd():
        return backend.backward(x["dout"], x["q"], x["k"], x["v"], out, lse,
                                causal=case.causal, softmax_scale=scale)

    return fwd, bwd


def closures(name: str, case: Case, device: str, seed: int = 0) -> tuple[Closures, dict]:
    """(FWD, BWD) closures of ``name`` on ``case`` (see ``Closures``), and the inputs they
    hold."""
    if name in _SDPA or name == FLEX:
        x = _inputs(case, device, bhsd=True, seed=seed)
        call = _sdpa_call(name, case) if name in _SDPA else _flex_call(case, device)
        fwd, bwd = _autograd_closures(call, x)
        if name == FLEX:  # the compiles (forward and backward) here, whatever the warm-up
            fwd()
            bwd()
        return (fwd, bwd), x
    backend = kernels.get(resolved_name(name, case, device))
    x = _inputs(case, device, bhsd=False, seed=seed)
    return _backend_closures(backend, x, case), x


def measure(name: str, case: Case, *, device: str, warmup: int, iters: int,
            capacity_bytes: int | None, seed: int = 0) -> Measured:
    """Time FWD and BWD of each step (FWD+BWD: the whole step), then the peak memory of one
    step; an OOM or any other error keeps what came before it (status "OOM" / "failed", with
    the error)."""
    why = unsupported_reason(name, case, device)
    if why:
        return Measured(status="skipped", reason=why)
    need = estimate_bytes(resolved_name(name, case, device), case)
    if capacity_bytes is not None and need > capacity_bytes:
        return Measured(status="skipped", reason=f"needs ~{need / 2**30:.1f} GiB by estimate, "
                                                 f"the cap is {capacity_bytes / 2**30:.1f} GiB")
    timer = Timer(device)
    got: dict[str, Any] = {}  # Measured's fields, as far as they were reached
    # Optional: dropped on an OOM, before the next case allocates its own
    fwd: Callable[[], object] | None = None
    bwd: Callable[[], object] | None
    x: dict | None
    try:
        (fwd, bwd), x = closures(name, case, device, seed)
        timed = timer.measure_steps([fwd, bwd], settle=warmup_rule(warmup, iters), iters=iters)
        got.update(fwd_ms=timed.parts[0], bwd_ms=timed.parts[1], fwd_bwd_ms=timed.steps)
        inputs = list(x.values())
        step = (fwd, bwd)
        got["peak_bytes"] = memory.peak_bytes(lambda: [f() for f in step], device=device,
                                              inputs=inputs)
    except Exception as e:  # one kernel's failure is its row's, not the grid's
        oom = agreement.is_oom(e)
        trace = None if oom else traceback.format_exc()
        if "fwd_ms" not in got and fwd is not None:  # the backward broke: time FWD alone
            got["fwd_ms"] = _forward_alone(timer, fwd, warmup, iters)
        x = fwd = bwd = None  # the inputs go before the next case allocates its own
        if device == "cuda":
            torch.cuda.empty_cache()
        return Measured(**got, status="OOM" if oom else "failed",
                        reason=agreement.one_line(e), traceback=trace,
                        sticky=agreement.is_sticky_cuda_error(e))
    return Measured(**got)


def _forward_alone(timer: Timer, fwd: Callable[[], object], warmup: int, iters: int
                   ) -> list[float] | None:
    """FWD's samples timed alone after the step broke (ran out of memory or raised), or None
    if the forward breaks too: the row already carries the step's error."""
    try:
        return timer.measure(fwd, warmup=warmup, iters=iters)
    except Exception:  # noqa: BLE001 - the step's own error is the row's
        return None


def label(case: Case) -> str:
    return (f"S={case.seqlen} H={case.heads} D={case.head_dim} {dtype_name(case.dtype)} "
            f"{'causal' if case.causal else 'full'}")
