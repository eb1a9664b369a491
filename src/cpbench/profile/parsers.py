"""Profiles people already have, read into two shapes.

- ``KernelTable``: per-kernel totals. From a torch.profiler ``key_averages().table()`` text
  (seed 000; every line may carry a host prefix such as ``g43:`` or ``[rank0]:``, and lines
  of other prefixes interleaved with it are skipped), and from an nsys ``cuda_gpu_kern_sum``
  export: tab-separated as copied from the GUI (seed 002), nsys's CSV (``--format csv``) or
  its column layout (a header over a rule of dashes).
- ``Trace``: the complete (``"ph": "X"``) events of a Chrome trace (``.json`` or
  ``.json.gz``, as torch.profiler exports them), for the step breakdown.

A table ends at the first blank line (or a closing rule): anything after it (a traceback,
notes, another excerpt) is not read, and ``notes`` says which lines those were. Input that
looks like a table but cannot be read is a UsageError naming the file and line.
"""

from __future__ import annotations

import csv
import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeGuard

from cpbench.errors import UsageError


@dataclass(frozen=True)
class KernelRow:
    name: str
    time_ms: float
    calls: int


@dataclass(frozen=True)
class KernelTable:
    source: str  # what was read, for the summary's header
    rows: tuple[KernelRow, ...]
    total_ms: float  # the device time the percentages are of
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Event:
    """One complete event of a Chrome trace; times in µs."""

    name: str
    cat: str
    start: float
    end: float
    pid: object = None
    tid: object = None


@dataclass(frozen=True)
class Trace:
    events: tuple[Event, ...]


def read(path: str) -> KernelTable | Trace:
    """Whatever ``path`` holds, by its content (not its name)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise UsageError(f"{path}: cannot read it ({e.strerror or e})") from None
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            raise UsageError(f"{path}: a gzip file that does not decompress ({e})") from None
        return read_trace(data, f"{path} (decompressed)")
    text = data.decode("utf-8", errors="replace")
    if text.lstrip()[:1] in ("{", "["):
        return read_trace(data, path)
    return read_table(text, path)


# -- Chrome traces -----------------------------------------------------------------------------

def _number(v: object) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def read_trace(data: bytes | str, where: str) -> Trace:
    try:
        doc = json.loads(data)
    except json.JSONDecodeError as e:
        raise UsageError(f"{where}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno}); "
                         f"give a Chrome trace as torch.profiler exports it") from None
    except ValueError as e:  # undecodable bytes
        raise UsageError(f"{where}: not a JSON text ({e})") from None
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise UsageError(f"{where}:1: no `traceEvents` list: not a Chrome trace")
    out = []
    for i, ev in enumerate(events):
        if not isinstance(ev, dict):
            raise UsageError(f"{where}: traceEvents[{i}] is not an object")
        if ev.get("ph") != "X":  # metadata, instants, flows: no duration to count
            continue
        ts, dur = ev.get("ts"), ev.get("dur")
        if not (_number(ts) and _number(dur)) or dur < 0:
            raise UsageError(f"{where}: traceEvents[{i}] ({ev.get('name')!r}): `ts` and `dur` "
                             f"must be numbers (µs, dur >= 0), got {ts!r} and {dur!r}")
        out.append(Event(str(ev.get("name", "")), str(ev.get("cat", "")), float(ts),
                         float(ts) + float(dur), ev.get("pid"), ev.get("tid")))
    return Trace(tuple(out))


# -- text tables ------------------------------------------------------------------------------

# a rule of dashes under (torch, nsys columns) or around (torch) a header, after any prefix
_RULE = re.compile(r"^(?P<prefix>.*?)(?P<rule>-{3,}(?: +-{3,})+) *$")
_NSYS_HEADER = ("Total Time", "Instances", "Name")


@dataclass
class _Cells:
    """A table's cells before they are interpreted: header, rows with their line numbers."""

    header: list[str]
    header_line: int
    rows: list[tuple[int, list[str]]]
    end: int  # index of the first line after the table
    footer: list[str]


