"""A strategy whose rank ``$CPBENCH_TEST_DIE_RANK`` process dies (``os._exit(7)``) at its
first attention call, as a rank killed by the OOM killer or a segfault would: no exception,
no report. Imported by the test's ``cpbench run`` process only; its own Options class makes
the ranks import it too when they unpickle the plan."""

from __future__ import annotations

import os
from dataclasses import dataclass

from cpbench.strategies import register
from cpbench.strategies.ring import Ring


@dataclass(frozen=True, kw_only=True)
class DyingOptions(Ring.Options):
    pass


@register
class Dying(Ring):
    name = "test-die"
    description = "one rank's process exits mid-case (test)"
    Options = DyingOptions

    def attention(self, q, k, v):
        if self.rank == int(os.environ["CPBENCH_TEST_DIE_RANK"]):
            os._exit(7)
        return super().attention(q, k, v)
