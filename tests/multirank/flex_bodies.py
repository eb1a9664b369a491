"""Rank bodies for torch-flex on CPU (module level so forkserver ranks can import them)."""

from __future__ import annotations

import warnings

import torch

from cpbench import comm, kernels, strategies
from cpbench.bench.check import _reference, global_inputs
from cpbench.bench.commtrace import traced
from cpbench.reference import compare
from cpbench.topology import Topology


def flex_forward(rank, world, cases):
    """Each (attn, options): torch's FlexAttention CP forward on this rank's shard (its
    backward does not run on CPU), gathered into global order and compared on rank 0 with
    the float64 reference under the same mask; and what the forward sent, traced as
    ``cpbench comm`` traces it (op, dtype, bytes). Returns (failures, sent per case) on
    rank 0."""
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
    topo = Topology(world_size=world, ranks_per_node=world)
    cls = strategies.get("torch-flex")
    failures, sent = [], []
    for i, (attn, opts) in enumerate(cases):
        st = cls(attn, topo, rank, kernel=kernels.get("sdpa-cpu"), options=opts)
        inputs = global_inputs(attn, seed=2000 + i)
        with traced(dispatch=not st.compiles) as events:
            out, lse = st.attention(*(st.shard(inputs[n]) for n in ("q", "k", "v")))
        sent.append(sorted((e.op, e.dtype, e.nbytes) for e in events))
        got = {"out": st.unshard(comm.all_gather(out.contiguous())),
               "lse": st.unshard(comm.all_gather(lse.contiguous()), seq_dim=2)}
        if rank == 0:
            ref = _reference(inputs, attn)
            for name, t in got.items():
                c = compare(name, t.to(torch.float64), ref[name], attn.dtype)
                if not c.passed:
                    failures.append(f"{opts} {attn}: {c.line()}")
    return (failures, sent) if rank == 0 else None
