"""The physics guards on synthetic records: each flag, no flag on an honest record or an
old one, and a flagged row never winning ``report --best``."""

from __future__ import annotations

from test_results import fake_record

from cpbench import guards, report, results
from cpbench.report.best import best_table, verdicts


def _comm(sent_fwd, sent_both, declared=(100, 300), varies=False):
    per_rank = [[f, int(varies), b, 0, *declared] for f, b in zip(sent_fwd, sent_both)]
    return results.comm_section(per_rank, "every timed step (cpbench.comm)")


def _with(record: dict, **sections) -> dict:
    record = {**record, **sections}
    record["derived"] = results.derive(record)
    return record


def test_bytes_as_declared_raise_no_flag():
    assert guards.comm_flags(_comm([100, 100], [400, 400])) == []


def test_bytes_other_than_declared_are_flagged_with_both_figures():
    flags = guards.comm_flags(_comm([100, 0], [400, 400]))
    assert flags == ["FWD rank 1: sent 0 B, schedule says 100 B"]
    flags = guards.comm_flags(_comm([100, 100], [400, 2_400_000]))
    assert flags == ["FWD+BWD rank 1: sent 2.4 MB, schedule says 400 B"]


def test_timed_steps_that_sent_differently_are_flagged():
    flags = guards.comm_flags(_comm([100, 100], [400, 400], varies=True))
    assert flags == ["FWD: bytes sent differ between timed steps"]


def test_no_schedule_no_comparison():
    comm = _comm([5, 5], [7, 7], declared=(-1, -1))
    assert comm["schedule_bytes"] is None and guards.comm_flags(comm) == []


def test_old_records_have_no_flags():
    assert fake_record()["derived"]["flags"] == []
    assert guards.flags({"config": {}}) == []


def test_a_flagged_row_never_wins_and_shows_in_the_table():
    fast = _with(fake_record("zigzag", fwd_bwd=[[1.0, 1.0, 1.0]] * 4),
                 comm=_comm([0] * 4, [0] * 4))
    slow = fake_record("ring")
    assert [v.winner for v in verdicts([fast, slow])] == ["ring"]
    text = report.summary([fast, slow])
    assert "Flags" in text and "sent 0 B, schedule says 100 B" in text
    assert "not ranked: zigzag" in best_table([fast, slow])
