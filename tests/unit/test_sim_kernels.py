"""``simulate --kernel``: each GPU's kernels against the figures they cite, the default the
field runs on that GPU, and every case without a figure of its own said, not scaled.

The published values are transcribed here a second time, independently of the presets (the
FlashAttention-3 paper's H100 bar charts; cuDNN and FlashAttention-4 on B200 as read off
MagiAttention's kernel-level figures, on GB200 from NVIDIA's CSV).
"""

from __future__ import annotations

import pytest
import yaml

from cpbench import strategies
from cpbench.cli import main as cli_main
from cpbench.config import AttentionConfig
from cpbench.errors import UsageError
from cpbench.sim import hardware, model, provenance
from cpbench.topology import Topology

L = (512, 1024, 2048, 4096, 8192, 16384)
# FlashAttention-3 paper (arXiv 2407.08608), H100 80GB SXM5, the FA3 and cuDNN bars
H100 = {
    "fa3": {(128, "fwd"): (467, 565, 625, 638, 646, 648),
            (128, "fwd_causal"): (292, 423, 521, 579, 602, 616),
            (128, "bwd"): (316, 424, 501, 542, 559, 561),
            (64, "fwd"): (333, 392, 460, 476, 496, 497),
            (64, "fwd_causal"): (197, 265, 371, 420, 460, 473),
            (64, "bwd"): (272, 363, 422, 453, 472, 474),
            (256, "fwd"): (482, 639, 707, 736, 746, 756),
            (256, "fwd_causal"): (286, 427, 537, 612, 628, 642)},
    "cudnn": {(128, "fwd"): (497, 574, 617, 609, 600, 595),
              (128, "fwd_causal"): (315, 410, 484, 518, 529, 539),
              (128, "bwd"): (305, 408, 465, 499, 518, 516),
              (64, "fwd"): (335, 373, 395, 408, 412, 413),
              (64, "fwd_causal"): (225, 288, 334, 363, 379, 388),
              (64, "bwd"): (266, 348, 395, 417, 432, 433),
              (256, "fwd"): (470, 546, 580, 581, 580, 581),
              (256, "fwd_causal"): (308, 391, 450, 483, 497, 509)},
}
B200_FWD = (247.1, 922.3, 1279.0, 1321.0, 1319.7, 1328.8)
B200_BWD = (364.1, 623.4, 807.1, 862.0, 870.7, 863.0)
B200_FWD_CAUSAL = (128.4, 531.2, 918.8, 1147.0, 1239.6, 1288.1)
B200_BWD_CAUSAL = (178.8, 334.7, 504.2, 643.2, 709.3, 737.8)
# cuDNN on B200: MagiAttention's kernel-level figures (cp_benchmark.md, "Kernel Level"),
# digitized, batch 1, GQA 64:8, head dim 128, at L = 1k..32k
B200_CUDNN = {"fwd": B200_FWD, "bwd": B200_BWD, "fwd_causal": B200_FWD_CAUSAL,
              "bwd_causal": B200_BWD_CAUSAL}
# cuDNN 9.27 on GB200: NVIDIA/cudnn-frontend's llama3.1_20260813_111214.csv, batch 2, 64:8,
# head dim 128, at L = 2k..32k
GB200_CUDNN = {"fwd": (1407, 1559, 1701, 1690, 1567), "bwd": (1114, 1325, 1434, 1305, 1304),
               "fwd_causal": (1061, 1334, 1552, 1608, 1556),
               "bwd_causal": (880, 1131, 1297, 1271, 1241)}
# FA4 on B200: the fa4 bars of the same MagiAttention figures (digitized), L = 1k..32k
B200_FA4 = {"fwd": (204.2, 834.8, 1379.5, 1330.6, 1295.9, 1294.2),
            "bwd": (148.1, 438.7, 843.9, 1044.3, 1109.2, 1129.3),
            "fwd_causal": (99.9, 396.1, 1331.8, 1373.5, 1364.1, 1388.8),
            "bwd_causal": (76.1, 247.3, 611.7, 937.5, 1032.0, 1090.7)}
