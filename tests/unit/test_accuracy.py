"""Accuracy as a metric: ``--check`` keeps per tensor the max and the RMS error relative to
the float64 reference, and ``cpbench report FILE --accuracy`` tables them by strategy × ranks ×
dtype × mask (a sweep that checks prints the same table at its end)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_results import fake_record

from cpbench import cli
from cpbench.reference import TENSORS, Comparison, compare
from cpbench.report.accuracy import accuracy_table, rows


def test_rms_error_against_a_hand_computed_case():
    ref = torch.tensor([3.0, -4.0, 0.0, 0.0], dtype=torch.float64)
    got = ref + torch.tensor([0.1, 0.0, -0.1, 0.2], dtype=torch.float64)
    c = compare("out", got, ref, "fp32")
    rms_err = math.sqrt((0.01 + 0.01 + 0.04) / 4)
    assert c.rms_abs == pytest.approx(rms_err)
    assert c.rms_rel == pytest.approx(rms_err / math.sqrt(25 / 4))
    assert c.max_rel == pytest.approx(0.2 / 4)
    assert "rms rel" in c.line()


def test_a_row_that_sees_nothing_is_no_error():
    ref = torch.tensor([float("-inf"), 1.0, 2.0], dtype=torch.float64)
    c = compare("lse", ref.clone(), ref, "fp32")
    assert c.passed and c.rms_abs == 0.0 and c.rms_rel == 0.0


def test_an_old_check_without_rms_still_reads():
    old = {"tensor": "dq", "max_abs": 1e-3, "max_rel": 1e-4, "passed": True}
    assert "rms" not in Comparison(**old).line()


def _checked(name, ranks, errors, *, dtype="bf16", rms=True):
    """A record checked on ``ranks`` ranks: every tensor's max rel error ``errors``, its RMS a
    tenth of that."""
    r = fake_record(name, check=[
        {"tensor": t, "max_abs": e, "max_rel": e, "passed": True,
         **({"rms_abs": e / 10, "rms_rel": e / 10} if rms else {})}
        for t, e in zip(TENSORS, errors)])
    r["config"]["attention"]["dtype"] = dtype
    r["ranks_per_problem"] = ranks
    r["topology"] = {"world_size": ranks, "ranks_per_node": ranks, "num_nodes": 1}
    return r


def _file():
    return [_checked("megatron-cp", 4, [4e-3] * 5), _checked("zigzag", 2, [1e-3] * 5),
            _checked("megatron-cp", 2, [2e-3] * 5), _checked("zigzag", 4, [1e-3] * 5),
            fake_record("ring")]  # not checked: no row


def test_a_row_per_strategy_and_rank_count_ordered_by_ranks():
    found = rows(_file())
    assert [(r["Strategy"], r["Ranks"]) for r in found] == [
        ("megatron-cp", 2), ("megatron-cp", 4), ("zigzag", 2), ("zigzag", 4)]
    assert found[1]["dq max"] == 4e-3 and found[1]["dq rms"] == pytest.approx(4e-4)
    assert {r["Dtype"] for r in found} == {"bf16"} and found[0]["Mask"] == "causal"
    text = accuracy_table(_file())
    for t in TENSORS:
        assert f"{t} max" in text and f"{t} rms" in text
    assert "4.0e-03" in text and "4.0e-04" in text


def test_old_records_show_a_dash_and_the_last_check_counts():
    again = _checked("zigzag", 2, [5e-3] * 5, rms=False)  # re-run, before the RMS fields
    found = rows(_file() + [again])
    zig2 = next(r for r in found if (r["Strategy"], r["Ranks"]) == ("zigzag", 2))
    assert zig2["out max"] == 5e-3 and zig2["out rms"] is None
    assert " - " in accuracy_table(_file() + [again])


def test_report_accuracy_cli(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _file()))
    assert cli.main(["report", str(path), "--accuracy"]) == 0
    out = capsys.readouterr().out
    assert out.count("megatron-cp") == 2 and out.count("zigzag") == 2
    assert cli.main(["report", str(path), "--accuracy", "--format", "json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 4
    assert cli.main(["report", str(path), "--accuracy", "--best"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--accuracy" in err
    unchecked = tmp_path / "u.jsonl"
    unchecked.write_text(json.dumps(fake_record("ring")) + "\n")
    assert cli.main(["report", str(unchecked), "--accuracy"]) == 0
    assert "run with --check" in capsys.readouterr().out


def test_a_sweep_that_checks_prints_the_table(tmp_path):
    """The runner's last word: the accuracy table over the sweep's own records."""
    import io

    from cpbench.sweep import runner

    records = _file()
    out = tmp_path / "r.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    case = type("Case", (), {"keys": [runner.results.record_key(r) for r in records[:2]]})
    sweep = type("Sweep", (), {"cases": [case]})
    stream = io.StringIO()
    r = runner._Runner(sweep, out, False, None, None, runner._Console(stream))
    r._say_accuracy()
    text = stream.getvalue()
    assert "Error against the float64 reference" in text
    assert text.count("megatron-cp") == 1 and text.count("zigzag") == 1  # its cases only
