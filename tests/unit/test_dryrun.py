"""The dry run: the engine-free backward equals the engine; every own strategy's real code runs
on fake tensors with the bytes its schedule declares; ranks called alike measure alike; host
syncs and errors are reported with their line; the command's bad input is one line, exit 2."""

import dataclasses
import json

import pytest
import torch

from cpbench import strategies, torchcompat
from cpbench.bench import dryrun, fakegrad
from cpbench.cli import main
from cpbench.config import AttentionConfig
from cpbench.topology import Topology

if why := torchcompat.dry_run_unavailable("cpu"):  # an older torch refuses it (test_torchcompat)
    pytest.skip(why, allow_module_level=True)

SLOW = pytest.mark.slow  # seconds of CPU: CI runs them, make test-fast leaves them out
OWN = ("ring", "zigzag", "megatron-cp", "megatron-cp-a2a+p2p", "double-ring", "burst",
       "ulysses", "usp", "llama3")


class _Twice(torch.autograd.Function):
    """Two outputs, the second never used (its gradient arrives as None)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w, (x * x).sum(-1)

    @staticmethod
    def backward(ctx, g, g_sum):
        x, w = ctx.saved_tensors
        return g * w + 2 * x * g_sum[..., None], g * x


def _graph(x, w):
    out, _ = _Twice.apply(x[0].transpose(0, 1), w)
    return torch.cat([out.unsqueeze(0), (out * x[0].t()).unsqueeze(0)], 2).exp()


@pytest.mark.parametrize("seed", [0, 1])
def test_fakegrad_equals_the_engine(seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 6, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(1, 5, 12, generator=gen, dtype=torch.float64)
    _graph(x, w).backward(dout)
    want = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    with fakegrad.recording():
        out = _graph(x, w)
    fakegrad.backward(out, dout)
    torch.testing.assert_close((x.grad, w.grad), want, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["zigzag", "usp", "llama3"])
def test_fakegrad_equals_the_engine_on_a_strategy(name):
    attn = AttentionConfig(seqlen=256, heads=4, head_dim=16, dtype="fp32", causal=True)
    topo = Topology(world_size=1, ranks_per_node=1)
    with dryrun.fake_world(0, 1):  # one rank: nothing is sent, the values are real
        strat = strategies.get(name)(attn, topo, 0, kernel=_kernel("sdpa-cpu"))
        gen = torch.Generator().manual_seed(7)
        q, k, v, dout = (torch.randn(1, 256, 4, 16, generator=gen) for _ in range(4))
        grads = []
        for run in (torch.Tensor.backward, fakegrad.backward):
            x = [t.clone().requires_grad_() for t in (q, k, v)]
            with fakegrad.recording():
                out, _ = strat.attention(*x)
            run(out, dout)
            grads.append([t.grad for t in x])
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-6)


def _kernel(name):
    from cpbench import kernels

    return kernels.get(name)


ATTN = AttentionConfig(seqlen=32768, heads=8, head_dim=64, dtype="bf16", causal=True)
TOPO = Topology(world_size=8, ranks_per_node=4)


@pytest.mark.parametrize("name", [n if n == "zigzag" else pytest.param(n, marks=SLOW)
                                  for n in OWN])
def test_every_own_strategy_sends_its_schedule_on_every_distinct_rank(name):
    opts = strategies.get(name).Options()
    alike = dryrun.distinct_ranks(name, opts, ATTN, TOPO, kernel_name="sdpa-cpu")
    assert sorted(r for ranks in alike.values() for r in ranks) == list(range(8))
    for rank in alike:
        r = dryrun.dry_rank(name, opts, ATTN, TOPO, rank, kernel_name="sdpa-cpu",
                            device="cpu")
        assert r.status == "ok", (rank, r.error, r.where)
        want = dryrun.schedule_bytes(name, opts, ATTN, TOPO, rank, kernel_name="sdpa-cpu")
        assert {p: r.sent_bytes(p) for p in ("fwd", "bwd")} == want
        # at least q, k, v, dout, out and the gradients: a real peak, not a placeholder
        shard = 1 * ATTN.seqlen // 8 * ATTN.heads * ATTN.head_dim * 2
        assert r.peak_fwd_bwd_bytes >= 7 * shard and r.peak_fwd_bytes >= 5 * shard


@SLOW
def test_ranks_called_alike_measure_alike():
    name, opts = "usp", strategies.get("usp").Options(ulysses_degree=2)
    alike = dryrun.distinct_ranks(name, opts, ATTN, TOPO, kernel_name="sdpa-cpu")
    assert len(alike) < 8
    for rep, ranks in alike.items():
        found = {(r.peak_fwd_bytes, r.peak_fwd_bwd_bytes, r.sent_bytes("fwd"),
                  r.sent_bytes("bwd"))
                 for r in (dryrun.dry_rank(name, opts, ATTN, TOPO, x, kernel_name="sdpa-cpu",
                                           device="cpu") for x in ranks)}
        assert len(found) == 1, (rep, ranks, found)


def test_a_host_sync_in_the_step_is_an_error_with_its_line(monkeypatch):
    cls = strategies.get("ring")
    real = cls.attention

    def attention(self, q, k, v):
        out, lse = real(self, q, k, v)
        scale = float(out.abs().max())  # a host sync: the value read on the host
        return out * scale, lse

    monkeypatch.setattr(cls, "attention", attention)
    r = dryrun.dry_rank("ring", cls.Options(), ATTN, TOPO, 1, kernel_name="sdpa-cpu",
                        device="cpu")
    assert r.status == "failed" and r.error.startswith("host sync")
    assert r.where.endswith(f"test_dryrun.py:{attention.__code__.co_firstlineno + 2}")


def test_an_error_in_a_kernel_names_its_file(monkeypatch):
    import dataclasses

    from cpbench.kernels import sdpa_cpu

    def broken(*a, **k):
        raise RuntimeError("misaligned address")

    backend = dataclasses.replace(sdpa_cpu.BACKEND, forward=broken)
    monkeypatch.setattr(dryrun.kernels, "get", lambda name: backend)
    r = dryrun.dry_rank("zigzag", strategies.get("zigzag").Options(), ATTN, TOPO, 0,
                        kernel_name="sdpa-cpu", device="cpu")
    assert r.status == "failed" and "RuntimeError: misaligned address" in r.error
    assert r.where.endswith(f"test_dryrun.py:{broken.__code__.co_firstlineno + 1}")


def test_cli_json_rows_and_bad_input(capsys):
    code = main(["dryrun", "--device", "cpu", "--strategy", "zigzag,llama3", "--nodes", "2",
                 "--gpus-per-node", "2", "--seqlen", "8k", "--format", "json"])
    rows = json.loads(capsys.readouterr().out)
    assert code == 0 and {r["strategy"] for r in rows} == {"zigzag", "llama3"}
    assert all(r["status"] == "ok" and r["peak_fwd_bwd_bytes"] > 0 for r in rows)
    assert main(["dryrun", "--device", "cpu", "--strategy", "zigzag", "--nodes", "1",
                 "--gpus-per-node", "4", "--ranks", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--ranks 4 is not a rank of 4" in err[0]


def test_cli_says_oom_and_by_how_much(capsys):
    assert main(["dryrun", "--device", "cpu", "--hardware", "a800-sxm", "--strategy", "local",
                 "--nodes", "1", "--gpus-per-node", "2", "--seqlen", "1M", "--heads", "40",
                 "--head-dim", "128", "--dtype", "bf16", "--ranks", "0"]) == 0
    out = capsys.readouterr().out
    assert "OOM: needs" in out and "over)" in out


@pytest.mark.parametrize("name", ["yunchang-usp", *(pytest.param(n, marks=SLOW) for n in
                                                   ("rfa-llama3", "rfa-zigzag", "torch-ring"))])
def test_the_upstream_adapters_run_every_rank_without_a_host_sync(name, own_modules):
    """Their libraries' code on fake tensors: rfa-llama3's CPU flash-attn interface once read
    a mask back to the host on every rank but the first (found at 512K)."""
    opts = strategies.get(name).Options()
    for rank in range(TOPO.world_size):
        r = dryrun.dry_rank(name, opts, ATTN, TOPO, rank, kernel_name="sdpa-cpu", device="cpu")
        assert r.status == "ok", (rank, r.error, r.where)
        assert r.sent_bytes("fwd") > 0 and r.sent_bytes("bwd") > 0


# the cases taking seconds of CPU each: in CI (make test), not in make test-fast
MASKED = AttentionConfig(seqlen=4096, heads=8, head_dim=64, dtype="bf16", causal=True,
                         documents=(2048, 1024, 512, 512), window_size=(256, 0))


@pytest.mark.parametrize("name,opts", [
    pytest.param("usp", {"ulysses_degree": 1}, marks=SLOW),
    pytest.param("usp", {"ulysses_degree": 2}, marks=SLOW), ("llama3", {}), ("ulysses", {}),
    pytest.param("megatron-cp", {}, marks=SLOW)])
def test_masked_cases_plan_on_the_host(name, opts):
    """Documents and a window: the layouts and tiles are planned on real CPU tensors, inner
    strategies' included (usp's ring once read a fake position on the host). The first and
    last rank: the ends of every layout."""
    opts = dryrun.case_options(name, opts)
    for rank in (0, TOPO.world_size - 1):
        r = dryrun.dry_rank(name, opts, MASKED, TOPO, rank, kernel_name="sdpa-cpu",
                            device="cpu")
        assert r.status == "ok", (rank, r.error, r.where)
        want = dryrun.schedule_bytes(name, opts, MASKED, TOPO, rank, kernel_name="sdpa-cpu")
        assert {p: r.sent_bytes(p) for p in ("fwd", "bwd")} == want


PADDED = AttentionConfig(seqlen=4000, heads=6, head_dim=64, dtype="bf16", causal=True,
                         documents=(1999, 1001, 513, 487))


@pytest.mark.parametrize("name", [pytest.param(n, marks=SLOW)
                                  for n in ("zigzag", "megatron-cp", "double-ring")]
                         + ["ring", "llama3"])
def test_padded_documents_run_on_the_host_at_any_n(name):
    """Lengths no layout splits over 3 ranks: each pads (zigzag layouts every document to 6,
    contiguous ones the tail) and its real code sends what its schedule declares."""
    topo = Topology(world_size=3, ranks_per_node=3)
    opts = dryrun.case_options(name, {})
    for rank in (0, 2):
        r = dryrun.dry_rank(name, opts, PADDED, topo, rank, kernel_name="sdpa-cpu",
                            device="cpu")
        assert r.status == "ok", (rank, r.error, r.where)
        want = dryrun.schedule_bytes(name, opts, PADDED, topo, rank, kernel_name="sdpa-cpu")
        assert {p: r.sent_bytes(p) for p in ("fwd", "bwd")} == want


@pytest.mark.parametrize("name", ["zigzag", "ulysses"])
def test_fakegrad_equals_the_engine_with_sinks(name):
    """The dry run's backward walk reaches the sinks too (a slice of them under Ulysses)."""
    attn = AttentionConfig(seqlen=128, heads=4, head_dim=16, dtype="fp32", causal=True,
                           sinks=True)
    with dryrun.fake_world(0, 1):
        strat = strategies.get(name)(attn, Topology(world_size=1, ranks_per_node=1), 0,
                                     kernel=_kernel("sdpa-cpu"))
        gen = torch.Generator().manual_seed(8)
        q, k, v, dout = (torch.randn(1, 128, 4, 16, generator=gen) for _ in range(4))
        sinks = torch.rand(4, generator=gen) * 4
        grads = []
        for run in (torch.Tensor.backward, fakegrad.backward):
            x = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
            with fakegrad.recording():
                out, _ = strat.attend(*x)
            run(out, dout)
            grads.append([t.grad for t in x])
    assert grads[0][3].abs().min() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["zigzag", "usp"])
