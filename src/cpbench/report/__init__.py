"""Reports rendered from result records (``cpbench report FILE.jsonl``): the seed-format
tables, markdown, csv and json. See ``tables`` for what each column means, ``sweep`` for the
tables over many runs (grouped by strategy, pivot, placements compared), ``dataframe`` for the
figures behind them, ``labels`` for how rows are named, and ``plot``."""

from cpbench.report import sweep
from cpbench.report.dataframe import efficiencies, frame
from cpbench.report.labels import row_label
from cpbench.report.tables import FORMATS, detail, report, rows, summary

__all__ = ["FORMATS", "detail", "efficiencies", "frame", "report", "row_label", "rows",
           "summary", "sweep"]
