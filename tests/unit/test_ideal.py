"""The ideal step's blocks come from the declared schedule, the heads its FLOPs say; masked
problems and strategies without a schedule have none, and say why."""

from __future__ import annotations

import pytest
from test_results import fake_record

from cpbench import results
from cpbench.bench import ideal
from cpbench.config import AttentionConfig
from cpbench.strategies.base import NoOptions
from cpbench.strategies.ulysses import Ulysses
from cpbench.strategies.zigzag import Zigzag
from cpbench.topology import Topology


def _topo(n):
    return Topology(world_size=n, ranks_per_node=n)


def test_zigzag_blocks_per_rank():
    attn = AttentionConfig(seqlen=1024, heads=4, head_dim=16)
    per_rank = ideal.rank_blocks("zigzag", Zigzag.Options(), attn, _topo(2), "sdpa-cpu")
    # each rank: its own two chunks (causal), then half of the other's (a half block)
    assert per_rank[0][0] == ("fwd", (512, 512, True, 4))
    assert {b for _, b in per_rank[0][1:]} | {b for _, b in per_rank[1][1:]} == {
        (512, 512, True, 4), (512, 256, False, 4), (256, 512, False, 4)}
    assert [p for p, _ in per_rank[0]].count("bwd") == len(per_rank[0]) // 2


def test_ulysses_blocks_are_the_whole_sequence_on_a_share_of_the_heads():
    attn = AttentionConfig(seqlen=1024, heads=4, head_dim=16)
    per_rank = ideal.rank_blocks("ulysses", Ulysses.Options(), attn, _topo(2), "sdpa-cpu")
    assert {b for _, b in per_rank[0]} == {(1024, 1024, True, 2)}


def test_no_ideal_for_masks_or_without_a_schedule():
    attn = AttentionConfig(seqlen=1024, heads=4, head_dim=16, window_size=(128, 0))
    assert "masked" in ideal.rank_blocks("zigzag", Zigzag.Options(), attn, _topo(2),
                                         "sdpa-cpu")


def test_fraction_is_the_ideal_over_the_measured_step():
    rec = fake_record(fwd=[[10.0] * 3] * 4, fwd_bwd=[[40.0] * 3] * 4)
    rec["ideal"] = {"rank": 1, "fwd_ms": 5.0, "bwd_ms": 15.0, "blocks": []}
    d = results.derive(rec)
    assert d["fraction_of_ideal_fwd"] == 0.5 and d["fraction_of_ideal"] == 0.5
    rec["ideal"] = {"none": "a masked problem"}
    assert "fraction_of_ideal" not in results.derive(rec)


def test_the_ideal_is_the_slowest_ranks_blocks_each_timed_once(monkeypatch):
    """Known block times (1 us a query row + 1 ns a key, backward 2.5x): zigzag on 2 ranks at
    1024 is each rank's causal 512 x 512, then rank 0's 256 x 512 and rank 1's 512 x 256
    (test_zigzag_blocks_per_rank): rank 1 is the slower, its ideal the sum of its two."""
    calls = []

    def fake(kernel, attn, shape, device, *, warmup, iters):
        calls.append(shape)
        rows, keys = shape[:2]
        t = rows * 1e-3 + keys * 1e-6
        return t, 2.5 * t

    monkeypatch.setattr(ideal, "_time_block", fake)
    attn = AttentionConfig(seqlen=1024, heads=4, head_dim=16)
    got = ideal.measure("zigzag", Zigzag.Options(), attn, _topo(2), "sdpa-cpu", device="cpu",
                        warmup=1, iters=2, fwd_only=False)
    assert sorted(calls) == [(256, 512, False, 4), (512, 256, False, 4), (512, 512, True, 4)]
    fwd = (0.512 + 0.000512) + (0.512 + 0.000256)
    assert got["rank"] == 1
    assert got["fwd_ms"] == pytest.approx(fwd) and got["bwd_ms"] == pytest.approx(2.5 * fwd)
    assert ideal.measure("zigzag", Zigzag.Options(), attn, _topo(2), "sdpa-cpu",
                         device="cpu", warmup=1, iters=2, fwd_only=True)["bwd_ms"] is None


def test_a_real_block_is_timed_and_is_the_ideal_of_local():
    """The real kernel: local's one block (the whole problem) timed, and its ideal that
    block's times."""
    attn = AttentionConfig(seqlen=256, heads=2, head_dim=16)
    got = ideal.measure("local", NoOptions(), attn, _topo(1), "sdpa-cpu", device="cpu",
                        warmup=1, iters=2, fwd_only=False)
    (block,) = got["blocks"]
    assert got["rank"] == 0
    assert (block["rows"], block["keys"], block["causal"], block["heads"]) == (256, 256, True, 2)
    assert (got["fwd_ms"], got["bwd_ms"]) == (block["fwd_ms"], block["bwd_ms"])
    assert got["fwd_ms"] > 0 and got["bwd_ms"] > 0


def test_the_tables_print_it_and_old_records_keep_their_columns():
    from cpbench import report

    rec = fake_record(fwd=[[10.0] * 3] * 4, fwd_bwd=[[40.0] * 3] * 4)
    rec["ideal"] = {"rank": 1, "fwd_ms": 5.0, "bwd_ms": 15.0, "blocks": []}
    lines = report.summary([rec]).splitlines()
    header = [c.strip() for c in lines[3].split("|")]
    assert header[-1] == "Ideal (%)" and lines[5].split("|")[-1].strip() == "50.0"
    markdown = report.summary([rec], "markdown")
    assert "| Fraction of Ideal (%) | CP Efficiency (%) |" in markdown
    assert "Ideal" not in report.summary([fake_record()])
