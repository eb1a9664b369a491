"""The variants of cpbench's own strategies the fake-GPU layer runs at its production size,
and those declared unable to run there, each with the exception it must raise. A variant that
raises anything else fails its test, and so does a declared one that no longer raises what is
declared (then the declaration goes): none vanishes from the list."""

from __future__ import annotations

import re

import pytest

from cpbench import kernels, strategies
from cpbench.errors import UsageError

OWN = ["zigzag", "ring", "megatron-cp", "megatron-cp-a2a+p2p", "double-ring", "burst",
       "ulysses", "usp", "llama3"]

# (strategy, the options that single the variant out) -> (exception, message): at 40 heads
# on 32 ranks, a Ulysses all-to-all over all 32 ranks cannot split the heads (not a fake-GPU
# limit: the same refusal on any device)
REFUSED: dict[tuple[str, tuple], tuple[type[Exception], str]] = {
    ("ulysses", ()): (UsageError, "ulysses over 32 ranks needs heads (40) divisible by 32"),
    ("usp", (("ulysses_degree", 32),)): (
        UsageError, "usp: ulysses degree 32 must divide 32 ranks and 40 heads"),
}


def params(topo) -> list:
    """Every own strategy's every variant on ``topo``, one pytest param each."""
    return [pytest.param(name, opts, id=f"{name}-{opts}") for name in OWN
            for opts in strategies.get(name).variants(topo)]


def refusal(name: str, opts) -> tuple[type[Exception], str] | None:
    """What the variant is declared to raise, or None (it must run)."""
    for (who, fields), why in REFUSED.items():
        if who == name and all(getattr(opts, f) == v for f, v in fields):
            return why
    return None


def builds(name: str, opts, attn, topo, kernel: str) -> bool:
    """Whether the variant builds: True, or its declared refusal raised exactly (False);
    anything else raises."""
    def build():
        strategies.get(name)(attn, topo, 0, kernel=kernels.get(kernel), options=opts,
                             create_groups=False)

    declared = refusal(name, opts)
    if declared is None:
        build()
        return True
    kind, message = declared
    with pytest.raises(kind, match=re.escape(message)):
        build()
    return False