# FA4 on GB200: the flash_attention_4 rows of the same NVIDIA CSV, L = 2k..32k
GB200_FA4 = {"fwd": (1112, 1194, 1255, 1217, 1227), "bwd": (1161, 1399, 1553, 1423, 1397),
             "fwd_causal": (1086, 1388, 1594, 1734, 1580),
             "bwd_causal": (844, 1157, 1403, 1405, 1334)}
B200_L, GB200_L = (1024, 2048, 4096, 8192, 16384, 32768), (2048, 4096, 8192, 16384, 32768)
BLACKWELL = {("b200", "cudnn"): (B200_L, B200_CUDNN, "cudnn-b200-magi"),
             ("gb200-nvl72", "cudnn"): (GB200_L, GB200_CUDNN, "cudnn-gb200"),
             ("b200", "fa4"): (B200_L, B200_FA4, "fa4-b200-magi"),
             ("gb200-nvl72", "fa4"): (GB200_L, GB200_FA4, "fa4-gb200")}
# FA3's causal and full backward at head dim 128, L = 1k..16k, on one H100: MagiAttention's
# kernel-level fa3 bars (scripts/digitize_magiattention.py --kernel fa3)
MAGI_FA3_CAUSAL_BWD, MAGI_FA3_BWD = (208, 353, 462, 517, 562), (335, 453, 517, 556, 587)
DEFAULTS = {"a100-sxm": "fa2", "a800-sxm": "fa2", "h100-sxm": "fa3", "h800-sxm": "fa3",
            "h200-sxm": "fa3", "b200": "cudnn", "gb200-nvl72": "cudnn"}


def raw(name: str) -> dict:
    with open(hardware.PRESET_DIR / f"{name}.yaml") as f:
        return yaml.safe_load(f)


def test_each_preset_defaults_to_the_kernel_the_field_runs_on_it():
    assert set(DEFAULTS) == set(hardware.names())
    for name, kernel in DEFAULTS.items():
        hw = hardware.load(name)
        assert hw.kernel_name == kernel and hw.kernel_choices[0][0] == kernel, name


@pytest.mark.parametrize("name", ["h100-sxm", "h800-sxm", "h200-sxm"])
@pytest.mark.parametrize("kernel", ["fa3", "cudnn"])
def test_hopper_points_are_the_fa3_papers_bars_and_priced_on(name, kernel):
    section = raw(name)["kernels"][kernel]
    hw = hardware.load(name, kernel)
    text = {k: " ".join(v.split()) for k, v in section["sources"].items()}
    for (dim, phase), values in H100[kernel].items():
        points = section[f"head_dim_{dim}"][phase][:len(L)]
        assert [(s, v) for s, v, _ in points] == list(zip(L, values)), (dim, phase)
        src = points[0][2]
        assert ", ".join(map(str, values)) in text[src], (dim, phase)
        base, causal = phase.split("_")[0], phase.endswith("causal")
        for side, value in zip(L, values):
            assert hw.kernel(base, causal, dim).tflops(side) == value
    assert "arXiv 2407.08608" in text[f"{kernel}-h100-fwd"]
    derived = {k: section[k]["bwd_causal"] for k in section
               if k.startswith("head_dim") and "bwd_causal" in section[k]}
    if kernel == "cudnn":  # no causal backward figure, and no ratio read for cuDNN
        assert derived == {}
        return
    # FA3's causal backward at 128 alone: the paper's full bars x MagiAttention's causal / full
    assert list(derived) == ["head_dim_128"] and "digitized" in text["fa3-causal-bwd"]
    for (side, value, src), c, f in zip(derived["head_dim_128"], MAGI_FA3_CAUSAL_BWD,
                                        MAGI_FA3_BWD):
        full = dict(zip(L, H100["fa3"][(128, "bwd")]))[side]
        assert src == "fa3-causal-bwd" and value == pytest.approx(full * c / f, abs=0.05)
    assert ", ".join(map(str, MAGI_FA3_CAUSAL_BWD)) in text["fa3-causal-bwd"]
    assert ", ".join(map(str, MAGI_FA3_BWD)) in text["fa3-causal-bwd"]


