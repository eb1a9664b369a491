"""Flat rows as csv or json: the machine-readable formats every table of cpbench offers."""

from __future__ import annotations

import csv
import io
import json


def data_text(rows: list[dict], fmt: str, *, empty_header: tuple[str, ...] = ()) -> str:
    """``rows`` as json (as they are) or csv (None empty, dict / list cells as json);
    ``empty_header``: the csv header when there are no rows."""
    if fmt == "json":
        return json.dumps(rows, indent=1) + "\n"
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else list(empty_header),
                            lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: json.dumps(v) if isinstance(v, (dict, list)) else v
                      for k, v in r.items()} for r in rows)
    return buf.getvalue()
