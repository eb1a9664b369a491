"""How a sweep records a row its launch left unwritten (the launch faked: what its ranks
would leave): the failing rank's status and message from the sweep's store, else from its
failure line anywhere in the log; never from the log's last lines. And ``--run``'s split of
`cpbench run` flags into one case per strategy."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cpbench import results, sweep
from cpbench.bench import failures
from cpbench.sweep import runner

SETTINGS = {"strategy": ("ring", "zigzag"), "nproc": 2, "seqlen": 256, "heads": 2,
            "head_dim": 16, "warmup": 0, "iters": 1}
# torchrun's summary: what the last lines of a NCCL job's log say, whatever the cause
SUMMARY = ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
           "  exitcode  : -6 (pid: 4242)\n  traceback : Signal 6 (SIGABRT) received by PID "
           "4242\n  [rank0]: out of memory? no: Watchdog caught collective operation timeout\n")


def _fake_launch(monkeypatch, act):
    """Replace the launch by ``act(case label, record key, env)`` writing what ranks would."""
    def launch(cmd, log_path, timeout, store_address=None):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, **runner.NCCL_ERROR_HANDLING)
        if store_address:
            env[failures.STORE_ENV] = store_address
        strategy = cmd[cmd.index("--strategy") + 1]
        log_path.write_text("$ " + " ".join(cmd) + "\n" + act(strategy, env) + SUMMARY)
        return 1, False
    monkeypatch.setattr(runner, "_launch", launch)


def test_the_split_is_one_case_per_strategy_with_its_own_keys():
    config = sweep.per_strategy(dict(SETTINGS))
    assert [c.label for c in config.cases] == ["ring", "zigzag"]
    assert [c.settings["strategy"] for c in config.cases] == [("ring",), ("zigzag",)]
    assert all(len(c.keys) == 1 for c in config.cases)
    with pytest.raises(ValueError, match="--nproc starts local CPU ranks"):
        sweep.per_strategy(dict(SETTINGS), nodes=1, gpus_per_node=2)


def test_the_rank_s_own_oom_from_the_store_not_the_log_tail(tmp_path, monkeypatch):
    config, out = sweep.per_strategy(dict(SETTINGS)), tmp_path / "r.jsonl"
    keys = {c.label: (c.keys[0], c.plan.cases[0].label) for c in config.cases}

    def act(strategy, env):
        if strategy == "ring":  # rank 1 left its OOM in the store (nothing in the log)
            monkeypatch.setenv(failures.STORE_ENV, env[failures.STORE_ENV])
            store = failures._client()
            store.set(f"cpbench/failure/{keys['ring'][0]}/1",
                      '["OOM", "OutOfMemoryError: CUDA out of memory (rank 1)"]')
            return ""
        return ""  # zigzag: no rank said anything

    _fake_launch(monkeypatch, act)
    assert runner.run(config, str(out), stream=open(os.devnull, "w")) == 1
    ring, zigzag = results.read(out)
    assert ring["status"] == results.OOM
    assert ring["error"].startswith("rank 1: OutOfMemoryError: CUDA out of memory (rank 1) "
                                    "(the launch ended (exit 1)")
    # "out of memory" in the log's last lines decides nothing
    assert zigzag["status"] == results.FAILED
    assert zigzag["error"].startswith("no rank reported a failure")
    assert zigzag["error"].endswith("its last line: [rank0]: out of memory? no: Watchdog caught "
                                    "collective operation timeout")  # context, not status
    assert Path(zigzag["sweep"]["log"]).exists()


def test_without_a_store_the_failure_line_anywhere_in_the_log(tmp_path, monkeypatch):
    config, out = sweep.per_strategy(dict(SETTINGS)), tmp_path / "r.jsonl"
    labels = {c.label: c.plan.cases[0].label for c in config.cases}

    def no_store(local=False):
        raise OSError("no port")

    monkeypatch.setattr(failures, "host_store", no_store)

    def act(strategy, env):
        assert failures.STORE_ENV not in env
        line = failures.line(0, results.FAILED, labels[strategy], "RuntimeError: boom")
        return f"{line}\n" + "noise\n" * 50

    _fake_launch(monkeypatch, act)
    assert runner.run(config, str(out), stream=open(os.devnull, "w")) == 1
    assert [(r["status"], r["error"].split(" (the launch")[0]) for r in results.read(out)] == [
        (results.FAILED, "rank 0: RuntimeError: boom")] * 2


def test_repair_tail_cuts_a_torn_line_under_the_appends_lock(tmp_path):
    import fcntl

    out = tmp_path / "r.jsonl"
    out.write_bytes(b'{"a": 1}\n{"torn')
    runner._repair_tail(out)
    assert out.read_bytes() == b'{"a": 1}\n'
    out.write_bytes(b'{"a": 1}\n{"torn')
    with open(out, "rb") as held:  # another writer holds the lock: the repair waits
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        import threading
        done = threading.Event()
        t = threading.Thread(target=lambda: (runner._repair_tail(out), done.set()))
        t.start()
        assert not done.wait(0.5)
    t.join(5)  # closing the file released the lock
    assert done.is_set() and out.read_bytes() == b'{"a": 1}\n'


def test_run_flags_under_a_launcher_need_the_job_s_size(capsys):
    from cpbench import cli

    assert cli.main(["sweep", "--launcher", "srun torchrun", "--out", "r.jsonl", "--run",
                     "--strategy", "ring"]) == 2
    assert "give --nodes" in capsys.readouterr().err
