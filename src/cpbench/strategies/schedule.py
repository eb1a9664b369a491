"""A strategy's communication and compute as data (``Strategy.schedule()``): the steps of each
phase, each with the kernel FLOPs it computes and the messages it sends. The profiler
breakdown, the simulator and the dry run read it; tests hold it equal to the bytes the code
really sends.
"""

from __future__ import annotations

from dataclasses import dataclass

FWD, BWD = "fwd", "bwd"



@dataclass(frozen=True)
class Message:
    """Bytes this rank sends in one step over one group. ``op``: "p2p" or "a2a".
    ``overlapped``: in flight during compute (False: exposed, nothing hides it);
    ``overlap_steps``: how many steps' kernels it has to arrive in (a double ring's outer hop
    has a whole inner window); ``after_compute``: posted after this step's kernel (a partial
    sum moving on), so those are the next steps' kernels, not this one's; ``copied``: bytes
    the rank's own layout copies around it read and write (``comm.a2a_copied_bytes``)."""

    op: str
    group: str
    nbytes: int
    crosses_nodes: bool
    overlapped: bool = True
    overlap_steps: int = 1
    after_compute: bool = False
    copied: int = 0


@dataclass(frozen=True)
class Step:
    """One step of a rank's schedule: the kernel FLOPs it computes, the shape of that kernel
    call (``block``: seqlen_q, seqlen_k, causal; None when the step computes nothing) and what
    it sends. The simulator prices the FLOPs at the kernel's speed for that shape.
    ``joins``: the step waits for the other ranks before it starts (a ring hop, a collective);
    False: it follows the rank's previous step at once (llama3's kernels after a gather), so
    the simulator times such a run of steps by each rank's own sum, not step by step."""

    phase: str
    index: int
    flops: float
    messages: tuple[Message, ...] = ()
    block: tuple[int, int, bool] | None = None
    # under a mask, the (rows, keys) its largest varlen call packs and how many calls it
    # makes (the simulator's memory model; None: the block's, one call)
    packed: tuple[int, int, int] | None = None
    # under a mask, its varlen calls' work by piece shape (``masked_varlen.spectrum``): the
    # simulator prices each piece in the kernel's whole tiles (packed documents: their
    # lengths)
    spectrum: tuple[tuple[float, float, bool, float], ...] = ()
    joins: bool = True