def read_table(text: str, where: str) -> KernelTable:
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.count("\t") >= 2 and all(h in line for h in _NSYS_HEADER):
            cells = _delimited(lines, i, where, lambda s: s.split("\t"), "tab-separated")
        elif line.count(",") >= 2 and all(h in line for h in _NSYS_HEADER):
            cells = _delimited(lines, i, where, lambda s: next(csv.reader([s])), "CSV")
        elif _RULE.match(line) and i + 1 < len(lines):
            cells = _ruled(lines, i, where)
        else:
            continue
        table = _interpret(cells, where)
        rest = [j for j in range(cells.end, len(lines)) if lines[j].strip()]
        if rest:
            table = KernelTable(table.source, table.rows, table.total_ms, table.notes + (
                f"lines {rest[0] + 1}-{rest[-1] + 1} follow the table and were not read",))
        return table
    raise UsageError(f"{where}:1: no profile found: expected a torch.profiler table "
                     f"(key_averages().table()), an nsys cuda_gpu_kern_sum export "
                     f"(tab-separated, CSV or columns) or a Chrome trace (.json, .json.gz)")


def _delimited(lines: list[str], i: int, where: str, split: Callable[[str], list[str]],
               what: str) -> _Cells:
    header = [h.strip() for h in split(lines[i])]
    rows, j = [], i + 1
    while j < len(lines) and lines[j].strip():
        cells = [c.strip() for c in split(lines[j])]
        if len(cells) != len(header):
            raise UsageError(f"{where}:{j + 1}: {len(cells)} {what} fields where the header "
                             f"(line {i + 1}) has {len(header)}")
        rows.append((j + 1, cells))
        j += 1
    return _Cells(header, i + 1, rows, j, [])


def _ruled(lines: list[str], i: int, where: str) -> _Cells:
    """A table laid out in columns whose widths the rule of dashes gives (the last column
    runs to the end of the line: nsys's Name). torch.profiler puts a rule above and below
    its header; nsys one below."""
    m = _RULE.match(lines[i])
    assert m is not None, "called on a line the rule matched"
    prefix = m["prefix"]
    starts = [len(prefix) + d.start() for d in re.finditer(r"-+", m["rule"])]

    def cut(line: str) -> list[str]:
        ends = starts[1:] + [len(line)]
        return [line[a:b].strip() for a, b in zip(starts, ends)]

    def near(k: int, step: int) -> int | None:
        """The next line of this prefix from ``k`` on (skipping other hosts' lines)."""
        while 0 <= k < len(lines) and not lines[k].startswith(prefix):
            k += step
        return k if 0 <= k < len(lines) else None

    below = near(i + 1, 1)
    rule2 = near(below + 1, 1) if below is not None else None
    above = near(i - 1, -1)
    if below is not None and rule2 is not None and "Name" in lines[below] \
            and _RULE.match(lines[rule2]):
        header_i, j = below, rule2 + 1  # torch: rule, header, rule
    elif above is not None and lines[above][len(prefix):].strip():
        header_i, j = above, i + 1
    else:
        raise UsageError(f"{where}:{i + 1}: a rule of dashes with no header line above it")
    rows = []
    while j < len(lines):
        line = lines[j]
        if prefix and not line.startswith(prefix):  # another host's line, interleaved
            j += 1
            continue
        if not line[len(prefix):].strip() or _RULE.match(line):
            break
        rows.append((j + 1, cut(line)))
        j += 1
    footer = []
    if j < len(lines) and _RULE.match(lines[j]):  # torch's closing rule, then its totals
        j += 1
        while j < len(lines) and lines[j].startswith(prefix) and "total:" in lines[j]:
            footer.append(lines[j][len(prefix):].strip())
            j += 1
    return _Cells(cut(lines[header_i]), header_i + 1, rows, j, footer)


