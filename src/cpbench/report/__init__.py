"""Reports rendered from result records (``cpbench report FILE.jsonl``): the seed-format
tables, markdown, csv and json. See ``tables`` for what each column means, ``render`` for how
tables fit the terminal, ``detail`` for seed 000's per-case block, ``lines`` for a case and a
run in one line, ``sweep`` for the tables over many runs (grouped by strategy, pivot,
placements compared), ``dataframe`` for the figures behind them, ``cells`` for how a figure
prints, ``labels`` for how rows are named, and ``plot``."""

from cpbench.report import sweep
from cpbench.report.dataframe import efficiencies, frame
from cpbench.report.detail import detail
from cpbench.report.labels import row_label
from cpbench.report.lines import case_line, outcome_line, skipped_lines
from cpbench.report.tables import FORMATS, report, rows, summary

__all__ = ["FORMATS", "case_line", "detail", "efficiencies", "frame", "outcome_line", "report",
           "row_label", "rows", "skipped_lines", "summary", "sweep"]
