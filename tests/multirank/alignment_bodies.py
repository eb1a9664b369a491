"""Rank body for the alignment test (module level so forkserver ranks can import it)."""

from __future__ import annotations

import dataclasses

from cpbench import kernels, strategies
from cpbench.bench.check import global_inputs
from cpbench.config import AttentionConfig
from cpbench.errors import UsageError
from cpbench.kernels import flash_attn as fa
from cpbench.topology import Topology


def _checking(seen: list[str], name: str):
    """sdpa-cpu's kernel, noting each tensor flash-attn would get at a base not 16-byte
    aligned (after its wrapper's preparation, which copies only what it must), and each one
    the strategy handed over misaligned but lse (its zigzag halves are strided views the
    wrapper copies anyway): a copy in the timed region."""
    inner = kernels.get("sdpa-cpu")

    def note(kind, tensors, prepared):
        for i, t in enumerate(tensors):
            if t.data_ptr() % fa.ALIGN_BYTES and not (kind == "backward" and i == 5):
                seen.append(f"{name}: {kind} argument {i} {tuple(t.shape)} handed over "
                            f"{t.data_ptr() % fa.ALIGN_BYTES} bytes past alignment")
        for i, t in enumerate(prepared):
            if t.data_ptr() % fa.ALIGN_BYTES:
                seen.append(f"{name}: {kind} argument {i} reaches flash-attn misaligned")

    def forward(q, k, v, **kw):
        note("forward", (q, k, v), fa.forward_inputs(q, k, v))
        return inner.forward(q, k, v, **kw)

    def backward(*tensors, **kw):
        note("backward", tensors, fa.backward_inputs(*tensors))
        return inner.backward(*tensors, **kw)

    return dataclasses.replace(inner, name="align-check", forward=forward, backward=backward)


def misaligned_kernel_args(rank: int, world: int, attn: AttentionConfig,
                           rpn: int) -> tuple[list[str], list[str]]:
    """Forward + backward of every cpbench strategy and variant that runs ``attn`` here;
    (what was handed to a kernel misaligned, the cases that ran)."""
    topo = Topology(world_size=world, ranks_per_node=rpn)
    seen, ran = [], []
    for name in sorted(strategies.names()):
        cls = strategies.get(name)
        if cls.unavailable("cpu") or cls.upstream is not None:  # a library's own calls
            continue
        for opts in dict.fromkeys(cls.variants(topo)):
            label = f"{name} {opts}"
            try:
                cls(attn, topo, rank, kernel=kernels.get("sdpa-cpu"), options=opts,
                    create_groups=False)
            except UsageError:  # this shape is not one the strategy takes
                continue
            st = cls(attn, topo, rank, kernel=_checking(seen, label), options=opts)
            x = global_inputs(attn, seed=3)
            q, k, v = (st.shard(x[n]).detach().requires_grad_() for n in ("q", "k", "v"))
            out, _ = st.attention(q, k, v)
            out.backward(st.shard(x["dout"]).to(out.dtype))
            ran.append(label)
    return seen, ran
