"""What shaped a preset, as far as an accuracy figure needs to know: the published rows a fit
used (a preset's ``fit:`` section, which ``scripts/calibrate_hardware.py`` prints), so that
``cpbench simulate --validate`` can label each row in-sample or held out; and how busy the
machine was while ``cpbench calibrate`` measured it (``load:``), so that no figure is
scored against a preset a loaded machine made.

A ``fit:`` section::

    fit:
      parameters: [kernel.step_overhead_us, ...]   # what the fit moved
      file: configs/validation/seed001_a800_4x8.csv  # the table it was fitted to
      rows: all scored        # or [[implementation, seqlen], ...]: the rows fitted; the
                              # file's other scored rows were held out
      held_out: [configs/validation/burstengine_runs_a800.csv]  # tables not fitted
      measured_on: [[implementation, seqlen, what]]  # rows of ``file`` whose run gave other
                                                    # figures (a profile): in-sample too

Files are matched by their name (a copy of the file elsewhere is the same table).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath

from cpbench.errors import UsageError

IN_SAMPLE, HELD_OUT = "in-sample", "held out"


@dataclass(frozen=True)
class Fit:
    parameters: tuple[str, ...]
    file: str
    rows: tuple[tuple[str, int], ...] | None  # None: every scored row of ``file``
    held_out: tuple[str, ...] = ()
    measured_on: tuple[tuple[str, int, str], ...] = ()

    def sample(self, table: str, implementation: str, seqlen: int) -> str:
        """``IN_SAMPLE`` when this row of ``table`` shaped the preset (fitted, or the run a
        measured figure came from), ``HELD_OUT`` otherwise: a row of another table, or of
        the fitted table left out of the fit."""
        if _name(table) != _name(self.file):
            return HELD_OUT
        if self.rows is None or (implementation, seqlen) in self.rows \
                or self.why(implementation, seqlen) is not None:
            return IN_SAMPLE
        return HELD_OUT

    def why(self, implementation: str, seqlen: int) -> str | None:
        """What a measured-on row gave the preset, if it is one."""
        return next((w for i, s, w in self.measured_on if (i, s) == (implementation, seqlen)),
                    None)


def _name(path: str) -> str:
    return PurePath(path).name


def _row(item, where: str, width: int) -> tuple:
    if not (isinstance(item, list) and len(item) == width and isinstance(item[0], str)
            and isinstance(item[1], int)):
        shape = "[implementation, seqlen]" if width == 2 else "[implementation, seqlen, what]"
        raise UsageError(f"{where}: each row is {shape}, got {item!r}")
    return tuple(item)


def parse_fit(d, where: str) -> Fit | None:
    if d is None:
        return None
    if not isinstance(d, dict) or not isinstance(d.get("file"), str):
        raise UsageError(f"{where}: a mapping with file (the table fitted), rows, "
                         f"parameters, held_out (see configs/hardware/a800-sxm.yaml)")
    rows = d.get("rows", "all scored")
    if rows != "all scored":
        if not isinstance(rows, list):
            raise UsageError(f"{where}: rows is 'all scored' or a list of [implementation, "
                             f"seqlen], got {rows!r}")
        rows = tuple(_row(r, f"{where}: rows", 2) for r in rows)
    held = d.get("held_out") or []
    parameters = d.get("parameters") or []
    if not (isinstance(held, list) and all(isinstance(h, str) for h in held)
            and isinstance(parameters, list)):
        raise UsageError(f"{where}: held_out and parameters are lists")
    measured_on = tuple(_row(r, f"{where}: measured_on", 3) for r in d.get("measured_on") or [])
    return Fit(tuple(map(str, parameters)), d["file"],
               None if rows == "all scored" else rows, tuple(held), measured_on)


def parse_load(d, where: str) -> float | None:
    """The share of the cores other processes used while ``cpbench calibrate`` measured
    (``load: {share: ..., wall_s: ...}``); None when the preset has no reading."""
    if d is None:
        return None
    share = d.get("share") if isinstance(d, dict) else None
    if not isinstance(share, (int, float)) or isinstance(share, bool) or not share >= 0:
        raise UsageError(f"{where}: a mapping with share (others' share of the cores, >= 0)")
    return float(share)


NO_EVIDENCE = ("no published CP rows on this hardware: an estimate from datasheets and kernel "
               "figures")


def stated_error(d, kernel: str) -> float | None:
    """The model's stated error with this kernel: the held-out rows' median |error| (a
    fraction) of ``evidence:``; None where it was validated on no held-out row."""
    e = (d or {}).get(kernel) if isinstance(d, dict) else None
    median = e.get("held_out_median") if isinstance(e, dict) and e.get("held_out") else None
    return None if median is None else float(median) / 100


def evidence(d, kernel: str, where: str) -> str:
    """The sentence every simulated table and record carries: the published CP rows this
    preset, with this kernel, was validated on (``evidence:``, per kernel: ``rows``,
    ``in_sample``, ``in_sample_median``, ``held_out``, ``held_out_median``, ``files``; the
    figures ``cpbench simulate --validate`` prints, held equal to them by a test), or
    ``NO_EVIDENCE``."""
    if d is None:
        return NO_EVIDENCE
    if not isinstance(d, dict):
        raise UsageError(f"{where}: a mapping of kernel name → rows, in_sample, "
                         f"in_sample_median, held_out, held_out_median, files")
    e = d.get(kernel)
    if e is None:
        return NO_EVIDENCE.replace("on this hardware", f"on this hardware with {kernel}")
    try:
        parts = [f"{what} {e[f'{key}_median']:.1f} %" for what, key in
                 (("in-sample", "in_sample"), ("held out", "held_out")) if e.get(key)]
        return (f"validated on {int(e['rows'])} published rows of this preset with {kernel} "
                f"({', '.join(parts)} median error)")
    except (KeyError, TypeError, ValueError):
        raise UsageError(f"{where}.{kernel}: needs rows, in_sample, in_sample_median, "
                         f"held_out, held_out_median") from None
