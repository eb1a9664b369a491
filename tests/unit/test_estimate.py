"""The estimate before every case (``bench.estimate``): its arithmetic on a given rate, the
refusal over --max-minutes with what to do instead (``bench.refusal``), and the headline
request refused from the command line within seconds, exit 2, before anything runs."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from cpbench import metrics
from cpbench.bench import estimate, load
from cpbench.bench.plan import plan
from cpbench.cli import main as cli_main
from cpbench.config import AttentionConfig, RunConfig
from cpbench.errors import UsageError
from cpbench.mask import parse_size

RATE = estimate.Rate(fwd=20e9, bwd=10e9, side=1024, kernel="sdpa-cpu", threads=1)
ATTN = AttentionConfig(batch=1, seqlen=8192, heads=8, head_dim=64, dtype="fp32", causal=True)
RUN = RunConfig(strategy=("zigzag",), warmup=2, iters=5).resolved("cpu")
CPU = estimate.Machine(device="cpu", local_ranks=2, threads_per_rank=1, cpus=2)


@pytest.fixture(autouse=True)
def _no_real_meter(monkeypatch):
    """No test here reads the real load meter: a plan() then estimates idle cores (eta's
    _NoMeter), so its sums hold at any load; a test that needs a load gives its own meter."""
    monkeypatch.setattr(load.Meter, "available", staticmethod(lambda: False))


def _flops(mode: str) -> float:
    return metrics.attention_flops(batch=1, seqlen_q=8192, seqlen_k=8192, heads=8,
                                   head_dim=64, causal=True, mode=mode)


def test_a_step_is_the_slowest_ranks_flops_at_its_share_of_the_probed_rate():
    est = estimate.case_estimate(ATTN, RUN, 2, 1.0, RATE, CPU, has_ideal=False)
    # each of 2 ranks half the FLOPs, each on one of the 2 cores, as the probe's one thread
    alone = _flops("fwd") / 2 / 20e9 + _flops("bwd") / 2 / 10e9
    assert est.step_s == pytest.approx(alone)
    # set-up, then the warm-up expected on idle cores (between 3, where the settle rule can
    # first stop, and 2 + 5, its most: 5), timed and memory steps
    assert est.case_s == pytest.approx(estimate.CASE_SETUP_S + est.step_s * (5 + 5 + 1))
    # an imbalanced layout: the slowest rank does 1.75 × the mean share
    assert estimate.case_estimate(ATTN, RUN, 2, 1.75, RATE, CPU, has_ideal=False
                                  ).step_s == pytest.approx(1.75 * est.step_s)
    # 4 ranks on the 2 cores: a quarter of the machine each
    four = estimate.Machine(device="cpu", local_ranks=4, threads_per_rank=1, cpus=2)
    assert estimate.case_estimate(ATTN, RUN, 4, 1.0, RATE, four, has_ideal=False
                                  ).step_s == pytest.approx(est.step_s)  # 1/4 work, 1/4 rate
    # there the slowest of an imbalanced layout (1.75 x) takes a whole core while its peers
    # wait, so the 4 ranks' work on 2 cores counts: 1.75 / 4 at 1 core against 1 / 4 at 1 / 2
    assert estimate.case_estimate(ATTN, RUN, 4, 1.75, RATE, four, has_ideal=False
                                  ).step_s == pytest.approx(est.step_s)
    # one rank of 2 threads (torchrun's one process): both cores
    one = estimate.Machine(device="cpu", local_ranks=1, threads_per_rank=2, cpus=2)
    assert estimate.case_estimate(ATTN, RUN, 1, 1.0, RATE, one, has_ideal=False
                                  ).step_s == pytest.approx(alone)  # 2x the work, 2 cores
    # GPUs: each rank its own device, the probe's whole rate
    gpu = estimate.Machine(device="cuda", local_ranks=8, threads_per_rank=1, cpus=2)
    assert estimate.case_estimate(ATTN, RUN, 2, 1.0, RATE, gpu, has_ideal=False
                                  ).step_s == pytest.approx(alone)


def test_the_case_counts_its_check_the_ideal_and_fwd_only():
    plain = estimate.case_estimate(ATTN, RUN, 2, 1.0, RATE, CPU, has_ideal=False)
    ideal = estimate.case_estimate(ATTN, RUN, 2, 1.0, RATE, CPU, has_ideal=True)
    # the ideal: one block of S / 2 (a quarter of the problem's FLOPs, half a rank's step on
    # one core), warmed up 2 and timed 5 times
    assert ideal.case_s == pytest.approx(plain.case_s + plain.step_s / 2 * (2 + 5))
    checked = estimate.case_estimate(ATTN, RunConfig(strategy=("zigzag",), check=True
                                                     ).resolved("cpu"),
                                     2, 1.0, RATE, CPU, has_ideal=False)
    # --check: the strategy's step and the gathers (2 steps), and the float64 reference on
    # every pair of the 8K (non-causal FLOPs, 3.5 x the forward's 4 S^2 d h), 12 x slower than
    # the probe's forward rate, on rank 0's one thread (one idle core); without it where rank
    # 0 kept the problem's
    full_fwd_bwd = 4 * 8192 ** 2 * 64 * 8 * 3.5
    assert checked.parts["check"] == pytest.approx(2 * plain.step_s
                                                   + full_fwd_bwd * 12 / 20e9 / 1)
    assert checked.case_s == pytest.approx(plain.case_s + checked.parts["check"])
    kept = estimate.case_estimate(ATTN, RunConfig(strategy=("zigzag",), check=True
                                                  ).resolved("cpu"),
                                  2, 1.0, RATE, CPU, has_ideal=False, reference=False)
    assert kept.parts["check"] == pytest.approx(2 * plain.step_s)
    fwd = estimate.case_estimate(ATTN, RunConfig(strategy=("zigzag",), fwd_only=True
                                                 ).resolved("cpu"),
                                 2, 1.0, RATE, CPU, has_ideal=False)
    assert fwd.step_s == pytest.approx(_flops("fwd") / 2 / 20e9)


def test_durations_read_as_people_say_them():
    assert [metrics.duration(s) for s in (0.0123, 3.4, 336, 4 * 3600, 3.5 * 86400)] == [
        "12 ms", "3.4 s", "5.6 min", "4 h", "3.5 d"]


@pytest.mark.slow  # seconds of CPU: a kernel probe (test-fast leaves it out)
def test_over_the_limit_is_refused_in_three_lines_that_keep_the_question(monkeypatch, capsys):
    monkeypatch.setattr(estimate, "probe", lambda *a: RATE)  # a fixed rate: the sums below
    run = RunConfig(strategy=("zigzag",), nproc=2, out="none")
    with pytest.raises(UsageError) as e:
        plan(run, {"seqlen": 524288}, {}, launcher="self")
    first, second, command = str(e.value), *e.value.more
    assert "\n" not in first and first.startswith("zigzag at seqlen 512K on 2 ranks: ~")
    assert first.endswith("over --max-minutes 10") and "--max-minutes 0 (no limit)" in second
    assert all(len(line) <= 118 for line in (second, command)) and len(first) <= 100
    # the same question: 2 ranks on 2 (emulated) nodes, 512K, run's CPU shape, on a preset
    # the line names; and simulate takes every flag it is given (it runs: a model, seconds)
    assert "on 2 GPUs of preset a800-sxm in bf16:" in second
    assert command == ("cpbench simulate --nodes 2 --gpus-per-node 1 --strategy zigzag "
                       "--seqlen 512K --heads 8 --head-dim 64")
    assert cli_main(command.split()[1:]) == 0
    assert "zigzag" in capsys.readouterr().out
    # the largest power-of-two length that fits, with its own estimate
    suggested = parse_size(second.split("try --seqlen ")[1].split(" ")[0])
    fits = plan(RunConfig(strategy=("zigzag",), nproc=2, out="none"), {"seqlen": suggested},
                {}, launcher="self")
    assert fits.estimates[0].case_s <= 600
    over = plan(RunConfig(strategy=("zigzag",), nproc=2, out="none", max_minutes=0),
                {"seqlen": 2 * suggested}, {}, launcher="self")
    assert over.estimates[0].case_s > 600  # twice the length would not have fitted
    # --max-minutes 0: no limit, the estimate still made
    p = plan(RunConfig(strategy=("zigzag",), nproc=2, out="none", max_minutes=0),
             {"seqlen": 524288}, {}, launcher="self")
    assert p.estimates[0].case_s > 3600


def test_max_minutes_must_not_be_negative():
    with pytest.raises(UsageError, match="--max-minutes must be >= 0"):
        RunConfig(strategy=("zigzag",), max_minutes=-1)


def test_the_probe_is_the_blocks_flops_over_its_second_calls_times():
    """The real kernel on a 256-block, read on a stub clock: the first call (its set-up)
    takes 1 s a phase, the second 10 ms forward and 25 ms backward."""
    ticks = iter([0.0, 1.0, 2.0, 10.0, 10.010, 10.035])
    rate = estimate.probe("sdpa-cpu", "cpu", "fp32", 2, 2, 16, 256, clock=lambda: next(ticks))
    # 4 · 256² pairs · 2 heads · 16 = 8 388 608 FLOPs forward, 2.5 × that backward
    assert rate.fwd == pytest.approx(8_388_608 / 0.010)
    assert rate.bwd == pytest.approx(2.5 * 8_388_608 / 0.025)
    assert rate.side == 256 and rate.threads == 1  # on one thread
    assert estimate.probe_side("cpu", 8, 64, 0.3, 1 << 20) == 1024
    assert estimate.probe_side("cpu", 8, 64, 0.3, 300) == 300  # never past the case's block


@pytest.mark.slow  # seconds of CPU: a cpbench process (test-fast leaves it out)
def test_the_headline_request_is_refused_within_seconds(tmp_path):
    """`cpbench run --strategy zigzag --seqlen 524288` on this CPU machine: hours a step. One
    line on stderr with the estimate and what to do, exit 2, no ranks started, no file."""
    out = tmp_path / "never-written.jsonl"
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "cpbench.cli", "run", "--strategy", "zigzag",
                           "--seqlen", "524288", "--nproc", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 3 and lines[0].startswith("cpbench run: error: zigzag at seqlen 512K")
    assert "--max-minutes 0" in lines[1] and lines[2].startswith("  cpbench simulate")
    assert max(map(len, lines)) <= 120
    assert done.stdout == "" and not out.exists()  # before anything ran or was written
    assert took < 60, took  # seconds on an idle machine; bounded loosely on a shared one


def test_the_reference_is_counted_where_the_problem_is_new_and_the_first_case_pays_more(
        monkeypatch):
    monkeypatch.setattr(estimate, "probe", lambda *a, **k: RATE)
    short = AttentionConfig(batch=1, seqlen=1024, heads=8, head_dim=64, dtype="fp32",
                            causal=True)
    other = AttentionConfig(batch=1, seqlen=1024, heads=8, head_dim=64, dtype="fp32",
                            causal=False)

    def pr(attn, checked=True):
        return estimate.Problem(label="x", attn=attn, ranks_per_problem=2, imbalance=1.0,
                                kernel="sdpa-cpu", has_ideal=False, checked=checked)

    run = RunConfig(strategy=("zigzag",), warmup=2, iters=5, check=True,
                    max_minutes=0).resolved("cpu")
    ests = estimate.estimates([pr(short), pr(short), pr(short, checked=False), pr(other),
                               pr(short)], run, CPU)
    step = ests[1].step_s
    # every pair (both masks alike), on rank 0's one thread
    reference = 4 * 1024 ** 2 * 64 * 8 * 3.5 * 12 / 20e9 / 1
    # the first: its reference; the second: rank 0 kept it; the third (a later round): no
    # check; the fourth a new problem; the fifth the first's again, no longer kept
    assert [e.parts["check"] for e in ests] == pytest.approx(
        [2 * step + reference, 2 * step, 0.0, 2 * ests[3].step_s + reference,
         2 * step + reference])
    # the first case's first calls in its set-up, on idle cores a core's worth
    assert ests[0].parts["setup"] == pytest.approx(
        estimate.CASE_SETUP_S + estimate.FIRST_CASE_S + step)
    assert ests[1].parts["setup"] == pytest.approx(estimate.CASE_SETUP_S + step)
    # and its first warm-up step's first calls in its steps, which the later cases lack
    assert ests[0].parts["steps"] - ests[1].parts["steps"] == pytest.approx(
        estimate.FIRST_STEPS_S)
