"""The physics guards end to end: ``cpbench run`` with a strategy a third party registers
through the entry-point group, whose schedule sends K/V and whose attention sends nothing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PLUGINS = Path(__file__).resolve().parent / "plugins"
SMALL = ["--seqlen", "256", "--heads", "2", "--head-dim", "16", "--warmup", "1",
         "--iters", "3"]


def _cpbench(*args, timeout=180):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(PLUGINS), *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd = [sys.executable, "-c", "import sys; from cpbench.cli import main; sys.exit(main())",
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=env)


def test_a_strategy_that_sends_nothing_is_flagged_and_never_wins(tmp_path):
    out = tmp_path / "r.jsonl"
    run = _cpbench("run", "--strategy", "test-silent-zigzag,zigzag,test-cp-off", "--nproc",
                   "2", *SMALL, "--out", str(out))
    assert run.returncode == 0, run.stdout + run.stderr  # exit status unchanged
    silent, zigzag, cp_off = (json.loads(line) for line in out.read_text().splitlines())
    assert silent["config"]["strategy"] == "test-silent-zigzag"
    # zigzag's ring at S=256, H=2, D=16, fp32, 2 ranks: one K and one V block of 128 tokens
    block = 2 * 128 * 2 * 16 * 4
    assert silent["comm"]["sent_bytes"]["fwd"] == [0, 0]
    assert silent["comm"]["schedule_bytes"]["fwd"] == [block, block]
    comm_flags = [f"FWD rank 0: sent 0 B, schedule says {block / 1e3:.3g} KB",
                  f"FWD+BWD rank 0: sent 0 B, schedule says {4 * block / 1e3:.3g} KB"]
    # computing its own blocks alone, it runs about as fast as the ideal (the kernel alone on
    # each rank's share): a fraction of ideal at or above 100 % may be flagged beside them
    assert [f for f in silent["derived"]["flags"] if f not in comm_flags and not f.startswith(
        "fraction of ideal above 100 %")] == []
    assert [f for f in silent["derived"]["flags"] if f in comm_flags] == comm_flags
    assert zigzag["comm"]["sent_bytes"] == {"fwd": [block, block],
                                            "fwd_bwd": [4 * block, 4 * block]}
    assert zigzag["derived"]["flags"] == []
    assert zigzag["sizes"] == {"world": [2, 2], "cp": [2, 2], "local_seqlen": [128, 128]}
    assert cp_off["sizes"] == {"world": [2, 2], "cp": [1, 1], "local_seqlen": [256, 256]}
    assert cp_off["derived"]["flags"] == ["CP over 1 ranks, asked for 2",
                                          "the shards hold 512 tokens, the 1 problem(s) 256"]
    # the flagged rows marked [n] (their reasons numbered under the table), after any marks
    # of the machine's load while it ran
    table = run.stdout[run.stdout.index("Benchmark Summary:"):]
    assert re.search(r"^ +test-silent-zigzag \[\d+(,\d+)+\] +\|", table, re.M)
    assert re.search(r"\n\[\d\] FWD rank 0: sent 0 B, schedule says", table)
    # report --best on these records, as an idle and as a busy machine's meter would have
    # read them (the stubbed load section): both paths run on any host
    for load, zigzag_wins in ((IDLE, True), (BUSY, False)):
        stubbed = _stubbed(out, tmp_path / "stubbed.jsonl", load)
        best = _cpbench("report", str(stubbed), "--best")
        assert best.returncode == 0, best.stderr
        ranked = best.stdout.split("not ranked:")[0]
        assert "test-silent-zigzag" not in ranked and "test-cp-off" not in ranked
        table = _cpbench("report", str(stubbed)).stdout  # the marks: the flags' alone
        # its comm flags, and the fraction of ideal's where its timing put it at 100 %
        assert re.search(r"^ +test-silent-zigzag \[1,2(,3)?\] +\|", table, re.M)
        assert re.search(r"\n\[[12]\] FWD rank 0: sent 0 B, schedule says", table)
        assert "not ranked: test-silent-zigzag" in best.stdout
        assert "not ranked: test-cp-off" in best.stdout
        assert ("zigzag" in ranked) == zigzag_wins
        assert ("not ranked: zigzag" in best.stdout) == (not zigzag_wins)


# what rank 0's load meter records over a case: idle, and two busy loops on the 2 cores
IDLE = {"foreign_cpu_s": 0.0, "wall_s": 10.0, "cpus": 2, "share": 0.0, "ranks_cores": 2}
BUSY = {"foreign_cpu_s": 19.0, "wall_s": 10.0, "cpus": 2, "share": 0.95, "ranks_cores": 2}


def _stubbed(path: Path, to: Path, load: dict) -> Path:
    """The run's records as a 2-core machine with ``load`` would have written them: the
    guards read the record's ``load`` and cores (``guards.not_measured``), not the host."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for r in records:
        r["load"] = load
        r["env"]["cpus_usable"] = 2  # the 2 ranks on one host: one core each
    to.write_text("".join(json.dumps(r) + "\n" for r in records))
    return to


