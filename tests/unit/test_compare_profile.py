"""Profiled parts in a comparison: β, Δβ, the z-scores, seed 004's suspicion score, the
findings in words; the aggregate-only and one-sided cases said as such."""

import copy
import json

import numpy as np
import pytest
from scipy import stats as scipy_stats
from test_compare_cli import FIXTURE, _write, cpbench_compare

from cpbench import metrics
from cpbench.compare.profile import compare_parts, ranked

PARTS = ("attention/fwd", "communication/send_recv", "idle")


def _record(shares: dict[str, float], *, iterations: int = 20, seed: int = 0,
            aggregate_only: bool = False) -> dict:
    """The fixture's zigzag record with a profile: per iteration, each part's mean share
    (%) with ±1 ppt of noise."""
    record = copy.deepcopy(json.loads(FIXTURE.read_text().splitlines()[0]))
    rng = np.random.default_rng(seed)
    rows = [{p: float(v + rng.normal(0, 1)) for p, v in shares.items()}
            for _ in range(iterations)]
    wall = {p: float(np.mean([r[p] for r in rows])) for p in shares}
    record["profile"] = ({"wall_pct": wall} if aggregate_only
                         else {"per_iteration": rows, "wall_pct": wall})
    return record


A_SHARES = {"attention/fwd": 60.0, "communication/send_recv": 20.0, "idle": 20.0}
B_SHARES = {"attention/fwd": 55.0, "communication/send_recv": 30.0, "idle": 15.0}


def test_tested_parts_and_the_suspicion_score():
    a, b = _record(A_SHARES, seed=1), _record(B_SHARES, seed=2)
    changes, note = compare_parts("zigzag", a, b)
    assert note is None and [c.part for c in changes] == list(PARTS)
    comm = next(c for c in changes if c.part == "communication/send_recv")
    share_a = [it[comm.part] for it in a["profile"]["per_iteration"]]
    share_b = [it[comm.part] for it in b["profile"]["per_iteration"]]
    assert comm.delta_pp == pytest.approx(np.mean(share_b) - np.mean(share_a))
    welch = scipy_stats.ttest_ind(share_b, share_a, equal_var=False)
    assert comm.z_beta == pytest.approx(welch.statistic) and comm.p_beta < 1e-10
    step = metrics.step_time(a["samples_ms"]["fwd_bwd"])
    assert comm.mu_a == pytest.approx(np.mean(share_a) / 100 * step)
    log_mu = scipy_stats.ttest_ind(np.log(np.array(share_b) / 100 * step),
                                   np.log(np.array(share_a) / 100 * step), equal_var=False)
    assert comm.z_log_mu == pytest.approx(log_mu.statistic)
    assert comm.score == pytest.approx(abs(comm.delta_pp)
                                       * (abs(comm.z_beta) + abs(comm.z_log_mu)))
    assert ranked(changes)[0].part == "communication/send_recv"


def test_no_change_scores_zero():
    a = _record(A_SHARES, seed=1)
    changes, _ = compare_parts("zigzag", a, copy.deepcopy(a))
    assert all(c.delta_pp == 0 and c.score == 0 for c in changes)


def test_aggregate_only_is_delta_without_a_test():
    a = _record(A_SHARES, aggregate_only=True)
    b = _record(B_SHARES, seed=2, aggregate_only=True)
    changes, note = compare_parts("zigzag", a, b)
    assert "without a test" in note
    assert all(not c.tested and c.z_beta is None and c.score is None for c in changes)
    idle = next(c for c in changes if c.part == "idle")
    assert idle.delta_pp == pytest.approx(b["profile"]["wall_pct"]["idle"]
                                          - a["profile"]["wall_pct"]["idle"])


def test_one_side_profiled_is_said():
    plain = json.loads(FIXTURE.read_text().splitlines()[0])
    changes, note = compare_parts("zigzag", _record(A_SHARES), plain)
    assert changes == [] and "only A has a profile" in note
    assert compare_parts("zigzag", plain, plain) == ([], None)


def test_report_writes_the_top_findings_in_words(tmp_path, capsys):
    a = _write(tmp_path / "a.jsonl", [_record(A_SHARES, seed=1)])
    b = _write(tmp_path / "b.jsonl", [_record(B_SHARES, seed=2)])
    assert cpbench_compare(a, b, "--format", "markdown") == 0
    text = capsys.readouterr().out
    findings = text[text.index("### Key Findings:"):text.index("### Detailed comparison")]
    assert "**`communication/send_recv` in zigzag [S=1K]:**" in findings
    assert "**increased** from **" in findings and "statistically significant" in findings
    table = text[text.index("### Detailed comparison table"):text.index("## 4. Legend")]
    rows = [line for line in table.splitlines() if line.startswith("| zigzag")]
    assert len(rows) == 3 and "communication/send_recv" in rows[0]
    assert cpbench_compare(a, b) == 0
    assert "Where the time went" in capsys.readouterr().out
