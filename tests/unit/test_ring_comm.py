"""RingComm refuses a second ring in flight on one ProcessGroup: NCCL ignores p2p tags, so
two rings on one communicator would serialize on GPUs even though gloo keeps them apart."""

from __future__ import annotations

import pytest
import torch

from cpbench import comm
from cpbench.topology import Group


class _Done:
    def wait(self):
        pass


@pytest.fixture
def no_transport(monkeypatch):
    """Ops queued and "completed" without a process group: only the bookkeeping runs."""
    monkeypatch.setattr(comm.dist, "P2POp", lambda *args: args)
    monkeypatch.setattr(comm.dist, "batch_isend_irecv", lambda ops: [_Done() for _ in ops])


def _group(name, pg):
    return Group(name, (0, 1), 0, False, pg)


def test_concurrent_rings_need_their_own_groups(no_transport):
    shared, other = object(), object()
    kv = comm.RingComm(_group("ring", shared))
    kv.send_recv(torch.ones(2))
    kv.commit()
    dkv = comm.RingComm(_group("ring_dkv", shared))
    dkv.send_recv(torch.ones(2))
    with pytest.raises(AssertionError, match="'ring_dkv' shares its ProcessGroup with ring "
                                             "'ring'"):
        dkv.commit()
    own = comm.RingComm(_group("ring_dkv", other))
    own.send_recv(torch.ones(2))
    own.commit()  # its own group: fine while the K/V ring is in flight
    kv.wait()
    own.wait()
    dkv.commit()  # the K/V ring is done: the group is free again
    dkv.wait()


def test_rings_sharing_a_group_on_purpose(no_transport):
    """ring-flash-attn's K/V and dK/dV rings share one group and overlap: rings made with
    queue_behind=True may (they queue on one communicator); with a ring that did not say so,
    still refused."""
    shared = object()
    kv = comm.RingComm(_group("ring", shared), queue_behind=True)
    kv.send_recv(torch.ones(2))
    kv.commit()
    dkv = comm.RingComm(_group("ring", shared), queue_behind=True)
    dkv.send_recv(torch.ones(2))
    dkv.commit()
    strict = comm.RingComm(_group("other", shared))
    strict.send_recv(torch.ones(2))
    with pytest.raises(AssertionError, match="shares its ProcessGroup"):
        strict.commit()
    kv.wait()
    dkv.wait()


def test_an_abandoned_ring_does_not_block_the_next(no_transport):
    pg = object()
    ring = comm.RingComm(_group("ring", pg))
    ring.send_recv(torch.ones(2))
    ring.commit()
    del ring  # e.g. an OOM unwound the strategy mid-ring; the driver goes on
    nxt = comm.RingComm(_group("ring", pg))
    nxt.send_recv(torch.ones(2))
    nxt.commit()  # raises AssertionError if the abandoned ring still counted as in flight
    nxt.wait()
