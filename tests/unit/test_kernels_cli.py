"""cpbench kernels: the grid, its rows (ok, skipped, OOM), formats, records and report."""

from __future__ import annotations

import csv
import io
import json

import pytest
import torch

from cpbench.bench import kernelbench
from cpbench.cli import main

TINY = ["--seqlen", "64", "--heads", "2", "--head-dim", "16", "--warmup", "0", "--iters", "2"]


def _csv(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text)))


def test_csv_has_one_row_per_case_with_every_column(capsys):
    code = main(["kernels", "--kernel", "sdpa-cpu,torch", "--seqlen", "64,128", "--heads", "2",
                 "--head-dim", "16", "--warmup", "0", "--iters", "2", "--format", "csv"])
    rows = _csv(capsys.readouterr().out)
    assert code == 0 and len(rows) == 4
    assert [(r["kernel"], r["seqlen"]) for r in rows] == [
        ("sdpa-cpu", "64"), ("torch", "64"), ("sdpa-cpu", "128"), ("torch", "128")]
    for r in rows:
        assert r["status"] == "ok"
        fwd, bwd, both = (float(r[k]) for k in ("fwd_ms", "bwd_ms", "fwd_bwd_ms"))
        # each step's FWD and BWD timed apart (two iterations: the medians are means), the
        # step from FWD's start to BWD's end: never less than the two, never a difference
        assert fwd > 0 and bwd > 0 and fwd + bwd <= both + 1e-9
        assert float(r["memory_mb"]) > 0 and float(r["fwd_tflops"]) > 0
    torch_rows = [r for r in rows if r["kernel"] == "torch"]
    assert all(float(r["speedup_fwd_bwd"]) == 1.0 for r in torch_rows)  # the baseline itself
    sdpa = rows[0]
    assert float(sdpa["speedup_fwd"]) == pytest.approx(float(rows[1]["fwd_ms"]) /
                                                       float(sdpa["fwd_ms"]))


def test_a_case_over_the_memory_cap_is_a_skipped_row_and_the_grid_goes_on(capsys):
    code = main(["kernels", "--kernel", "torch,sdpa-cpu", "--seqlen", "64,1M", "--heads", "2",
                 "--head-dim", "16", "--warmup", "0", "--iters", "1", "--max-memory", "1",
                 "--format", "csv"])
    rows = _csv(capsys.readouterr().out)
    assert code == 0 and [r["status"] for r in rows] == ["ok", "ok", "skipped", "skipped"]
    assert "by estimate" in rows[2]["note"] and rows[2]["fwd_ms"] == ""


def test_a_kernel_that_cannot_run_here_says_why(capsys):
    main(["kernels", "--kernel", "sdpa-cudnn", *TINY, "--format", "json"])
    (row,) = json.loads(capsys.readouterr().out)
    assert row["status"] == "skipped" and "cuda" in row["note"]


def test_an_out_of_memory_case_is_an_oom_row_with_its_forward(monkeypatch):
    def closures(name, case, device, seed=0):
        def boom():
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried ...")
        return (lambda: None, boom), {}

    monkeypatch.setattr(kernelbench, "closures", closures)
    case = kernelbench.Case(seqlen=64, heads=2, head_dim=16, dtype=torch.float32, causal=True)
    m = kernelbench.measure("torch", case, device="cpu", warmup=0, iters=2, capacity_bytes=None)
    assert m.status == "OOM" and m.fwd_ms is not None and m.fwd_bwd_ms is None
    assert "can't allocate" in m.reason


def test_sdpa_backends_and_table_format(capsys):
    code = main(["kernels", "--kernel", "sdpa-math,sdpa-flash", *TINY, "--causal", "both"])
    out = capsys.readouterr().out
    assert code == 0 and "### Attention kernels" in out and out.count("sdpa-math") == 2
    assert "Speedup FWD+BWD" in out


def test_records_re_render_with_cpbench_report(capsys, tmp_path):
    out = tmp_path / "k.jsonl"
    main(["kernels", "--kernel", "sdpa-cpu", *TINY, "--out", str(out), "--format", "csv"])
    first = _csv(capsys.readouterr().out)
    assert main(["report", str(out), "--format", "csv"]) == 0
    again = _csv(capsys.readouterr().out)
    assert [r["fwd_ms"] for r in again] == [r["fwd_ms"] for r in first]


@pytest.mark.parametrize("args, needle", [
    (["--kernel", "nope"], "unknown kernel"),
    (["--seqlen", "0"], "positive"),
    (["--dtype", "fp64"], "unknown dtype"),
    (["--max-memory", "-1"], "--max-memory"),
])
def test_bad_input_is_one_line_exit_2(capsys, args, needle):
    with pytest.raises(SystemExit) as e:
        code = main(["kernels", *args])
        raise SystemExit(code)
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and err.count("\n") == 1
