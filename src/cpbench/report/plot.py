"""``cpbench report --plot out.png``: TFLOPs/s per GPU against Seq Len, a line per strategy
(placement, and topology when the records hold several); OOM and failed cases as red marks
on the x axis, labelled. matplotlib is imported here only (``pip install cpbench[plot]``)."""

from __future__ import annotations

import textwrap

from cpbench.errors import UsageError
from cpbench.profile.breakdown import ordered
from cpbench.report.labels import row_label
from cpbench.report.sweep import latest_frame, row_keys, size_text
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


def plot(records: list[dict], path: str, title_note: str | None = None) -> None:
    """Write the plot of ``records`` to ``path`` (the format from its suffix);
    ``title_note`` is appended to the title (e.g. that the figures are simulated)."""
    plt = require_matplotlib()
    df = latest_frame(records)
    if df.empty:
        raise UsageError("no records to plot")
    df = df.assign(row=row_keys(df))
    df["rate"] = df["fwd_tflops"].where(df["fwd_only"], df["fwd_bwd_tflops"])
    rows = list(dict.fromkeys(df["row"]))
    # the legend goes under the axes, two columns: the figure grows with it, the axes keep
    # their size whatever the number of lines
    legend_rows = (len(rows) + 2) // 2
    fig, ax = plt.subplots(figsize=(10, 5.0 + 0.22 * legend_rows), dpi=120)
    marks = []  # (seqlen, status, colour) of the cases with no rate, drawn last
    for i, (row, g) in enumerate(df.groupby("row", sort=False)):
        g = g.sort_values("seqlen")
        ok = g[(g["status"] == OK) & g["rate"].notna()]
        line, = ax.plot(ok["seqlen"], ok["rate"], label=row, **line_style(i, plt))
        bad = g[(g["status"] != OK) | g["rate"].isna()]
        marks += [(s, st, line.get_color()) for s, st in zip(bad["seqlen"], bad["status"])]
    if marks:
        ax.scatter([m[0] for m in marks], [0] * len(marks), marker="x", s=70, color="red",
                   zorder=3, clip_on=False, label="OOM / failed (at 0)")
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
    phase = "FWD" if df["fwd_only"].all() else "FWD+BWD"
    ax.set_xlabel("Seq Len (global)")
    ax.set_ylabel(f"TFLOPs/s per GPU ({phase})")
    a = df.iloc[0]
    topo = ", ".join(dict.fromkeys(df["topo"]))
    title = (f"{a['dtype']}, B={a['batch']}, H={a['heads']}, D={a['head_dim']}, "
             f"{'causal' if a['causal'] else 'full'} — {topo} GPUs"
             + (f" ({title_note})" if title_note else ""))
    ax.set_title(textwrap.fill(title, 90), fontsize=10)  # wrapped: never cut off
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2,
              frameon=False)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


MARKERS = "osD^vP*Xhp<>"


def line_style(i: int, plt) -> dict:
    """The i-th line's colour and marker: 20 colours (tab20) x 12 markers, so no two lines of
    a plot look alike (matplotlib's default cycle repeats its colours after ten)."""
    colours = plt.get_cmap("tab20").colors
    return {"color": colours[(i * 2) % 20 + (i // 10) % 2], "marker": MARKERS[i % len(MARKERS)]}


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
        ax.barh(labels, widths, left=left, label=part, color=line_style(i, plt)["color"])
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
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return True
