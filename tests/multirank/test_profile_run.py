"""``cpbench run --profile``: one Chrome trace per rank per case, each record's ``profile``
breakdown, and the same figures recomputed later from the saved trace."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

from cpbench import results
from cpbench.profile import breakdown, groups

REPO = Path(__file__).resolve().parents[2]
# the acceptance command's cases and length, on a small problem: the suite runs on 2 cores
SMALL = ["--heads", "2", "--head-dim", "16", "--warmup", "0", "--iters", "1"]


def _cpbench(*args, timeout=240):
    cmd = [sys.executable, "-c", "import sys; from cpbench.cli import main; sys.exit(main())",
           *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_run_profile_traces_and_breakdown(tmp_path):
    prof, out = tmp_path / "prof", tmp_path / "r.jsonl"
    run = _cpbench("run", "--strategy", "zigzag,ulysses", "--nproc", "2", "--seqlen", "4k",
                   *SMALL, "--profile", prof, "--out", out)
    assert run.returncode == 0, run.stdout + run.stderr
    records = results.read(out)
    assert [r["config"]["strategy"] for r in records] == ["zigzag", "ulysses"]
    rules = groups.load()
    for index, (record, op) in enumerate(zip(records, ("send_recv", "all_to_all")), 1):
        p = record["profile"]
        case_dir = Path(p["traces"][0]).parent
        assert case_dir.parent == prof and case_dir.name.startswith(
            f"{index}_{record['config']['strategy']}_")  # + the digest of the record's key
        assert p["traces"] == [str(case_dir / f"rank{r}.trace.json.gz") for r in (0, 1)]
        for path in p["traces"]:  # a Chrome trace, as Perfetto and HTA load it
            doc = json.loads(gzip.decompress(Path(path).read_bytes()))
            assert any(e.get("name") == breakdown.STEP_MARK for e in doc["traceEvents"])
        assert p["rank"] in (0, 1) and p["steps"] == 3 and p["timeline"] == breakdown.CPU
        assert abs(sum(p["wall_pct"].values()) - 100) <= 1 and "idle" in p["wall_pct"]
        assert p["wall_pct"]["attention/fwd"] > 0 and p["wall_pct"]["attention/bwd"] > 0
        assert f"communication/{op}" in p["wall_pct"]
        assert 0 <= p["exposed_comm_ms"] <= p["step_ms"]
        # the same figures, recomputed from the saved trace of the rank the record names
        again = breakdown.from_file(p["traces"][p["rank"]], rules).to_dict()
        assert {k: p[k] for k in again} == again
        assert len(p["per_iteration"]) == len(p["per_iteration_ms"]) == 3
        assert all(abs(sum(it.values()) - 100) <= 1 for it in p["per_iteration"])
    summary = _cpbench("profile", "summarize", records[1]["profile"]["traces"][0])
    assert summary.returncode == 0, summary.stderr
    assert "communication/all_to_all" in summary.stdout
    assert "Exposed Communication:" in summary.stdout
