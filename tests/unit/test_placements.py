"""One view of placements (issue 40, item 4): ``report --compare placement`` and ``simulate
--compare-placements`` print one table, strategy × placement, each strategy's winner with its
margin over the next placement and the interval (measured, 3 samples a side) or the model's
stated error (simulated); the plot is one panel of the differences."""

from __future__ import annotations

import re

import pytest
from test_results import fake_record

from cpbench import results
from cpbench.cli import main
from cpbench.metrics import ratio_interval
from cpbench.report import placements
from cpbench.report.cells import sig
from cpbench.report.render import WIDE, fitting
from cpbench.sim import command, hardware
from cpbench.topology import Topology

TOPOS = {1: "4×1", 2: "2×2", 4: "1×4"}


def _rec(strategy, rpn, ms, options=None, iters=5, busy=None):
    """A measured case on 4 ranks at ``rpn`` ranks per node: FWD+BWD ``ms`` and up."""
    r = fake_record(strategy, options=options or {}, defaults={},
                    fwd=[[ms / 3 + i * 0.1 for i in range(iters)]] * 4,
                    fwd_bwd=[[ms + i * 0.3 for i in range(iters)]] * 4)
    r["topology"] = {"world_size": 4, "ranks_per_node": rpn, "num_nodes": 4 // rpn}
    if busy is not None:  # others kept `busy` of rank 0's 2 cores while it timed
        r["load"] = {"cpus": 2, "wall_s": 1.0, "foreign_cpu_s": busy, "ranks_cores": 2}
    r["derived"] = results.derive(r)
    return r


def _runs(iters=5, busy_at=None):
    """usp (two degrees) and zigzag at 1, 2 and 4 ranks per node; 1×4 the fastest."""
    out = []
    for rpn, f in ((1, 1.3), (2, 1.1), (4, 1.0)):
        busy = 1.5 if rpn == busy_at else None
        out += [_rec("usp", rpn, 30 * f, {"ulysses_degree": 4}, iters, busy),
                _rec("usp", rpn, 33 * f * (1.2 if rpn == 4 else 1), {"ulysses_degree": 1},
                     iters, busy),
                _rec("zigzag", rpn, 40 * f, None, iters, busy)]
    return out


def _table(text: str) -> tuple[list[str], list[dict]]:
    """The header and the rows (continuation lines of wrapped cells joined) of the one table."""
    lines = text.splitlines()
    rules = [i for i, x in enumerate(lines) if x and set(x) == {"="}]
    assert len(rules) == 2, text  # one table
    header = [c.strip() for c in lines[rules[0] + 1].split("|")]
    rows: list[dict] = []
    for line in lines[rules[0] + 3:rules[1]]:
        cells = [c.strip() for c in line.split("|")]
        if cells[0] or not rows:
            rows.append(dict(zip(header, cells)))
        else:
            rows[-1] = {k: (f"{v} {c}".strip()) for (k, v), c in zip(rows[-1].items(), cells)}
    return header, rows


def test_one_table_topologies_as_columns_and_a_winner_per_strategy():
    recs = _runs()
    with fitting(120):
        text = placements.placement_view(recs)
    assert text.count("### ") == 1
    header, rows = _table(text)
    assert header == ["Strategy", "Placement", "4×1", "2×2", "1×4", "Winner"]
    assert "every row: Seq Len 1K" in text
    winners = {r["Strategy"]: r for r in rows if r["Winner"]}
    assert set(winners) == {"usp", "zigzag"}  # one winner per strategy, on its fastest row
    assert [r["Strategy"] for r in rows] == ["usp", "usp", "zigzag"]
    assert winners["usp"]["Placement"] == "ulysses_degree=4" == rows[0]["Placement"]
    # usp: 1×4 (30.0 ms) over the next placement, 2×2 of the same row (33.0 ms)
    win = [30.0 + i * 0.3 for i in range(5)]
    nxt = [33.0 + i * 0.3 for i in range(5)]
    low, high = ratio_interval(nxt, win)
    margin = 100 * (nxt[2] / win[2] - 1)
    assert winners["usp"]["Winner"] == (f"1×4: +{margin:.1f} % [{100 * (low - 1):+.1f}, "
                                        f"{100 * (high - 1):+.1f}] over 2×2")
    assert winners["zigzag"]["Winner"].startswith("1×4: +9.9 % [")
    assert winners["zigzag"]["Winner"].endswith("] over 2×2")


def test_one_iteration_gives_a_margin_and_no_interval():
    with fitting(120):
        _, rows = _table(placements.placement_view(_runs(iters=1)))
    zig = next(r for r in rows if r["Strategy"] == "zigzag")
    assert zig["Winner"] == "1×4: +10.0 % (1 iteration: no interval) over 2×2"
    assert not re.search(r"\[[-+\d.]+, [-+\d.]+\]", zig["Winner"])


def test_a_placement_that_does_not_measure_cp_never_wins():
    """1×4, the fastest, ran on a busy host: its times show, marked; 2×2 wins."""
    with fitting(120):
        text = placements.placement_view(_runs(busy_at=4))
    _, rows = _table(text)
    zig = next(r for r in rows if r["Strategy"].startswith("zigzag"))
    assert zig["1×4"] == "40.60" and zig["Winner"].startswith("2×2: +")
    assert zig["Strategy"] == "zigzag [1]"
    assert "[1] others kept 1.5 of 2 cores busy: not CP" in text.splitlines()
    everywhere = [_rec("zigzag", rpn, 40.0, busy=1.5) for rpn in TOPOS]
    with fitting(120):
        _, rows = _table(placements.placement_view(everywhere))
    assert rows[0]["Winner"] == "none: flagged or not CP"


def test_the_terminal_shows_a_strategys_fastest_rows_and_counts_the_rest():
    recs = [_rec("usp", 2, 30.0 + u, {"ulysses_degree": u, "placement": p})
            for p in ("head-first", "ring-first") for u in (1, 2, 4, 8)]
    with fitting(120):
        text = placements.placement_view(recs)
    _, rows = _table(text)
    assert len(rows) == placements.TOP
    assert "usp at 1K: 3 more placements, 1.09-1.22x the winner's time (--wide lists them)" \
        in text
    with fitting(WIDE):
        _, rows = _table(placements.placement_view(recs))
    assert len(rows) == 8 and rows[0]["Placement"] == "head-first ulysses_degree=1"
    assert rows[0]["FWD+BWD (ms)"] == "31.60"  # one topology: the one time column


def test_simulated_placements_give_the_models_stated_error_and_no_interval():
    hw = hardware.load("a800-sxm")
    topo = Topology(world_size=16, ranks_per_node=8)
    cases = command.placement_cases(("usp", "double-ring"), topo)
    records, _ = command.simulate(("usp", "double-ring"), {},
                                  dict(batch=1, heads=40, head_dim=128, dtype="bf16",
                                       causal=True), [2 ** 17], topo, hw, cases=cases)
    with fitting(120):
        text = command.render_comparison(command.compare_placements(records), hw, topo,
                                         "table")
    header, rows = _table(text)
    assert header == ["Strategy", "Placement", "FWD+BWD (ms)", "Winner"]
    winners = [r["Winner"] for r in rows if r["Winner"]]
    assert len(winners) == 2 and all(" (model ±" in w for w in winners)
    assert not re.search(r"\[[-+\d.]+, [-+\d.]+\]", text)  # a model has no interval
    error = re.search(r"median \|error\| (\d+\.\d) %\s+held\s+out;\s+validated\s+on\s+(\d+)"
                      r"\s+published\s+rows", text)
    assert error and int(error[2]) >= 5 and error[1] == f"{100 * hw.stated_error:.1f}"
    assert all(f"±{error[1]} %" in w for w in winners)
    # a prediction to 3 significant figures, as the rest of simulate prints it
    times = [r["FWD+BWD (ms)"] for r in rows]
    assert all(t == sig(float(t)) for t in times) and min(map(float, times)) > 10, times
    assert len(text.splitlines()) <= 40  # was a table per length, every placement: 100+


def test_plot_is_one_panel_of_the_differences(tmp_path):
    pytest.importorskip("matplotlib")
    fig = placements.figure(_runs(busy_at=1), note="a note under it")
    assert len(fig.axes) == 1
    ax = fig.axes[0]
    assert "\n" not in ax.get_title() and ax.get_title()
    low, high = ax.get_xlim()  # relative to each strategy's fastest: 1.0 .. 1.3, not 0
    assert 0.9 < low < 1.0 and 1.3 < high < 1.5
    notes = [t.get_text() for t in fig.texts]
    assert notes and "a note under it" in notes[0] and "hollow: flagged" in notes[0]


def test_simulate_compare_placements_plots_the_same_one_panel(tmp_path, capsys, monkeypatch):
    """``simulate --compare-placements --plot`` draws report's one panel (was a panel per
    topology, its y axis from 0): a real PNG, one axes, a one-line title, the notes under."""
    pytest.importorskip("matplotlib")
    drawn = []
    figure = placements.figure

    def kept(*args, **kwargs):  # the figure the CLI saved, to read its parts
        drawn.append(figure(*args, **kwargs))
        return drawn[-1]

    monkeypatch.setattr(placements, "figure", kept)
    target = tmp_path / "placements.png"
    assert main(["simulate", "--compare-placements", "--strategy", "usp,zigzag", "--nodes",
                 "2", "--gpus-per-node", "2", "--plot", str(target)]) == 0
    assert "plot written" in capsys.readouterr().err
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = drawn
    assert len(fig.axes) == 1
    title = fig.axes[0].get_title()
    assert title and "\n" not in title and not fig._suptitle
    low, high = fig.axes[0].get_xlim()  # each strategy's fastest is 1: the axis is not from 0
    assert 0.9 < low < 1.0 < high
    notes = " ".join(t.get_text() for t in fig.texts)
    assert "simulated on A800" in notes and "the model's stated error" in notes


def test_cli_report_compare_placement_prints_one_table_with_a_winner(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    for r in _runs():
        results.append(path, r)
    assert main(["report", str(path), "--compare", "placement"]) == 0
    header, _ = _table(capsys.readouterr().out)
    assert header[-1] == "Winner" and {"4×1", "2×2", "1×4"} <= set(header)