@pytest.mark.parametrize("name,kernel", sorted(BLACKWELL))
def test_blackwell_points_are_the_published_figures_and_priced_on(name, kernel):
    """Every phase at head dim 128 from one run of one kernel, each point citing it; beyond
    the last length a full block holds flat and a causal block follows the stated causal-long
    rule."""
    lengths, values, src = BLACKWELL[name, kernel]
    section = raw(name)["kernels"][kernel]
    hw = hardware.load(name, kernel)
    text = " ".join(section["sources"][src].split())
    for phase, want in values.items():
        points = section["head_dim_128"][phase]
        assert [(s, v, c) for s, v, c in points[:len(lengths)]] == \
            [(s, v, src) for s, v in zip(lengths, want)], phase
        assert ", ".join(map(str, want)) in text, phase
        base, causal = phase.split("_")[0], phase.endswith("causal")
        for side, value in zip(lengths, want):
            assert hw.kernel(base, causal, 128).tflops(side) == value
        full, last = values[base][-1], want[-1]
        for side, value, rule in points[len(lengths):]:
            assert causal and rule == "causal-long"
            extra = 1 / last - 1 / full
            assert value == pytest.approx(1 / (1 / full + extra * lengths[-1] / side), abs=0.051)
    assert hw.kernel_notes(128, True) == [] and hw.kernel_notes(128, False) == []
    assert "digitized" in text.lower() if name == "b200" else "not read off a figure" in text


@pytest.mark.parametrize("name", ["b200", "gb200-nvl72"])
def test_every_fa4_point_cites_its_source_and_fa4_prices_apart_from_cudnn(name):
    """No FA4 point without a named source; a causal forward faster than the full one at the
    last length holds flat beyond it (the causal-long rule has no diagonal cost to shrink);
    and a CP step priced with fa4 is not priced with cuDNN's curves."""
    section = raw(name)["kernels"]["fa4"]
    curves = {phase: pts for key, dims in section.items() if key.startswith("head_dim")
              for phase, pts in dims.items()}
    assert set(curves) == {"fwd", "bwd", "fwd_causal", "bwd_causal"}
    for phase, points in curves.items():
        assert len(points) >= 5 and all(len(p) == 3 and p[2] in section["sources"]
                                        for p in points), phase
    last = curves["fwd_causal"][-1]
    assert last[1] > curves["fwd"][-1][1] and last[2] != "causal-long"
    fa4, cudnn = hardware.load(name, "fa4"), hardware.load(name, "cudnn")
    assert fa4.kernel("fwd", True, 128).tflops(1 << 20) == last[1]
    attn = AttentionConfig(seqlen=1 << 20, heads=64, kv_heads=8, head_dim=128, dtype="bf16")
    topo = Topology(world_size=64, ranks_per_node=8)
    for strategy in ("ulysses", "zigzag"):
        options = strategies.get(strategy).Options()
        fa4_p, cudnn_p = (model.predict(strategy, options, attn, topo, hw) for hw in (fa4, cudnn))
        # FA4's backward is the faster on both GPUs' figures, by 5 % or more at these blocks
        assert fa4_p.bwd_compute_s < 0.95 * cudnn_p.bwd_compute_s, strategy
        assert fa4_p.bwd_s < cudnn_p.bwd_s, strategy


def test_a_missing_figure_is_said_not_scaled():
    """FA3 has no causal backward figure at head dim 64 (128's is derived: fa3-causal-bwd)
    and no head dim 256 backward: the notes say what prices them; a head dim with figures
    and a full block need no note."""
    hw = hardware.load("h100-sxm")
    assert hw.kernel_notes(128, False) == [] and hw.kernel_notes(128, True) == []
    assert hw.kernel_notes(64, True) == [
        "fa3: no causal backward figure at head dim 64; causal blocks priced on the "
        "full-block curve (FLOPs halved)"]
    # head dim 128's causal backward: the paper's full curve times MagiAttention's ratio
    assert hw.kernel("bwd", True, 128).tflops(8192) == pytest.approx(559 * 517 / 556, abs=0.1)
    notes = hw.kernel_notes(256, False)
    assert notes == ["fa3: no head dim 256 backward figure on this GPU; priced on head dim "
                     "128's (published: 128, 64)"]
    # head dim 256's forward is its own figure; its backward is 128's, said above
    assert hw.kernel("fwd", False, 256).tflops(16384) == 756
    assert hw.kernel("bwd", False, 256).tflops(16384) == 561