def test_a_dry_rank_with_sinks_sends_its_schedule(name):
    attn = dataclasses.replace(ATTN, sinks=True)
    opts = strategies.get(name).Options()
    for rank in (0, 5):
        r = dryrun.dry_rank(name, opts, attn, TOPO, rank, kernel_name="sdpa-cpu",
                            device="cpu")
        assert r.status == "ok", (rank, r.error, r.where)
        want = dryrun.schedule_bytes(name, opts, attn, TOPO, rank, kernel_name="sdpa-cpu")
        assert {p: r.sent_bytes(p) for p in ("fwd", "bwd")} == want


def test_the_table_fits_120_columns(capsys):
    """An OOM verdict (the longest cell) wraps in the room the other columns leave; the peaks
    of both phases share a column, as the bytes sent do."""
    assert main(["dryrun", "--device", "cpu", "--hardware", "a800-sxm", "--strategy", "local",
                 "--nodes", "1", "--gpus-per-node", "2", "--seqlen", "1M", "--heads", "40",
                 "--head-dim", "128", "--dtype", "bf16", "--ranks", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert max(map(len, out)) <= 120, "\n".join(out)
    header = next(line for line in out if line.startswith("Strategy"))
    assert header.split() == ["Strategy", "Worst", "rank", "Peak", "GiB", "FWD/+BWD", "Sim",
                              "GiB", "(err)", "Sent", "GiB", "FWD/BWD", "Verdict"]
    row = next(i for i, line in enumerate(out) if line.startswith("local "))
    assert "OOM: needs" in out[row] and out[row + 1].startswith(" ") and "over)" in out[row + 1]
