"""The one "fraction of ideal", for run, report and simulate alike.

It is the field's: ring-flash-attention's "theoretic flash_attn" (its README: 8 GPUs each
running the kernel on its own 8k tokens, that rate divided by 8), the kernel alone on each
GPU's share. A problem of S tokens over N ranks: one block of S / N queries on S / N keys
(every head, the batch; causal as the problem), its time N times over. N such blocks hold
exactly the problem's FLOPs over N (causal: N · (S/N)² / 2 = S² / 2N), at the kernel's rate
on the side each GPU holds; no communication, merge, layout, step cost or imbalance: what CP
cannot beat on this kernel. ``cpbench run`` times that block alone on rank 0 (the same kernel,
device and dtype: ``bench.ideal``); ``cpbench simulate`` prices it on the preset's curve
(``sim.model.ideal``); ``results.derive`` divides either by the step.

Records before this (an ``ideal`` with a ``rank``: the slowest rank's blocks, as its schedule
declared them, each timed alone, so the strategy's imbalance counted against the ideal) are
read, marked ``superseded`` and given no fraction.

None for a masked problem (documents, windows): a block's work is its mask's, not its shape's.
"""

from __future__ import annotations

from typing import Any

from cpbench.config import AttentionConfig

DEFINITION = "share"  # the record's ``ideal.definition``
IDEAL = ("the kernel alone on each GPU's share of the tokens (ring-flash-attention's "
         "\"theoretic flash_attn\"): no communication, merge or step costs")


def none_reason(attn: AttentionConfig) -> str | None:
    """Why the problem has no ideal, or None."""
    if attn.documents or attn.window_size not in (None, (-1, -1)):
        return "a masked problem: a block's work is its mask's, not its shape's"
    return None


def share(attn: AttentionConfig, ranks: int) -> tuple[int, int]:
    """(the tokens of each rank's block, S // ranks; the times it stands in the ideal,
    ``ranks``). ``ranks``: those sharing one problem (1 for a no-CP baseline: its own kernel
    on the whole sequence)."""
    ranks = max(1, ranks)
    return attn.seqlen // ranks, ranks


def section(attn: AttentionConfig, ranks: int, block_fwd_ms: float,
            block_bwd_ms: float | None, **extra) -> dict:
    """The record's ``ideal`` section from one block's times (see the module docstring):
    the ideal ``fwd_ms`` / ``bwd_ms``, the block's times ``times`` over."""
    tokens, times = share(attn, ranks)
    return {"definition": DEFINITION, "what": IDEAL, "tokens_per_gpu": attn.batch * tokens,
            "times": times, "fwd_ms": times * block_fwd_ms,
            "bwd_ms": None if block_bwd_ms is None else times * block_bwd_ms,
            "block": {"rows": tokens, "keys": tokens, "causal": attn.causal,
                      "heads": attn.heads, "fwd_ms": block_fwd_ms, "bwd_ms": block_bwd_ms},
            **extra}


SUPERSEDED = ("an older record's ideal (the slowest rank's declared blocks, imbalance "
              "included): not this fraction of ideal")


def superseded(ideal: dict[str, Any] | None) -> bool:
    """An ideal of the definition before this one (the slowest rank's declared blocks)."""
    if not ideal or ideal.get("fwd_ms") is None:
        return False
    return "rank" in ideal and ideal.get("definition") != DEFINITION
