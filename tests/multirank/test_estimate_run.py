"""The estimate held against what followed, on a real run on this machine: every case within
1.5× either way of the estimate at the load it met, as its record keeps both (``bench.eta``).

The assertion is the same at any load and never reads the load: the estimate reads it (the
load meter, over each case's steps). But a change of others' load during a case's set-up,
between the meter's readings, goes unseen (it failed 1 run in 3 on a machine shared with
other test runs), so it is a ``timing`` test: run alone, on a machine otherwise idle."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# three cases of ~2-5 s each on 2 idle cores, steps long enough (~0.1 s) to outweigh the
# set-up allowance, the re-estimate used twice
RUN = ["run", "--nproc", "2", "--strategy", "zigzag,ulysses,llama3", "--seqlen", "2k",
       "--warmup", "1", "--iters", "3"]
WITHIN = 1.5


@pytest.mark.timing
@pytest.mark.slow
def test_each_case_took_its_estimate_within_half_again(tmp_path):
    out = tmp_path / "r.jsonl"
    cmd = [sys.executable, "-c", "import sys; from cpbench.cli import main; sys.exit(main())",
           *RUN, "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    said = re.findall(r"done in \S+ \S+ \(estimated \S+ \S+\)", done.stderr + done.stdout)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == len(said) == 4, done.stderr  # llama3's two layouts
    # the model against the case at the load it met (its record's, read over its steps):
    # what others' load did meanwhile is read, not forecast, so a burst of it mid-case (one
    # took 4.9x its line's estimate here, others on 26 of its ~30 CPU seconds) does not
    # decide this; the line's own estimate is in the message
    ratios = [r["estimate"]["took_s"] / r["estimate"]["at_load_s"] for r in records]
    said_ratios = [r["estimate"]["took_s"] / r["estimate"]["revised_s"] for r in records]
    loads = [r["load"] for r in records]
    assert all(1 / WITHIN <= x <= WITHIN for x in ratios), (ratios, said_ratios, loads)
    # the first case's line is its plan; a later one's its re-estimate
    assert records[0]["estimate"]["revised_s"] == records[0]["estimate"]["case_s"]
