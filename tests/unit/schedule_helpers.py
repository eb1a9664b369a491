"""Shared by the schedule tests: a strategy on planned groups (no processes), and the bytes
its declared schedule sends, summed."""

from __future__ import annotations

import dataclasses
from collections import Counter

from cpbench import kernels, strategies
from cpbench.config import AttentionConfig
from cpbench.topology import Topology

# the default problem: small, GQA, every world size here divides 2·S
B, S, H, HK, D = 2, 96, 4, 2, 16


def attn(dtype="bf16", causal=True, seqlen=S, **kw) -> AttentionConfig:
    return AttentionConfig(**{**dict(batch=B, seqlen=seqlen, heads=H, kv_heads=HK, head_dim=D,
                                     dtype=dtype, causal=causal), **kw})


def plan(name, world, rpn, rank=0, problem=None, *, cp_lists=None, kernel="torch", **opts):
    """Strategy ``name`` (or class) for ``rank`` with ``opts``, groups planned, not created."""
    cls = strategies.get(name) if isinstance(name, str) else name
    return cls(problem or attn(), Topology(world_size=world, ranks_per_node=rpn), rank,
               kernel=kernels.get(kernel), options=cls.Options(**opts), create_groups=False,
               cp_lists=cp_lists)


def build(name, world, rpn, rank=0, **kw):
    """``plan`` with AttentionConfig fields and options mixed in ``kw``."""
    cls = strategies.get(name)
    options = {f.name for f in dataclasses.fields(cls.Options)}
    return plan(cls, world, rpn, rank, AttentionConfig(**{k: v for k, v in kw.items()
                                                         if k not in options}),
                **{k: v for k, v in kw.items() if k in options})


def totals(st, keys=("phase", "group")) -> Counter:
    """The bytes ``st``'s schedule declares, summed by ``keys`` (of phase, op, group); a
    single key gives plain keys, several give tuples."""
    out = Counter()
    for step in st.schedule():
        for m in step.messages:
            key = tuple({"phase": step.phase, "op": m.op, "group": m.group}[k] for k in keys)
            out[key[0] if len(keys) == 1 else key] += m.nbytes
    return out


def step_bytes(st, phase) -> list[int]:
    """Bytes declared per step of ``phase``."""
    return [sum(m.nbytes for m in s.messages) for s in st.schedule() if s.phase == phase]


def volume(st, phase) -> dict[tuple[str, str], int]:
    """Bytes ``st``'s schedule declares in ``phase``, summed per (op, group)."""
    return {(op, group): n for (p, op, group), n in totals(st, ("phase", "op", "group")).items()
            if p == phase}
