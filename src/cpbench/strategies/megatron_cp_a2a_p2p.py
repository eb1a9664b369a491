"""megatron-cp-a2a+p2p: TransformerEngine's hierarchical context parallelism
(``cp_comm_type="a2a+p2p"``; Megatron-LM's ``hierarchical_context_parallel_sizes``).

TE receives the CP group as two levels, ``[cp_group_a2a, cp_group_p2p]``: Ulysses-style
all-to-all of Q/K/V inside each level-1 group (meant to be the ranks of a node, over NVLink),
then AttnFuncWithCPAndKVP2P (the ``megatron-cp`` strategy) exchanging K/V around level-2 rings
(across nodes, over IB), then the all-to-all back. TE numbers a rank
cp_rank = a2a_size · p2p_rank + a2a_rank, i.e. level-1 groups are consecutive ranks and a ring
links the ranks with the same a2a_rank: exactly USP's head-first mesh.

So this is ``usp`` with placement head-first and ring_impl "megatron-cp", registered under its
TE name; only the level-1 size is an option. One difference, in the layout only: TE shards
the input by the zigzag of the global cp_rank (2·N chunks) and reorders the gathered chunks
after the all-to-all; here each rank holds a contiguous piece of its ring position's zigzag
set (USP's rule). After the all-to-all both hold the same tokens in the same order, and every
message has the same size.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpbench.strategies import register
from cpbench.strategies.base import option
from cpbench.strategies.usp import Usp
from cpbench.topology import HEAD_FIRST


@register
class MegatronCPA2AP2P(Usp):
    name = "megatron-cp-a2a+p2p"
    description = ("TE cp_comm_type a2a+p2p: all-to-all inside a node, megatron-cp K/V ring "
                   "across nodes (usp head-first over megatron-cp)")

    @dataclass(frozen=True, kw_only=True)
    class Options:
        a2a_degree: int = option(0, "level-1 (all-to-all) group size; 0: the largest divisor "
                                 "of heads whose groups stay in a node")

    @classmethod
    def variants(cls, topo):
        return [cls.Options()]

    def _plan(self) -> tuple[int, str, str]:
        return self.opts.a2a_degree or self.default_ulysses_degree(), HEAD_FIRST, "megatron-cp"

    def resolved_options(self) -> dict:
        return {"a2a_degree": self.ulysses_degree, "p2p_degree": self.ring_degree}