def test_a_kernel_the_preset_has_no_figures_for_is_refused():
    with pytest.raises(UsageError, match="b200 has no fa3 curves"):
        hardware.load("b200", "fa3")
    assert cli_main(["simulate", "--hardware", "a800-sxm", "--kernel", "fa3"]) == 2


def test_list_hardware_shows_each_kernel_with_its_sources(capsys):
    assert cli_main(["simulate", "--list-hardware"]) == 0
    out = capsys.readouterr().out
    assert all(len(x) <= 120 for x in out.splitlines())
    flat = " ".join(out.split())
    for name in hardware.names():
        for kernel, _, sources in hardware.load(name).kernel_choices:
            assert f"kernel {kernel}" in flat and all(s in flat for s in sources), name
    assert "kernel fa3 (default)" in flat and "kernel cudnn (default)" in flat
    assert "kernel fa4 (default)" not in flat


def test_every_simulated_table_and_record_states_its_evidence(capsys, tmp_path):
    out = tmp_path / "sim.jsonl"
    assert cli_main(["simulate", "--hardware", "h100-sxm", "--nodes", "1", "--seqlen", "64K",
                     "--heads", "64", "--kv-heads", "8", "--strategy", "zigzag,ulysses",
                     "--out", str(out)]) == 0
    text = capsys.readouterr().out
    h100 = hardware.load("h100-sxm").evidence
    assert h100.startswith("validated on 80 published rows of this preset with fa3 (in-sample "
                           "3.2 %, held out 18.3 %")
    assert f"kernel fa3): {h100}." in " ".join(text.split())
    import json

    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert records and all(r["simulation"]["evidence"] == h100 for r in records)
    assert all(r["simulation"]["kernel"] == "fa3" for r in records)
    assert cli_main(["simulate", "--hardware", "h100-sxm", "--nodes", "1", "--seqlen", "64K",
                     "--strategy", "zigzag", "--compare-placements"]) == 0
    assert "Evidence (" in capsys.readouterr().out


def test_acceptance_commands_print_csv_that_pandas_reads(capsys):
    import io

    import pandas as pd

    common = ["--heads", "64", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bf16",
              "--strategy", "ulysses,zigzag,llama3,usp", "--format", "csv"]
    for flags in (["--hardware", "h100-sxm", "--kernel", "fa3", "--nodes", "1",
                   "--gpus-per-node", "8", "--seqlen", "64K"],
                  *(["--hardware", "b200", "--kernel", kernel, "--nodes", "8",
                     "--gpus-per-node", "8", "--seqlen", "1M"] for kernel in ("cudnn", "fa4"))):
        assert cli_main(["simulate", *flags, *common]) == 0
        df = pd.read_csv(io.StringIO(capsys.readouterr().out))
        assert len(df) >= 4 and set(df["strategy"]) == {"ulysses", "zigzag", "llama3", "usp"}
        stated = hardware.load(flags[1], kernel=flags[3]).evidence
        assert (df["evidence"] == stated).all()
        assert stated.startswith({"fa4": "no published CP rows on this hardware with fa4",
                                  "fa3": "validated on 80", "cudnn": "validated on 50"}[flags[3]])
        for value in df["fwd_bwd_ms"]:  # predictions to 3 significant figures
            assert float(f"{value:.3g}") == value


@pytest.mark.parametrize("preset,kernel", [
    ("a800-sxm", "fa2"),
    # minutes of CPU: their packed-document rows simulate 350 (H100, 8-64 GPUs) and 200
    # (B200, 8 GPUs) packings (make test-evidence, a CI phase of its own)
    # (~4 min idle for H100: over the suite's 300-s limit on a busy host)
    pytest.param("h100-sxm", "fa3", marks=[pytest.mark.evidence, pytest.mark.timeout(900)]),
    pytest.param("b200", "cudnn", marks=[pytest.mark.evidence, pytest.mark.timeout(900)])])
def test_the_evidence_is_what_validate_scores_now(preset, kernel):
    """The footer's figures are the validation's own: recomputed from the files they name,
    so a change to the model that moves them fails here until the preset says it."""
    from pathlib import Path

    from cpbench.sim import validate

    stated = raw(preset)["evidence"][kernel]
    root = Path(__file__).resolve().parents[2]
    got = validate.evidence(hardware.load(preset, kernel=kernel),
                            [str(root / f) for f in stated["files"]])
    assert got == {k: v for k, v in stated.items() if k != "files"}
    assert hardware.load("a800-sxm").evidence == (
        "validated on 26 published rows of this preset with fa2 (in-sample 8.2 %, held out "
        "2.4 % median error)")
    assert hardware.load("a100-sxm").evidence == provenance.NO_EVIDENCE


