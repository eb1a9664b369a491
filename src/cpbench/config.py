"""Frozen, keyword-only configuration dataclasses: the single source of truth for a run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """The attention problem, in global terms (``seqlen`` is the whole sequence)."""

    batch: int = 1
    seqlen: int = 4096
    heads: int = 8
    kv_heads: int | None = None  # None: same as heads (no GQA)
    head_dim: int = 64
    dtype: str = "fp32"
    causal: bool = True

    def __post_init__(self):
        for name in ("batch", "seqlen", "heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise ValueError(
                f"kv_heads {self.kv_heads} must divide heads {self.heads}; use one of: "
                + ", ".join(str(d) for d in range(1, self.heads + 1) if self.heads % d == 0)
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of: {', '.join(DTYPES)}")

    @property
    def num_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
