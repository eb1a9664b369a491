"""Notes grouped, empty columns gone, verdict columns kept (issue 40, item 5): every printer
narrows its tables through ``report.render``, so the rules are checked there and on the
summary ``cpbench run`` and ``cpbench report`` print."""

from test_results import fake_record

from cpbench import report, results
from cpbench.report import render
from cpbench.report.render import WIDE, Fit, fitting

FLAGS = Fit(notes=("Flags",))


def _rows(flags: list[str]) -> list[dict]:
    return [{"Strategy": f"s{i}", "FWD (ms)": f"{10 + i:.2f}", "Flags": f}
            for i, f in enumerate(flags)]


def _marks(lines: list[str]) -> dict[str, str]:
    """Row name → its note marks ("[1,2]"), from the table's body."""
    out = {}
    for line in lines:
        cell = line.split("|")[0].strip()
        if cell.startswith("s") and "[" in cell:
            name, _, marks = cell.partition(" ")
            out[name] = marks
    return out


def test_notes_of_one_kind_are_one_note_with_the_range_of_their_numbers():
    busy = [f"others kept {x} of 2 cores busy" for x in ("0.5", "0.3", "0.9", "0.3")]
    with fitting(120):
        lines = render.render(None, _rows(busy + ["4 ranks share 2 cores"]), "table", FLAGS)
    notes = [x for x in lines if x.startswith("[")]
    assert notes == ["[1] others kept 0.3-0.9 of 2 cores busy", "[2] 4 ranks share 2 cores"]
    assert _marks(lines) == {"s0": "[1]", "s1": "[1]", "s2": "[1]", "s3": "[1]", "s4": "[2]"}


def test_a_number_that_does_not_differ_stays_and_names_are_not_numbers():
    texts = ["unsettled: 7 warm-up steps, fell 900.5 to 380 ms on h100",
             "unsettled: 7 warm-up steps, fell 616 to 220.8 ms on h100",
             "unsettled: 7 warm-up steps, fell 616 to 220.8 ms on h200"]
    kinds = render.grouped(texts)
    assert kinds[texts[0]] == kinds[texts[1]] == \
        "unsettled: 7 warm-up steps, fell 616-900.5 to 220.8-380 ms on h100"
    assert kinds[texts[2]] == texts[2]  # another device: another kind


def test_columns_dash_in_every_row_are_hidden_but_not_under_wide():
    rows = [{"Strategy": "a", "FWD (ms)": "-", "CP": "True"},
            {"Strategy": "b", "FWD (ms)": "-", "CP": "False"}]
    with fitting(120):
        table = render.render(None, rows, "table")
        markdown = render.render(None, rows, "markdown")
    assert "FWD (ms)" not in "\n".join(table) and "CP" in table[1]
    assert markdown[0] == "| Strategy | CP |"
    with fitting(WIDE):
        assert "FWD (ms)" in render.render(None, rows, "table")[1]


def test_run_summary_groups_the_busy_notes_and_keeps_cp_and_imbalance():
    """The summary ``cpbench run`` prints, narrow: rows flagged by a busy host with different
    loads share one note; CP and Imbalance stay, the long label wraps instead."""
    long = {"placement": "head-first", "ulysses_degree": 2, "ring_impl": "double-ring",
            "ring_window": 2, "burstengine_dkv_hop": True}
    records = []
    for i, busy in enumerate(("1.3", "1.0", "0.4")):
        r = fake_record("usp", options={**long, "ulysses_degree": i + 1}, defaults={})
        r["balance"] = {"imbalance": 1.0 + i / 10}
        # rank 0's host while it timed: others used `busy` of its 2 cores
        r["load"] = {"cpus": 2, "wall_s": 1.0, "foreign_cpu_s": float(busy), "ranks_cores": 2}
        r["derived"] = results.derive(r)
        records.append(r)
    records.append(fake_record("local", ranks_per_problem=1))
    with fitting(100):
        text = report.summary(records)
    lines = text.splitlines()
    at = next(i for i, x in enumerate(lines) if x.lstrip().startswith("Strategy"))
    header = [c.strip() for c in lines[at].split("|")]
    assert max(len(x) for x in lines if not x.startswith("every row")) <= 100
    assert {"CP", "Imbal"} <= set(header), header
    notes = [x for x in lines if x.startswith("[")]
    assert notes == ["[1] others kept 0.4-1.3 of 2 cores busy: not CP"], notes


def test_a_range_among_the_notes_widens_the_range():
    # a record's own range ("1.2-1.3", its ranks apart) beside plain readings: one range
    texts = [f"others kept {x} of 2 cores busy: not CP" for x in ("1.2-1.3", "1.2-1.4", "0.9")]
    assert set(render.grouped(texts).values()) == {"others kept 0.9-1.4 of 2 cores busy: not CP"}
