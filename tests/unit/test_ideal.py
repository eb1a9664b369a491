"""The one "fraction of ideal" (``cpbench.ideal``): the kernel alone on each GPU's share, one
block of S / N tokens N times over, timed alone by ``run`` and priced by ``simulate``; masked
problems have none and say why; older records' ideals are read and marked."""

from __future__ import annotations

import pytest
from test_results import fake_record

from cpbench import ideal, results
from cpbench.bench import ideal as bench_ideal
from cpbench.config import AttentionConfig, RunConfig


def _run(warmup: int, iters: int) -> RunConfig:
    return RunConfig(strategy=("zigzag",), warmup=warmup, iters=iters).resolved("cpu")


def test_the_share_is_s_over_n_tokens_n_times_over():
    attn = AttentionConfig(seqlen=1024, heads=4, head_dim=16)
    assert ideal.share(attn, 4) == (256, 4)
    assert ideal.share(attn, 1) == (1024, 1)  # a no-CP baseline: the whole sequence once
    got = ideal.section(attn, 4, 2.0, 5.0)
    assert (got["fwd_ms"], got["bwd_ms"], got["times"], got["tokens_per_gpu"]) == \
        (8.0, 20.0, 4, 256)
    assert got["block"] == {"rows": 256, "keys": 256, "causal": True, "heads": 4,
                            "fwd_ms": 2.0, "bwd_ms": 5.0}
    assert ideal.section(attn, 4, 2.0, None)["bwd_ms"] is None  # --fwd-only


def test_no_ideal_for_masks():
    windowed = AttentionConfig(seqlen=1024, heads=4, head_dim=16, window_size=(128, 0))
    assert "masked" in bench_ideal.measure(windowed, 2, "sdpa-cpu", _run(1, 1))["none"]
    assert ideal.none_reason(AttentionConfig(seqlen=1024, heads=4, head_dim=16)) is None


def test_fraction_is_the_ideal_over_the_measured_step():
    rec = fake_record(fwd=[[10.0] * 3] * 4, fwd_bwd=[[40.0] * 3] * 4)
    rec["ideal"] = ideal.section(AttentionConfig(seqlen=1024, heads=8, head_dim=32), 4,
                                 1.25, 3.75)  # 4 x (1.25 + 3.75) = 20 ms of a 40 ms step
    d = results.derive(rec)
    assert d["fraction_of_ideal_fwd"] == 0.5 and d["fraction_of_ideal"] == 0.5
    rec["ideal"] = {"none": "a masked problem"}
    assert "fraction_of_ideal" not in results.derive(rec)


def test_an_older_records_ideal_is_read_marked_and_gives_no_fraction():
    """Before the one definition, run's ideal was the slowest rank's declared blocks."""
    rec = fake_record(fwd=[[10.0] * 3] * 4, fwd_bwd=[[40.0] * 3] * 4)
    rec["ideal"] = {"rank": 1, "fwd_ms": 5.0, "bwd_ms": 15.0, "blocks": []}
    d = results.derive(rec)
    assert "fraction_of_ideal" not in d and d["ideal_superseded"] == ideal.SUPERSEDED
    # a simulated record of before carried the same definition (no rank): still a fraction
    rec["ideal"] = {"fwd_ms": 5.0, "bwd_ms": 15.0, "what": "the kernel alone"}
    assert results.derive(rec)["fraction_of_ideal"] == 0.5


def test_run_times_one_block_of_the_share_and_counts_it_n_times(monkeypatch):
    calls = []

    def fake(kernel, attn, tokens, device, *, warmup, iters):
        calls.append((tokens, warmup, iters))
        return 1.5, 4.0

    monkeypatch.setattr(bench_ideal, "_time_block", fake)
    attn = AttentionConfig(seqlen=1024, heads=4, head_dim=16)
    got = bench_ideal.measure(attn, 2, "sdpa-cpu", _run(5, 50))
    assert calls == [(512, 3, 20)]  # capped: the other ranks wait on rank 0
    assert (got["fwd_ms"], got["bwd_ms"]) == (3.0, 8.0)
    fwd_only = RunConfig(strategy=("zigzag",), fwd_only=True).resolved("cpu")
    assert bench_ideal.measure(attn, 2, "sdpa-cpu", fwd_only)["bwd_ms"] is None


def test_a_real_block_is_timed_and_is_the_ideal_of_local():
    """The real kernel: local's one block (the whole problem) timed, once over."""
    attn = AttentionConfig(seqlen=256, heads=2, head_dim=16)
    got = bench_ideal.measure(attn, 1, "sdpa-cpu", _run(1, 2))
    block = got["block"]
    assert (block["rows"], block["keys"], block["causal"], block["heads"]) == (256, 256, True, 2)
    assert (got["fwd_ms"], got["bwd_ms"]) == (block["fwd_ms"], block["bwd_ms"])
    assert got["fwd_ms"] > 0 and got["bwd_ms"] > 0


def test_the_tables_print_it_and_old_records_keep_their_columns():
    from cpbench import report

    rec = fake_record(fwd=[[10.0] * 3] * 4, fwd_bwd=[[40.0] * 3] * 4)
    rec["ideal"] = ideal.section(AttentionConfig(seqlen=1024, heads=8, head_dim=32), 4,
                                 1.25, 3.75)
    rec["derived"] = results.derive(rec)
    lines = report.summary([rec]).splitlines()
    header = [c.strip() for c in lines[3].split("|")]
    assert header[-1] == "Ideal (%)" and lines[5].split("|")[-1].strip() == "50.0"
    markdown = report.summary([rec], "markdown")
    # no baseline: the CP efficiency is "-" in every row, so no column (report.render)
    assert markdown.splitlines()[0].endswith("| Fraction of Ideal (%) |")
    assert "Ideal" not in report.summary([fake_record()])
    assert pytest.approx(0.5) == rec["derived"]["fraction_of_ideal"]
