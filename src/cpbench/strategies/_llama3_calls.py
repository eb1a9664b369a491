"""llama3's kernel calls: the local queries against the gathered K/V put back in sequence
order, and their gradients (``cpbench.strategies.llama3`` gathers and reduce-scatters)."""

from __future__ import annotations

import torch

from cpbench.merge import OutLseAccumulator


def attend(strat, q, k_all, v_all):
    """The local queries against the gathered keys: (out fp32, lse)."""
    k_all, v_all = strat.in_sequence_order(k_all), strat.in_sequence_order(v_all)
    if not strat.mask.plain:
        return _masked(strat, q, k_all, v_all)
    b, s, h, _ = q.shape
    d = v_all.shape[-1]  # out has V's width
    out = torch.empty(b, s, h, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, s, dtype=torch.float32, device=q.device)
    for rows, parts in strat.plain_parts():
        acc = OutLseAccumulator(b, len(range(s)[rows]), h, d, q.device)
        for keys, causal in parts:
            acc.update(*strat.kernel_call("forward", q[:, rows], k_all[:, keys],
                                          v_all[:, keys], causal=causal))
        out[:, rows], lse[:, :, rows] = acc.out, acc.lse
    return out, lse


def attend_grads(strat, dout, q, k_all, v_all, out, lse):
    """(dq fp32, dk and dv of the whole gathered sequence in member order and the dK/dV
    dtype), against the final out / lse. Key ranges of different query rows overlap under
    the zigzag layout: their gradients add up in that dtype, as TE's do."""
    dtype = strat.dkv_dtype
    k_all, v_all = strat.in_sequence_order(k_all), strat.in_sequence_order(v_all)
    if not strat.mask.plain:
        dq, dk, dv = _masked_grads(strat, dout, q, k_all, v_all, out, lse)
        return dq, strat.in_member_order(dk), strat.in_member_order(dv)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k_all.shape, dtype=dtype, device=q.device)
    dv = torch.zeros(v_all.shape, dtype=dtype, device=q.device)
    for rows, parts in strat.plain_parts():
        for keys, causal in parts:
            bq, bk, bv = strat.kernel_call("backward", dout[:, rows], q[:, rows],
                                           k_all[:, keys], v_all[:, keys], out[:, rows],
                                           lse[:, :, rows], causal=causal)
            dq[:, rows] += bq
            dk[:, keys] += bk
            dv[:, keys] += bv
    return dq, strat.in_member_order(dk), strat.in_member_order(dv)


def _masked(strat, q, k_all, v_all):
    """Under a mask one varlen call per local half, each against the whole gathered sequence
    (MagiAttention's Ring AllGather, ``FA3RingAGAttnFunc``; TE's all_gather per zigzag half):
    (out fp32, lse)."""
    halves = strat.halves(q.device)
    if len(halves) == 1:
        return strat.masked_forward(q, k_all, v_all, strat.gathered_tiles(0))
    b, s, h, _ = q.shape
    out = torch.empty(b, s, h, v_all.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, s, dtype=torch.float32, device=q.device)
    for i, rows in enumerate(halves):
        out[:, rows], lse[:, :, rows] = strat.masked_forward(q[:, rows], k_all, v_all,
                                                             strat.gathered_tiles(i))
    return out, lse


def _masked_grads(strat, dout, q, k_all, v_all, out, lse):
    """The backward of ``_masked``: (dq fp32, dk and dv of the gathered sequence in
    sequence order and the dK/dV dtype). Each half's call returns dK/dV of the whole
    gathered sequence; they are added in that dtype (their ``dk.add_``)."""
    dtype, halves = strat.dkv_dtype, strat.halves(q.device)
    if len(halves) == 1:
        dq, dk, dv = strat.masked_backward(dout, q, k_all, v_all, out, lse,
                                           strat.gathered_tiles(0))
        return dq, dk.to(dtype), dv.to(dtype)
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k_all.shape, dtype=dtype, device=q.device)
    dv = torch.zeros(v_all.shape, dtype=dtype, device=q.device)
    for i, rows in enumerate(halves):
        dq[:, rows], dk_i, dv_i = strat.masked_backward(
            dout[:, rows], q[:, rows], k_all, v_all, out[:, rows], lse[:, :, rows],
            strat.gathered_tiles(i))
        dk += dk_i.to(dtype)
        dv += dv_i.to(dtype)
    return dq, dk, dv