def test_a_cp_off_strategy_that_passes_its_check_is_named_in_the_summary():
    """Ranks as threads: the CP-off strategy computes the right answer (each rank the whole
    problem), its check passes, and the run's last line names its flag."""
    run = _cpbench("run", "--launcher", "threads", "--strategy", "test-cp-off", "--nproc",
                   "2", "--check", *SMALL, "--out", "none")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 case(s): 1 done; check: 1 PASS (1 flagged: test-cp-off: CP over 1 ranks, " \
           "asked for 2 (+1 more))" in run.stdout




def test_every_cp_row_prints_its_fraction_of_ideal(tmp_path):
    out = tmp_path / "r.jsonl"
    run = _cpbench("run", "--strategy", "zigzag,ring", "--nproc", "2", *SMALL,
                   "--out", str(out), "--details")
    assert run.returncode == 0, run.stdout + run.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    for r in records:  # one block of S / 2 timed alone, twice over (cpbench.ideal)
        assert r["ideal"]["times"] == 2 and r["ideal"]["block"]["rows"] == 256 // 2
        assert r["ideal"]["fwd_ms"] == 2 * r["ideal"]["block"]["fwd_ms"] > 0
        fraction = {**r["derived"], **r["derived"].get("withheld", {})}["fraction_of_ideal"]
        assert 0 < fraction < 10  # kept, under a mark where the row withholds it
    # each detail block: the fraction, or why the row's timings do not measure CP
    assert run.stdout.count("  - Fraction of Ideal: ") + \
        run.stdout.count("  - Not Measuring CP: ") == 2
    # the records re-rendered as an idle and as a busy machine's meter would have read them
    for load, measured in ((IDLE, True), (BUSY, False)):
        stubbed = _stubbed(out, tmp_path / "stubbed.jsonl", load)
        table = _cpbench("report", str(stubbed)).stdout
        table = table[table.index("Benchmark Summary:"):].splitlines()
        header = [c.strip() for c in table[3].split("|")]  # under the shared columns' line
        md = _cpbench("report", str(stubbed), "--format", "markdown").stdout.splitlines()
        md_header = [c.strip() for c in md[0].split("|")]
        if not measured:  # withheld in every row: "-" in every row, so no column at all
            assert "Ideal (%)" not in header and "Fraction of Ideal (%)" not in md_header
            continue
        assert "Ideal (%)" in header  # the narrow table's name, the unit in the header
        col = header.index("Ideal (%)")
        for line in table[5:7]:
            assert 0 < float([c.strip() for c in line.split("|")][col]) < 1000
        # no local baseline here: the CP efficiency, "-" in every row, has no column
        assert "CP Efficiency (%)" not in md_header
        for line in md[2:4]:
            assert float(line.split("|")[md_header.index("Fraction of Ideal (%)")].strip()) > 0
