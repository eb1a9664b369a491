"""``cpbench compare --plot OUT.png``: both runs' per-iteration step times, one panel per case
and phase (each on its own scale: a FWD time beside a FWD+BWD one would flatten it), a box and
every iteration as a dot for A and for B, the ratio, its interval and the verdict above."""

from __future__ import annotations

import math
import textwrap

import numpy as np

from cpbench.compare import cells
from cpbench.compare.analysis import NOT_COMPARABLE, PHASES, Comparison, PhaseTest, Uncompared
from cpbench.report.plot import require_matplotlib, save

COLUMNS = 4  # panels per row: two cases' FWD and FWD+BWD
COLOURS = {"A": "tab:blue", "B": "tab:orange"}


def plot(cmp: Comparison, path: str) -> None:
    """Write the distributions of every compared (case, phase) to ``path`` (format from its
    suffix)."""
    plt = require_matplotlib()
    # those not comparable: their times, no ratio
    panels: list[PhaseTest | Uncompared] = [*cmp.tests, *cmp.uncompared]
    cols = min(COLUMNS, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.3 * cols, 3.4 * rows), dpi=120,
                             squeeze=False)
    jitter = np.random.default_rng(0)  # the dots' spread only: fixed, so re-plots match
    for ax, t in zip(axes.ravel(), panels):
        for x, (side, values) in enumerate((("A", t.samples_a), ("B", t.samples_b))):
            ax.boxplot([values], positions=[x], widths=0.5, showfliers=False,
                       medianprops={"color": COLOURS[side], "linewidth": 2})
            ax.scatter(x + jitter.uniform(-0.15, 0.15, len(values)), values, s=8,
                       alpha=0.6, color=COLOURS[side], zorder=3)
        ax.set_xticks([0, 1], ["A", "B"])
        ax.set_xlim(-0.6, 1.6)
        ax.set_ylabel(f"{PHASES[t.phase]} step time (ms)", fontsize=8)
        ax.tick_params(labelsize=7)
        said = (f"B/A ×{t.ratio:.3f} [{t.ci_low:.3f}, {t.ci_high:.3f}] {t.verdict}"
                if isinstance(t, PhaseTest) else NOT_COMPARABLE)
        ax.set_title(f"{textwrap.fill(t.case, 40)}\n{PHASES[t.phase]}: {said}", fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    for ax in axes.ravel()[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"Per-iteration step times (slowest rank), A vs B; ratio of medians with its "
                 f"{cells.percent(cmp.level)} interval", fontsize=9)
    fig.tight_layout()
    save(fig, path)
