"""``cpbench report --best``: which strategy wins each problem, and by how much.

A problem is everything but the strategy: the mask (causal or full, documents, window), the
shape (dtype, B, S, heads, head dim), the topology (world, nodes × GPUs), the kernel and the
device, measured or simulated; under ``--packings K`` the distribution, not one packing's
lengths (judged over the packings: ``_packed_verdict``). Among its CP rows that ran, the
fastest FWD+BWD median (FWD with --fwd-only) wins; a row a physics guard flagged
(``cpbench.guards``: above the device's peak, sent other than its schedule, sizes not as
asked) never does: it is listed below the table instead; the margin is the runner-up's time over
the winner's, less one.
The words are ``cpbench compare``'s: it wins when the 95 % bootstrap interval of the
runner-up / winner ratio of per-iteration times lies wholly above 1 + min_effect, it is a
tie only when that interval lies inside 1 ± min_effect (an equivalence test), and unclear
otherwise: overlapping intervals show no difference, they do not show the absence of one.
Simulated rows, which have no spread, tie within 1 %.
``--plot`` draws the winner map: problems × topologies, each cell coloured by its winner.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median

from cpbench import rounds
from cpbench.metrics import ratio_interval
from cpbench.report.dataframe import frame
from cpbench.report.labels import joined, rank_unit, ranks_text
from cpbench.report.render import Fit, prose, render
from cpbench.report.tables import case_text
from cpbench.results import OK

SIM_TIE = 0.01  # simulated rows: a margin below this is a tie (a model has no spread)
MIN_EFFECT = 0.02  # the equivalence band, as `cpbench compare --min-effect` defaults
WINS, TIE, UNCLEAR, ONLY = "wins", "tie", "unclear", "only one"


@dataclass(frozen=True)
class Verdict:
    problem: str
    topology: str
    winner: str
    time_ms: float
    runner_up: str | None
    margin: float | None  # runner-up / winner - 1
    interval: tuple[float, float] | None  # of runner-up / winner
    call: str  # WINS, TIE, UNCLEAR or ONLY

    @property
    def tie(self) -> bool:
        return self.call == TIE


def _call(interval: tuple[float, float], min_effect: float) -> str:
    low, high = interval
    if low > 1 + min_effect:
        return WINS
    return TIE if 1 - min_effect <= low and high <= 1 + min_effect else UNCLEAR


def _problem(row: dict) -> str:
    mask = "causal" if row["causal"] else "full"
    if _packed(row):  # --packings K: one problem over its packings
        mask += f" docs {row['documents_spec']} ×{int(row['packings'])} packings"
    elif row["documents"] != "-":
        docs = row["documents"].split(",")
        mask += f" docs×{len(docs)}"
    if row["window"] != "(-1, -1)":
        mask += f" win{row['window'].replace(' ', '')}"
    source = " (sim)" if row["simulated"] else ""
    return (f"{mask} S={row['seqlen']} B={row['batch']} H={row['heads']} {row['dtype']} "
            f"{row['kernel']}{source}")


def verdicts(records: list[dict], min_effect: float = MIN_EFFECT) -> list[Verdict]:
    df = frame(rounds.pool(records))
    df = df[(df["status"] == OK) & (df["ranks_per_problem"] > 1) & (df["flags"] == "")
            & df["not_measured"].isna()]
    return [_packed_verdict(rows, min_effect) if _packed(rows[0])
            else _verdict(rows, min_effect) for rows in _groups(df)]


def _packed(row: dict) -> bool:
    """A row of ``--packings K`` (pandas leaves NaN where a record has no packing)."""
    return row.get("packing") is not None and row["packing"] == row["packing"]


def _groups(df):
    if df.empty:
        return []
    df = df.assign(time=df["fwd_ms"].where(df["fwd_only"], df["fwd_bwd_ms"]),
                   iters=df["iters_fwd"].where(df["fwd_only"], df["iters_fwd_bwd"]),
                   problem=[_problem(r) for r in df.to_dict("records")],
                   topology=[f"{n}×{g}" for n, g in zip(df["nodes"], df["ranks_per_node"])])
    df = df[df["time"].notna()]
    return [g.sort_values("time").to_dict("records")
            for _, g in df.groupby(["problem", "topology", "world"], sort=False)]


def _packed_verdict(rows: list[dict], min_effect: float) -> Verdict:
    """Over packings: each strategy's median over the packings it ran; the fastest wins. It
    wins when it beat the runner-up in every packing they share, each time with the 95 %
    bootstrap interval of the per-iteration ratio above 1 + min_effect; a tie when the
    widest interval over packings lies inside 1 ± min_effect; else unclear (simulated: a tie
    within SIM_TIE). The margin is the median of the per-packing ratios."""
    by: dict[str, dict[int, dict]] = {}
    for r in rows:
        by.setdefault(joined(r["strategy"], r["options"]), {})[int(r["packing"])] = r
    ranked = sorted(by, key=lambda n: median(r["time"] for r in by[n].values()))
    best, first = ranked[0], rows[0]
    best_ms = median(r["time"] for r in by[best].values())
    if len(ranked) == 1:
        return Verdict(first["problem"], first["topology"], best, best_ms, None, None, None,
                       ONLY)
    second = ranked[1]
    shared = sorted(set(by[best]) & set(by[second]))
    ratios = [by[second][i]["time"] / by[best][i]["time"] for i in shared]
    found = [ratio_interval(by[second][i]["iters"], by[best][i]["iters"]) for i in shared]
    bounds = [b for b in found if b]
    if len(bounds) == len(shared) and shared:
        interval = (min(b[0] for b in bounds), max(b[1] for b in bounds))
        call = _call(interval, min_effect)
    else:
        interval = None
        call = TIE if not shared or min(ratios) - 1 < SIM_TIE else WINS
    return Verdict(first["problem"], first["topology"], best, best_ms, second,
                   median(ratios) - 1 if ratios else None, interval, call)


def _verdict(rows: list[dict], min_effect: float) -> Verdict:
    best = rows[0]
    name = joined(best["strategy"], best["options"])
    if len(rows) == 1:
        return Verdict(best["problem"], best["topology"], name, best["time"], None, None,
                       None, ONLY)
    second = rows[1]
    margin = second["time"] / best["time"] - 1
    call = TIE if margin < SIM_TIE else WINS
    interval = ratio_interval(second["iters"], best["iters"])
    if interval:
        call = _call(interval, min_effect)
    return Verdict(best["problem"], best["topology"], name, best["time"],
                   joined(second["strategy"], second["options"]), margin, interval, call)


def best_table(records: list[dict], fmt: str = "table",
               min_effect: float = MIN_EFFECT) -> str:
    """One line per problem and topology: the winner, its time, the runner-up, the margin."""
    records = rounds.pool(records)
    vs = verdicts(records, min_effect)
    flagged = _flagged(records)
    if not vs:
        lines = ["no CP rows that ran unflagged: nothing to rank", *flagged]
        return "\n".join(lines if fmt == "markdown" else prose(lines)) + "\n"
    rows = []
    for v in vs:
        margin = "-" if v.margin is None else f"{100 * v.margin:+.1f}"
        if v.interval:
            margin += f" [{100 * (v.interval[0] - 1):+.1f}, {100 * (v.interval[1] - 1):+.1f}]"
        rows.append({"Problem": v.problem, "Topology": v.topology, "Winner": v.winner,
                     "Time (ms)": f"{v.time_ms:.2f}", "Runner-up": v.runner_up or "-",
                     "Margin (%)": margin, "Verdict": v.call})
    if fmt == "markdown":
        return "\n".join(render(None, rows, fmt) + [f"- {line}" for line in flagged]) + "\n"
    drift = rounds.drift_lines(records, case_text)
    title = (f"Which strategy wins (fastest FWD+BWD; wins: the 95 % interval of runner-up / "
             f"winner above 1 + {min_effect:g}; tie: inside 1 ± {min_effect:g}; unclear: "
             f"neither):")
    return "\n".join([*prose([title]), *render(None, rows, fmt, _FIT), *prose(flagged)]
                     + ([""] + prose(drift) if drift else [])) + "\n"


# the problem is the same on every row of a one-problem run: a line above the table then
_FIT = Fit(lift=("Problem", "Topology"), wrap=("Problem", "Runner-up", "Winner"))


def _flagged(records: list[dict]) -> list[str]:
    """A line per flagged row that ran: why it is not ranked."""
    df = frame(records)
    df = df[(df["status"] == OK) & (df["ranks_per_problem"] > 1)
            & ((df["flags"] != "") | df["not_measured"].notna())]
    return [f"not ranked: {joined(r['strategy'], r['options'])} {_problem(r)} "
            f"{r['nodes']}×{r['ranks_per_node']}: "
            f"{'; '.join(x for x in (r['flags'], r['not_measured']) if isinstance(x, str) and x)}"
            for r in df.to_dict("records")]


def plot_winners(records: list[dict], path: str, min_effect: float = MIN_EFFECT) -> None:
    """The winner map: a row per problem, a column per topology, coloured by strategy;
    a tie (~) or an unclear call (?) is hatched and names both."""
    from cpbench.report.plot import require_matplotlib, save

    plt = require_matplotlib()
    vs = verdicts(records, min_effect)
    problems = list(dict.fromkeys(v.problem for v in vs))
    topos = list(dict.fromkeys(v.topology for v in vs))
    names = sorted({v.winner for v in vs})
    colours = {n: plt.get_cmap("tab20")(i % 20) for i, n in enumerate(names)}
    fig, ax = plt.subplots(figsize=(2.2 * len(topos) + 4, 0.6 * len(problems) + 1.5), dpi=120)
    for v in vs:
        x, y = topos.index(v.topology), problems.index(v.problem)
        ax.add_patch(plt.Rectangle((x, y), 1, 1, color=colours[v.winner],
                                   hatch="//" if v.call in (TIE, UNCLEAR) else None, ec="white"))
        text = v.winner + (f"\n~ {v.runner_up}" if v.tie else
                           f"\n? {v.runner_up}" if v.call == UNCLEAR else
                           f"\n+{100 * v.margin:.0f} %" if v.margin is not None else "")
        ax.text(x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=7)
    ax.set_xlim(0, len(topos))
    ax.set_ylim(0, len(problems))
    ax.set_xticks([i + 0.5 for i in range(len(topos))], topos)
    ax.set_yticks([i + 0.5 for i in range(len(problems))], problems, fontsize=7)
    ax.set_xlabel(f"nodes × {ranks_text(rank_unit(records))}")
    ax.set_title("Fastest strategy per problem\n(hatched: a tie with the runner-up, or unclear)",
                 fontsize=9)
    fig.tight_layout()
    save(fig, path)
