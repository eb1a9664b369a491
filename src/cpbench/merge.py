"""Overflow-safe merge of partial attention results by their log-sum-exp.

Attention of q against the union of key blocks A and B, from the per-block results:
    lse = log(exp(lse_a) + exp(lse_b)) = lse_a - logsigmoid(lse_a - lse_b)
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)
        = out_a - sigmoid(lse_b - lse_a) * (out_a - out_b)
The sigmoid / log-sigmoid form never exponentiates a large positive number. Rows where a side
is -inf (no visible key yet) are taken from the other side directly, so no NaN appears.
"""

from __future__ import annotations

import torch


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial results. out: (b, s, h, d); lse: (b, h, s). Computes in fp32."""
    lse_a, lse_b = lse_a.float(), lse_b.float()
    a_empty, b_empty = torch.isneginf(lse_a), torch.isneginf(lse_b)
    # Replace -inf by finite stand-ins so the arithmetic stays finite; fix those rows after.
    la = torch.where(a_empty, torch.zeros_like(lse_a), lse_a)
    lb = torch.where(b_empty, torch.zeros_like(lse_b), lse_b)
    w_b = torch.sigmoid(lb - la)
    w_b = torch.where(b_empty, 0.0, torch.where(a_empty, 1.0, w_b))
    lse = la - torch.nn.functional.logsigmoid(la - lb)
    lse = torch.where(a_empty, lse_b, torch.where(b_empty, lse_a, lse))
    w_bsh1 = w_b.transpose(1, 2).unsqueeze(-1)
    oa, ob = out_a.float(), out_b.float()
    return oa - w_bsh1 * (oa - ob), lse


class OutLseAccumulator:
    """Running fp32 (out, lse) for a rank's queries, merged block by block.

    ``update(out, lse, seq=slice)`` merges a block that covers only part of the local
    queries (e.g. the second half under zigzag) into that slice of the accumulator.
    ``head_dim`` is out's: V's head dim, which MLA sets apart from Q and K's.
    """

    def __init__(self, batch: int, seqlen: int, heads: int, head_dim: int,
                 device: torch.device | str | None) -> None:
        self.out = torch.zeros(batch, seqlen, heads, head_dim, dtype=torch.float32, device=device)
        self.lse = torch.full((batch, heads, seqlen), float("-inf"), dtype=torch.float32,
                              device=device)

    def update(self, block_out: torch.Tensor, block_lse: torch.Tensor,
               seq: slice | None = None) -> None:
        seq = seq if seq is not None else slice(None)
        out, lse = merge(self.out[:, seq], self.lse[:, :, seq], block_out, block_lse)
        self.out[:, seq] = out
        self.lse[:, :, seq] = lse

    def result(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.out.to(dtype), self.lse


# -- attention sinks (gpt-oss): one logit per query head in every query's denominator --------
#
# A sink s_h is one more "key" of every query of head h whose score is s_h and whose value is
# zero. Given a query's sink-free (out, lse) over all its keys, the sink enters once:
#     lse' = logaddexp(lse, s_h),   out' = out * exp(lse - lse')
# Added to each partial block before a merge it would be counted once per block: so every
# strategy applies it once, after its last merge (``add_sink``), and keeps (out', lse').
# Backward: a standard flash backward fed (out', dO, lse') is exact for dq, dk, dv
# (P = exp(S - lse') and D = rowsum(dO * out') already hold the sink's share; its column
# has no value, so no dP), and  dsink_h = -sum_i exp(s_h - lse'_i) * D_i  (``sink_grad``):
# over this rank's queries only; the parameter is replicated, so its gradient is summed
# over the ranks as any replicated parameter's is (``bench.check``, a DDP all-reduce).


def add_sink(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out', lse') of a query's final (out, lse) with ``sinks`` (h,) joining each row's
    denominator; out (b, s, h, d) keeps its dtype, lse is fp32. ``None``: unchanged. A row
    that sees no key keeps out 0 and gets lse' = s_h (the sink alone)."""
    if sinks is None:
        return out, lse
    lse = _wide(lse)
    new_lse = sink_lse(lse, sinks)
    keep = torch.exp(lse - new_lse)  # the keys' share of the mass; 0 where lse is -inf
    return (_wide(out) * keep.transpose(1, 2).unsqueeze(-1)).to(out.dtype), new_lse


def sink_lse(lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """lse' = logaddexp(lse, s_h): for a strategy whose final correction rescales each
    step's output by exp(lse_step - lse) itself (TE's), which then yields out'."""
    if sinks is None:
        return lse
    return torch.logaddexp(_wide(lse), _wide(sinks.detach()).view(1, -1, 1))


def sink_grad(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
              sinks: torch.Tensor | None) -> torch.Tensor | None:
    """d loss / d sinks (h,) from this rank's queries: out, lse as ``add_sink`` returned
    them, dout (b, s, h, d). In ``sinks``' dtype; None without sinks."""
    if sinks is None:
        return None
    delta = (_wide(dout) * _wide(out)).sum(-1).transpose(1, 2)  # D_i: (b, h, s)
    share = torch.exp(_wide(sinks.detach()).view(1, -1, 1) - _wide(lse))
    return -(share * delta).sum((0, 2)).to(sinks.dtype)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """fp32, or fp64 where given (the float64 checks of the maths)."""
    return t if t.dtype == torch.float64 else t.float()
