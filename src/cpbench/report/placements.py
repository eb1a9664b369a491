"""One view of placements (``report --compare placement``, ``simulate --compare-placements``):
one table, strategy × placement, each strategy's winner and by how much.

A row is a strategy and the options that set it apart (its variant: USP's degrees and
head- / ring-first, a double ring's window, …); the columns are the topologies (nodes × ranks
per node) when the records hold several, else one time column. A cell is the FWD+BWD time
(FWD with --fwd-only) in ms, measured or predicted, or OOM / failed.

The Winner column, on each strategy's fastest row, names its fastest placement and the margin
over the next fastest (next / winner − 1), with
- measured: the 95 % bootstrap interval of that ratio, only from 3 samples a side
  (``metrics.ratio_interval``);
- simulated: the model's stated error where the caller knows it (``cpbench simulate``: its
  validation against held-out published rows), never an interval.
A placement the physics guards flag, or whose timings do not measure CP, never wins (as in
``report --best``): its time shows, its row marked with the note. The terminal shows each
strategy's ``TOP`` fastest rows (``--wide``: all), and counts the rest.
"""

from __future__ import annotations

import math
import re
import textwrap
from dataclasses import dataclass

from cpbench.errors import UsageError
from cpbench.metrics import ratio_interval
from cpbench.report import tables
from cpbench.report.cells import missing, ms, sig
from cpbench.report.dataframe import PROBLEM
from cpbench.report.labels import joined, rank_unit, ranks_text
from cpbench.report.render import Fit, grouped, prose, render, width
from cpbench.report.sweep import latest_frame, size_text
from cpbench.results import OK

TOP = 5  # rows a strategy shows in the terminal; --wide shows every one
# the problem apart from its length and its topology: one table, its rows per Seq Len
_SHAPE = [c for c in PROBLEM if c not in ("seqlen", "ranks_per_node")] + ["fwd_only"]


