"""The simulator's memory model: a rank's peak bytes from its schedule and what its code keeps.

Held to the dry run (``cpbench dryrun``, the real code's allocations on fake tensors) by
``tests/unit/test_sim_memory.py`` (plain, CPU) and ``tests/fake_gpu/test_sim_memory_gpu.py``
(documents, a window and GQA, fake CUDA); the terms below are what that code allocates:

- inputs q, k, v, dout and the forward's out in the activation dtype, and the lse;
- the strategy's accumulators per phase (``Strategy.accumulator_bytes``: fp32 out in the
  forward, fp32 dQ, dK, dV in a ring's backward, the dK/dV part only from the first call on);
- per step, the buffers messages are received into: a block (or a collective's output) from
  the step that posts it through the step that consumes it (and forwards it: the buffer a
  block is sent from is the one received before), a partial sum posted after its step's
  kernel until it is awaited (the one sent is the accumulator);
- the kernel's results of two consecutive calls (a step's are alive while the next call
  returns its own): out and lse in the forward, dQ, dK, dV in the backward; under a mask the
  GPU's varlen path's fp32 results and, during a call, its packed inputs (``Step.packed``);
  at the end, the last call's beside what the phase finishes with (``finish_bytes``);
- ``Strategy.held_bytes`` (blocks a strategy keeps to the end of the forward);
- with ``kernel_buffers`` (the GPUs' FlashAttention-2 kernels; off for the CPU's), what the
  backward kernel allocates inside its call while it runs (``kernels.fa2_workspace``: an
  fp32 dQ accumulator and row sums, and under GQA dK, dV expanded to every query head),
  with the query rows unpadded (the model's figures scale with S; the kernel pads to 128).

The peak is the larger of the forward's and the backward's worst step. Not counted: other
kernel workspaces (the forward's split-KV buffers, FlashAttention-3's), the allocator's
rounding and fragmentation (the GPU figure is higher by those).
"""

from __future__ import annotations

from cpbench.kernels import fa2_workspace
from cpbench.strategies.base import BWD, FWD, Step, Strategy


def peak_bytes(strat: Strategy, schedule: list[Step], kernel_buffers: bool = True) -> float:
    """``strat``'s rank at its worst moment of a forward + backward (``kernel_buffers``: see
    the module docstring)."""
    return _peaks(strat, schedule, {})[0 if kernel_buffers else 1]


def peaks(ranks: list[Strategy], schedules: list[list[Step]]) -> tuple[float, float]:
    """The largest ``peak_bytes`` of ``ranks`` with and without the kernel's buffers, each
    distinct rank computed once: ranks whose hooks and schedules read the same have the same
    peaks (a block's sizes are ``BlockBytes``' functions of the strategy's type and problem)."""
    distinct: dict[tuple, tuple[Strategy, list[Step]]] = {}
    for strat, schedule in zip(ranks, schedules):
        distinct.setdefault(_signature(strat, schedule), (strat, schedule))
    calls: dict = {}
    both = [_peaks(strat, schedule, calls) for strat, schedule in distinct.values()]
    return max(p[0] for p in both), max(p[1] for p in both)


def _signature(strat: Strategy, schedule: list[Step]) -> tuple:
    """Everything of a rank that ``peak_bytes`` reads."""
    hooks = tuple((strat.receives_in_place(p), strat.call_setup_bytes(p),
                   strat.late_accumulator_bytes(p), strat.accumulator_bytes(p),
                   strat.finish_bytes(p)) for p in (FWD, BWD))
    steps = tuple((st.phase, st.block, st.packed, st.messages) for st in schedule)
    return (_context(strat), strat.local_seqlen, strat.held_bytes(), hooks, steps)


def _context(strat: Strategy) -> tuple:
    """What one kernel call's bytes depend on besides its step."""
    return type(strat), strat.attn, strat.kernel_head_share(), strat.mask.plain


def _call_bytes(strat: Strategy, ctx: tuple, step: Step, calls: dict
                ) -> tuple[float, float, float]:
    """``_kernel_bytes`` and ``_kernel_buffers``, once per call shape (``ctx``:
    ``_context(strat)``)."""
    key = (ctx, step.phase, step.block, step.packed)
    if key not in calls:
        calls[key] = (*_kernel_bytes(strat, step), _kernel_buffers(strat, step))
    return calls[key]


def _peaks(strat: Strategy, schedule: list[Step], calls: dict) -> tuple[float, float]:
    """(with the kernel's buffers, without): the worse phase of each."""
    fwd, bwd = (_phase_peak(strat, schedule, phase, calls) for phase in (FWD, BWD))
    return max(fwd[0], bwd[0]), max(fwd[1], bwd[1])


