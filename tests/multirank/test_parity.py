"""Upstream parity, measured: each of cpbench's strategies and the upstream code it is named
after, on the same problem and mesh, traced at torch.distributed (``cpbench comm``'s tracer):
the same calls and bytes per (phase, op, dtype), and for the rings the same per-rank,
per-step sequence (op, dtype, bytes, group, kernel calls before it).

The upstream code runs here: ring-flash-attn 0.1.8 (zigzag_ring_flash_attn.py,
ring_flash_attn.py, llama3_flash_attn_varlen.py) and yunchang 0.6.4 (hybrid/attn_layer.py
LongContextAttention, ring/*)."""

from __future__ import annotations

from collections import defaultdict

import pytest
from rankpool import run_ranks

from cpbench.bench import commrun
from cpbench.bench import plan as planning
from cpbench.config import RunConfig

PROBLEM = {"seqlen": 256, "heads": 8, "head_dim": 16, "dtype": "bf16"}


def _traced(names: str, world: int = 4, **options) -> list[dict]:
    p = planning.plan(RunConfig(strategy=tuple(names.split(",")), nproc=world, out="none",
                                warmup=0, iters=1), dict(PROBLEM), options, launcher="self")
    found = run_ranks(commrun.rank_comm, world, p, timeout=180)[0]
    assert not any(c["error"] for c in found), [c["error"] for c in found]
    return found


def _by_strategy(found: list[dict]) -> dict[str, dict]:
    rows = defaultdict(dict)
    for r in commrun.summarize(found):
        rows[r["strategy"].split()[0]][(r["phase"], r["op"], r["dtype"])] = \
            (r["calls"], r["bytes"])
    return rows


@pytest.mark.parametrize("ours,theirs", [("zigzag", "rfa-zigzag"), ("ring", "rfa-ring")])
def test_rings_send_what_ring_flash_attn_sends(ours, theirs):
    found = _traced(f"{ours},{theirs}")
    rows = _by_strategy(found)
    assert rows[ours] == rows[theirs]
    assert rows[ours][("bwd", "p2p", "float32")][1] > 0  # dK/dV partial sums in fp32, as theirs
    assert commrun.steps(found[0]) == commrun.steps(found[1])  # step by step, rank by rank


@pytest.mark.parametrize("placement", ["head-first", "ring-first"])
def test_usp_sends_what_yunchang_sends_over_the_zigzag_ring(placement):
    rows = _by_strategy(_traced("usp,yunchang-usp", ulysses_degree=2, placement=placement,
                                ring_impl="zigzag"))
    assert rows["usp"] == rows["yunchang-usp"]
    assert {op for _, op, _ in rows["usp"]} == {"all_to_all_single", "p2p"}


def test_usp_over_ring_sends_what_yunchang_over_basic_sends():
    ours = _by_strategy(_traced("usp", ulysses_degree=2, ring_impl="ring"))["usp"]
    theirs = _by_strategy(_traced("yunchang-usp", ulysses_degree=2, ring_impl="basic"))
    assert ours == theirs["yunchang-usp"]


def test_ulysses_forward_sends_no_fp32():
    """DeepSpeed, yunchang and TE send q, k, v and out in the activation dtype, never the lse
    (yunchang hybrid/attn_layer.py: SeqAllToAll4D of query, key, value, then the output)."""
    rows = _by_strategy(_traced("ulysses"))["ulysses"]
    assert set(rows) == {("fwd", "all_to_all_single", "bfloat16"),
                         ("bwd", "all_to_all_single", "bfloat16")}
    # 4 ranks x (q, k, v, out) forward and (dout, dq, dk, dv) backward
    assert [calls for calls, _ in rows.values()] == [16, 16]


def _by_chunk(found: dict) -> list[tuple]:
    """Per rank and phase, the calls in order (op, dtype, bytes), each with how many head
    chunks had computed before it: its kernel count ranked densely, as a chunk is one varlen
    call upstream and one or two kernels in cpbench."""
    out = []
    for rank, per_rank in enumerate(found["events"]):
        for phase, events in per_rank.items():
            rank_of = {k: i for i, k in enumerate(sorted({e.kernels_before for e in events}))}
            out += [(rank, phase, rank_of[e.kernels_before], e.op, e.dtype, e.nbytes)
                    for e in events]
    return out


@pytest.mark.parametrize("stride", [1, 0])
def test_llama3_sends_what_ring_flash_attn_llama3_sends(stride):
    """ring-flash-attn 0.1.8 llama3_flash_attn_varlen.py: K/V gathered in the activation
    dtype, the next head chunk's gathers posted before this chunk computes (L104-115, L233-243:
    two chunks' gathers before the first kernel), dK/dV reduce-scattered in the activation
    dtype after each chunk (L194-196, L292-293). The contiguous layout is the library's; the
    zigzag layout (the default) moves the same bytes."""
    found = _traced("llama3,rfa-llama3", heads_k_stride=stride, layout="contiguous",
                    dkv_dtype="activation")
    rows = _by_strategy(found)
    assert rows["llama3"] == rows["rfa-llama3"]
    assert {dtype for _, _, dtype in rows["llama3"]} == {"bfloat16"}
    assert _by_chunk(found[0]) == _by_chunk(found[1])
    if stride == 1:  # 8 K/V heads: chunk 1's gathers go out before chunk 0's kernel
        assert [c for r, p, c, op, *_ in _by_chunk(found[0])
                if (r, p, op) == (0, "fwd", "all_gather")][:4] == [0, 0, 0, 0]
    zigzag = _by_strategy(_traced("llama3", heads_k_stride=stride, layout="zigzag"))["llama3"]
    assert zigzag == rows["llama3"]


def test_llama3_fp32_sums_are_a_named_option():
    rows = _by_strategy(_traced("llama3", dkv_dtype="fp32", layout="zigzag"))["llama3"]
    assert rows[("bwd", "reduce_scatter_tensor", "float32")][1] == \
        2 * rows[("bwd", "all_gather", "bfloat16")][1]
