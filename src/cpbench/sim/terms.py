"""A CP step's cost, term by term: what ``simulate --details`` shows per strategy, so a reader
sees why one wins. ``sim.model.evaluate`` prices every step through ``step``; the terms of
the step's slowest rank add up to the step's time:

- ``kernel``: the block's FLOPs at the kernel's published rate for a block of one GPU's
  share (S / N tokens a side): the work itself;
- ``block size``: what running it in the step's own blocks costs beyond that (a zigzag step's
  half blocks run lower on the curve; Ulysses' whole-sequence blocks higher: negative; under
  a mask each varlen piece at its own side, so packed documents at their lengths);
- ``NCCL contention``: the kernel's rate inside a CP run below its rate alone
  (``kernel.in_cp``: NCCL's kernels take SMs; measured on A800 in seed 000's profile), in
  steps whose messages run beside the kernel only (``_contends``);
- ``merge / rescale``: the forward's merge of a block into the fp32 (out, lse), the
  backward's dq, dk, dv sums (``merge``, ``accumulate``: bytes per element over HBM), and
  under GQA a varlen backward's own fp32 dK / dV sums over every key of its call
  (``kernel.gqa_sums``: FA3 zeroes and converts them per call, so a call given the whole
  gathered sequence pays for all of it however few keys its pieces see);
- ``layout copies``: the copies a rank's all-to-alls make of their tensors besides the wire
  (``comm.a2a_copied_bytes``: the chunk-major send buffer, the received chunks laid side by
  side), bytes over HBM (``sharing.copies_s``);
- ``launch / sync``: a fixed cost per kernel step (``kernel.step_overhead_us``);
- ``comm not hidden``: an overlapped message that outlasts its kernel;
- ``comm latency``, ``comm bandwidth``: exposed messages (all-to-alls, all-gathers, the last
  hop): a link's latency once per step and their bytes over its rate.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpbench.sim import curves, sharing
from cpbench.sim.hardware import GB, Hardware

TERMS = ("kernel", "block size", "NCCL contention", "merge / rescale", "layout copies",
         "launch / sync", "comm not hidden", "comm latency", "comm bandwidth")


@dataclass(frozen=True)
class Scale:
    """How a schedule compiled at one size maps to the asked one, and one GPU's share."""

    linear: float  # bytes and elements
    square: float  # FLOPs
    length: float  # block sides
    share_side: float  # S / N: the side of one GPU's block, the ``kernel`` term's rate


def comm_s(hw: Hardware, intra: float, inter: float, node: float) -> tuple[float, float]:
    """(seconds, of which latency) of a step's messages: inside and across nodes at once,
    the longer; across nodes the GPU's NIC or its node's NICs shared, the slower."""
    t_intra = (intra / (hw.intra.bandwidth_gbs * GB), hw.intra.latency_us * 1e-6) \
        if intra else (0.0, 0.0)
    t_inter = (0.0, 0.0)
    if inter:
        t_inter = (max(inter / (hw.inter.bandwidth_gbs * GB), node / (hw.node_inter_gbs * GB)),
                   hw.inter.latency_us * 1e-6)
    bw, lat = max(t_intra, t_inter, key=lambda t: t[0] + t[1])
    return bw + lat, lat


def _contends(r) -> bool:
    """Whether NCCL's kernels run beside this rank's attention kernel in the step: only
    when the step has messages overlapping it (a ring's P2P, an all-gather posted ahead).
    ``in_cp`` was measured while a ring's P2P kernels ran beside attention (seed 000); an
    all-to-all before or after the kernel (Ulysses) takes no SMs from it. Found on
    MagiAttention's H100 FA3 rows (charged on every step, Ulysses came out 10-13 % slow; the
    preset's ``fit:`` makes those rows in-sample); judged on rows that did not choose it:
    B200 cuDNN median |error| 9.3 -> 3.6 % (Ring P2P's ratio to Ulysses within 0.10 in 8 of
    8 from 5, USP's and LoongTrain's in 5 of 8 from 8), seed 001's held-out Ulysses rows
    -7.5 / -7.6 % -> +0.9 / +1.3 %, BurstEngine's 2.6 -> 2.1 % (docs/simulator.md)."""
    return bool(r.intra_ov or r.inter_ov)