def _natural(text: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def _distinct(labels: list[str]) -> tuple[dict[str, str], str]:
    """Each label without the words all of them share, and those shared words:
    ``head-first u=8 r=4`` / ``ring-first u=8 r=4`` → ``head-first`` / ``ring-first``,
    shared ``u=8 r=4``."""
    words = [label.split() for label in labels]
    common = [w for w in words[0] if all(w in ws for ws in words[1:])]
    short = {label: " ".join(w for w in ws if w not in common) or label
             for label, ws in zip(labels, words)}
    return short, " ".join(common)


@dataclass(frozen=True)
class ModelError:
    """A model's stated error, as its validation measured it: "median |error| 7.5 % on 16
    held-out published rows"."""

    median: float  # a fraction
    what: str  # where it comes from, in words


@dataclass(frozen=True)
class _Cell:
    topo: str
    variant: str
    time: float | None
    text: str
    samples: list | None
    eligible: bool  # may win: ran, unflagged, measures CP
    notes: str

    def name(self, several_topos: bool, several_variants: bool) -> str:
        parts = ([self.topo] if several_topos else []) + \
            ([self.variant] if several_variants and self.variant != "-" else [])
        return " ".join(parts)


def _cells(df) -> list[_Cell]:
    out = []
    for r in df.to_dict("records"):
        phase = "fwd" if r["fwd_only"] else "fwd_bwd"
        time = r[f"{phase}_ms"]
        ok = r["status"] == OK and not missing(time)
        reason = tables.short_reason(r["not_measured"])
        notes = "; ".join(x for x in (r["flags"], reason) if x)
        samples = r[f"iters_{phase}"]
        number = sig if r["simulated"] else ms  # a prediction: 3 significant figures
        out.append(_Cell(r["topo"], r["options"], time if ok else None,
                         number(time) if ok else r["status"],
                         samples if isinstance(samples, list) else None,
                         ok and not notes, notes))
    return out


def _time(c: _Cell) -> float:
    return math.inf if c.time is None else c.time


def _margin(win: _Cell, nxt: _Cell, simulated: bool, error: ModelError | None) -> str:
    """The next placement's time over the winner's, less one, in %, with its interval or the
    model's stated error."""
    assert win.time is not None and nxt.time is not None
    text = f"+{100 * (nxt.time / win.time - 1):.1f} %"
    if simulated:
        return text + (f" (model ±{100 * error.median:.1f} %)" if error else " (model)")
    interval = ratio_interval(nxt.samples, win.samples)
    if interval is None:
        n = min(len(c.samples or ()) for c in (win, nxt))
        return text + f" ({n} iteration{'s' * (n != 1)}: no interval)"
    return text + f" [{100 * (interval[0] - 1):+.1f}, {100 * (interval[1] - 1):+.1f}]"


def _winner(cells: list[_Cell], names, simulated: bool, error: ModelError | None
            ) -> tuple[_Cell | None, str]:
    """The strategy's winning cell and the Winner column's text."""
    ranked = sorted((c for c in cells if c.eligible), key=_time)
    if not ranked:
        ran = any(c.time is not None for c in cells)
        return None, "none: flagged or not CP" if ran else "none ran"
    win, nxt = ranked[0], ranked[1] if len(ranked) > 1 else None
    head = names(win, win)  # on the winner's own row: its topology, if there are several
    if nxt is None:
        return win, f"{head}: the only one" if head else "the only one"
    margin = _margin(win, nxt, simulated, error)
    return win, f"{head + ': ' if head else ''}{margin} over {names(nxt, win) or 'the next'}"


def _strategy_rows(strategy: str, g, topos: list[str], simulated: bool,
                   error: ModelError | None) -> tuple[list[dict], str | None]:
    """One strategy's rows at one problem, fastest first (the winner's row carries the
    Winner text), and a line counting the rows past ``TOP``."""
    cells = _cells(g)
    variants = sorted(dict.fromkeys(c.variant for c in cells), key=_natural)
    short, common = _distinct(variants)
    several_t, several_v = len(topos) > 1, len(variants) > 1

    def names(c: _Cell, win: _Cell) -> str:
        """How the Winner column names ``c``: its topology where there are several, its
        variant where it is not the winner's row."""
        named = _Cell(c.topo, short[c.variant], None, "", None, False, "")
        return named.name(several_t, several_v and c.variant != win.variant)

    win, said = _winner(cells, names, simulated, error)

    def best(v: str) -> float:
        times = [c.time for c in cells if c.variant == v and c.time is not None]
        return min(times) if times else math.inf

    order = sorted(variants, key=lambda v: (win is None or v != win.variant, best(v)))
    rows = []
    for v in order:
        mine = {c.topo: c for c in cells if c.variant == v}
        # the strategy first: a row's note marks go beside it (report.render)
        row = {"Strategy": joined(strategy, common or "-"), "Placement": short[v],
               "Seq Len": size_text(int(g["seqlen"].iloc[0]))}
        row.update({t: mine[t].text if t in mine else "-" for t in topos})
        row["Winner"] = said if win is not None and v == win.variant or \
            (win is None and v == order[0]) else ""
        notes = [n for c in mine.values() for n in c.notes.split("; ") if n]
        kind = grouped(notes)  # a row spans topologies: each kind of note once, as a range
        row["Flags"] = "; ".join(dict.fromkeys(kind[n] for n in notes)) or "-"
        rows.append(row)
    if width() is None or len(rows) <= TOP:
        return rows, None
    rest = [best(v) for v in order[TOP:] if math.isfinite(best(v))]
    top = win.time if win is not None else None
    spread = (f", {min(rest) / top:.2f}-{max(rest) / top:.2f}x the winner's time"
              if rest and top else "")
    return rows[:TOP], (f"{joined(strategy, common or '-')} at {rows[0]['Seq Len']}: "
                        f"{len(rows) - TOP} more placements{spread} (--wide lists them)")


def _title(df, records: list[dict], topos: list[str]) -> str:
    a = df.iloc[0]
    unit = rank_unit(records)
    phase = "FWD" if a["fwd_only"] else "FWD+BWD"
    where = (f"{a['world']} {ranks_text(unit)} as nodes×{unit}s" if len(topos) > 1
             else f"{topos[0]} {ranks_text(unit)}")
    model = records[0]["config"]["attention"]  # a model's V width and sinks (--model)
    extra = (f"DV={model['v_head_dim']}, " if model.get("v_head_dim") else "") + \
        ("sinks, " if model.get("sinks") else "")
    return (f"{phase} (ms) by placement on {where} ({a['dtype']}, B={a['batch']}, "
            f"H={a['heads']}, D={a['head_dim']}, {extra}"
            f"{'causal' if a['causal'] else 'full'})")


def placement_view(records: list[dict], fmt: str = "table",
                   error: ModelError | None = None) -> str:
    """The one table (see the module docstring), a table per problem shape if the records
    hold several (a dtype, a head count: they do not compare)."""
    df = latest_frame(records)
    df = df[df["ranks_per_problem"] > 1] if not df.empty else df
    if df.empty:
        return "no CP rows: nothing to compare\n"
    simulated = bool(df["simulated"].all())
    lines: list[str] = []
    more: list[str] = []
    for _, shape in df.groupby(_SHAPE, sort=False, dropna=False):
        topos = list(dict.fromkeys(shape["topo"]))
        rows = []
        for (_, strategy), g in shape.groupby(["seqlen", "strategy"], sort=True):
            got, extra = _strategy_rows(strategy, g, topos, simulated, error)
            rows += got
            more += [extra] if extra else []
        if len(topos) == 1:  # the one column is the time
            rows = [{("FWD+BWD (ms)" if k == topos[0] else k): v for k, v in r.items()}
                    for r in rows]
        lines += ([""] if lines else []) + render(_title(shape, records, topos), rows, fmt, _FIT)
    lines += prose(more)
    return "\n".join(lines + _under(simulated, error, fmt)) + "\n"


_FIT = Fit(lift=("Seq Len",), wrap=("Strategy", "Placement", "Winner"),
           notes=("Flags",))


def _under(simulated: bool, error: ModelError | None, fmt: str) -> list[str]:
    if simulated:
        said = (f"the model's stated error: {error.what}; a margin under it does not tell the "
                f"placements apart" if error else
                "no stated error: the preset was validated on no held-out published row")
        text = f"Winner: each strategy's fastest placement, its margin predicted ({said})."
    else:
        text = ("Winner: each strategy's fastest placement that is neither flagged nor off CP, "
                "its margin over the next with the 95 % bootstrap interval (from 3 iterations "
                "a side).")
    return ["", *(prose([text]) if fmt != "markdown" else [text])]


def plot(records: list[dict], path: str, note: str | None = None) -> None:
    """Write ``figure`` to ``path`` (format from its suffix)."""
    from cpbench.report.plot import save

    save(figure(records, note), path)


def figure(records: list[dict], note: str | None = None):
    """One panel: each strategy's rows down y, a marker per placement (topology) at its time
    over the strategy's winner's (1 = the winner; the axis spans the differences, not 0);
    hollow where the placement may not win. A one-line title, the notes under the figure."""
    from cpbench.report.plot import require_matplotlib

    plt = require_matplotlib()
    df = latest_frame(records)
    df = df[df["ranks_per_problem"] > 1] if not df.empty else df
    points, labels = _relative(df)
    if not points:
        raise UsageError("--compare placement --plot: no CP row ran, nothing to plot; give "
                         "records of CP strategies")
    topos = list(dict.fromkeys(t for _, t, _, _ in points))
    labels = [textwrap.fill(x, 44) for x in labels]
    tallest = max(x.count("\n") + 1 for x in labels)  # a row as tall as its longest label
    # rows down the y axis (labels stay readable), the relative time across
    fig, ax = plt.subplots(figsize=(7.5, max(2.5, 0.14 * max(3, tallest) * len(labels) + 1.2)),
                           dpi=120)
    for i, topo in enumerate(topos):
        colour = plt.get_cmap("tab10")(i % 10)
        for may_win in (True, False):
            at = [(y, x) for x, t, y, e in points if t == topo and e == may_win]
            if at:
                ax.scatter(*zip(*at), s=36, label=topo if may_win else f"{topo} (flagged)",
                           color=colour if may_win else "none", edgecolors=colour, zorder=3)
    ax.axvline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()  # the table's order, top down
    ax.set_xlabel("time / the strategy's fastest (1 = its winner)", fontsize=8)
    xs = [y for _, _, y, _ in points]
    pad = max(0.01, (max(xs) - min(xs)) * 0.08)  # the differences fill the axis, not 0
    ax.set_xlim(min(xs) - pad, max(xs) + pad)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=7, title="nodes × ranks per node", title_fontsize=7,
              loc="upper left", bbox_to_anchor=(1.01, 1.0))
    phase = "FWD" if df["fwd_only"].all() else "FWD+BWD"
    ax.set_title(f"{phase} time by placement, relative to each strategy's fastest", fontsize=9)
    notes = [n for n in (note, "hollow: flagged or not measuring CP, never a winner"
                         if any(not e for *_, e in points) else None) if n]
    fig.tight_layout()
    if notes:
        fig.text(0.01, 0.0, "\n".join(textwrap.fill(n, 130) for n in notes), fontsize=7,
                 va="top")
    return fig


def _relative(df) -> tuple[list[tuple[int, str, float, bool]], list[str]]:
    """(row, topology, time over its strategy's fastest, may win) for every cell that ran,
    and the rows' labels: the strategy's winner is the reference, its fastest cell where none
    may win."""
    points: list[tuple[int, str, float, bool]] = []
    labels: list[str] = []
    if df.empty:
        return points, labels
    several_lengths = df["seqlen"].nunique() > 1
    for (seqlen, strategy), g in df.groupby(["seqlen", "strategy"], sort=True):
        cells = [c for c in _cells(g) if c.time is not None]
        eligible = [_time(c) for c in cells if c.eligible]
        ref = min(eligible or [_time(c) for c in cells], default=math.inf)
        for v in sorted(dict.fromkeys(c.variant for c in cells), key=_natural):
            labels.append(joined(strategy, v) + (f" @{size_text(int(seqlen))}"
                                                 if several_lengths else ""))
            points += [(len(labels) - 1, c.topo, _time(c) / ref, c.eligible)
                       for c in cells if c.variant == v]
    return points, labels
