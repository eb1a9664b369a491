"""Sweep configs: expansion, validation (every error at once, with its case), keys,
command lines. No processes are started."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from cpbench import results, sweep
from cpbench.bench.plan import failure_record

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path, text: str) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return path


def test_product_then_cases_in_order(tmp_path):
    cfg = sweep.load(_write(tmp_path, """
base: {nproc: 2, heads: 2, head_dim: 16, warmup: 0, iters: 1}
sweep: {strategy: [ring, zigzag], seqlen: [256, 512]}
cases: [{strategy: usp, seqlen: 1k, timeout: 7}]
"""))
    labels = [c.label for c in cfg.cases]
    assert labels == ["strategy=ring seqlen=256", "strategy=ring seqlen=512",
                      "strategy=zigzag seqlen=256", "strategy=zigzag seqlen=512",
                      "strategy=usp seqlen=1k timeout=7"]
    assert cfg.cases[-1].timeout == 7 and cfg.cases[0].timeout is None
    assert cfg.cases[-1].settings["seqlen"] == 1024
    assert len(cfg.cases[-1].keys) == len(cfg.cases[-1].plan.cases)  # a row per variant
    cmd = sweep.command(cfg, cfg.cases[0], "/tmp/o.jsonl")
    assert cmd[:3] == [sys.executable, "-m", "cpbench.run"]  # the package's entry: any cwd
    assert cmd[3:] == ["--nproc", "2", "--heads", "2", "--head-dim", "16", "--warmup", "0",
                       "--iters", "1", "--strategy", "ring", "--seqlen", "256",
                       "--out", "/tmp/o.jsonl"]


def test_every_error_listed_with_its_case(tmp_path):
    path = _write(tmp_path, """
colour: blue
base: {nproc: 2, heads: 3, head_dim: 16, seqlenn: 4, out: x.jsonl}
sweep: {strategy: [ring, ulysses, nosuch], seqlen: [256, 257]}
cases: [{strategy: ring, causal: maybe}, {strategy: ring, timeout: -1}]
""")
    with pytest.raises(sweep.SweepError) as info:
        sweep.load(path)
    errors = info.value.errors
    text = "\n".join(errors)
    assert "unknown key 'colour'" in text
    assert "unknown setting 'seqlenn' (did you mean 'seqlen'?)" in text
    assert "'out' is set by `cpbench sweep`" in text
    # one error of several cases: one line naming them
    assert any(e.startswith("cases 3, 4: ulysses over 2 ranks needs heads (3)") for e in errors)
    assert "cases 5, 6: unknown strategy 'nosuch'; see cpbench strategies" in errors
    assert any(e.startswith("case 2 (strategy=ring seqlen=257):") for e in errors)
    assert any(e.startswith("case 7 (strategy=ring causal=maybe): causal must be true")
               for e in errors)
    assert "case 8 (strategy=ring timeout=-1): timeout must be a positive number" in text
    assert len(errors) == 8
    assert not any(e.startswith("case 1 ") for e in errors)  # ring at 256 on 2 ranks is fine


def test_every_bad_value_of_one_case_is_listed(tmp_path, capsys):
    """Two (and more) bad values in one case: each its own line, not only the first the
    configs' checks meet; a value fine beside the case's others is not named."""
    from cpbench.cli import main

    path = _write(tmp_path, """
base: {nproc: 2, seqlen: 1k, heads: 6, kv_heads: 3, iters: 0, warmup: -1, dtype: fp64}
cases: [{strategy: [ring, zigzg]}, {strategy: ring, head_dim: x, batch: 0, kv_heads: 4}]
""")
    with pytest.raises(sweep.SweepError) as info:
        sweep.load(path)
    first = [e for e in info.value.errors if e.startswith(("case 1 ", "cases 1, 2: "))]
    assert [e.split(": ", 1)[1].split(" (did")[0].split(";")[0] for e in first] == [
        "unknown strategy 'zigzg'", "--iters must be a positive integer, got 0",
        "--warmup must be >= 0, got -1", "unknown dtype 'fp64'"]
    assert "cases 1, 2: --iters must be a positive integer, got 0" in info.value.errors
    second = "\n".join(e for e in info.value.errors if e.startswith("case 2 "))
    assert "cannot read head_dim: 'x' as int" in second and "batch must be a positive" in second
    assert "kv_heads 4 must divide heads 6" in second  # a pair, neither wrong alone
    assert not any("kv_heads 3" in e for e in info.value.errors)  # 3 divides the case's 6
    assert main(["sweep", str(path), "--dry-run", "--out", "r.jsonl"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"cpbench sweep: error: {e}" for e in info.value.errors]  # one line each


def test_repeated_rows_are_an_error(tmp_path):
    with pytest.raises(sweep.SweepError, match="case 2 .*repeats a row of case 1"):
        sweep.load(_write(tmp_path, """
base: {nproc: 2, heads: 2, head_dim: 16}
cases: [{strategy: ring, seqlen: 256}, {strategy: ring, seqlen: 256, timeout: 3}]
"""))


def test_record_key_matches_plan_key(tmp_path):
    cfg = sweep.load(_write(tmp_path, """
