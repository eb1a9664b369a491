"""``--packings K``: the plan's cases (one per strategy and packing, each packing its own
sampled lengths), the record's ``packing`` section, the table over packings and
``report --best`` judged over the packings."""

from __future__ import annotations

import pytest
from test_results import fake_record

from cpbench import results
from cpbench.bench.plan import plan
from cpbench.config import RunConfig
from cpbench.errors import UsageError
from cpbench.report import summary
from cpbench.report.best import verdicts


def test_the_plan_runs_every_strategy_on_every_packing():
    run = RunConfig(strategy=("zigzag", "llama3"), nproc=4, out="none", packings=3, seed=5)
    # one llama3 layout (both are variants of it)
    p = plan(run, {"seqlen": 4096, "documents": "lognormal:512,0.8"}, {"layout": "zigzag"},
             launcher="self")
    assert [(c.strategy, c.packing) for c in p.cases] == [
        (n, i) for i in range(3) for n in ("zigzag", "llama3")]
    docs = [p.attn_of(c).documents for c in p.cases]
    assert docs[0] == docs[1] and len({docs[0], docs[2], docs[4]}) == 3
    assert p.packing_of(p.cases[2]) == {"index": 1, "count": 3, "seed": 6,
                                        "documents": "lognormal:512,0.8"}
    assert len(set(p.keys())) == 6  # each packing its own row
    with pytest.raises(UsageError, match="--packings 3 samples packings of a --documents"):
        plan(run, {"seqlen": 4096, "documents": (2048, 2048)}, {}, launcher="self")


def _packed(name, index, times, imbalance=1.0):
    r = fake_record(name, fwd=[[t / 3 for t in times]] * 4, fwd_bwd=[times] * 4)
    r["config"]["attention"]["documents"] = [1000 + index, 24 - index]
    r["packing"] = {"index": index, "count": 3, "seed": index, "documents": "trace:pile"}
    r["balance"] = {"area_per_rank": [1, 1, 1, 1], "area_per_step": None,
                    "imbalance": imbalance}
    r["derived"] = results.derive(r)
    return r


def test_best_over_packings_needs_a_win_in_every_packing():
    fast, slow = [20.0, 20.2, 20.1, 20.3, 20.2], [30.0, 30.4, 30.2, 30.1, 30.3]
    wins = [_packed("zigzag", i, fast) for i in range(3)] + \
        [_packed("ring", i, slow, imbalance=1.5 + i / 10) for i in range(3)]
    (v,) = verdicts(wins)
    assert (v.winner, v.runner_up, v.tie) == ("zigzag", "ring", False)
    assert "×3 packings" in v.problem and v.margin == pytest.approx(30.2 / 20.2 - 1)
    assert v.call == "wins"
    # ring faster in one packing: the median still names zigzag, but not as a win, and not
    # as a tie either (the intervals reach far outside 1 ± 2 %)
    mixed = wins[:5] + [_packed("ring", 2, [10.0, 10.1, 10.2, 10.1, 10.0])]
    (v,) = verdicts(mixed)
    assert v.winner == "zigzag" and v.call == "unclear" and not v.tie
    # the same times in every packing: a tie
    even = [_packed(n, i, fast) for i in range(3) for n in ("zigzag", "ring")]
    (v,) = verdicts(even)
    assert v.tie
    text = summary(wins)
    assert "Over the packings" in text and "1.50 - 1.70" in text and "trace:pile" in text


@pytest.mark.slow  # seconds of CPU (make test-fast leaves it out; CI runs it)
def test_simulate_predicts_every_packing():
    from cpbench.sim import command, hardware
    from cpbench.topology import Topology

    topo = Topology(world_size=8, ranks_per_node=4)
    attention = {"batch": 1, "heads": 8, "head_dim": 64, "dtype": "bf16", "causal": True,
                 "documents": "trace:prolong64k"}
    records, _ = command.simulate(("zigzag", "ring"), {}, attention, [16384], topo,
                                  hardware.load("h100-sxm"), seed=3, packings=2)
    assert [(r["config"]["strategy"], r["packing"]["index"]) for r in records] == [
        ("zigzag", 0), ("ring", 0), ("zigzag", 1), ("ring", 1)]
    assert records[0]["config"]["attention"]["documents"] != \
        records[2]["config"]["attention"]["documents"]
    assert all(r["packing"]["seed"] == 3 + r["packing"]["index"] for r in records)
    assert records[0]["padding"]["document_multiple"] == 16
    (v,) = verdicts(records)
    assert "×2 packings" in v.problem


def test_a_sweep_forwards_packings(tmp_path):
    from cpbench import sweep

    path = tmp_path / "s.yaml"
    path.write_text("base: {strategy: [ring, zigzag], nproc: 2, heads: 2, head_dim: 16, "
                    "seqlen: 1k, documents: 'trace:pile', packings: 2}\n"
                    "sweep: {window_size: ['-1,-1']}\n")
    cfg = sweep.load(path)
    (case,) = cfg.cases
    assert [c.packing for c in case.plan.cases] == [0, 0, 1, 1]
    assert "--packings" in " ".join(sweep.command(cfg, case, str(tmp_path / "o.jsonl")))


def test_the_table_over_packings_leaves_flagged_times_out_and_says_not_cp():
    from cpbench.report import packings

    fine = [_packed("zigzag", i, [20.0 + i, 20.1 + i, 20.2 + i, 20.1 + i, 20.0 + i])
            for i in range(2)]
    bad = _packed("zigzag", 2, [5.0, 5.1, 5.0, 5.2, 5.1])
    bad["samples_ms"]["fwd"] = [[50.0, 50.2, 50.1, 50.3, 50.2]] * 4  # FWD above FWD+BWD
    bad["derived"] = results.derive(bad)
    assert bad["derived"]["flags"]
    (row,) = packings.rows(fine + [bad])
    assert (row["Packings"], row["Min (ms)"], row["Max (ms)"]) == ("2", "20.10", "21.10")
    assert row["Flags"] == "1 flagged left out"
    shared = [_packed("ring", i, [30.0] * 5) for i in range(2)]
    for r in shared:
        r["env"].update(hostnames=["h"] * 4, cpus_usable=2)
        r["derived"] = results.derive(r)
    assert all(r["derived"]["not_measured"] for r in shared)
    rows = {r["Strategy"]: r for r in packings.rows(fine + shared)}
    assert rows["ring"]["Flags"].endswith("not CP") and rows["zigzag"]["Flags"] == "-"
