"""``cpbench run`` with one more strategy, ``test-oom-in-ring`` (zigzag, except that rank 1
runs out of memory at its third attention call), for the GPU tests' torchrun jobs:
``torchrun ... tests/gpu/faulty_run.py <cpbench run flags>``."""

from __future__ import annotations

import sys

import torch

from cpbench.run import main
from cpbench.strategies import register
from cpbench.strategies.zigzag import Zigzag


@register
class OomInRing(Zigzag):
    name = "test-oom-in-ring"
    description = "rank 1 raises torch.OutOfMemoryError at its third call (test)"

    def attention(self, q, k, v):
        self.calls = getattr(self, "calls", 0) + 1
        if self.rank == 1 and self.calls == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (injected on rank 1, call 3)")
        return super().attention(q, k, v)


if __name__ == "__main__":
    sys.exit(main())