base: {nproc: 2, heads: 2, head_dim: 16, warmup: 0, iters: 1}
cases: [{strategy: ring, seqlen: 256}]
"""))
    case = cfg.cases[0]
    record = failure_record(case.plan, 0, results.TIMEOUT, "late", sweep={"case": 1})
    record = json.loads(json.dumps(record))
    assert results.record_key(record) == case.keys[0]
    record["config"]["run"]["out"] = "elsewhere.jsonl"  # how it was launched is not the key
    record["config"]["run"]["collective_timeout"] = 5.0
    assert results.record_key(record) == case.keys[0]
    record["config"]["attention"]["seqlen"] = 512
    assert results.record_key(record) != case.keys[0]


@pytest.mark.parametrize("name", ["cpu_smoke.yaml", "node8_sweep.yaml",
                                  pytest.param("seed001_32gpu.yaml", marks=pytest.mark.slow)])
def test_shipped_configs_validate(name):
    cfg = sweep.load(REPO / "configs" / name)
    assert cfg.cases
    if name == "seed001_32gpu.yaml":
        assert (cfg.nodes, cfg.gpus_per_node) == (4, 8)
        seqlens = {c.settings["seqlen"] for c in cfg.cases}
        assert seqlens == {2 ** 17, 2 ** 18, 2 ** 19, 2 ** 20}
        usp = [c for c in cfg.cases if c.settings["strategy"] == ("usp",)][0]
        assert {c.options.placement for c in usp.plan.cases} == {"head-first", "ring-first"}
        with pytest.raises(ValueError, match="Slurm"):
            sweep.command(cfg, cfg.cases[0], "o.jsonl")
        cmd = sweep.command(cfg, cfg.cases[0], "o.jsonl", launcher="srun torchrun --nnodes 4")
        assert cmd[:3] == ["srun", "torchrun", "--nnodes"] and cmd[4:6] == ["-m", "cpbench.run"]


def test_dry_run_of_a_multi_node_config_prints_each_launch_on_the_nodes(tmp_path, capsys):
    """No --launcher: the srun + torchrun line the sbatch script would start for each case
    (placeholders for what only the job knows, said so); a real run still refuses."""
    from cpbench import slurm
    from cpbench.cli import main

    path = _write(tmp_path, "topology: {nodes: 4, gpus_per_node: 8}\nbase: {seqlen: 64k}\n"
                            "sweep: {strategy: [ring, zigzag]}\n")
    assert main(["sweep", str(path), "--dry-run", "--out", "r.jsonl"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# each case's launch on 4 nodes")
    assert lines[1] == f"# {slurm.PREVIEW_NOTE}"
    launcher = slurm.sweep_launcher(slurm.preview_world(4, 8))
    for line, (i, name) in zip(lines[2:], ((1, "ring"), (2, "zigzag")), strict=True):
        label, cmd = line.split(": ", 1)
        assert label == f"[{i}] strategy={name}"
        words = shlex.split(cmd)
        expected = [w.replace("{case}", str(i)) for w in shlex.split(launcher)]
        assert words[:len(expected)] == expected
        assert words[len(expected):len(expected) + 2] == ["-m", "cpbench.run"]
        assert words[-4:] == ["--strategy", name, "--out", "r.jsonl"]
    assert main(["sweep", str(path), "--out", str(tmp_path / "r.jsonl")]) == 2
    assert "spans 4 nodes: run it through Slurm" in capsys.readouterr().err


@pytest.mark.slow
def test_seed001_dry_run_prints_the_node_commands(capsys):
    from cpbench.cli import main

    assert main(["sweep", str(REPO / "configs" / "seed001_32gpu.yaml"), "--dry-run",
                 "--out", "r.jsonl"]) == 0
    launches = [line for line in capsys.readouterr().out.splitlines()
                if not line.startswith("#")]
    assert len(launches) == 28
    assert all(" srun --nodes=4 " in line and " torchrun --nnodes=4 --nproc-per-node=8 " in line
               for line in launches)


def test_one_error_in_many_cases_is_one_line_naming_them(tmp_path, capsys):
    """A bad strategy swept over 4 lengths: one line naming the value and the 4 cases, not 4
    copies; the good strategy's cases are not named."""
    from cpbench.cli import main

    path = _write(tmp_path, """
base: {nproc: 2, heads: 2, head_dim: 16}
sweep: {strategy: [zigzg, ring], seqlen: [256, 512, 1k, 2k]}
cases: [{strategy: zigzg, seqlen: 4k, iters: 0}]
""")
    assert main(["sweep", str(path), "--dry-run", "--out", "r.jsonl"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["cpbench sweep: error: cases 1-4, 9: unknown strategy 'zigzg' (did you mean "
                   "zigzag?); see cpbench strategies",
                   "cpbench sweep: error: case 9 (strategy=zigzg seqlen=4k iters=0): --iters "
                   "must be a positive integer, got 0"]
    assert all(len(line) <= 120 for line in err)


def test_a_yaml_mistake_is_one_line_with_its_place(tmp_path, capsys):
    from cpbench.cli import main

    path = _write(tmp_path, "base: {heads: 2\nsweep:\n  strategy: [ring]\n")
    assert main(["sweep", str(path), "--dry-run", "--out", "r.jsonl"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"cpbench sweep: error: {path}, line 2, column ")
    assert "not YAML: expected ',' or '}'" in err[0]
