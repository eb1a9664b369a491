"""``cpbench simulate`` end to end: the tables, the comparison, the validation, the plot, bad
input (one line, exit 2) and the speed the issue asks for (1,000 configs in under 5 s)."""

from __future__ import annotations

import csv
import dataclasses
import io
import re
from pathlib import Path

import pytest

from cpbench import cli
from cpbench.report import render
from cpbench.sim import command, hardware, model, provenance, validate
from cpbench.topology import Topology

ROOT = Path(__file__).resolve().parents[2]
SEED_CSV = ROOT / "configs" / "validation" / "seed001_a800_4x8.csv"


def run(capsys, *args) -> tuple[int, str, str]:
    code = cli.main(["simulate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_default_prints_the_run_table_marked_simulated(capsys):
    code, out, _ = run(capsys, "--strategy", "zigzag,burst,local")
    assert code == 0
    assert out.startswith("Simulated, not measured: A800")
    assert "Benchmark Summary (simulated on A800" in out
    header = next(line for line in out.splitlines() if "TFLOPs/s" in line)
    for col in ("Strategy", "FWD (ms)", "FWD+BWD (ms)", "Mem (MB)"):
        assert col in header
    # what every row shares is said once, above the table (GPUs: a simulated cluster)
    assert "every row: Dtype bf16, QKV Format bshd, B 1, Seq Len 131072, World 32, " \
           "Nodes×GPUs 4×8" in out
    assert re.search(r"^ +zigzag +\|", out, re.M)
    assert "CP efficiency" in out  # local is the baseline
    assert "Where the time goes" in out


def test_several_seqlens_print_the_sweep_view_and_csv_parses(capsys):
    code, out, _ = run(capsys, "--strategy", "usp", "--seqlen", "128K,256K")
    assert code == 0 and "### usp (head-first" in out and "TFLOPs/s per GPU by Seq Len" in out
    code, out, _ = run(capsys, "--strategy", "zigzag", "--seqlen", "128K,256K",
                       "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and [r["seqlen"] for r in rows] == ["131072", "262144"]
    assert all(float(r["tflops"]) > 0 for r in rows)


def test_out_of_memory_prints_oom_in_every_figure_column(capsys):
    code, out, _ = run(capsys, "--strategy", "megatron-cp", "--seqlen", "8M")
    assert code == 0
    assert "Seq Len 8388608" in out
    row = next(line for line in out.splitlines() if re.match(r" +megatron-cp +\|", line))
    cells = [c.strip() for c in row.split("|")]
    # FWD, FWD+BWD, Memory, TFLOPs/s: nothing would have run; the need is said below
    assert cells.count("OOM") == 4, row
    assert "GiB per GPU" in out


@pytest.mark.parametrize("args,needle", [
    (["--hardware", "tpu"], "unknown preset 'tpu'"),
    (["--nodes", "0"], "--nodes and --gpus-per-node must be >= 1"),
    (["--strategy", "ulysses"], "needs heads (40) divisible by 32"),
    (["--dtype", "fp32"], "models bf16/fp16"),
    (["--compare-placements", "--window", "4"], "drop the strategy options"),
    (["--validate", "missing.csv"], "missing.csv"),
    (["--seqlen", "100", "--strategy", "zigzag"], "try --seqlen"),
])
def test_bad_input_is_one_line_exit_2(capsys, args, needle):
    code, out, err = run(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and needle in err, err


@pytest.mark.slow  # seconds of CPU (make test-fast leaves it out; CI runs it)
def test_compare_placements_fastest_first(capsys):
    """One table (report.placements), each strategy's placements fastest first, its winner
    named on its first row; --wide lists every placement."""
    code, out, _ = run(capsys, "--compare-placements", "--strategy", "usp,double-ring",
                       "--wide")
    assert code == 0 and out.count("### ") == 1
    lines = out.splitlines()
    header = [c.strip() for c in next(x for x in lines if "Winner" in x).split("|")]
    rows = [dict(zip(header, (c.strip() for c in line.split("|")))) for line in lines
            if re.match(r"^ *(usp|double-ring) +\|", line)]
    for name in ("usp", "double-ring"):
        mine = [r for r in rows if r["Strategy"] == name]
        times = [float(r["FWD+BWD (ms)"]) for r in mine]
        assert times == sorted(times) and len(mine) > 5
        assert "(model ±" in mine[0]["Winner"] and not any(r["Winner"] for r in mine[1:])
    placements = {r["Placement"] for r in rows}
    assert any("head-first ulysses_degree=8" in p for p in placements)
    assert any("ring-first ulysses_degree=8" in p for p in placements)
    assert {"window=2", "window=4", "window=8"} <= placements


def test_plot_is_written(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    target = tmp_path / "sim.png"
    code, _, err = run(capsys, "--strategy", "zigzag,burst", "--seqlen", "128K,256K,512K",
                       "--plot", str(target))
    assert code == 0 and "plot written" in err
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_validate_prints_every_published_row_with_its_error(capsys, monkeypatch):
    # a sentence a line: this reads what is said (tests/unit/test_output_fit.py: the widths)
    monkeypatch.setattr(render, "DEFAULT_WIDTH", 1000)
    code, out, _ = run(capsys, "--validate", str(SEED_CSV))
    assert code == 0
    rows = list(csv.DictReader(open(SEED_CSV)))
    errors = re.findall(r"([+-]\d+\.\d) %", out)
    assert len(errors) == len(rows) == 16  # the published rows
    # the preset's fit: section names 10 rows fitted, the other 5 scored rows held out
    assert re.search(r"^error, in-sample \(10 rows the preset's fit used\): \d+ of 10 within "
                     r"15 %, median \|error\| [\d.]+ %, worst", out, re.M)
    assert re.search(r"^error, held out \(5 rows nothing was fitted to\): \d+ of 5 ", out, re.M)
    assert re.search(r"^error, all \(15 scored rows\): ", out, re.M)
    ranking = re.search(r"^ranking \(pairs at one sequence length published > 5 % apart\): "
                        r"(\d+) of (\d+) ordered as published \(in-sample (\d+) of (\d+), held "
                        r"out (\d+) of (\d+), mixed (\d+) of (\d+)\); not:$", out, re.M)
    assert ranking, out
    good, total, *parts = map(int, ranking.groups())
    assert sum(parts[0::2]) == good and sum(parts[1::2]) == total
    listed = re.findall(r"^  \d+: published .*simulated .*\((in-sample|held out|mixed)\)$",
                        out, re.M)
    assert len(listed) == total - good
    samples = [line.split("|")[-1].strip() for line in out.splitlines()
               if re.search(r"\|\s*\d{6,7}\s*\|", line)]
    assert samples.count("in-sample") == 10 and samples.count("held out") == 5
    assert samples.count("not scored") == 1


def _results(published_and_predicted, implementation=None):
    """validate.Results of the seed's first row, re-published and re-predicted (rates)."""
    row = validate.load(SEED_CSV)[0]
    hw = hardware.load("a800-sxm")
    real = model.predict(row.strategy, row.options, row.attn, row.topo, hw)
    base = validate.Result(row, real).predicted
    out = []
    for i, (published, predicted) in enumerate(published_and_predicted):
        scale = base / predicted  # same FLOPs: the time scales inversely with the rate
        p = dataclasses.replace(real, fwd_s=real.fwd_s * scale, bwd_s=real.bwd_s * scale)
        r = dataclasses.replace(row, published=published,
                                implementation=(implementation or "impl") + str(i))
        out.append(validate.Result(r, p))
    return out


def test_rows_are_in_sample_only_where_the_fit_section_names_them():
    fit = provenance.Fit(("x",), "configs/validation/table.csv",
                         (("impl0", 131072), ("impl1", 131072)),
                         measured_on=(("impl2", 131072, "a profile"),))
    assert fit.sample("elsewhere/table.csv", "impl0", 131072) == "in-sample"  # by file name
    assert fit.sample("table.csv", "impl0", 262144) == "held out"  # another length
    assert fit.sample("table.csv", "impl2", 131072) == "in-sample"  # gave other figures
    assert fit.sample("table.csv", "impl3", 131072) == "held out"  # not fitted
    assert fit.sample("other.csv", "impl0", 131072) == "held out"  # another table
    every = dataclasses.replace(fit, rows=None)
    assert every.sample("table.csv", "impl3", 131072) == "in-sample"
    hw = hardware.load("a800-sxm")
    results = _results([(100.0, 100.0)] * 4)
    assert validate.samples(results, dataclasses.replace(hw, fit=fit), "table.csv") == [
        "in-sample", "in-sample", "in-sample", "held out"]
    # a preset fitted to nothing: every row is held out
    assert set(validate.samples(results, dataclasses.replace(hw, fit=None), "t.csv")) == \
        {"held out"}


def test_the_headline_counts_error_and_ranking_per_sample():
    """Published 100, 90, 80, 50; simulated 100 (0 %), 95 (+5.6 %), 70 (-12.5 %), 96 (+92 %):
    all six pairs are > 5 % apart published; the last row simulated at 96 comes out above
    90's 95 and 80's 70 (two pairs out of order), below 100's 100."""
    results = _results([(100.0, 100.0), (90.0, 95.0), (80.0, 70.0), (50.0, 96.0)])
    sample = ["in-sample", "in-sample", "held out", "held out"]
    lines = validate.summary(results, sample)
    assert lines[0] == ("error, in-sample (2 rows the preset's fit used): 2 of 2 within 15 %, "
                        "median |error| 2.8 %, worst 5.6 % (impl1, 131072)")
    assert lines[1] == ("error, held out (2 rows nothing was fitted to): 1 of 2 within 15 %, "
                        "median |error| 52.2 %, worst 92.0 % (impl3, 131072)")
    assert lines[2].startswith("error, all (4 scored rows): 3 of 4 within 15 %, median "
                               "|error| 9.0 %")
    # pairs: (0,1) in-sample in order; (2,3) held out: 80 > 50 published, 70 <= 96 simulated;
    # mixed: (0,2), (0,3), (1,2) in order, (1,3): 90 > 50 published, 95 <= 96 simulated
    assert lines[3] == ("ranking (pairs at one sequence length published > 5 % apart): 4 of 6 "
                        "ordered as published (in-sample 1 of 1, held out 0 of 1, mixed 3 of 4)"
                        "; not:")
    assert [line.split(": ", 1)[1] for line in lines[4:]] == [
        "published impl1 90.0 > impl3 50.0, simulated 95.0 <= 96.0 (mixed)",
        "published impl2 80.0 > impl3 50.0, simulated 70.0 <= 96.0 (held out)"]


@pytest.mark.slow  # seconds of CPU (make test-fast leaves it out; CI runs it)
def test_a_thousand_configs():
    """Every strategy and variant × 8 sequence lengths × batch 1/2 × bf16/fp16 on 1, 2, 4 and
    8 nodes of 8 GPUs, from a cold cache, each a finite prediction. (How fast: the benchmark
    benchmarks/sim_speed.py, not a timed test.)"""
    model.clear_cache()
    hw = hardware.load("a800-sxm")
    # no schedule beats its FLOPs spread over every GPU at the kernel's fastest published
    # rate (the curves' top; kernel.in_cp slows only steps with messages beside the kernel,
    # so the bound is the rate alone): a lower bound on each time
    top = {p: max(t for c in (hw.kernel(p, False, 128), hw.kernel(p, True, 128))
                  for _, t in c.points) for p in ("fwd", "bwd")}
    n = timed = 0
    for nodes in (1, 2, 4, 8):
        topo = Topology(world_size=8 * nodes, ranks_per_node=8)
        for dtype in ("bf16", "fp16"):
            for batch in (1, 2):
                records, _ = command.simulate(
                    ("all",), {}, dict(batch=batch, heads=40, head_dim=128, dtype=dtype,
                                       causal=True), [2 ** k for k in range(15, 23)], topo, hw)
                n += len(records)
                for r in records:
                    d, gpus = r["derived"], r["ranks_per_problem"]
                    if "fwd_bwd_ms" not in d:
                        assert r["status"] == "OOM", r["status"]
                        continue
                    timed += 1
                    fwd_s = d["flops_fwd"] / gpus / (top["fwd"] * 1e12)
                    bwd_s = d["flops_fwd"] * 2.5 / gpus / (top["bwd"] * 1e12)
                    assert d["fwd_ms"] / 1e3 >= fwd_s * (1 - 1e-9), r["config"]
                    assert (d["fwd_bwd_ms"] - d["fwd_ms"]) / 1e3 >= bwd_s * (1 - 1e-9)
    assert n >= 1000 and timed >= 900


def test_ranking_check_counts_only_pairs_published_clearly_apart():
    """Three rows at one seqlen: A 100, B 90, C 98 published; simulated A < B (an inversion of
    a pair 11 % apart: flagged) and A < C (2 % apart: noise, not a ranking)."""
    row = validate.load(SEED_CSV)[0]
    hw = hardware.load("a800-sxm")
    real = model.predict(row.strategy, row.options, row.attn, row.topo, hw)
    base = validate.Result(row, real).predicted

    def result(published, predicted):
        r = validate.Result(dataclasses.replace(row, published=published), real)
        scale = base / predicted  # same FLOPs: the time scales inversely with the rate
        p = dataclasses.replace(real, fwd_s=real.fwd_s * scale, bwd_s=real.bwd_s * scale)
        return validate.Result(r.row, p)

    a, b, c = result(100.0, 80.0), result(90.0, 85.0), result(98.0, 90.0)
    assert validate.rank_violations([a, b, c]) == [(a, b)]
    assert validate.rank_violations([a, result(90.0, 70.0), c]) == []


# Seed 001's errors on the A800 preset (relative, TFLOP/s simulated over published - 1), as
# measured with the USP rows simulated as BurstEngine's benchmark ran them (ring_impl=
# double-ring, burstengine_dkv_hop: docs/upstream/burstengine_usp.md) and the step overhead
# and links refitted to them (2026-11-26; the kernel curves, the in-CP rate and the memory
# passes are not fitted; the fit used 10 of these rows, the other 5 held out: the preset's
# fit: section names them). Before, with USP simulated as a zigzag ring: DoubleRing +3.7 /
# -11.1 / +9.9 %, BurstAttention +6.3 / -4.3 / -3.9 %, USP ring-first +120.2 / +85.4 /
# +85.9 %, USP head-first +0.1 / -3.7 / +12.6 %, zigzag +0.1 %, Ulysses -8.6 / -8.2 %: 12 of
# 15 within 15 %, every row but ring-first's within 12.7 %. The guard (11 of 15, every row
# but ring-first's within 16 %) held throughout. With NCCL contention priced only in steps
# whose messages overlap the kernel (sim.terms._contends, 2026-11-28; chosen on H100 rows,
# not these) Ulysses went from -7.5 / -7.6 % to +0.9 / +1.3 %, head-first 262K from -6.0
# to -5.1 %, while five rows lost about a point: ring-first +123.2 / +86.9 / +86.7 % to the
# figures below, head-first 131K +0.7 to +1.5 %, 524K +11.3 to +12.4 % (their Ulysses
# stage no longer pays the in-CP rate, and they were already predicted too fast).
SEED_001_ERRORS = {
    ("DoubleRing (LoongTrain)", 131072): 0.062, ("DoubleRing (LoongTrain)", 262144): -0.097,
    ("DoubleRing (LoongTrain)", 524288): 0.102,
    ("BurstAttention (double_ring opt_bwd)", 131072): 0.068,
    ("BurstAttention (double_ring opt_bwd)", 262144): -0.040,
    ("BurstAttention (double_ring opt_bwd)", 524288): -0.037,
    ("USP (Ring First Placement)", 131072): 1.241, ("USP (Ring First Placement)", 262144): 0.878,
    ("USP (Ring First Placement)", 524288): 0.877,
    ("USP (Head First Placement)", 131072): 0.015, ("USP (Head First Placement)", 262144): -0.051,
    ("USP (Head First Placement)", 524288): 0.124,
    ("ZigZag ring (ring-flash-attn)", 524288): 0.002,
    ('"Megatron CP RingAttn" = DeepSpeed-Ulysses SP 32', 262144): 0.009,
    ('"Megatron CP RingAttn" = DeepSpeed-Ulysses SP 32', 524288): 0.013,
}
RING_FIRST = "USP (Ring First Placement)"


def test_the_a800_preset_keeps_its_standing_on_seed_001():
    """The guard: at least 11 of the 15 scored rows within 15 %, every row but USP
    ring-first's three within 16 %, and no row worse than its error above (half a point of
    slack for rounding). Ring-first's three are far off (a penalty that grows with S², as
    compute does, which no link parameter explains: docs/simulator.md, Measured error);
    when the model learns it, lower their entries here."""
    results = validate.run(validate.load(SEED_CSV), hardware.load("a800-sxm"))
    scored = {(r.row.implementation, r.row.attn.seqlen): r.error
              for r in results if r.row.scored}
    assert scored.keys() == SEED_001_ERRORS.keys()
    worse = {k: (round(e, 3), SEED_001_ERRORS[k]) for k, e in scored.items()
             if abs(e) > abs(SEED_001_ERRORS[k]) + 0.005}
    assert not worse, f"rows worse than their recorded error (now, recorded): {worse}"
    assert sum(abs(e) <= 0.15 for e in scored.values()) >= 11
    assert all(abs(e) <= 0.16 for k, e in scored.items() if k[0] != RING_FIRST), scored


def test_burstengine_runs_the_preset_was_not_fitted_to_hold_across_nodes():
    """BurstEngine's other published runs on the same 4 x 8 A800 (kernel_perf.csv; not used by
    the fit: held out): BurstAttention 128K-1M and USP head-first 128K-1M (as its benchmark
    ran it) within 15 %. Its
    one-node BurstAttention rows at 4K and 8K tokens a GPU are over-predicted (+73.2 %,
    +13.7 % on 2026-11-28; +77 %, +23 % before the refit): the small-block gap of issue 27."""
    rows = validate.load(ROOT / "configs" / "validation" / "burstengine_runs_a800.csv")
    results = validate.run(rows, hardware.load("a800-sxm"))
    across = [r for r in results if r.row.scored and r.row.topo.world_size == 32]
    assert len(across) == 8
    assert all(abs(r.error) <= 0.15 for r in across), [
        (r.row.implementation, r.row.attn.seqlen, round(r.error, 3)) for r in across]


def test_burstengine_usp_rows_are_simulated_as_its_benchmark_ran_them():
    """Seed 001's USP tables and kernel_perf.csv's LoongTrain-USP rows came from BurstEngine's
    benchmark_doublering.py: its ring is InternEvo's double ring as one window, plus one dK/dV
    hop (docs/upstream/burstengine_usp.md). Scored as a zigzag ring they would compare another
    schedule with the published time."""
    burst_csv = ROOT / "configs" / "validation" / "burstengine_runs_a800.csv"
    for table, count in ((SEED_CSV, 6), (burst_csv, 4)):
        usp = [r for r in validate.load(table) if r.strategy == "usp" and r.scored]
        assert len(usp) == count, table
        for r in usp:
            assert (r.options.ring_impl, r.options.burstengine_dkv_hop, r.options.ring_window) \
                == ("double-ring", True, 0), (table, r.implementation, r.options)
            assert r.options.placement == ("ring-first" if "Ring First" in r.implementation
                                           else "head-first")


def test_a_validation_csv_without_a_column_says_which(tmp_path):
    bad = tmp_path / "rows.csv"
    bad.write_text("implementation,strategy,seqlen\nx,zigzag,4096\n")
    with pytest.raises(ValueError, match="missing column.*options"):
        validate.load(bad)
    assert validate.parse_options("burst", "double_ring=false;opt_bwd=true") == \
        validate.strategies.get("burst").Options(double_ring=False, opt_bwd=True)
    with pytest.raises(ValueError, match="does not take --window"):
        validate.parse_options("zigzag", "window=4")
    opts = validate.parse_options("usp", "ulysses_degree=1;placement=ring-first")
    assert opts.ulysses_degree == 1 and type(opts.ulysses_degree) is int
    rows = bad.with_name("rows2.csv")
    header = open(SEED_CSV).readline()
    line = open(SEED_CSV).readlines()[1]
    rows.write_text(header + line.replace(",true,", ",maybe,", 1))
    with pytest.raises(ValueError, match=r"rows2.csv:2: causal must be true or false"):
        validate.load(rows)
    rows.write_text(header + line.replace(",131072,", ",131000,", 1))
    with pytest.raises(ValueError, match=r"rows2.csv:2: .*try --seqlen"):
        validate.load(rows)


def test_machine_readable_rows_say_they_are_simulated(capsys):
    code, out, _ = run(capsys, "--strategy", "zigzag", "--format", "json")
    rows = __import__("json").loads(out)
    assert code == 0 and rows[0]["kernel"].startswith("simulated: A800")


def test_saved_predictions_re_render_marked_and_beside_measured_rows(capsys, tmp_path):
    """--out appends the predictions as records; `cpbench report` says they are simulated,
    prints no run detail for them, and beside a measured record marks which is which."""
    import json as _json

    out = tmp_path / "sim.jsonl"
    code, text, _ = run(capsys, "--strategy", "zigzag", "--seqlen", "128K,256K",
                        "--out", str(out))
    assert code == 0 and f"records: {out}" in text
    assert cli.main(["report", str(out), "--view", "run"]) == 0
    shown = capsys.readouterr().out
    assert "simulated on A800" in shown and "Benchmark Results for" not in shown
    assert cli.main(["report", str(out), "--view", "sweep"]) == 0
    assert capsys.readouterr().out.startswith("Every row is simulated on A800")
    # a measured zigzag row beside the predicted ones
    from test_results import fake_record
    measured = fake_record("zigzag", seqlen=131072)
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(out.read_text() + _json.dumps(measured) + "\n")
    assert cli.main(["report", str(mixed), "--view", "sweep"]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("2 of 3 rows are simulated")
    assert re.search(r"^every row: .*Source measured", shown, re.M)
    assert re.search(r"^every row: .*Source simulated", shown, re.M)
    # pivot rows kept apart, each named by its kernel (the preset, for a prediction)
    assert re.search(r"zigzag \[simulated: A800[^|]*\] \[4×8\] \(simulated\) +\|", shown)
    assert re.search(r"zigzag \[sdpa-cpu\] \[2×2\] +\|", shown)


def test_two_presets_in_one_file_stay_apart(capsys, tmp_path):
    out = tmp_path / "two.jsonl"
    for preset in ("a800-sxm", "h100-sxm"):
        assert run(capsys, "--strategy", "zigzag", "--seqlen", "128K,256K", "--nodes", "4",
                   "--hardware", preset, "--out", str(out))[0] == 0
    assert cli.main(["report", str(out), "--view", "sweep"]) == 0
    shown = capsys.readouterr().out
    pivot = shown[shown.index("TFLOPs/s per GPU by Seq Len"):].split("\n\n")[0]
    rows = [line for line in pivot.splitlines() if line.strip().startswith("zigzag")]
    assert len(rows) == 2 and "A800" in rows[0] and "H100" in rows[1]


def test_help_lists_every_shipped_preset_from_the_files(capsys, monkeypatch, tmp_path):
    """`simulate --help` lists the presets, one line each, read from the preset files: one
    added is listed without touching the CLI."""
    def help_text() -> str:
        with pytest.raises(SystemExit):
            cli.main(["simulate", "--help"])
        return capsys.readouterr().out

    listed = help_text().split("hardware presets (--hardware NAME")[1].splitlines()[1:]
    assert [line.split()[0] for line in listed] == hardware.names() == [
        p.stem for p in sorted(hardware.PRESET_DIR.glob("*.yaml"))]
    a800 = next(line for line in listed if line.split()[0] == "a800-sxm")
    assert "4 x 8 by default; A800 SXM4 80GB" in a800
    for path in hardware.PRESET_DIR.glob("*.yaml"):
        (tmp_path / path.name).write_text(path.read_text())
    (tmp_path / "x9-test.yaml").write_text(
        (hardware.PRESET_DIR / "h200-sxm.yaml").read_text().replace(
            "description: H200", "description: X9 test card, H200"))
    monkeypatch.setattr(hardware, "PRESET_DIR", tmp_path)
    added = help_text()
    assert re.search(r"^  x9-test +4 x 8 by default; X9 test card", added, re.M)
