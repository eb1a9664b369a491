"""What a strategy's blocks weigh, and what its code keeps alive: the sizes its schedule's
messages are built from and the hooks the simulator's memory model reads (``sim.memory``).
Each width on its own: Q, dQ at the Q/K head dim; out, dout, V, dV at V's (MLA)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cpbench.strategies.schedule import FWD

if TYPE_CHECKING:
    from cpbench.config import AttentionConfig


class BlockBytes:
    """Mixed into ``Strategy``: reads its ``attn`` and ``local_seqlen``."""

    attn: AttentionConfig

    if TYPE_CHECKING:
        @property
        def local_seqlen(self) -> int: ...

    def held_bytes(self) -> int:
        """Bytes this rank keeps alive beyond the step that made them, at their peak (e.g.
        every received block kept to the end of the forward): the simulator's memory model
        adds them to the per-step buffers the schedule implies. Default: none."""
        return 0

    def accumulator_bytes(self, phase: str) -> int:
        """Bytes of the partial results this rank's code keeps through ``phase`` besides the
        messages it moves (the simulator's memory model; ``sim.memory``). Default, a ring's:
        the fp32 out in the forward; fp32 dQ, dK and dV in the backward."""
        s = self.local_seqlen
        if phase == FWD:
            return self.out_bytes(s, element_size=4)
        return self.q_bytes(s, element_size=4) + self.late_accumulator_bytes(phase)

    def finish_bytes(self, phase: str) -> int:
        """Bytes the end of ``phase`` allocates beside the accumulators and the last kernel
        call's results. Default, a ring's: its fp32 sums cast back to the activation dtype
        (out; dQ, dK, dV), a copy unless that is fp32."""
        s = self.local_seqlen
        if self.attn.element_size == 4:
            return 0
        if phase == FWD:
            return self.out_bytes(s)
        return self.q_bytes(s) + self.kv_bytes(s)

    def receives_in_place(self, phase: str) -> bool:
        """True when ``phase``'s messages arrive in buffers allocated before its loop and
        counted in ``accumulator_bytes`` (TE's backward ring), not in new ones per step."""
        return False

    def call_setup_bytes(self, phase: str) -> tuple[int, int]:
        """(kept, scratch): bytes each step makes for its kernel call, kept as its input, and
        the scratch that made them, freed before the call. Default: none."""
        return 0, 0

    def late_accumulator_bytes(self, phase: str) -> int:
        """The part of ``accumulator_bytes`` that starts from the phase's first kernel call's
        results (a ring's dK, dV partial sums); not alive during that call."""
        wide = 4 // self.attn.element_size
        return 0 if phase == FWD else self.kv_bytes(self.local_seqlen) * wide

    def k_bytes(self, seqlen: int, element_size: int | None = None) -> int:
        """Bytes of one K block (or dK) of ``seqlen`` tokens, in the activation dtype."""
        a = self.attn
        return a.batch * seqlen * a.num_kv_heads * a.head_dim * (element_size or a.element_size)

    def v_bytes(self, seqlen: int, element_size: int | None = None) -> int:
        """Bytes of one V block (or dV): V's own head dim."""
        return self.k_bytes(seqlen, element_size) * self.attn.dv // self.attn.head_dim

    def kv_bytes(self, seqlen: int) -> int:
        """Bytes of one K block and one V block together (or dK and dV)."""
        return self.k_bytes(seqlen) + self.v_bytes(seqlen)

    def q_bytes(self, seqlen: int, element_size: int | None = None) -> int:
        """Bytes of a Q block (or dQ)."""
        a = self.attn
        return a.batch * seqlen * a.heads * a.head_dim * (element_size or a.element_size)

    def out_bytes(self, seqlen: int, element_size: int | None = None) -> int:
        """Bytes of an out block (or dout): V's head dim."""
        return self.q_bytes(seqlen, element_size) * self.attn.dv // self.attn.head_dim

    def lse_bytes(self, seqlen: int) -> int:
        return self.attn.batch * self.attn.heads * seqlen * 4
