"""``--check``: run a strategy on global inputs and compare with the float64 reference.

Every rank builds the same global q, k, v, dO from the seed (small S only), takes its shard
by the strategy's own layout, runs forward and backward; the shards are gathered back into
global order and rank 0 compares them tensor by tensor with the reference.
"""

from __future__ import annotations

import math
import pickle

import torch
import torch.distributed as dist

from cpbench import comm
from cpbench.config import AttentionConfig
from cpbench.mask import mask_of
from cpbench.reference import SINK_TENSORS, TENSORS, Comparison, compare, reference_by_head
from cpbench.strategies.base import Strategy


def global_inputs(attn: AttentionConfig, seed: int, device="cpu") -> dict[str, torch.Tensor]:
    """Fresh random q, k, v, dout (b, s, h, d) in the activation dtype; never zeros. With
    ``attn.sinks``, also ``sinks`` (h,) in fp32 (``sink_logits``)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = {name: torch.randn(attn.batch, attn.seqlen, *attn.widths[name], generator=gen).to(
        device=device, dtype=attn.torch_dtype) for name in ("q", "k", "v", "dout")}
    if attn.sinks:  # drawn last: q, k, v of a seed stay what they were without sinks
        x["sinks"] = sink_logits(attn, gen).to(device)
    return x


def sink_logits(attn: AttentionConfig, gen: torch.Generator) -> torch.Tensor:
    """One fp32 sink logit per query head, uniform in [0, log S]: the range of a row's lse
    over 1..S keys of unit scores, so the sink takes a real share of the mass, more of a row
    that sees few keys than of one that sees many. (gpt-oss's reference stores a bf16
    parameter and its Triton kernel computes with it in fp32; fp32 is training's master
    copy.)"""
    return torch.rand(attn.heads, generator=gen) * math.log(max(attn.seqlen, 2))


def checked_tensors(strategy: Strategy) -> tuple[str, ...]:
    """What a check compares: every tensor, less lse for a library that does not return it,
    and the sinks' gradient where the problem has sinks."""
    names = TENSORS if strategy.returns_lse else tuple(n for n in TENSORS if n != "lse")
    return names + SINK_TENSORS if strategy.attn.sinks else names


def summed_sink_grad(strategy: Strategy, grad: torch.Tensor) -> torch.Tensor:
    """The sinks' gradient of the whole problem from this rank's share (collective): the
    sinks are one parameter replicated over the ranks sharing a problem, so their gradient
    is summed over them as data parallelism sums any replicated parameter's."""
    if strategy.ranks_per_problem > 1:
        dist.all_reduce(grad)
    return grad


def run_local(strategy: Strategy, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Forward + backward of this rank's shard; returns local out, lse, dq, dk, dv (no lse
    when the strategy returns none), and with sinks the problem's dsinks (collective)."""
    q, k, v = (strategy.shard(inputs[n]).detach().requires_grad_() for n in ("q", "k", "v"))
    sinks = inputs.get("sinks")
    sinks = None if sinks is None else sinks.detach().clone().requires_grad_()
    strategy.need_lse = True
    try:
        out, lse = strategy.attend(q, k, v, sinks)
    finally:
        strategy.need_lse = False
    out.backward(strategy.shard(inputs["dout"]))
    got = {"out": out.detach()}
    if sinks is not None:
        assert sinks.grad is not None, "the backward reaches the sinks"
        got["dsinks"] = summed_sink_grad(strategy, sinks.grad)
    for name, x in (("dq", q), ("dk", k), ("dv", v)):
        assert x.grad is not None, "the backward reaches every input"
        got[name] = x.grad
    if strategy.returns_lse:
        assert lse is not None, "a strategy that returns lse"
        got["lse"] = lse.detach()
    return got


