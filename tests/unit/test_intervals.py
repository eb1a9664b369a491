"""No interval without samples: a report prints an interval only from at least
``metrics.MIN_SAMPLES`` samples a side; one iteration, or a model's one prediction, prints the
figure alone (issue 40, item 6)."""

import re

import pytest
from test_results import fake_record

from cpbench import metrics, report
from cpbench.report import sweep
from cpbench.report.dataframe import frame
from cpbench.report.render import WIDE, fitting
from cpbench.sim import command, hardware
from cpbench.topology import Topology

BRACKETS = re.compile(r"\[\d+(\.\d+)?, \d+(\.\d+)?\]")


@pytest.mark.parametrize("n", [1, 2])
def test_too_few_samples_give_no_interval(n):
    assert metrics.ratio_interval([10.0] * n, [5.0, 6.0, 7.0]) is None
    assert metrics.ratio_interval([5.0, 6.0, 7.0], [10.0] * n) is None
    assert metrics.ratio_interval(None, [1.0, 2.0, 3.0]) is None


def test_three_samples_a_side_give_the_bootstrap_interval():
    num, den = [10.0, 11.0, 12.0], [5.0, 5.5, 6.0]
    assert metrics.ratio_interval(num, den) == metrics.bootstrap_ratio(num, den)
    low, high = metrics.ratio_interval(num, den)
    assert low <= 11.0 / 5.5 <= high and low < high


def _pair(iters: int) -> list[dict]:
    """A CP row and its local baseline, ``iters`` iterations each."""
    return [fake_record("zigzag", fwd=[[10.0 + i for i in range(iters)]] * 4,
                        fwd_bwd=[[30.0 + i for i in range(iters)]] * 4),
            fake_record("local", ranks_per_problem=1, fwd=[[20.0 + i for i in range(iters)]] * 4,
                        fwd_bwd=[[62.0 + i for i in range(iters)]] * 4)]


def test_efficiency_from_one_iteration_prints_no_interval():
    df = frame(_pair(1))
    zig = df[df["strategy"] == "zigzag"].iloc[0]
    assert zig["cp_efficiency"] == pytest.approx(62.0 / (4 * 30.0))
    assert zig["cp_efficiency_low"] is None and zig["cp_efficiency_high"] is None
    with fitting(WIDE):
        text = report.summary(_pair(1))
    line = next(x for x in text.splitlines() if x.strip().startswith("zigzag") and "N=4" in x)
    assert line.rstrip().endswith("51.7 %") and not BRACKETS.search(line)
    assert "bootstrap interval" not in text  # the header promises none


def test_efficiency_from_three_iterations_prints_its_interval():
    with fitting(WIDE):
        text = report.summary(_pair(3))
    line = next(x for x in text.splitlines() if x.strip().startswith("zigzag") and "N=4" in x)
    assert BRACKETS.search(line) and "bootstrap interval" in text


def test_placement_ratio_from_one_iteration_has_no_interval():
    one = [dict(r, iters_fwd_bwd=[30.0], flags="", not_measured=None, status="ok")
           for r in ({"x": 0}, {"x": 1})]
    assert sweep.ratio_cell(one[0], dict(one[1], iters_fwd_bwd=[23.0]), "fwd_bwd") == "1.30x"
    three = [dict(r, iters_fwd_bwd=[30.0, 31.0, 32.0]) for r in one]
    assert BRACKETS.search(sweep.ratio_cell(three[0], three[1], "fwd_bwd"))


def test_a_model_prints_no_interval():
    """``cpbench simulate``: each phase's one "sample" is the prediction; its efficiency
    prints alone, on one line."""
    hw = hardware.load("a800-sxm")
    topo = Topology(world_size=8, ranks_per_node=8)
    records, _ = command.simulate(("local", "zigzag"), {},
                                  dict(batch=1, heads=8, head_dim=128, dtype="bf16",
                                       causal=True), [2 ** 16], topo, hw)
    text = command.render(records, hw, topo, "table")
    lines = text.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("CP efficiency"))
    assert not BRACKETS.search(text) and "bootstrap" not in lines[at]
    assert re.fullmatch(r"\s+zigzag\s+N=8\s+\d+\.\d %", lines[at + 1])