VALIDATION = "configs/validation/seed001_a800_4x8.csv"


def _root_file(name: str) -> str:
    from pathlib import Path

    return str(Path(__file__).resolve().parents[2] / name)


def test_validate_csv_is_one_labelled_row_per_published_row(capsys):
    import csv as csv_module
    import io
    import json

    import pandas as pd

    path = _root_file(VALIDATION)
    with open(path, newline="") as f:
        published = list(csv_module.DictReader(f))
    assert cli_main(["simulate", "--validate", path, "--format", "csv"]) == 0
    df = pd.read_csv(io.StringIO(capsys.readouterr().out))
    assert list(df["implementation"]) == [r["implementation"] for r in published]
    scored = [r["score"] != "no" for r in published]
    assert list(df["scored"]) == scored
    assert set(df["sample"][df["scored"]]) == {"in-sample", "held out"}
    assert set(df["sample"][~df["scored"]]) == {"not scored"}
    assert df["note"][~df["scored"]].notna().all()  # its reason in its own row
    assert cli_main(["simulate", "--validate", path, "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["rows"]) == len(published) and data["kernel"] == "fa2"
    assert any(line.startswith("error, held out") for line in data["summary"])


def test_validate_without_hardware_takes_the_preset_whose_evidence_names_the_table(capsys):
    """H100 rows are simulated on h100-sxm with its FA3 (not A800's FA2); --hardware and
    --kernel still choose; a table no preset names stays on the a800-sxm default."""
    import io

    import pandas as pd

    def preset_and_kernel(*argv):
        assert cli_main(["simulate", "--validate", *argv, "--format", "csv"]) == 0
        df = pd.read_csv(io.StringIO(capsys.readouterr().out))
        return set(zip(df["preset"], df["kernel"]))

    h100, h800, a800 = (hardware.load(n).name for n in ("h100-sxm", "h800-sxm", "a800-sxm"))
    table = _root_file("configs/validation/magiattention_h100.csv")
    assert preset_and_kernel(table) == {(h100, "fa3")}
    assert preset_and_kernel(table, "--kernel", "cudnn") == {(h100, "cudnn")}
    assert preset_and_kernel(table, "--hardware", "h800-sxm") == {(h800, "fa3")}
    assert preset_and_kernel(_root_file(VALIDATION)) == {(a800, "fa2")}
    assert hardware.preset_of_table("elsewhere/magiattention_b200.csv") == ("b200", "cudnn")
    assert hardware.preset_of_table("unknown.csv") is None
    # a table scored once, not in the evidence: its GPU's preset, the default kernel
    assert hardware.preset_of_table("magiattention_b200_varlen_16_64.csv") == ("b200", None)


def test_validate_table_never_cuts_a_name_mid_word(capsys):
    assert cli_main(["simulate", "--validate", _root_file(VALIDATION)]) == 0
    out = capsys.readouterr().out
    assert all(len(x) <= 120 for x in out.splitlines())
    cells = {c.strip() for x in out.splitlines() if "|" in x for c in x.split("|")}
    words = {w for c in cells for w in c.split()}
    for word in ("ulysses_degree=4", "placement=ring-first", "ring_impl=double-ring",
                 "burstengine_dkv_hop=True", "(ring-flash-attn)", "(LoongTrain)"):
        assert word in words, word


def test_report_of_simulated_records_states_their_evidence(capsys, tmp_path):
    out = tmp_path / "sim.jsonl"
    assert cli_main(["simulate", "--hardware", "b200", "--nodes", "1", "--seqlen", "64K",
                     "--strategy", "zigzag", "--out", str(out)]) == 0
    capsys.readouterr()
    assert cli_main(["report", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    stated = hardware.load("b200").evidence
    assert stated.startswith("validated on 50 published rows of this preset with cudnn")
    assert f"Evidence (HGX B200 (8x 400 Gb/s per node), kernel cudnn): {stated}." \
        in text
