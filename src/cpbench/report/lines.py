"""A case in one line as ``cpbench run`` finishes it, and the run in one line at its end:
the density of ``pytest -q`` (details behind ``--details``; the records keep everything).
The figures are the summary's cells (``report.cells``), so a rule about a figure holds here
too."""

from __future__ import annotations

from collections import Counter

from cpbench.metrics import duration
from cpbench.report import cells
from cpbench.report.dataframe import to_frame
from cpbench.report.labels import row_label
from cpbench.results import OK, derive


def case_line(record: dict, seconds: float) -> str:
    """``done in 2.3 s (estimated 2.0 s), check PASS, FWD 36.40 ms, FWD+BWD 116.20 ms``; a
    failed or OOM case its error instead of figures; the row's flags after."""
    row = to_frame([record]).to_dict("records")[0]
    status = record["status"]
    est = record.get("estimate")  # bench.estimate's, made before the case started
    parts = [f"{'done' if status == OK else status} in {duration(seconds)}"
             + (f" (estimated {duration(est.get('revised_s', est['case_s']))})" if est else "")]
    passed = row["check_passed"]
    if not cells.missing(passed):
        parts.append(f"check {'PASS' if passed else 'FAIL'}")
    figures = cells.figures(row)
    if status == OK or not cells.missing(row["fwd_ms"]):
        parts.append(f"FWD {cells.with_unit(figures['FWD (ms)'], 'ms')}")
        if not row["fwd_only"]:
            parts.append(f"FWD+BWD {cells.with_unit(figures['FWD+BWD (ms)'], 'ms')}")
    if record.get("memory_status") and record["memory_status"] != OK:
        parts.append(f"memory {record['memory_status']}")
    if status != OK and record.get("error"):
        parts.append(str(record["error"]).splitlines()[0])
    if row["flags"]:
        parts.append(f"flagged: {row['flags']}")
    return ", ".join(parts)


def outcome_line(records: list[dict]) -> str:
    """The run in a line: cases by status, checks by verdict, the flagged passes named."""
    if not records:
        return "no case ran"
    status = Counter("done" if r["status"] == OK else r["status"] for r in records)
    text = f"{len(records)} case(s): " + ", ".join(f"{n} {s}" for s, n in status.items())
    checked = [r for r in records if r.get("check")]
    verdicts = [r["derived"].get("check_passed") for r in checked]
    if verdicts:
        failed = verdicts.count(False)  # FAIL printed only where there is one (grep FAIL)
        text += f"; check: {verdicts.count(True)} PASS" + _flagged(checked) + \
            (f", {failed} FAIL" if failed else "")
    return text


def _flagged(checked: list[dict]) -> str:
    """" (2 flagged: ring: CP over 1 ranks, asked for 2; …)": the passes the table flags (a
    strategy that ran without CP passes its check and is no plain PASS); each row's first
    flag, and how many more."""
    found = [(row_label(r), flags) for r in checked if r["derived"].get("check_passed")
             and (flags := derive(r)["flags"])]
    if not found:
        return ""
    return f" ({len(found)} flagged: " + "; ".join(
        f"{who}: {flags[0]}" + (f" (+{len(flags) - 1} more)" if len(flags) > 1 else "")
        for who, flags in found) + ")"


def skipped_lines(reasons: list[str]) -> list[str]:
    """The cases a plan skipped, a line per reason rather than per case: ``skipped
    rfa-ring, rfa-stripe: <why>``; a strategy's variants skipped for one reason count as
    ``yunchang-usp (3 cases)``; what the names share after them (``cannot run here``)
    said once. A reason with no ``name: `` before it (a refusal that names its strategy in
    its own words) is said once, its cases counted: ``skipped 3 cases: <reason>``."""
    by: dict[tuple[bool, str], list[str]] = {}  # (named, why) -> the names
    for reason in reasons:
        who, sep, why = reason.partition(": ")
        by.setdefault((bool(sep), why if sep else reason), []).append(who)
    out = []
    for (named, why), whos in by.items():
        if not named:  # the reason is the whole line: nothing to list but how many
            out.append(f"skipped {f'{len(whos)} cases: ' if len(whos) > 1 else ''}{why}")
            continue
        tails = {w.split(" ", 1)[1] if " " in w else "" for w in whos}
        shared = tails.pop() if len(tails) == 1 else None  # e.g. "cannot run here"
        names = Counter(w.split(" ", 1)[0] if shared is not None or " (" in w else w
                        for w in whos)
        listed = ", ".join(n if k == 1 else f"{n} ({k} cases)" for n, k in names.items())
        out.append(f"skipped {listed}{' ' + shared if shared else ''}: {why}")
    return out
