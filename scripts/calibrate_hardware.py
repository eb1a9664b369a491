#!/usr/bin/env python3
"""Fit a hardware preset's free parameters to published rows (a validation CSV), keeping a
held-out part of the table out of the fit.

    python scripts/calibrate_hardware.py configs/hardware/a800-sxm.yaml \
        configs/validation/seed001_a800_4x8.csv [--hold-out 0.33] [--seed 0]

Only what no figure gives moves: the per-step overhead (the step's cost beyond its kernel,
merge and gradient sums: the host's launch and posting time the GPU waits for at small
blocks) and the three link bandwidths, each inside the physical range below (the
datasheet's nominal rate is the ceiling). The kernel curves (published figures), the
kernel's rate inside a CP run and the merge / gradient-sum passes (measured) are not fitted,
and no parameter is per strategy. The loss is robust, in log(simulated / published)
FWD+BWD TFLOP/s over the fitted rows with scale 0.15 (a Cauchy loss: a row off by far more
pulls little more than one off by 15 %), so a few rows no machine explains cannot drag the
fit. The search is a bounded coordinate descent from the preset's current values: a local
fit, reproducible from the files given.

The held-out part: ``--hold-out`` (default a third) of the scored rows, drawn with
``--seed`` (default 0), are left out of the loss; the report gives the error and the ranking
agreement of the fitted (in-sample) and the held-out rows apart: the held-out figures are
what the fit says about rows it has not seen. ``--hold-out 0`` fits every scored row (then
nothing of the table is out of sample, and the report says so). Prints the fitted values and
the ``fit:`` section (the rows fitted, by implementation and sequence length) as YAML to
paste into the preset, then the validation table, each row labelled in-sample or held out.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
from pathlib import PurePath

import yaml

from cpbench.sim import hardware, model, provenance, validate

# (lower, upper): the physical range of each free parameter
RANGES = {"overhead": (20.0, 300.0),  # µs a step: at least the small kernels measured in
          # seed 000's profile (~20 µs), at most a step's whole host time
          "intra": (100.0, 200.0),  # NVLink on A800: 200 GB/s a direction, nominal
          "inter": (15.0, 25.0),  # one HDR 200 Gb/s NIC
          "node": (50.0, 100.0)}  # four HDR NICs per node
SCALE = 0.15  # residual scale of the loss: the 15 % a prediction is allowed to be off


def _vector(hw: hardware.Hardware) -> dict[str, float]:
    return {"overhead": hw.step_overhead_us, "intra": hw.intra.bandwidth_gbs,
            "inter": hw.inter.bandwidth_gbs, "node": hw.node_inter_gbs}


def _hardware(base: hardware.Hardware, v: dict[str, float]) -> hardware.Hardware:
    return dataclasses.replace(
        base, step_overhead_us=v["overhead"],
        intra=dataclasses.replace(base.intra, bandwidth_gbs=v["intra"]),
        inter=dataclasses.replace(base.inter, bandwidth_gbs=v["inter"]),
        node_inter_gbs=v["node"])


def loss(rows: list[validate.Row], hw: hardware.Hardware) -> float:
    total = 0.0
    for r in validate.run([r for r in rows if r.scored], hw):
        x = math.log(r.predicted / r.row.published)
        total += math.log1p((x / SCALE) ** 2)  # Cauchy: bounded pull
    return total


def _descend(rows, base, v: dict[str, float], best: float) -> tuple[dict, float]:
    """Coordinate descent with multiplicative steps 20 %, 10 %, … down to 0.5 %."""
    step = 0.2
    while step >= 0.005:
        improved = False
        for name in v:
            lo, hi = RANGES[name]
            for factor in (1 + step, 1 / (1 + step)):
                trial = dict(v)
                trial[name] = min(hi, max(lo, v[name] * factor if v[name] else lo))
                value = loss(rows, _hardware(base, trial))
                if value < best - 1e-9:
                    v, best, improved = trial, value, True
                    break
        if not improved:
            step /= 2
    return v, best


def fit(rows, base: hardware.Hardware) -> hardware.Hardware:
    """Descend again from each result until a whole descent changes nothing: re-running the
    script on its own output then reproduces it."""
    v = {k: min(RANGES[k][1], max(RANGES[k][0], x)) for k, x in _vector(base).items()}
    best = loss(rows, _hardware(base, v))
    while True:
        v_next, best_next = _descend(rows, base, v, best)
        if best_next >= best - 1e-9:
            return _hardware(base, v)
        v, best = v_next, best_next


def split(rows: list[validate.Row], fraction: float, seed: int,
          keep: frozenset[tuple[str, int]] = frozenset()
          ) -> tuple[list[validate.Row], list[tuple[str, int]]]:
    """(every row, the held-out ones marked not scored; the keys of the rows fitted): a
    ``fraction`` of the scored rows drawn with ``seed`` (never one of ``keep``: rows that
    shaped the preset otherwise, in-sample whatever the fit does), at least as many left to
    fit as there are free parameters."""
    keys = [(r.implementation, r.attn.seqlen) for r in rows if r.scored]
    if len(set(keys)) != len(keys):
        raise SystemExit("calibrate_hardware: two scored rows share implementation and "
                         "seqlen; name them apart in the CSV")
    if not 0 <= fraction < 1:
        raise SystemExit(f"calibrate_hardware: --hold-out must be in [0, 1), got {fraction}")
    candidates = [k for k in keys if k not in keep]
    held = set(random.Random(seed).sample(candidates, round(len(keys) * fraction)))
    if len(keys) - len(held) < len(RANGES):
        raise SystemExit(f"calibrate_hardware: {len(keys) - len(held)} rows left to fit "
                         f"{len(RANGES)} parameters; hold out fewer")
    fitted = [dataclasses.replace(r, scored=r.scored and (r.implementation, r.attn.seqlen)
                                  not in held) for r in rows]
    return fitted, [k for k in keys if k not in held]


PARAMETERS = ["kernel.step_overhead_us", "intra_node.bandwidth_gbs",
              "inter_node.bandwidth_gbs_per_gpu", "inter_node.node_bandwidth_gbs"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("preset")
    p.add_argument("csv")
    p.add_argument("--hold-out", type=float, default=1 / 3, metavar="FRACTION",
                   help="share of the scored rows left out of the fit (default a third; 0 "
                        "fits every row)")
    p.add_argument("--seed", type=int, default=0, help="draws the held-out rows (default 0)")
    args = p.parse_args(argv)
    base = hardware.load(args.preset)
    rows = validate.load(args.csv)
    # rows the preset's own fit: section says shaped other figures (a profile's run)
    same_table = base.fit is not None and \
        PurePath(base.fit.file).name == PurePath(args.csv).name
    measured_on = base.fit.measured_on if base.fit is not None and same_table else ()
    to_fit, fitted = split(rows, args.hold_out, args.seed,
                           frozenset((i, s) for i, s, _ in measured_on))
    hw = fit(to_fit, base)
    all_scored = len(fitted) == sum(r.scored for r in rows)
    section = provenance.Fit(tuple(PARAMETERS), args.csv,
                             None if all_scored else tuple(fitted), measured_on=measured_on)
    hw = dataclasses.replace(hw, fit=section)
    at_bound = [k for k, x in _vector(hw).items() if x in RANGES[k]]
    out = {"kernel": {"step_overhead_us": round(hw.step_overhead_us, 1)},
           "intra_node": {"bandwidth_gbs": round(hw.intra.bandwidth_gbs, 1)},
           "inter_node": {"bandwidth_gbs_per_gpu": round(hw.inter.bandwidth_gbs, 1),
                          "node_bandwidth_gbs": round(hw.node_inter_gbs, 1)},
           "fit": {"parameters": PARAMETERS, "file": args.csv,
                   "rows": "all scored" if all_scored else [list(k) for k in fitted],
                   "held_out": [], "at_a_bound": at_bound,
                   "measured_on": [list(m) for m in measured_on],
                   "split": f"--hold-out {args.hold_out:.3g} --seed {args.seed}"}}
    sys.stdout.write(yaml.safe_dump(out, default_flow_style=None, sort_keys=False,
                                    allow_unicode=True, width=96))
    sys.stdout.write(validate.report(validate.run(rows, hw), hw, args.csv))
    model._compiled.cache_clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
