"""Planning ``--launcher threads``: what it refuses (one line, exit 2, before any rank
starts), what it runs (no baseline bracket: nothing is timed; a strategy that cannot run as
threads skipped with its reason) and the waits of ranks sharing one device."""

from __future__ import annotations

import pytest
import torch

import cpbench.launch
from cpbench import cli, strategies
from cpbench.bench import plan as planning
from cpbench.config import RunConfig
from cpbench.errors import UsageError

TORCHRUN = dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1")


@pytest.fixture()
def no_launch(monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(cpbench.launch, "run_ranks", forbidden)
    monkeypatch.setattr(cpbench.launch, "run_threads", forbidden)


def _error(capsys, *args) -> str:
    code = cli.main(["run", "--launcher", "threads", *args, "--out", "none"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_what_threads_refuse(no_launch, capsys, monkeypatch, tmp_path):
    assert "nothing to profile" in _error(capsys, "--strategy", "ring", "--profile",
                                          str(tmp_path))
    assert "drop --rounds" in _error(capsys, "--strategy", "ring", "--rounds", "2")
    if not torch.cuda.is_available():
        assert "no CUDA device" in _error(capsys, "--strategy", "ring", "--device", "cuda")
    for var, value in TORCHRUN.items():
        monkeypatch.setenv(var, value)
    assert "under torchrun drop --launcher" in _error(capsys, "--strategy", "ring")


def _plan(**run_kw):
    return planning.plan(RunConfig(out="none", launcher="threads", nproc=4, **run_kw),
                         {"seqlen": 256}, {}, launcher="self")


def test_threads_plan_runs_each_case_once_on_one_device():
    p = _plan(strategy=("ring", "local"), device="cpu")
    assert p.launcher == planning.THREADS and not p.timed and p.run.nproc == 4
    assert [c.strategy for c in p.cases] == ["ring", "local"]  # no baseline at both ends
    processes = planning.plan(RunConfig(out="none", nproc=4, strategy=("ring", "local")),
                              {"seqlen": 256}, {}, launcher="self")
    assert processes.timed and [c.strategy for c in processes.cases] == \
        ["local", "ring", "local"]


def test_ranks_sharing_a_device_wait_for_each_other_longer():
    from cpbench.config import AttentionConfig

    attn = AttentionConfig(batch=1, seqlen=32768, heads=8, head_dim=64)
    run = RunConfig(nproc=4).resolved("cpu")
    alone, shared = planning.case_waits(attn, run, 4), planning.case_waits(attn, run, 4, 4)
    assert alone[0] > planning.MIN_COLLECTIVE_TIMEOUT_S  # above the floor: it scales
    assert shared == pytest.approx((4 * alone[0], 4 * alone[1]))


def test_a_strategy_that_cannot_run_as_threads_says_why(monkeypatch, capsys):
    cls = strategies.get("ring")
    monkeypatch.setattr(cls, "no_threads", "it cannot (test)")
    p = _plan(strategy=("all",), device="cpu")
    assert "ring" not in {c.strategy for c in p.cases}
    assert "ring cannot run here: it cannot (test)" in p.skipped
    with pytest.raises(UsageError, match="ring cannot run here: it cannot"):
        _plan(strategy=("ring", "zigzag"), device="cpu")
    assert strategies.get("torch-flex").no_threads.startswith("its FlexAttention runs through "
                                                              "torch.compile")
    assert cli.main(["strategies"]) == 0
    assert "not with --launcher threads: it cannot (test)" in capsys.readouterr().out
