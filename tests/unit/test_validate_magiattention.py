"""The MagiAttention H100 / B200 tables (configs/validation/magiattention_*.csv): how they were
read off the published figures (scripts/digitize_magiattention.py, checked on a chart drawn
here with random bars), that their figures agree with cpbench's FLOP count, and how
``--validate`` scores them (in-sample on H100, held out on B200, the kernel they ran,
rankings within one mask)."""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import random
from pathlib import Path

import pytest

from cpbench.metrics import attention_flops
from cpbench.sim import hardware, model, validate

ROOT = Path(__file__).resolve().parents[2]
TABLES = {"h100-sxm": ROOT / "configs" / "validation" / "magiattention_h100.csv",
          "b200": ROOT / "configs" / "validation" / "magiattention_b200.csv"}
_spec = importlib.util.spec_from_file_location(
    "digitize_magiattention", ROOT / "scripts" / "digitize_magiattention.py")
digitize = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(digitize)


def _chart(path: Path, heights: list[list[float]], tick: float,
           colours: dict = digitize.COLOURS) -> None:
    """Four groups of bars in the figures' colours, gridlines in their grey, each series'
    tops joined by a line with markers (crossing the other bars, as in the figures)."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(colours.items())[:len(heights[0])]
    fig, ax = plt.subplots(figsize=(20, 10), dpi=200)
    fig.subplots_adjust(left=0.06, right=0.99)
    width = 0.8 / len(names)
    for j, (rgb, _) in enumerate(names):
        xs = [g + (j - len(names) / 2 + 0.5) * width for g in range(4)]
        ys = [heights[g][j] for g in range(4)]
        colour = tuple(c / 255 for c in rgb)
        ax.bar(xs, ys, width=width, color=colour, zorder=2)
        ax.plot(xs, ys, color=tuple(0.7 * c for c in colour), marker="D", markersize=4,
                linewidth=1.5, zorder=3)
    top = max(max(h) for h in heights)
    ax.set_ylim(0, top * 1.1)
    ax.set_yticks([tick * k for k in range(int(top * 1.1 // tick) + 1)])
    ax.set_xlim(-0.6, 3.8)  # room right of the last group, where the gridlines are read
    ax.grid(axis="y", color=(234 / 255,) * 3, linewidth=2, zorder=0, antialiased=False)
    for spine in ax.spines.values():
        spine.set_color((204 / 255,) * 3)
        spine.set_linewidth(3)
    fig.savefig(path, facecolor="white")
    plt.close(fig)


def _pixel(heights: list[list[float]]) -> float:
    """TFLOP/s a pixel of ``_chart``'s y axis: its limit (1.1 x the tallest bar) over the
    axes' height (10 inches at 200 dpi, matplotlib's default subplot top 0.88, bottom 0.11)."""
    return max(max(h) for h in heights) * 1.1 / (10 * 200 * (0.88 - 0.11))


def _within_the_digitizers_bias(read: list[tuple[str, float]], heights: list[list[float]]):
    """Each bar read as ``digitize.bars`` states: never more than 2 pixels high, at most 8
    low (series lines crossing a top hide its first rows: 5.2 pixels low at worst over 3,840
    random bars, 1.3 % of a bar of 340; a bound of 1 % failed about one run in eight)."""
    pixel = _pixel(heights)
    want = [h for group in heights for h in group]
    assert all(-8 * pixel <= v - w <= 2 * pixel for (_, v), w in zip(read, want)), (
        [(round(v, 1), round(w, 1)) for (_, v), w in zip(read, want)], pixel)


def test_the_digitizer_reads_random_bars_within_its_stated_bias(tmp_path):
    rng = random.Random()
    heights = [[rng.uniform(300, 700) for _ in range(5)] for _ in range(4)]
    path = tmp_path / "chart.png"
    _chart(path, heights, 100)
    read = digitize.bars(path)
    assert [name for name, _ in read] == [n for n in list(digitize.COLOURS.values())[:5]] * 4
    _within_the_digitizers_bias(read, heights)


@pytest.mark.slow  # ~2 s of CPU a figure (test-fast leaves them out)
@pytest.mark.parametrize("tick", [25, 50, 100, 200, 250, 500])
def test_the_digitizer_reads_each_figures_tick_off_its_labels(tmp_path, tick):
    """The y axis is the gridlines at the values their labels print (MagiAttention's figures
    tick at 50 on H100's varlen causal backward, 100 on B200's: not one tick a GPU)."""
    rng = random.Random()
    heights = [[rng.uniform(2, 9) * tick for _ in range(5)] for _ in range(4)]
    path = tmp_path / "chart.png"
    _chart(path, heights, tick)
    import numpy as np
    from PIL import Image

    a = np.asarray(Image.open(path).convert("RGB")).astype(int)
    values = [v for _, v in digitize.gridlines(a)]
    assert values == [tick * k for k in range(len(values), 0, -1)]
    _within_the_digitizers_bias(digitize.bars(path), heights)


@pytest.mark.parametrize("gpu", ["b200", "h100"])
def test_the_digitizer_reads_the_kernel_figures_legend(tmp_path, gpu):
    """The kernel-level figures: B200 six kernels a length, ticks of 200, bars down to ~100;
    H100 seven, ticks of 100, bars down to ~15 (its varlen figures' sdpa)."""
    colours, _ = digitize.KERNEL_RUNS[gpu]
    tick = {"b200": 200, "h100": 100}[gpu]
    assert len(colours) == {"b200": 6, "h100": 7}[gpu]
    rng = random.Random()
    low, high = {"b200": (100, 1500), "h100": (15, 750)}[gpu]
    heights = [[rng.uniform(low, high) for _ in colours] for _ in range(4)]
    path = tmp_path / "chart.png"
    _chart(path, heights, tick, colours)
    read = digitize.bars(path, colours)
    assert [name for name, _ in read] == list(colours.values()) * 4
    _within_the_digitizers_bias(read, heights)
    assert digitize.resolution(path) == pytest.approx(_pixel(heights), rel=0.02)


@pytest.mark.parametrize("gpu, figures", [("b200", 4), ("h100", 8)])
def test_kernel_curves_pair_one_legends_bars_with_the_lengths(monkeypatch, tmp_path, gpu,
                                                              figures):
    """The folder's name picks the legend; H100 adds the varlen full and causal figures
    (B200's have another legend)."""
    colours, _ = digitize.KERNEL_RUNS[gpu]
    legends = list(colours.values())
    n = len(digitize.KERNEL_LENGTHS)
    root, seen = tmp_path / gpu, []

    def fake(path, palette):
        assert palette is colours
        seen.append(path.relative_to(root).as_posix())
        return [(name, 100.0 * i + j) for i in range(n) for j, name in enumerate(legends)]

    monkeypatch.setattr(digitize, "bars", fake)
    curves = digitize.kernel_curves(root, "cudnn")
    masks = ("full", "causal", "varlen_full", "varlen_causal")[:figures // 2]
    assert set(curves) == {(m, p) for m in masks for p in ("fwd", "bwd")}
    assert curves["full", "fwd"] == [(s, 100.0 * i + legends.index("cudnn")) for i, s in
                                     enumerate(digitize.KERNEL_LENGTHS)]
    assert len(seen) == figures and f"{masks[-1]}_mask/bwd/flops_report.png" in seen
    monkeypatch.setattr(digitize, "bars", lambda path, colours: [("cudnn", 1.0)])
    with pytest.raises(SystemExit, match="1 cudnn bars, not one a length"):
        digitize.kernel_curves(root, "cudnn")


@pytest.mark.parametrize("folder, legend", [("h100", "fa4"), ("b200", "fa3"),
                                            ("distributed", "cudnn")])
def test_kernel_asks_for_a_folder_with_that_legend(tmp_path, capsys, folder, legend):
    assert digitize.main(["--kernel", legend, str(tmp_path / folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err) <= 121 and f"no {legend} bars" in err, err


def test_loongtrain_windows_follow_its_benchmark():
    # ring of 1, 2, 4, 8 nodes: one window of the ring, then 2 windows
    assert [digitize._loongtrain_window(r) for r in (1, 2, 4, 8)] == [1, 2, 2, 4]


@pytest.mark.parametrize("preset", sorted(TABLES))
def test_the_tables_times_and_rates_agree_with_cpbench_flops(preset):
    with open(TABLES[preset], newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 40 and {r["kernel"] for r in rows} == {"fa3" if "h100" in preset
                                                                else "cudnn"}
    for r in rows:
        world = int(r["nodes"]) * int(r["gpus_per_node"])
        kw = dict(batch=1, seqlen_q=int(r["seqlen"]), seqlen_k=int(r["seqlen"]),
                  heads=int(r["heads"]), head_dim=int(r["head_dim"]),
                  causal=r["causal"] == "true")
        total = attention_flops(**kw, mode="fwd_bwd") / world / float(r["fwd_bwd_ms"]) / 1e9
        assert total == pytest.approx(float(r["tflops"]), rel=2e-3), r["implementation"]
        fwd = float(r["printed_tflops"].split(";")[0].split()[1])
        rate = attention_flops(**kw, mode="fwd") / world / float(r["fwd_ms"]) / 1e9
        assert rate == pytest.approx(fwd, rel=1e-3)


def test_validate_labels_them_and_names_the_kernel_they_ran():
    """H100's rows chose the NCCL contention rule (sim.terms; h100-sxm's fit:): in-sample.
    B200's did not: held out."""
    for preset, path in TABLES.items():
        hw = hardware.load(preset)
        results = validate.run(validate.load(str(path)), hw)
        sample = "in-sample" if preset == "h100-sxm" else "held out"
        assert set(validate.samples(results, hw, str(path))) == {sample}
        lines = validate.kernel_lines(results, hw)
        if preset == "h100-sxm":  # FA3, the preset's default
            assert lines == []
            fa2 = hardware.load(preset, kernel="fa2")
            assert validate.kernel_lines(results, fa2) == [
                "kernel: 40 scored rows were published with fa3, simulated with fa2 "
                "(--kernel fa3)"]
        else:  # cuDNN, the preset's default since it has B200 cuDNN curves
            assert lines == []
            fa4 = hardware.load(preset, kernel="fa4")
            assert validate.kernel_lines(results, fa4) == [
                "kernel: 40 scored rows were published with cudnn, simulated with fa4 "
                "(--kernel cudnn)"]


def test_rankings_compare_rows_of_one_mask_only():
    """A causal row and a full row at one length are different problems, not a ranking."""
    hw = hardware.load("h100-sxm")
    rows = validate.load(str(TABLES["h100-sxm"]))
    results = validate.run(rows, hw)
    pairs = validate.ranked_pairs(results)
    assert pairs and all(hi.row.attn.causal == lo.row.attn.causal for hi, lo in pairs)
    full = results[0]  # Ulysses, full mask, 8 GPUs
    causal = next(r for r in results if r.row.attn.causal and r.row.strategy == "megatron-cp"
                  and r.row.attn.seqlen == full.row.attn.seqlen)
    assert full.row.published > 1.2 * causal.row.published  # far apart, were it one problem
    assert validate.ranked_pairs([full, causal]) == []
    swapped = dataclasses.replace(causal.row, attn=dataclasses.replace(causal.row.attn,
                                                                       causal=False))
    same = validate.Result(swapped, model.predict(swapped.strategy, swapped.options,
                                                   swapped.attn, swapped.topo, hw))
    assert validate.ranked_pairs([full, same]) == [(full, same)]


VARLEN = ROOT / "configs" / "validation" / "magiattention_h100_varlen.csv"


def test_the_varlen_rows_pack_documents_as_magiattention_and_are_held_out():
    """The packed-document runs: 20 packings a row (their pack_num) of their own trace as
    their sampler draws it, no document over a quarter of the sequence; the H100 preset's
    rule was not chosen on them (held out, unlike the full / causal rows)."""
    rows = validate.load(str(VARLEN))
    assert len(rows) == 10 and {r.topo.world_size for r in rows} == {8}
    fit = hardware.load("h100-sxm").fit
    for r in rows:
        assert r.documents == digitize.VARLEN_DOCUMENTS and len(r.packed) == 20
        assert r.attn is r.packed[0] and r.published_fwd_ms is None
        assert all(sum(a.documents) == a.seqlen and max(a.documents) <= a.seqlen // 4
                   for a in r.packed)
        assert fit.sample(str(VARLEN), r.implementation, r.attn.seqlen) == "held out"
    with open(VARLEN, newline="") as f:
        for r in csv.DictReader(f):  # FWD+BWD joined from the two bars (printed to 0.1)
            fwd, bwd = (float(x.split()[1]) for x in r["printed_tflops"].split(";"))
            assert float(r["tflops"]) == pytest.approx(3.5 / (1 / fwd + 2.5 / bwd), abs=0.1)
    assert fit.sample(str(TABLES["h100-sxm"]), rows[0].implementation,
                      rows[0].attn.seqlen) == "in-sample"


def _prediction(fwd_s: float, bwd_s: float) -> model.Prediction:
    return model.Prediction(fwd_s=fwd_s, bwd_s=bwd_s, fwd_compute_s=0, bwd_compute_s=0,
                            memory_bytes=0, capacity_bytes=1, ranks_per_problem=8,
                            resolved={})


def test_a_packed_row_is_scored_as_magiattention_averages_its_packs():
    """Each phase's TFLOP/s by the packing's real mask area, averaged over the packings,
    then 3.5 / (1/fwd + 2.5/bwd), as the published figure is formed (not the time of
    the padded problem, not one packing)."""
    from cpbench.metrics import problem_flops

    row = validate.load(str(VARLEN))[0]
    two = dataclasses.replace(row, packed=row.packed[:2])
    preds = (_prediction(0.010, 0.030), _prediction(0.020, 0.040))
    rates = {}
    for phase, times in (("fwd", (0.010, 0.020)), ("bwd", (0.030, 0.040))):
        flops = [problem_flops(batch=1, seqlen=a.seqlen, heads=64, head_dim=128,
                               causal=a.causal, documents=a.documents, mode=phase)[0]
                 for a in two.packed]
        assert flops[0] != flops[1]  # two packings, two mask areas
        rates[phase] = sum(f / 8 / t / 1e12 for f, t in zip(flops, times)) / 2
    result = validate.Result(two, preds[0], preds)
    assert result.predicted == pytest.approx(3.5 / (1 / rates["fwd"] + 2.5 / rates["bwd"]))
    assert result.fwd_ms == pytest.approx(15.0)
    assert validate.packing_lines([result]) == [
        f"documents: 1 rows packed as --documents {digitize.VARLEN_DOCUMENTS}, 2 packings "
        f"(seeds 0-1); FLOPs by the mask's real area, each phase's TFLOP/s the mean over the "
        f"packings, FWD+BWD 3.5 / (1/fwd + 2.5/bwd)"]


def test_the_digitizer_reads_the_varlen_figures_into_rows_without_times(monkeypatch, tmp_path):
    """The varlen figures' folders and legend (the same series as the full / causal ones),
    rows up to --max-gpus, each naming its documents and packings."""
    seen = []

    def fake(path):
        seen.append(path.relative_to(tmp_path).as_posix())
        return [(name, 100.0 + 10 * g + j) for g in range(4)
                for j, name in enumerate(list(digitize.COLOURS.values()))]

    monkeypatch.setattr(digitize, "bars", fake)
    table = digitize.rows(tmp_path, "h100", packings=20, max_gpus=16)
    assert "h100/varlen_causal_mask/bwd/flops_report.png" in seen
    assert len(table) == 2 * 2 * 5 and {r["nodes"] for r in table} == {1, 2}
    first = table[0]
    assert first["implementation"] == "Ulysses, varlen full" and first["fwd_ms"] == ""
    assert (first["documents"], first["packings"]) == (digitize.VARLEN_DOCUMENTS, 20)
    assert float(first["tflops"]) == pytest.approx(100.0, abs=0.05)
