"""``--rounds K``: the plan's A B … B A order (the baseline included), the record's ``round``,
and every reader pooling a case's rounds (report, --best, compare) with the drift printed."""

from __future__ import annotations

import copy
import json

import pytest
from test_results import fake_record

from cpbench import rounds
from cpbench.bench.plan import plan
from cpbench.compare import analysis
from cpbench.config import RunConfig
from cpbench.errors import UsageError
from cpbench.report import summary
from cpbench.report.best import best_table, verdicts


def test_rounds_alternate_their_order_with_the_baseline_inside():
    run = RunConfig(strategy=("zigzag", "ulysses", "local"), nproc=2, out="none", rounds=3)
    p = plan(run, {"seqlen": 1024}, {}, launcher="self")
    got = [(c.strategy, c.round) for c in p.cases]
    one = [c.strategy for c in p.cases[:3]]
    assert sorted(one) == ["local", "ulysses", "zigzag"]  # each case once per round
    assert got == [(n, 0) for n in one] + [(n, 1) for n in one[::-1]] + [(n, 2) for n in one]
    assert p.round_of(p.cases[4]) == {"index": 1, "count": 3}
    assert "[round 1]" in p.cases[4].label and len(p.waits) == len(p.cases)
    # one round: as before, the baseline timed at both ends, no round in the record
    single = plan(RunConfig(strategy=("zigzag", "local"), nproc=2, out="none"),
                  {"seqlen": 1024}, {}, launcher="self")
    assert [c.strategy for c in single.cases] == ["local", "zigzag", "local"]
    assert single.round_of(single.cases[0]) is None


def test_rounds_must_be_positive():
    with pytest.raises(UsageError, match="--rounds must be a positive integer"):
        RunConfig(strategy=("zigzag",), rounds=0)


def _round(record, index, count=2):
    r = copy.deepcopy(record)
    r["round"] = {"index": index, "count": count}
    return r


def _run(scale=1.0):
    """zigzag and ring in two rounds, A B B A, the second round 10 % slower (drift)."""
    def rec(name, base, k):
        times = [[scale * base * (1 + 0.1 * k) + 0.01 * i for i in range(6)]] * 4
        return _round(fake_record(name, fwd=[[t / 3 for t in times[0]]] * 4, fwd_bwd=times),
                      k)
    return [rec("zigzag", 20.0, 0), rec("ring", 30.0, 0), rec("ring", 30.0, 1),
            rec("zigzag", 20.0, 1)]


def test_pool_joins_a_cases_rounds_in_round_order():
    pooled = rounds.pool(_run())
    assert [r["config"]["strategy"] for r in pooled] == ["zigzag", "ring"]
    z = pooled[0]
    assert len(z["samples_ms"]["fwd_bwd"][0]) == 12
    assert z["samples_ms"]["fwd_bwd"][0][6] == pytest.approx(22.0)  # round 1 after round 0
    assert z["round"]["pooled"] == [0, 1]
    assert z["round"]["medians_ms"]["fwd_bwd"] == pytest.approx([20.025, 22.025])
    assert rounds.pool(pooled) == pooled  # pooling twice changes nothing


def test_old_records_and_failed_rounds_are_kept_as_they_are():
    old = [fake_record("zigzag"), fake_record("ring")]
    assert rounds.pool(old) == old
    failed = _round(fake_record("zigzag", status="failed", error="boom"), 1)
    mixed = _run()[:3] + [failed]
    pooled = rounds.pool(mixed)
    assert [r["status"] for r in pooled] == ["ok", "ok", "failed"]
    assert len(pooled[0]["samples_ms"]["fwd"][0]) == 6  # one round of zigzag ran


def test_report_and_best_show_one_row_per_case_and_the_drift():
    text = summary(_run())
    assert text.count("zigzag") == 2 and "Drift between rounds" in text  # row + drift line
    assert "20.02 → 22.02 ms by round (drift 10.0 %)" in text
    (v,) = verdicts(_run())
    assert (v.winner, v.runner_up) == ("zigzag", "ring")
    assert "Drift between rounds" in best_table(_run())


def test_compare_pools_rounds_and_notes_their_drift():
    cmp = analysis.compare(_run(), _run(1.2), resamples=500)
    assert {(len(t.samples_a), len(t.samples_b)) for t in cmp.tests} == {(12, 12)}
    assert {t.verdict for t in cmp.tests} == {"slower"}
    assert any(n.startswith("B: zigzag") and "drift 10.0 %" in n for n in cmp.notes)


def test_the_record_keeps_its_round():
    from cpbench import results
    from cpbench.config import AttentionConfig
    from cpbench.strategies import get

    record = results.make_record(
        strategy="zigzag", options=get("zigzag").Options(), attention=AttentionConfig(),
        run=RunConfig(strategy=("zigzag",), rounds=2), kernel="sdpa-cpu", world_size=2,
        ranks_per_node=2, ranks_per_problem=2, env={}, round={"index": 1, "count": 2})
    assert json.loads(json.dumps(record))["round"] == {"index": 1, "count": 2}
    assert record["config"]["run"]["rounds"] == 2