def _interpret(c: _Cells, where: str) -> KernelTable:
    col = {h: k for k, h in enumerate(c.header)}
    if "# of Calls" in col and "Name" in col:
        device = [h for h in c.header if re.fullmatch(r"Self (?!CPU\b)\w+", h)]
        time_col = device[0] if device else "Self CPU"
        calls_col, unit, source = "# of Calls", None, f"torch.profiler table ({time_col})"
    elif "Instances" in col and "Name" in col and any(h.startswith("Total Time") for h in col):
        time_col = next(h for h in c.header if h.startswith("Total Time"))
        unit_in_header = re.search(r"\((ns|us|µs|μs|ms|s)\)", time_col)
        calls_col, unit = "Instances", unit_in_header[1] if unit_in_header else None
        source = "nsys cuda_gpu_kern_sum"
    else:
        raise UsageError(f"{where}:{c.header_line}: a table whose header is neither "
                         f"torch.profiler's (Name … # of Calls) nor nsys's (Total Time, "
                         f"Instances, Name): {' | '.join(c.header)}")
    if time_col not in col:
        raise UsageError(f"{where}:{c.header_line}: no {time_col} column to read times from")
    rows, host_only = [], 0
    for line, cells in c.rows:
        time_ms = _cell(cells[col[time_col]], time_col, where, line, unit)
        calls = _cell(cells[col[calls_col]], calls_col, where, line, None)
        if time_ms == 0 and time_col != "Self CPU":
            host_only += 1  # a host-side row (cudaLaunchKernel…): no device time to group
            continue
        rows.append(KernelRow(cells[col["Name"]], time_ms, int(calls)))  # an int already
    if not rows:
        raise UsageError(f"{where}:{c.header_line}: a table with no rows of {time_col} time")
    return _with_total(rows, c, time_col, source, host_only, where)


def _with_total(rows: list[KernelRow], c: _Cells, time_col: str, source: str,
                host_only: int, where: str) -> KernelTable:
    """The table with its total: torch's footer total when it exceeds the rows (a table cut
    at a row limit), the remainder then listed as a row of its own, so percentages are of
    the whole device time."""
    notes = [f"{host_only} host-only rows (no {time_col} time) not counted"] if host_only \
        else []
    listed = sum(r.time_ms for r in rows)
    footer = next((f for f in c.footer if f.startswith(f"{time_col} time total:")), None)
    if footer is not None:
        total = _cell(footer.split(":", 1)[1], f"{time_col} total", where, None, None)
        if total > listed * 1.001:  # beyond the footer's own rounding
            rows.append(KernelRow("(not listed in the table)", total - listed, 0))
            notes.append(f"the table lists {listed:.3f} of {total:.3f} ms")
    return KernelTable(source, tuple(rows), sum(r.time_ms for r in rows), tuple(notes))


_UNIT_MS = {"ns": 1e-6, "us": 1e-3, "µs": 1e-3, "μs": 1e-3, "ms": 1.0, "s": 1e3}
_NUMBER = re.compile(r"^([0-9][0-9,]*(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?)\s*(ns|us|µs|μs|ms|s)?$")


def _cell(text: str, column: str, where: str, line: int | None, unit: str | None
          ) -> float:
    """A time in ms (``column`` a time column: the value's unit, else the header's) or a
    count (a calls column)."""
    m = _NUMBER.match(text.strip())
    counting = column in ("# of Calls", "Instances")
    at = f"{where}:{line}" if line else where
    if m is None or (counting and (m[2] or not m[1].replace(",", "").isdigit())):
        what = "a count" if counting else "a time such as 1.5ms or 240 μs"
        raise UsageError(f"{at}: cannot read {text.strip()!r} as {what} ({column} column)")
    value = float(m[1].replace(",", ""))
    if counting:
        return int(value)
    unit = m[2] or unit
    if unit is None:
        raise UsageError(f"{at}: {text.strip()!r} has no unit ({column} column)")
    return value * _UNIT_MS[unit]
