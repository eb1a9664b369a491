"""The float64 single-process reference and the tolerances every check uses.

Reference: full softmax attention in float64 with autograd, on the same (dtype-rounded)
inputs the strategy saw, so the only error measured is the strategy's and its kernel's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# (atol, rtol) per activation dtype, for |got - ref| <= atol + rtol * |ref|. Stated once.
TOLERANCES = {
    "fp32": (2e-4, 2e-3),
    "fp16": (1e-2, 1e-2),
    "bf16": (6e-2, 5e-2),
}
TENSORS = ("out", "lse", "dq", "dk", "dv")
SINK_TENSORS = ("dsinks",)  # compared too where the problem has sinks


def reference_attention(q_bshd: torch.Tensor, k_bshd: torch.Tensor, v_bshd: torch.Tensor,
                        dout_bshd: torch.Tensor, *, causal: bool,
                        softmax_scale: float, visible: torch.Tensor | None = None,
                        sinks: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """out, lse (b, h, s), dq, dk, dv in float64. k/v may have fewer heads (GQA).
    ``visible`` (sq, sk) bool: the whole mask (documents, window; causal included), which
    then replaces ``causal``. ``sinks`` (h,): one more score per row of each head, with no
    value, in the softmax (gpt-oss); its gradient is ``dsinks``."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q_bshd, k_bshd, v_bshd))
    leaves = [q, k, v]
    group = q.shape[2] // k.shape[2]
    ke, ve = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s_bhqk = torch.einsum("bqhd,bkhd->bhqk", q, ke) * softmax_scale
    if visible is not None:
        s_bhqk = s_bhqk.masked_fill(~visible.to(q.device), float("-inf"))
    elif causal:
        sq, sk = s_bhqk.shape[-2:]
        future = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
        s_bhqk = s_bhqk.masked_fill(future, float("-inf"))
    if sinks is not None:  # the sink as a last column of every row: the plain softmax does it
        leaves.append(sinks.detach().double().requires_grad_())
        column = leaves[-1].view(1, -1, 1, 1).expand(*s_bhqk.shape[:-1], 1)
        s_bhqk = torch.cat([s_bhqk, column], dim=-1)
        ve = torch.cat([ve, ve.new_zeros(ve.shape[0], 1, *ve.shape[2:])], dim=1)
    lse = torch.logsumexp(s_bhqk, dim=-1)
    # a row that sees nothing (a pad token) has out 0 and lse -inf, and passes no gradient
    seen = torch.isfinite(lse)[..., None]
    p = torch.softmax(s_bhqk.masked_fill(~seen, 0.0), dim=-1) * seen
    out = torch.einsum("bhqk,bkhd->bqhd", p, ve)
    grads = torch.autograd.grad(out, leaves, dout_bshd.double())
    ref = {"out": out.detach(), "lse": lse.detach(), "dq": grads[0], "dk": grads[1],
           "dv": grads[2]}
    return ref if sinks is None else {**ref, "dsinks": grads[3]}


def reference_by_head(inputs: dict[str, torch.Tensor], *, heads: int, kv_heads: int, causal: bool,
                      softmax_scale: float, visible: torch.Tensor | None = None,
                      after_head: Callable[[], None] | None = None
                      ) -> dict[str, torch.Tensor]:
    """The float64 reference one query head at a time (heads are independent), so its S×S
    matrices exist for one head only; dK/dV of a shared KV head sum over its query heads.
    ``inputs["sinks"]``, where present, gives each head its sink (and ``dsinks``).
    ``after_head`` is called after each head (the check's heartbeat to waiting peers)."""
    group = heads // kv_heads
    sinks = inputs.get("sinks")
    parts: dict[str, list[torch.Tensor]] = {"out": [], "lse": [], "dq": []}
    if sinks is not None:
        parts["dsinks"] = []
    b, s, _, d = inputs["k"].shape
    dk = torch.zeros(b, s, kv_heads, d, dtype=torch.float64,
                     device=inputs["k"].device)
    dv = dk.new_zeros(b, s, kv_heads, inputs["v"].shape[-1])  # V's own width (MLA)
    for h in range(heads):
        j = h // group
        ref = reference_attention(inputs["q"][:, :, h:h + 1], inputs["k"][:, :, j:j + 1],
                                  inputs["v"][:, :, j:j + 1], inputs["dout"][:, :, h:h + 1],
                                  causal=causal, softmax_scale=softmax_scale,
                                  visible=visible,
                                  sinks=None if sinks is None else sinks[h:h + 1])
        for name in parts:
            parts[name].append(ref[name])
        dk[:, :, j:j + 1] += ref["dk"]
        dv[:, :, j:j + 1] += ref["dv"]
        if after_head is not None:
            after_head()
    ref = {"out": torch.cat(parts["out"], 2), "lse": torch.cat(parts["lse"], 1),
           "dq": torch.cat(parts["dq"], 2), "dk": dk, "dv": dv}
    return ref if sinks is None else {**ref, "dsinks": torch.cat(parts["dsinks"])}


@dataclass(frozen=True)
class Comparison:
    """One tensor against the float64 reference. The max says whether any element is wrong
    (the pass / fail); the RMS says how wrong the tensor is as a whole, which is what grows
    with ring size when partial results are summed in a low precision. None where a record
    predates the RMS fields."""
    tensor: str
    max_abs: float
    max_rel: float  # max |err| / max |ref|
    passed: bool
    rms_abs: float | None = None  # sqrt(mean err²)
    rms_rel: float | None = None  # sqrt(mean err²) / sqrt(mean ref²)

    def line(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        rms = "" if self.rms_rel is None else f"  rms rel {self.rms_rel:.3e}"
        return (f"{self.tensor:>4}: max abs {self.max_abs:.3e}  max rel {self.max_rel:.3e}"
                f"{rms}  {verdict}")


def compare(tensor: str, got: torch.Tensor, ref: torch.Tensor, dtype: str) -> Comparison:
    atol, rtol = TOLERANCES[dtype]
    if got.shape != ref.shape:  # e.g. an out at the Q/K width where V has its own: wrong
        return Comparison(tensor, float("inf"), float("inf"), False)
    got, ref = got.double(), ref.double()
    same = got == ref  # equal infinities too: the lse -inf of a row that sees nothing
    err = torch.where(same, 0.0, (got - ref).abs())
    finite = bool((torch.isfinite(got) | same).all())
    passed = finite and bool((err <= atol + rtol * ref.abs()).all())
    finite_ref = ref[torch.isfinite(ref)]
    scale = finite_ref.abs().max().item() if finite_ref.numel() else 0.0
    scale = scale or 1.0
    # over the finite elements: the -inf lse of a row that sees nothing is no error, and an
    # inf error (a non-finite result) already fails through ``finite`` and the max
    err_finite = err[torch.isfinite(err)]
    rms_abs = err_finite.square().mean().sqrt().item() if err_finite.numel() else 0.0
    rms_ref = finite_ref.square().mean().sqrt().item() if finite_ref.numel() else 0.0
    return Comparison(tensor, err.max().item(), err.max().item() / scale, passed, rms_abs,
                      rms_abs / (rms_ref or 1.0))
