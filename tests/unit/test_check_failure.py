"""``--check`` when rank 0 fails building its reference: the failure is the broadcast's
payload, so every rank leaves the broadcast and raises it (no rank is left waiting)."""

from __future__ import annotations

import pytest
import torch

from cpbench import kernels
from cpbench.bench import check
from cpbench.config import AttentionConfig
from cpbench.strategies.ring import Ring
from cpbench.topology import Topology

ATTN = AttentionConfig(batch=1, seqlen=64, heads=2, head_dim=16, dtype="fp32", causal=True)


def _strategy(rank: int) -> Ring:
    return Ring(ATTN, Topology(world_size=2, ranks_per_node=1), rank,
                kernel=kernels.get("torch"), options=Ring.Options(), create_groups=False)


@pytest.fixture
def two_ranks(monkeypatch):
    """The collectives of a 2-rank check, faked: both ranks' shards are this rank's; the
    broadcast records what rank 0 sent and hands it to the receiving rank."""
    sent = []

    def run_local(strategy, inputs):
        shard = strategy.shard(inputs["q"])  # any tensor of the right shape: never compared
        return {"out": shard, "dq": shard, "dk": shard, "dv": shard,
                "lse": torch.zeros(1, 2, ATTN.seqlen // 2)}

    def broadcast(objs, src):
        if sent:  # the receiving rank gets what rank 0 sent
            objs[0] = sent[-1]
        else:
            sent.append(objs[0])

    monkeypatch.setattr(check, "run_local", run_local)
    monkeypatch.setattr(check.comm, "all_gather", lambda t: [t, t])
    monkeypatch.setattr(check.dist, "broadcast_object_list", broadcast)
    return sent


def test_rank0_failure_is_broadcast_and_raised_everywhere(two_ranks, monkeypatch):
    def oom(inputs, attn, after_head=None):
        raise torch.OutOfMemoryError("CUDA out of memory (injected in the reference)")

    monkeypatch.setattr(check, "_reference", oom)
    with pytest.raises(torch.OutOfMemoryError, match="injected in the reference"):
        check.check_strategy(_strategy(0), seed=0)
    assert isinstance(two_ranks[0], torch.OutOfMemoryError)  # rank 0 sent it, then raised
    with pytest.raises(torch.OutOfMemoryError, match="injected in the reference"):
        check.check_strategy(_strategy(1), seed=0)  # rank 1 raises what it received


def test_an_exception_that_cannot_be_pickled_travels_as_its_message(two_ranks, monkeypatch):
    class Local(Exception):  # defined in a function: pickle cannot find it
        pass

    def fail(inputs, attn, after_head=None):
        raise Local("reference failed")

    monkeypatch.setattr(check, "_reference", fail)
    with pytest.raises(RuntimeError, match="rank 0: Local: reference failed"):
        check.check_strategy(_strategy(0), seed=0)