def _compute(hw: Hardware, phase: str, r, head_dim, s: Scale) -> dict[str, float]:
    """One rank's kernel call and the step's own costs around it, by term."""
    copies = {"layout copies": sharing.copies_s(hw, r.copied * s.linear)} if r.copied else {}
    if not r.flops:
        return copies
    flops = r.flops * s.square
    alone = hw.kernel(phase, r.causal, head_dim)
    in_cp = hw.kernel_in_cp[0 if phase == "fwd" else 1]
    at_side = flops / (alone.tflops(r.side * s.length) * 1e12)
    if r.spectrum:  # varlen calls: each piece at its own side and mask
        rate = curves.piece_rate(r.spectrum, lambda c: hw.kernel(phase, c, head_dim),
                                 hw.tiles[0 if phase == "fwd" else 1], r.gqa, s.length,
                                 phase, hw.fixed_tile_count)
        at_side = flops / (rate * 1e12)
    at_share = flops / (alone.tflops(s.share_side) * 1e12)
    return {"kernel": at_share, "block size": at_side - at_share,
            "NCCL contention": at_side / in_cp - at_side if _contends(r) else 0.0,
            "merge / rescale": sharing.passes_s(
                hw, phase, r.q_elements * s.linear, r.kv_elements * s.linear,
                r.out_elements * s.linear, r.v_elements * s.linear)
            + _gqa_sums_s(hw, phase, r, s),
            **copies, "launch / sync": hw.step_overhead_us * 1e-6}


def _gqa_sums_s(hw: Hardware, phase: str, r, s: Scale) -> float:
    """A GQA varlen backward's own dK / dV sums over the K / V elements its step states (the
    strategies that merge blocks; ``r.gqa`` is known on varlen calls). Not priced: dense
    calls (as many keys as rows: the pass is under 1 % of their kernel) and Ulysses' one
    call (the whole sequence's keys, 1 / N of the K/V heads: likewise)."""
    if phase == "fwd" or r.gqa <= 1:
        return 0.0
    return hw.gqa_sums.seconds((r.kv_elements + r.v_elements) * s.linear)


def _views(hw: Hardware, load, head_dim, s: Scale) -> list[tuple[float, float, dict]]:
    """Each distinct rank view's (step time, kernel time, terms): max(compute, overlapped
    messages) + exposed ones."""
    parts = [_compute(hw, load.phase, r, head_dim, s) for r in load.ranks]
    finishes = sharing.shared_compute([sum(p.values()) for p in parts], load.nodes,
                                      hw.idle_speedup)
    out = []
    for finish, r, p in zip(finishes, load.ranks, parts):
        exp, lat = comm_s(hw, r.intra_exp * s.linear, r.inter_exp * s.linear,
                          r.node_exp * s.linear)
        ov, _ = comm_s(hw, r.intra_ov * s.linear, r.inter_ov * s.linear, r.node_ov * s.linear)
        if hw.overlapped is not None:  # measured in situ: it adds, nothing hides
            hidden_not, total = hw.overlapped * ov, finish + hw.overlapped * ov + exp
        else:
            hidden_not, total = max(finish, ov) - finish, max(finish, ov) + exp
        # a CPU's shared cores stretch the compute terms alike (finish over their sum)
        stretch = finish / sum(p.values()) if p and sum(p.values()) else 1.0
        out.append((total, finish, {**{k: v * stretch for k, v in p.items()},
                                    "comm not hidden": hidden_not, "comm latency": lat,
                                    "comm bandwidth": exp - lat}))
    return out


def step(hw: Hardware, load, head_dim, s: Scale) -> tuple[float, float, dict[str, float]]:
    """(the step's time, its slowest rank's kernel time, the terms of the rank that sets
    it): lock-step, the step lasts as long as its slowest rank."""
    views = _views(hw, load, head_dim, s)
    worst, terms = -1.0, {}
    for total, _, t in views:
        if total > worst:
            worst, terms = total, t
    return worst, max(finish for _, finish, _ in views), terms


def runs(steps) -> list[tuple]:
    """The steps (``StepLoad``) in runs: a step that joins the other ranks starts one, and
    the following steps of its phase that do not join go with it."""
    out: list[list] = []
    for st in steps:
        if out and not st.joins and st.phase == out[-1][0].phase:
            out[-1].append(st)
        else:
            out.append([st])
    return [tuple(r) for r in out]


def run(hw: Hardware, loads, head_dim, s: Scale) -> tuple[float, float, dict[str, float]]:
    """``step`` over a run of steps of which only the first waits for the other ranks
    (``Step.joins``): each rank goes through the rest at its own pace, so the run lasts as
    long as the slowest rank's sum of its own step times (not the sum of per-step maxima).
    A rank is followed through the run by its view at each step (``StepLoad.who``)."""
    if len(loads) == 1:
        return step(hw, loads[0], head_dim, s)
    views = [_views(hw, load, head_dim, s) for load in loads]
    worst, compute = -1.0, 0.0
    path: tuple[int, ...] = ()
    for p in dict.fromkeys(zip(*(load.who for load in loads))):  # ranks alike: once
        total = sum(views[i][v][0] for i, v in enumerate(p))
        compute = max(compute, sum(views[i][v][1] for i, v in enumerate(p)))
        if total > worst:
            worst, path = total, p
    terms = dict.fromkeys(TERMS, 0.0)
    for i, v in enumerate(path):
        for key, value in views[i][v][2].items():
            terms[key] += value
    return worst, compute, terms
