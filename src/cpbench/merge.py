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
