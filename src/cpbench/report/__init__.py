"""Reports rendered from result records (``cpbench report FILE.jsonl``): the seed-format
tables, markdown, csv and json. See ``tables`` for what each column means, ``sweep`` for the
tables over many runs (grouped by strategy, pivot, placements compared) and ``plot``."""

from cpbench.report import sweep
from cpbench.report.tables import FORMATS, detail, efficiencies, frame, report, rows, summary

__all__ = ["FORMATS", "detail", "efficiencies", "frame", "report", "rows", "summary", "sweep"]