def _reference(inputs: dict, attn: AttentionConfig, after_head=None) -> dict[str, torch.Tensor]:
    # At the rank's own thread count, not every core: with others' load, an OpenMP barrier
    # waiting on a descheduled thread made a 1K reference 5-9x slower at 2 threads than at
    # 1 (measured on 2 busy cores), past the peers' collective timeout; idle, 2 threads
    # gained nothing at 1K. Under the threads launcher the count is process-wide, so raising
    # it also oversubscribed the ranks still computing.
    mask = mask_of(attn)
    every = torch.arange(attn.seqlen)
    return reference_by_head(inputs, heads=attn.heads, kv_heads=attn.num_kv_heads,
                             causal=attn.causal, softmax_scale=attn.softmax_scale,
                             visible=None if mask.plain else mask.visible(every, every),
                             after_head=after_head)


def _worst(comparisons) -> Comparison:
    return max(comparisons, key=lambda c: (not c.passed, c.max_abs))


def check_strategy(strategy: Strategy, seed: int, *, device="cpu",
                   cache: dict | None = None) -> list[Comparison]:
    """Collective: every rank calls it and gets the same comparisons. ``cache`` keeps rank
    0's reference for the last problem, so variants of one problem share it. The cached
    reference lives on the CPU (computed where the inputs are, fast on a GPU): left on the
    GPU it would count in every later case's ``max_memory_allocated``."""
    attn = strategy.attn
    inputs = global_inputs(attn, seed, device)
    local = run_local(strategy, inputs)
    # Each problem's result in global order: one per group of ranks sharing a problem (a
    # no-CP baseline solves it on every rank, and every rank's answer is checked).
    problems = strategy.world_size // strategy.ranks_per_problem
    assert problems in (1, strategy.world_size), "a problem is shared by all ranks or by one"
    solved, names = {}, checked_tensors(strategy)
    for name in names:
        parts = comm.all_gather(local[name]) if strategy.world_size > 1 else [local[name]]
        seq_dim = 2 if name == "lse" else 1
        # dsinks is no shard: every rank holds its problem's whole sum, and each is checked
        whole = problems == 1 and name not in SINK_TENSORS
        solved[name] = [strategy.unshard(parts, seq_dim=seq_dim)] if whole else parts
    if strategy.world_size == 1:
        found = _on_rank0(solved, names, inputs, attn, seed, cache, None)
    elif strategy.rank == 0:
        found = _on_rank0(solved, names, inputs, attn, seed, cache, _beat)
        dist.broadcast_object_list([found], src=0)
    else:
        found = _await_rank0()
    if isinstance(found, BaseException):
        raise found
    return found


# Rank 0 broadcasts this after each head of its reference: its peers wait one head at a time,
# so the group's timeout bounds a head, not the whole reference (under others' load a 2k
# reference took minutes, past the peers' 60 s: "Connection closed by peer").
_WORKING = "cpbench: rank 0 computing the reference"


def _beat() -> None:
    dist.broadcast_object_list([_WORKING], src=0)


def _await_rank0():
    while True:
        got: list = [None]
        dist.broadcast_object_list(got, src=0)
        if not (isinstance(got[0], str) and got[0] == _WORKING):
            return got[0]


def _on_rank0(solved: dict, names, inputs: dict, attn: AttentionConfig, seed: int,
              cache: dict | None, beat):
    """The comparisons, or rank 0's failure (its reference can run out of memory) as what it
    sends: raised after the broadcast on every rank, so no rank is left waiting in it."""
    try:
        return _compare_on_rank0(solved, names, inputs, attn, seed, cache, beat)
    except Exception as e:
        return _portable(e)


def _compare_on_rank0(solved: dict, names, inputs: dict, attn: AttentionConfig, seed: int,
                      cache: dict | None, beat=None) -> list[Comparison]:
    cache = {} if cache is None else cache
    key = (attn, seed)
    if key not in cache:
        cache.clear()  # one problem at a time: never hold two references
        cache[key] = {n: t.cpu() for n, t in _reference(inputs, attn, beat).items()}
    return [_worst(compare(n, got.cpu(), cache[key][n], attn.dtype) for got in solved[n])
            for n in names]


def _portable(e: Exception) -> Exception:
    """``e`` if it survives pickling (the broadcast pickles it), else a RuntimeError that
    says what it was."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"rank 0: {type(e).__name__}: {e}")
