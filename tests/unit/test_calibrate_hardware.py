"""scripts/calibrate_hardware.py: the fit to published rows keeps a held-out part of the
table out of its loss, says which rows it fitted, and reports the held-out rows apart."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest
import yaml

from cpbench.sim import hardware, validate

ROOT = Path(__file__).resolve().parents[2]
SEED_CSV = ROOT / "configs" / "validation" / "seed001_a800_4x8.csv"
_spec = importlib.util.spec_from_file_location("calibrate_hardware",
                                               ROOT / "scripts" / "calibrate_hardware.py")
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)


def _keys(rows, scored=True):
    return [(r.implementation, r.attn.seqlen) for r in rows if r.scored is scored]


def test_the_split_draws_a_share_of_the_scored_rows_reproducibly():
    rows = validate.load(SEED_CSV)
    marked, fitted = script.split(rows, 1 / 3, seed=0)
    assert len(fitted) == 10 and _keys(marked) == fitted  # the rest marked not scored
    held = set(_keys(rows)) - set(fitted)
    assert len(held) == 5
    assert script.split(rows, 1 / 3, seed=0)[1] == fitted  # the same seed, the same split
    assert script.split(rows, 1 / 3, seed=1)[1] != fitted
    keep = frozenset(held)  # rows that shaped the preset otherwise are never drawn
    assert keep <= set(script.split(rows, 1 / 3, seed=0, keep=keep)[1])
    assert len(script.split(rows, 0.0, seed=0)[1]) == 15
    with pytest.raises(SystemExit, match="rows left to fit 4 parameters"):
        script.split(rows, 0.9, seed=0)


@pytest.mark.slow  # three fits: seconds of CPU
def test_a_held_out_row_does_not_move_the_fit():
    """The same fit whatever a held-out row says (published 10x off), a fitted row moves it."""
    rows = validate.load(SEED_CSV)
    marked, fitted = script.split(rows, 1 / 3, seed=0)
    base = hardware.load("a800-sxm")
    before = script._vector(script.fit(marked, base))
    held = next(i for i, (r, o) in enumerate(zip(marked, rows)) if o.scored and not r.scored)
    wild = list(marked)
    wild[held] = dataclasses.replace(wild[held], published=wild[held].published * 10)
    assert script._vector(script.fit(wild, base)) == before
    one = next(i for i, r in enumerate(marked) if r.scored)
    wild = list(marked)
    wild[one] = dataclasses.replace(wild[one], published=wild[one].published * 10)
    assert script._vector(script.fit(wild, base)) != before


def test_the_report_gives_the_fitted_rows_and_the_held_out_figures(capsys):
    assert script.main([str(ROOT / "configs" / "hardware" / "a800-sxm.yaml"),
                        str(SEED_CSV)]) == 0
    out = capsys.readouterr().out
    head, table = out.split("Validation against published rows", 1)
    section = yaml.safe_load(head)["fit"]
    assert len(section["rows"]) == 10 and section["split"] == "--hold-out 0.333 --seed 0"
    # the preset's measured-on row (seed 000's profile) stays in-sample: never held out
    assert ["ZigZag ring (ring-flash-attn)", 524288] in section["rows"]
    assert re.search(r"^error, held out \(5 rows nothing was fitted to\)", table, re.M)
    assert re.search(r"^error, in-sample \(10 rows the preset's fit used\)", table, re.M)
    # the shipped preset is this fit's output: its fit: section lists the same rows
    shipped = hardware.load("a800-sxm").fit
    assert shipped is not None and sorted(shipped.rows) == sorted(map(tuple, section["rows"]))
    assert yaml.safe_load(head)["intra_node"]["bandwidth_gbs"] == \
        hardware.load("a800-sxm").intra.bandwidth_gbs
