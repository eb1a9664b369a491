"""Tables as the terminal prints them: seed 001's layout (centred cells between '|', '='
rules around, '-' under the header), fitted to a width by default; or markdown.

Fitting (``Fit``), in this order, the first three always, the others only as far as the
width needs (``--wide``: none of them):

0. paired columns merge into one (Strategy and its Placement: ``usp (head-first …)``);
1. note columns (Flags) become numbered notes under the table, each row marked ``[n]``:
   notes of one kind (alike but for their numbers) share a number, their numbers given as
   ranges ("others kept 0.3-0.9 of 2 cores busy"), so a reason stays visible however narrow
   the table and is said once;
2. problem columns every row shares (Dtype, B, Seq Len, …) move to one line above it, and
   columns that are "-" in every row go (markdown too: they say nothing);
3. headers take their short names (units stay in the header: ``Mem (MB)``);
4. the least essential columns are hidden, in the order given, and named under the table;
5. the text columns (a strategy's label) break over lines.

The width is the terminal's on a terminal, else ``DEFAULT_WIDTH``; a command sets it once
(``fitting``) from its ``--wide`` flag. The records keep every field whatever is shown.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import shutil
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Iterator, Mapping

DEFAULT_WIDTH = 120  # not a terminal, or its width unknown
MIN_WIDTH = 60  # a narrower terminal still gets this: below it tables only wrap
WIDE = 0  # fitting(WIDE): no limit (--wide)

_width: contextvars.ContextVar[int | None] = contextvars.ContextVar("cpbench_table_width",
                                                                    default=None)


@dataclass(frozen=True)
class Fit:
    """How a table narrows (see the module's docstring); columns by their header."""

    lift: tuple[str, ...] = ()
    drop: tuple[str, ...] = ()
    wrap: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    short: Mapping[str, str] = field(default_factory=dict)
    rename: Mapping[str, str] = field(default_factory=dict)  # in every mode (e.g. GPUs/ranks)
    merge: tuple[tuple[str, str], ...] = ()  # (a, b): a's cell becomes "a (b)", b goes


PLAIN = Fit()


def terminal_width() -> int:
    """The terminal's width where stdout is one, else ``DEFAULT_WIDTH``."""
    try:
        tty = sys.stdout.isatty()
    except (AttributeError, ValueError):  # replaced or closed stdout
        tty = False
    if not tty:
        return DEFAULT_WIDTH
    return max(MIN_WIDTH, shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns)


def width() -> int | None:
    """The width tables fit now: the one ``fitting`` set, else the terminal's; None for no
    limit (``--wide``)."""
    set_to = _width.get()
    if set_to is None:
        return terminal_width()
    return None if set_to == WIDE else set_to


@contextlib.contextmanager
def fitting(columns: int | None) -> Iterator[None]:
    """Within the block tables fit ``columns`` (``WIDE``: no limit; None: the terminal's)."""
    token = _width.set(columns)
    try:
        yield
    finally:
        _width.reset(token)


def wide_width(wide: bool) -> int | None:
    """What ``fitting`` takes for a command's ``--wide`` flag."""
    return WIDE if wide else None


def prose(lines: list[str]) -> list[str]:
    """Lines of text broken to ``width()`` (``DEFAULT_WIDTH`` under --wide: a sentence
    gains nothing from a wide table), each continuation indented under its line's text."""
    limit = width() or DEFAULT_WIDTH
    out = []
    for line in lines:
        if len(line) <= limit:
            out.append(line)
            continue
        lead = " " * (len(line) - len(line.lstrip()))
        out += textwrap.wrap(line, limit, subsequent_indent=lead + "  ", break_on_hyphens=False,
                             break_long_words=False)  # a path or a command stays whole
    return out


def render(title: str | None, rows: list[dict], fmt: str, fit: Fit = PLAIN) -> list[str]:
    """A table under an optional ``### title``: seed 001's layout fitted to ``width()``, or
    markdown (every column: a page, not a terminal)."""
    out = [f"### {title}"] if title else []
    if not rows:
        return out
    limit = width()
    if title and fmt != "markdown" and limit is not None:  # a heading longer than the table
        out = textwrap.wrap(out[0], limit, subsequent_indent="    ", break_on_hyphens=False)
    rows = [{fit.rename.get(k, k): v for k, v in r.items()} for r in rows]
    if fmt == "markdown":
        rows = _without_empty(rows)
        cols = list(rows[0])
        out += ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
        return out + ["| " + " | ".join(r[c] for c in cols) + " |" for r in rows]
    if limit is None:
        return out + seed_table(rows)
    fitted = fit_rows(rows, _renamed(fit), limit)
    return out + fitted.caption + seed_table(fitted.rows, fitted.wrap_at) + fitted.notes


def _renamed(fit: Fit) -> Fit:
    """``fit`` with its columns named as ``rename`` shows them."""
    def names(cols):
        return tuple(fit.rename.get(c, c) for c in cols)

    return Fit(lift=names(fit.lift), drop=names(fit.drop), wrap=names(fit.wrap),
               notes=names(fit.notes), merge=tuple(names(pair) for pair in fit.merge),
               short={fit.rename.get(k, k): v for k, v in fit.short.items()})


@dataclass
class Fitted:
    rows: list[dict]
    caption: list[str]
    notes: list[str]
    wrap_at: dict[str, int]  # column -> the width its text breaks at


def table_width(rows: list[dict], wrap_at: Mapping[str, int] | None = None) -> int:
    """How wide ``seed_table`` prints these rows."""
    return sum(w for w in _widths(rows, wrap_at or {})) + len(rows[0]) - 1


def _widths(rows: list[dict], wrap_at: Mapping[str, int]) -> list[int]:
    cols = list(rows[0])
    return [max(len(c) if c not in wrap_at else min(len(c), wrap_at[c]),
                *(min(len(r[c]), wrap_at.get(c, len(r[c]))) for r in rows)) + 2
            for c in cols]


def fit_rows(rows: list[dict], fit: Fit, limit: int) -> Fitted:
    """The rows narrowed to ``limit`` columns as far as ``fit`` allows (steps 0-5 above)."""
    for a, b in fit.merge:
        if a in rows[0] and b in rows[0]:
            rows = [{k: (f"{v} ({r[b]})" if k == a and r[b] not in ("", "-") else v)
                     for k, v in r.items() if k != b} for r in rows]
    rows, notes = _notes(rows, fit.notes, limit)
    rows, caption = _lift(rows, fit.lift, limit)
    rows = _without_empty(rows)
    rows = [{fit.short.get(k, k): v for k, v in r.items()} for r in rows]
    hidden = []
    for col in (fit.short.get(c, c) for c in fit.drop):
        if table_width(rows) <= limit or len(rows[0]) <= 1:
            break
        if col in rows[0]:
            hidden.append(col)
            rows = [{k: v for k, v in r.items() if k != col} for r in rows]
    wrap_at = _wrap_widths(rows, [fit.short.get(c, c) for c in fit.wrap], limit)
    if hidden:
        notes += textwrap.wrap(f"(not shown, to fit {limit} columns: {', '.join(hidden)}; "
                               f"--wide shows every column)", limit)
    return Fitted(rows, caption, notes, wrap_at)


def _notes(rows: list[dict], columns: tuple[str, ...], limit: int) -> tuple[list[dict], list[str]]:
    """Note columns out of the rows: each distinct text numbered, its rows marked ``[n]``
    after their first cell."""
    present = [c for c in columns if c in rows[0]]
    if not present:
        return rows, []
    numbered: dict[str, int] = {}
    out = []
    first = next(c for c in rows[0] if c not in present)
    kind = grouped([t for r in rows for c in present for t in _split_notes(r[c])])
    for r in rows:
        texts = [kind[t] for c in present for t in _split_notes(r[c])]
        marks = [numbered.setdefault(t, len(numbered) + 1) for t in texts]
        kept = {k: v for k, v in r.items() if k not in present}
        if marks:
            kept[first] = f"{kept[first]} [{','.join(map(str, dict.fromkeys(marks)))}]"
        out.append(kept)
    lines = [line for text, n in numbered.items()
             for line in textwrap.wrap(f"[{n}] {text}", limit, subsequent_indent="    ")]
    return out, lines


# a number standing alone (not part of a name: fp32, h100, v2.1), or a range of two
# ("1.2-1.3": a note already grouped, or a record's own range), read as one value
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?(?![\w.])")


def grouped(texts: list[str]) -> dict[str, str]:
    """Each note → the note its kind prints: notes alike but for their numbers are one note,
    each number that differs among them given as its range (``others kept 0.3 of 2 cores
    busy`` and ``… 0.9 …`` → ``others kept 0.3-0.9 of 2 cores busy``; a range among them
    widens it: ``1.2-1.3`` and ``1.4`` → ``1.2-1.4``)."""
    kinds: dict[str, list[str]] = {}
    for text in dict.fromkeys(texts):
        kinds.setdefault(_NUMBER.sub("#", text), []).append(text)
    out = {}
    for template, members in kinds.items():
        numbers = [_NUMBER.findall(m) for m in members]
        parts = template.split("#")
        text = parts[0]
        for i, part in enumerate(parts[1:]):
            ends = [e for n in numbers for e in n[i].split("-")]
            low, high = min(ends, key=float), max(ends, key=float)
            text += (low if float(low) == float(high) else f"{low}-{high}") + part
        out.update(dict.fromkeys(members, text))
    return out


def _without_empty(rows: list[dict]) -> list[dict]:
    """The rows without the columns that are "-" in every row (the first column stays)."""
    empty = [c for c in list(rows[0])[1:] if all(r[c] == "-" for r in rows)]
    return [{k: v for k, v in r.items() if k not in empty} for r in rows] if empty else rows


def _split_notes(cell: str) -> list[str]:
    """A note cell's notes: "-" none, else its "; "-separated parts."""
    return [] if cell in ("", "-") else [t.strip() for t in cell.split("; ") if t.strip()]


def _lift(rows: list[dict], columns: tuple[str, ...], limit: int
          ) -> tuple[list[dict], list[str]]:
    """Columns every row shares, out of the table into one line (``Dtype fp32, B 1, …``)."""
    shared = [c for c in columns if c in rows[0] and len({r[c] for r in rows}) == 1]
    if not shared:
        return rows, []
    text = ", ".join(f"{c} {rows[0][c]}" for c in shared)
    rows = [{k: v for k, v in r.items() if k not in shared} for r in rows]
    return rows, textwrap.wrap(f"every row: {text}", limit)


def _wrap_widths(rows: list[dict], columns: list[str], limit: int) -> dict[str, int]:
    """Break the text columns' cells (at spaces) until the table fits: the widest of them
    narrows first, a character at a time, so they end about as wide; each keeps at least
    12 characters and its longest word."""
    present = [c for c in columns if c in rows[0]]
    wrap_at = {c: max(len(r[c]) for r in rows) for c in present}
    # never narrower than its longest word: a name is never cut mid-word
    floor = {c: max(12, *(len(w) for r in rows for w in r[c].split())) for c in present}
    over = table_width(rows) - limit
    while over > 0:
        narrowable = [c for c in wrap_at if wrap_at[c] > floor[c]]
        col = max(narrowable, key=lambda c: wrap_at[c], default=None)
        if col is None:
            break
        wrap_at[col] -= 1
        over -= 1
    # a header wider than its cells wraps too; a cell that fits its column keeps one line
    return {c: at for c, at in wrap_at.items() if at < max(len(r[c]) for r in rows)}


def _cell_lines(text: str, at: int | None) -> list[str]:
    if at is None or len(text) <= at:
        return [text]
    return textwrap.wrap(text, at, break_on_hyphens=False) or [""]


def seed_table(rows: list[dict], wrap_at: Mapping[str, int] | None = None) -> list[str]:
    """Seed 001's layout: centred cells between '|', '=' rules around, '-' under the header;
    a column in ``wrap_at`` breaks its text over lines at that width."""
    wrap_at = wrap_at or {}
    cols = list(rows[0])
    widths = _widths(rows, wrap_at)

    def lines(cells: list[str]) -> list[str]:
        split = [_cell_lines(str(c), wrap_at.get(col)) for c, col in zip(cells, cols)]
        depth = max(len(s) for s in split)
        return ["|".join((s[i] if i < len(s) else "").center(w)
                         for s, w in zip(split, widths)).rstrip() for i in range(depth)]

    total = sum(widths) + len(widths) - 1
    out = ["=" * total, *lines(cols), "-" * total]
    for r in rows:
        out += lines([r[c] for c in cols])
    out.append("=" * total)
    return out
