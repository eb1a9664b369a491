"""``cpbench report --plot out.png``: TFLOPs/s per GPU (per rank on CPUs) against Seq Len, a
line per strategy and placement, a panel per topology, split by strategy family so that no
panel holds more than ``MAX_SERIES`` lines; a series keeps its colour and marker in every
panel, no two series of a plot share both. OOM and failed cases as red marks on the x axis,
labelled. matplotlib is imported here only (``pip install cpbench[plot]``)."""

from __future__ import annotations

import textwrap

from cpbench.errors import UsageError
from cpbench.profile.breakdown import ordered
from cpbench.report.labels import rank_unit, ranks_text, row_label
from cpbench.report.sweep import latest_frame, size_text
from cpbench.results import OK

INSTALL_HINT = "--plot needs matplotlib: pip install 'cpbench[plot]'"


def require_matplotlib():
    """matplotlib.pyplot on the Agg backend (files, no display); ValueError with the install
    line when it is missing."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError(INSTALL_HINT) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str) -> None:
    """Write ``fig`` to ``path`` (the format from its suffix), its text never cut off, and
    free it: pyplot keeps every open figure."""
    plt = require_matplotlib()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def check_target(path: str) -> None:
    """ValueError with the fix when there is no matplotlib or ``path`` cannot be written:
    called before any work or output, so a bad --plot is one line, not half a report."""
    from pathlib import Path

    require_matplotlib()
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"--plot {path} is a directory; give a file such as "
                         f"{target / 'tflops.png'}")
    if not target.parent.is_dir():
        raise UsageError(f"--plot {path}: directory {target.parent} does not exist")


MAX_SERIES = 8  # lines a panel holds before it splits: more cannot be told apart


def panels(df) -> list[tuple[str, list[str]]]:
    """The panels of the plot: (title, the series it draws). A panel per topology, split
    by strategy family (a strategy's placements stay together) into as few panels as keep
    each at ``MAX_SERIES`` lines or fewer, about as full as each other; a family with more
    lines than a panel holds is cut into pieces first."""
    out = []
    for topo, g in df.groupby("topo", sort=False):
        families: dict[str, list[str]] = {}
        for strategy, series in zip(g["strategy"], g["series"]):
            members = families.setdefault(strategy, [])
            if series not in members:
                members.append(series)
        total = sum(len(m) for m in families.values())
        count = -(-total // MAX_SERIES)
        target = -(-total // count)  # the fullest panel, balanced
        pieces = [m[i:i + target] for m in families.values() for i in range(0, len(m), target)]
        chunks: list[list[str]] = [[]]
        for piece in pieces:
            if chunks[-1] and len(chunks[-1]) + len(piece) > target:
                chunks.append([])
            chunks[-1].extend(piece)
        for i, chunk in enumerate(chunks):
            part = f" ({i + 1}/{len(chunks)})" if len(chunks) > 1 else ""
            out.append((f"{topo}{part}", chunk))
    return out


def plot(records: list[dict], path: str, title_note: str | None = None) -> None:
    """Write ``figure(records, title_note)`` to ``path`` (the format from its suffix)."""
    save(figure(records, title_note), path)


def figure(records: list[dict], title_note: str | None = None):
    """The plot of ``records``: a panel per topology (and strategy families, at most
    ``MAX_SERIES`` lines a panel), each series one colour and marker in every panel;
    ``title_note`` is appended to the title (e.g. that the figures are simulated)."""
    plt = require_matplotlib()
    df = latest_frame(records)
    if df.empty:
        raise UsageError("no records to plot")
    mixed = df["simulated"].nunique() > 1  # a prediction beside the measured row
    df = df.assign(series=[lab + (" (simulated)" if mixed and sim else "")
                           for lab, sim in zip(df["label"], df["simulated"])])
    # a withheld rate (guards.withhold: a flagged row, or one not measuring CP) is a mark at
    # 0, not a point
    df["rate"] = df["fwd_tflops"].where(df["fwd_only"], df["fwd_bwd_tflops"])
    df["mark"] = df["status"].where(df["status"] != OK, [
        "flagged" if flags else "not CP" if isinstance(why, str) else OK
        for flags, why in zip(df["flags"], df["not_measured"])])
    unit = rank_unit(records)
    layout = panels(df)
    styles = {name: line_style(i, plt) for name, i in _style_indices(layout).items()}
    cols = min(2, len(layout))
    rows = -(-len(layout) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 5.6 * rows), dpi=120,
                             squeeze=False)
    for ax, (title, series) in zip(axes.ravel(), layout):
        topo = title.split(" ")[0]
        _panel(ax, df[(df["topo"] == topo) & df["series"].isin(series)], series, styles)
        ax.set_title(f"{topo} {ranks_text(unit)}{title[len(topo):]}", fontsize=9)
        ax.set_ylabel(f"TFLOPs/s per {unit} ({'FWD' if df['fwd_only'].all() else 'FWD+BWD'})",
                      fontsize=8)
    for ax in axes.ravel()[len(layout):]:
        ax.set_visible(False)
    tops: dict[str, float] = {}  # a topology's panels on one scale, so they compare
    for ax, (title, _) in zip(axes.ravel(), layout):
        key = title.split(" ")[0]
        tops[key] = max(tops.get(key, 0.0), ax.get_ylim()[1])
    for ax, (title, _) in zip(axes.ravel(), layout):
        ax.set_ylim(0, tops[title.split(" ")[0]])
    a = df.iloc[0]
    title = (f"{a['dtype']}, B={a['batch']}, H={a['heads']}, D={a['head_dim']}, "
             f"{'causal' if a['causal'] else 'full'}"
             + (f" ({title_note})" if title_note else "") + _not_cp(df))
    fig.suptitle(textwrap.fill(title, 90), fontsize=10)  # wrapped: never cut off
    fig.tight_layout()
    return fig


def _not_cp(df) -> str:
    """The title's word that rows' timings do not measure CP (``guards.not_measured``)."""
    reasons = sorted({r.split(":")[0] for r in df["not_measured"] if isinstance(r, str) and r})
    return f"; timings do not measure CP ({'; '.join(reasons)})" if reasons else ""


def _style_indices(layout: list[tuple[str, list[str]]]) -> dict[str, int]:
    """A style (``line_style``'s index) per series, the same in every panel it is in: the
    first whose colour no series it shares a panel with has, else the first whose colour
    and marker none has (two series of a panel never look alike)."""
    neighbours: dict[str, set[str]] = {}
    for _, series in layout:
        for name in series:
            neighbours.setdefault(name, set()).update(n for n in series if n != name)
    chosen: dict[str, int] = {}
    for name in neighbours:
        taken = {chosen[n] for n in neighbours[name] if n in chosen}
        colours = {t % 10 for t in taken}
        looks = {(t % 10, t % len(MARKERS)) for t in taken}
        free = [i for i in range(10) if i not in colours]
        chosen[name] = free[0] if free else next(
            i for i in range(10 * len(MARKERS)) if (i % 10, i % len(MARKERS)) not in looks)
    return chosen


def _panel(ax, df, series: list[str], styles: dict) -> None:
    """One panel: a line per series, OOM, failed, flagged and not-CP cases as red marks at 0,
    labelled; its legend under it (the axes keep their size whatever the number of lines)."""
    marks = []  # (seqlen, status, colour) of the cases with no rate, drawn last
    for name in series:
        g = df[df["series"] == name].sort_values("seqlen")
        ok = g[(g["status"] == OK) & g["rate"].notna()]
        ax.plot(ok["seqlen"], ok["rate"], label=name, **styles[name])
        bad = g[(g["status"] != OK) | g["rate"].isna()]
        marks += [(s, st, styles[name]["color"]) for s, st in zip(bad["seqlen"], bad["mark"])]
    if marks:
        ax.scatter([m[0] for m in marks], [0] * len(marks), marker="x", s=70, color="red",
                   zorder=3, clip_on=False, label="OOM / failed / flagged / not CP (at 0)")
        stacked: dict = {}
        for s, status, colour in marks:  # one label per case, stacked where they share a Seq Len
            k = stacked[s] = stacked.get(s, -1) + 1
            ax.annotate(status, (s, 0), textcoords="offset points", xytext=(0, 8 + 10 * k),
                        ha="center", fontsize=7, color=colour)
    seqlens = sorted(df["seqlen"].unique())
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqlens, [size_text(int(s)) for s in seqlens])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("Seq Len (global)", fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2,
              frameon=False)


MARKERS = "osD^vP*Xhp<>"


def line_style(i: int, plt) -> dict:
    """The i-th series' colour and marker: tab10's ten colours x 12 markers, so no two of
    60 series look alike, and series next to each other (a panel's: at most
    ``MAX_SERIES`` in a row) never share a colour."""
    colours = plt.get_cmap("tab10").colors
    return {"color": colours[i % len(colours)], "marker": MARKERS[i % len(MARKERS)]}


def breakdown_path(path: str) -> str:
    """Where ``--plot OUT.png`` puts the breakdown chart: ``OUT.breakdown.png``."""
    from pathlib import Path

    p = Path(path)
    return str(p.with_name(f"{p.stem}.breakdown{p.suffix}"))


def plot_breakdown(records: list[dict], path: str) -> bool:
    """A stacked bar per profiled row (``run --profile``): the parts of its step's wall time
    (attention, communication by op, …, idle), in %, with the exposed communication marked.
    False when no record carries a breakdown (nothing written)."""
    profiled = [r for r in records if (r.get("profile") or {}).get("wall_pct")]
    if not profiled:
        return False
    plt = require_matplotlib()
    parts = ordered(dict.fromkeys(p for r in profiled for p in r["profile"]["wall_pct"]))
    labels = [f"{row_label(r)} @ {size_text(r['config']['attention']['seqlen'])}"
              for r in profiled]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.45 * len(profiled) + 0.2 * len(parts)),
                           dpi=120)
    left = [0.0] * len(profiled)
    for i, part in enumerate(parts):
        widths = [r["profile"]["wall_pct"].get(part, 0.0) for r in profiled]
        # bars have no marker: tab20's twenty colours, none repeated before the 21st part
        ax.barh(labels, widths, left=left, label=part, color=plt.get_cmap("tab20").colors[i % 20])
        left = [a + b for a, b in zip(left, widths)]
    for y, r in enumerate(profiled):  # the communication no kernel hides, on its bar
        pct = r["profile"].get("exposed_comm_pct")
        if pct is not None:
            ax.annotate(f"exposed comm {pct:.1f} %", (101, y), va="center", fontsize=7)
    ax.set_xlim(0, 125)
    ax.set_xlabel("% of the profiled step's wall time (slowest rank)")
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3,
              frameon=False)
    ax.set_title("Where the time goes", fontsize=10)
    fig.tight_layout()
    save(fig, path)
    return True
