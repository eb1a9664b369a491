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
        assert float(r["memory_mb"]) > 0
        # a rate is withheld only for a flagged row: two steps on a busy host can time the
        # backward (2.5x the FLOPs) below the forward, which the guards call impossible
        assert float(r["fwd_tflops"]) > 0 if r["fwd_tflops"] else bwd < fwd, r
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
    # no torch row to divide by: the speedups are "-" in every row, so neither column nor
    # title names them (report.render hides a column of dashes)
    assert "Speedup" not in out and "speedup" not in out
    code = main(["kernels", "--kernel", "torch,sdpa-math", *TINY, "--causal", "yes"])
    out = capsys.readouterr().out
    assert code == 0 and "Speedup FWD+BWD" in out and "(speedup: torch's time" in out


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


def _raising_for(kernel: str, error: Exception, monkeypatch):
    """kernelbench.closures with ``kernel``'s FWD+BWD raising ``error``."""
    real = kernelbench.closures

    def closures(name, case, device, seed=0):
        if name != kernel:
            return real(name, case, device, seed)

        def boom():
            raise error
        return (lambda: None, boom), {}

    monkeypatch.setattr(kernelbench, "closures", closures)


def test_a_kernel_that_raises_is_a_failed_row_and_the_grid_keeps_the_others(
        capsys, monkeypatch, tmp_path):
    long = "the kernel broke " + "in a long way " * 20
    _raising_for("torch", ValueError(long), monkeypatch)
    out = tmp_path / "k.jsonl"
    code = main(["kernels", "--kernel", "torch,sdpa-cpu", "--seqlen", "64,128", "--heads", "2",
                 "--head-dim", "16", "--warmup", "0", "--iters", "1", "--out", str(out)])
    got = capsys.readouterr()
    assert code == 1  # a row failed
    assert "kernel torch" in got.err and "failed" in got.err and long.split()[-1] in got.err
    lines = got.out.splitlines()
    rows = [r for r in lines if " | " in r and r.split()[0] in ("torch", "sdpa-cpu")]
    assert len(rows) == 4  # both kernels, both shapes
    failed = [r for r in rows if "failed" in r]
    assert len(failed) == 2 and all(r.split()[:2] == ["torch", "[1]"] for r in failed)
    note = next(r for r in lines if r.startswith("[1] "))  # the error, a note under the table
    assert "ValueError: the kernel broke" in note and long.strip() not in note  # cut short
    records = [json.loads(line) for line in out.read_text().splitlines()]
    by = {(r["kernel"], r["config"]["attention"]["seqlen"]): r for r in records}
    assert [by["sdpa-cpu", s]["status"] for s in (64, 128)] == ["ok", "ok"]
    bad = by["torch", 64]
    assert bad["status"] == "failed" and bad["error"] == f"ValueError: {' '.join(long.split())}"
    assert "raise error" in bad["traceback"]
    assert bad["samples_ms"]["fwd"] and not bad["samples_ms"].get("fwd_bwd")  # kept FWD


def test_after_an_error_that_kills_the_gpu_the_rest_are_skipped_saying_why(
        capsys, monkeypatch):
    _raising_for("torch", RuntimeError("CUDA error: an illegal memory access was encountered"),
                 monkeypatch)
    main(["kernels", "--kernel", "torch,sdpa-cpu", "--seqlen", "64,128", "--heads", "2",
          "--head-dim", "16", "--warmup", "0", "--iters", "1", "--format", "json"])
    rows = json.loads(capsys.readouterr().out)
    assert sorted((r["kernel"], r["seqlen"], r["status"]) for r in rows) == [
        ("sdpa-cpu", 64, "skipped"), ("sdpa-cpu", 128, "skipped"), ("torch", 64, "failed"),
        ("torch", 128, "skipped")]
    assert sum("not tried: torch on S=64" in r["note"] for r in rows) == 3


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_runs_compiled(monkeypatch):
    """Uncompiled, flex_attention is an unfused reference holding the S×S scores."""
    from torch.nn.attention import flex_attention as fa

    compiled, real = [], torch.compile

    def compile_(fn, **kwargs):
        if fn is not fa.flex_attention:  # flex_attention's eager path compiles its own parts
            return real(fn, **kwargs)
        compiled.append((fn, kwargs))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    monkeypatch.setattr(torch, "compile", compile_)
    case = kernelbench.Case(seqlen=128, heads=2, head_dim=16, dtype=torch.float32, causal=True)
    call = kernelbench._flex_call(case, "cpu")
    assert compiled == [(fa.flex_attention, {"dynamic": False, "fullgraph": True})]
    q = torch.randn(1, 2, 128, 16)
    assert call(q, q, q)[0] == "compiled"
    assert "flex" not in kernelbench.QUADRATIC  # its estimate holds no S×S matrices


@pytest.mark.slow
def test_flex_compiled_forward_on_cpu_is_attention_without_the_unfused_warning(recwarn):
    """torch.compile really makes FlexAttention here (its forward runs on CPU; ~20 s)."""
    case = kernelbench.Case(seqlen=128, heads=2, head_dim=16, dtype=torch.float32, causal=True)
    q, k, v = (torch.randn(1, 2, 128, 16, dtype=torch.float64).float() for _ in range(3))
    out = kernelbench._flex_call(case, "cpu")(q, k, v)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=True)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    assert not [w for w in recwarn if "without torch.compile" in str(w.message)]


def test_flex_closures_compile_with_a_forward_then_a_backward(monkeypatch):
    """closures() runs flex's compiles up front: a forward, then the backward of that
    forward (the backward alone has no graph to run)."""
    calls = []

    def fake_flex(case, device):
        def call(q, k, v):
            calls.append("fwd")
            return q * k + v
        return call

    monkeypatch.setattr(kernelbench, "_flex_call", fake_flex)
    case = kernelbench.Case(seqlen=64, heads=2, head_dim=16, dtype=torch.float32, causal=True)
    (fwd, bwd), x = kernelbench.closures(kernelbench.FLEX, case, "cpu")
    assert calls == ["fwd"] and x["q"].grad is None  # compiled and run back, grads cleared
    fwd()
    bwd()
    assert calls == ["fwd", "fwd"]
