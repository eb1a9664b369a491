"""``cpbench run --launcher threads`` end to end on CPU: every strategy (the upstream ones in
bf16, as they run) passes its float64 check with the ranks as threads, GQA, packed documents
and windows included, with no time printed; negative controls fail theirs (a mailbox that
delivers zeros, a strategy that sends nothing); a rank that runs out of memory inside a ring
ends its case, named, and the next case runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpbench import guards, results, threadpg, torchcompat
from cpbench.cli import main as cli_main

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SMALL = ["--seqlen", "256", "--heads", "4", "--head-dim", "16", "--nproc", "4"]


def _run(tmp_path, *flags) -> tuple[int, list[dict]]:
    out = tmp_path / "r.jsonl"
    code = cli_main(["run", "--launcher", "threads", "--check", *SMALL, *flags,
                     "--out", str(out)])
    return code, results.read(out) if out.exists() else []


def _passed(records: list[dict]) -> None:
    bad = [(r["config"]["strategy"], r["status"], r["error"], r["derived"]["flags"])
           for r in records if r["status"] != "ok" or r["derived"]["check_passed"] is not True
           or r["derived"]["flags"] != []]
    assert not bad, bad
    for r in records:  # nothing measured; the one untimed step's bytes counted
        assert r["samples_ms"] is None and r["memory_bytes"] is None, r["config"]["strategy"]
        assert r["env"]["launcher"] == "threads"
        assert r["derived"]["not_measured"] == guards.THREADS
        assert r["comm"]["counted"].startswith("one untimed step")


def test_every_strategy_passes_as_threads_bf16_gqa(tmp_path, capsys, own_modules):
    code, records = _run(tmp_path, "--strategy", "all", "--dtype", "bf16", "--kv-heads", "2")
    text = capsys.readouterr().out
    assert code == 0, text[-4000:]
    _passed(records)
    ran = {r["config"]["strategy"] for r in records}
    # every strategy that can run on CPU here, the upstream adapters included
    expected = {"zigzag", "ring", "ulysses", "usp", "llama3", "megatron-cp", "burst",
                "double-ring", "megatron-cp-a2a+p2p", "local", "rfa-ring", "rfa-zigzag",
                "rfa-llama3", "rfa-stripe", "yunchang-usp", "torch-ring"}
    if torchcompat.VERSION < torchcompat.CP_SINCE:  # skipped, naming the torch it needs
        expected.remove("torch-ring")
        assert re.search(r"^skipped torch-ring.*needs torch >= 2\.10", text, re.M)
    assert expected <= ran
    assert all(r["comm"]["sent_bytes"]["fwd_bwd"][0] > 0 for r in records
               if r["ranks_per_problem"] > 1)
    summary = text[text.index("Benchmark Summary:"):]
    assert guards.THREADS in summary  # said once, under the table
    assert re.search(r"^skipped (.*, )?te-p2p[ ,].*cannot run here", text, re.M)
    assert "ranks as threads on one cpu" in text


@pytest.mark.parametrize("mask, names", [
    (["--documents", "64,96,32,64"], "zigzag,llama3,usp,double-ring,rfa-zigzag,rfa-llama3"),
    (["--window-size", "40,0"], "ring,llama3,usp,megatron-cp-a2a+p2p,rfa-llama3"),
], ids=["documents", "window"])
def test_masks_pass_as_threads(tmp_path, capsys, own_modules, mask, names):
    code, records = _run(tmp_path, "--strategy", names, "--dtype", "bf16", *mask)
    assert code == 0, capsys.readouterr().out[-4000:]
    _passed(records)
    assert {r["config"]["strategy"] for r in records} == set(names.split(","))


def test_a_mailbox_delivering_zeros_fails_every_ring(tmp_path, capsys, own_modules,
                                                     monkeypatch):
    """The negative control: every message arrives as zeros (the same bytes counted): each
    strategy whose data travels point to point fails its check; the baseline passes."""
    send = threadpg.ThreadedGroup.send

    def zeros(self, tensors, dst, tag=0):
        return send(self, [torch.zeros_like(tensors[0])], dst, tag)

    monkeypatch.setattr(threadpg.ThreadedGroup, "send", zeros)
    names = "ring,zigzag,megatron-cp,burst,rfa-zigzag,local"
    code, records = _run(tmp_path, "--strategy", names, "--dtype", "bf16")
    assert code == 1, capsys.readouterr().out[-4000:]
    verdicts = {r["config"]["strategy"]: r["derived"]["check_passed"] for r in records}
    assert verdicts == {**dict.fromkeys(names.split(",")[:-1], False), "local": True}
    assert all(r["status"] == "ok" for r in records)


def _cpbench(*args, entry=None, plugins=False, timeout=300):
    path = [str(HERE / "plugins")] if plugins else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [*path, *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd = [sys.executable, *(["-c", "import sys; from cpbench.cli import main; "
                                    "sys.exit(main())", "run"] if entry is None else [entry]),
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=env)


def test_a_strategy_that_sends_nothing_fails_its_check(tmp_path):
    out = tmp_path / "r.jsonl"
    run = _cpbench("--launcher", "threads", "--strategy", "test-silent-zigzag,zigzag",
                   "--check", *SMALL, "--out", str(out), plugins=True)
    assert run.returncode == 1, run.stdout + run.stderr
    silent, zigzag = results.read(out)
    assert silent["derived"]["check_passed"] is False and silent["status"] == "ok"
    assert silent["comm"]["sent_bytes"]["fwd"] == [0] * 4
    assert any("sent 0 B, schedule says" in f for f in silent["derived"]["flags"])
    assert zigzag["derived"]["check_passed"] is True


def test_an_oom_inside_a_ring_ends_its_case_and_the_next_runs(tmp_path):
    """Rank 1 runs out of memory at its third call while its peers wait for it in the ring
    (tests/multirank/faults.py): the case is recorded OOM with rank 1's message, the threads
    form a new world and zigzag runs; in seconds, not the collective timeout."""
    out = tmp_path / "r.jsonl"
    run = _cpbench("--launcher", "threads", "--strategy", "test-oom-in-ring,zigzag",
                   "--nproc", "2", "--seqlen", "256", "--heads", "2", "--head-dim", "16",
                   "--check", "--collective-timeout", "120", "--out", str(out),
                   entry=str(HERE / "faults.py"), timeout=200)
    assert run.returncode == 0, run.stdout + run.stderr
    oom, zigzag = results.read(out)
    assert (oom["status"], zigzag["status"]) == ("OOM", "ok")
    assert oom["error"].startswith("rank 1: OutOfMemoryError: CUDA out of memory (injected "
                                   "on rank 1, call 3)")
    assert zigzag["derived"]["check_passed"] is True
    assert "forming the process group again" in run.stdout and "not run" not in run.stdout


def test_sinks_as_threads_check_dsinks_and_are_kept_in_the_record(tmp_path, capsys):
    code, records = _run(tmp_path, "--strategy", "ring,ulysses,megatron-cp,rfa-ring",
                         "--kv-heads", "2", "--sinks")
    text = capsys.readouterr().out
    assert code == 0, text[-4000:]
    _passed(records)
    assert {r["config"]["strategy"] for r in records} == {"ring", "ulysses", "megatron-cp"}
    assert re.search(r"^skipped rfa-ring\b.*cannot add attention sinks", text, re.M)
    for r in records:
        assert r["config"]["attention"]["sinks"] is True
        assert [c["tensor"] for c in r["check"]][-1] == "dsinks"