def _phase_peak(strat: Strategy, schedule: list[Step], phase: str, calls: dict
                ) -> tuple[float, float]:
    s = strat.local_seqlen
    q, out, kv, lse = strat.q_bytes(s), strat.out_bytes(s), strat.kv_bytes(s), strat.lse_bytes(s)
    resident = q + out + kv  # q, dout (V's width), k and v
    resident += strat.held_bytes() if phase == FWD else out + lse  # the forward's out
    steps = [i for i, st in enumerate(schedule) if st.phase == phase]
    # its buffers are among the accumulators when it receives in place
    flight = ([0.0] * len(schedule) if strat.receives_in_place(phase)
              else _in_flight(schedule, phase))
    ctx = _context(strat)
    kept, scratch = strat.call_setup_bytes(phase)
    # the late accumulators start from the first call's results: not alive during it
    late, worst, previous = strat.late_accumulator_bytes(phase), [0.0, 0.0], None
    for i in steps:
        results, transient, buffers = _call_bytes(strat, ctx, schedule[i], calls)
        for n, extra in enumerate((buffers, 0.0)):  # with the kernel's buffers, without
            step = flight[i]
            if results:
                # its inputs made for it, its results and transients (or the scratch that
                # made those inputs, freed before the call), the previous call's results
                # (alive until these return)
                step += kept + max(scratch, results + (transient + extra))
                step += previous if previous is not None else -late
            worst[n] = max(worst[n], step)
        previous = results if results else previous
    # the end: the last call's results alive while the phase's results are made
    end = (previous or 0.0) + strat.finish_bytes(phase)
    base = resident + strat.accumulator_bytes(phase)
    return base + max(worst[0], end), base + max(worst[1], end)


def _in_flight(schedule: list[Step], phase: str) -> list[float]:
    """Bytes of the messages in flight at each step, of blocks and of partial sums (posted
    after the kernel, in flight from the next step on), from the step that posts one to the
    step that awaits it (whole bytes: exact in any order)."""
    flight = [0.0] * len(schedule)
    in_phase = [st.phase == phase for st in schedule]
    for i, step in enumerate(schedule):
        if not in_phase[i]:
            continue
        for m in step.messages:
            partial = m.after_compute
            first = i + 1 if partial else i
            last = first + max(m.overlap_steps, 1) - 1 if m.overlapped else i
            # the buffer received into, until the step that awaits it; a block (not a partial
            # sum) is the next step's input too (and what that step forwards: the buffer a
            # block is sent from is the one received before, or an input)
            for j in range(first, min(last + (not partial), len(schedule) - 1) + 1):
                if in_phase[j]:
                    flight[j] += m.nbytes
    return flight


def _kernel_bytes(strat: Strategy, step: Step) -> tuple[float, float]:
    """One kernel call's (results, transient) bytes for the rows and keys of its block and
    the heads the strategy computes on a rank: results out + lse (forward), dQ + dK + dV
    (backward). Under a mask the GPU's varlen path (``kernels.masked_varlen``) returns fp32
    results and, while it runs, holds its packed inputs and the varlen call's own results."""
    if not step.block:
        return 0.0, 0.0
    rows, keys = step.block[0], step.block[1]
    # kv: K and V together; out (and dout) at V's head dim
    q, out, kv = strat.q_bytes(rows), strat.out_bytes(rows), strat.kv_bytes(keys)
    lse = strat.lse_bytes(rows)
    wide, share = 4 / strat.attn.element_size, strat.kernel_head_share()
    if strat.mask.plain:
        results = out + lse if step.phase == FWD else q + kv
        return share * results, 0.0
    pq, pout, pkv, calls = q, out, kv, 1
    if step.packed:
        packed_rows, packed_keys, calls = step.packed
        pq, pout = strat.q_bytes(packed_rows), strat.out_bytes(packed_rows)
        pkv = strat.kv_bytes(packed_keys)
    if step.phase == FWD:  # packed q, k, v; every call's out (merged at the end); fp32 sum
        return share * (wide * out + lse), share * (pq + pkv + calls * pout + wide * out)
    # packed dout, q, out, k, v; the call's dQ, dK, dV and the previous call's
    call = pq + pkv
    return share * wide * (q + kv), share * (pq + 2 * pout + pkv + min(calls, 2) * call)


def _kernel_buffers(strat: Strategy, step: Step) -> float:
    """What one backward call of FlashAttention-2 holds inside it (the varlen call's rows:
    its largest call's, one sequence per batch element; the kernel adds 128 per sequence)."""
    if step.phase != BWD or not step.block:
        return 0.0
    a = strat.attn
    rows, keys = step.block[0], step.block[1]
    if not strat.mask.plain and step.packed:
        rows, keys = step.packed[0], step.packed[1]
    return strat.kernel_head_share() * fa2_workspace.buffer_bytes(
        rows=a.batch * rows, keys=a.batch * keys, heads=a.heads, kv_heads=a.num_kv_heads,
        head_dim=a.head_dim, element_size=a.element_size)
