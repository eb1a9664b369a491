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
    read = digitize.bars(path, 100)
    assert [name for name, _ in read] == [n for n in list(digitize.COLOURS.values())[:5]] * 4
    _within_the_digitizers_bias(read, heights)


def test_the_digitizer_reads_the_kernel_figures_legend(tmp_path):
    """The kernel-level figures: six kernels a length, ticks of 200, bars down to ~100."""
    rng = random.Random()
    heights = [[rng.uniform(100, 1500) for _ in range(6)] for _ in range(4)]
    path = tmp_path / "chart.png"
    _chart(path, heights, 200, digitize.KERNEL_COLOURS)
    read = digitize.bars(path, 200, digitize.KERNEL_COLOURS)
    assert [name for name, _ in read] == list(digitize.KERNEL_COLOURS.values()) * 4
    _within_the_digitizers_bias(read, heights)
    assert digitize.resolution(path, 200) == pytest.approx(_pixel(heights), rel=0.02)


def test_kernel_curves_pair_one_legends_bars_with_the_lengths(monkeypatch, tmp_path):
    legends = list(digitize.KERNEL_COLOURS.values())
    n = len(digitize.KERNEL_LENGTHS)
    seen = []

    def fake(path, tick, colours):
        seen.append((path.relative_to(tmp_path).as_posix(), tick))
        return [(name, 100.0 * i + j) for i in range(n) for j, name in enumerate(legends)]

    monkeypatch.setattr(digitize, "bars", fake)
    curves = digitize.kernel_curves(tmp_path, "cudnn")
    assert set(curves) == {(m, p) for m in ("full", "causal") for p in ("fwd", "bwd")}
    assert curves["full", "fwd"] == [(s, 100.0 * i + 1) for i, s in
                                     enumerate(digitize.KERNEL_LENGTHS)]
    assert ("causal_mask/bwd/flops_report.png", 200) in seen
    monkeypatch.setattr(digitize, "bars", lambda path, tick, colours: [("cudnn", 1.0)])
    with pytest.raises(SystemExit, match="1 cudnn bars, not one a length"):
        digitize.kernel_curves(tmp_path, "cudnn")


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
