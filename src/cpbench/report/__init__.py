"""Reports rendered from result records (``cpbench report FILE.jsonl``): the seed-format
tables, markdown, csv and json. See ``tables`` for what each column means."""

from cpbench.report.tables import FORMATS, detail, efficiencies, frame, report, rows, summary

__all__ = ["FORMATS", "detail", "efficiencies", "frame", "report", "rows", "summary"]
