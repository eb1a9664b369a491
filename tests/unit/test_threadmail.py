"""The threaded group's strict mailbox (``cpbench.threadpg``, ``cpbench.threadmail``): a
receive into a buffer of another shape or dtype raises naming both ranks, shapes and dtypes;
mail left undelivered, or a receive never waited for, fails the case; no message crosses to
the next case on the groups a run keeps."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from cpbench import threadmail
from cpbench.launch import RankError, run_threads


def _run(fn, nproc=2):
    return run_threads(fn, nproc, timeout=60, collective_timeout=10.0)


@pytest.mark.parametrize("buffer, says", [
    (torch.empty(3, 4, dtype=torch.float64), "(3, 4) torch.float64"),
    (torch.empty(1, 4, dtype=torch.bfloat16), "(1, 4) torch.bfloat16")])
def test_a_receive_whose_buffer_differs_from_its_message_raises(buffer, says):
    def body(rank, world):
        if rank == 0:
            dist.send(torch.ones(1, 4, dtype=torch.float64), dst=1)
        else:
            dist.recv(buffer, src=0)

    with pytest.raises(RankError) as e:
        _run(body)
    assert (f"rank 1: recv from rank 0 on ranks [0, 1] (tag 0): rank 0 sent (1, 4) "
            f"torch.float64, the buffer is {says}: a receive's buffer must match its message"
            in str(e.value))


def test_an_undelivered_message_fails_its_case_and_a_received_one_does_not():
    def body(rank, world):
        threadmail.begin_case()
        if rank == 0:
            dist.send(torch.ones(2), dst=1)
            dist.send(torch.ones(2), dst=1, tag=5)  # no receive takes it
        else:
            dist.recv(torch.empty(2), src=0)
        try:
            threadmail.end_case()
        except threadmail.MailLeft as e:
            return str(e)
        return None

    assert _run(body) == [None, "rank 1: mail left at the case's end: message 1 from rank 0 "
                                "(tag 5, on ranks [0, 1]) never received"]


def test_a_receive_never_waited_for_fails_its_case():
    def body(rank, world):
        threadmail.begin_case()
        if rank == 1:
            dist.irecv(torch.empty(2), src=0, tag=3)  # posted, never waited, never sent
        with pytest.raises(threadmail.MailLeft) if rank == 1 else contextlib.nullcontext():
            threadmail.end_case()
        return True

    assert _run(body) == [True, True]


def test_no_message_crosses_from_one_case_to_the_next():
    """Case 1 leaves a message from rank 0 to rank 1 on tag 0; case 2's receive on the same
    group, peer and tag gets case 2's message, and case 2 ends clean."""
    def body(rank, world):
        threadmail.begin_case()
        if rank == 0:
            dist.send(torch.full((2,), 1.0), dst=1)
        with pytest.raises(threadmail.MailLeft) if rank == 1 else contextlib.nullcontext():
            threadmail.end_case()
        threadmail.begin_case()
        got = torch.empty(2)
        if rank == 0:
            dist.send(torch.full((2,), 2.0), dst=1)
        else:
            dist.recv(got, src=0)
        threadmail.end_case()
        return got

    assert _run(body)[1].tolist() == [2.0, 2.0]


def test_outside_a_threaded_launch_the_case_edges_do_nothing():
    threadmail.begin_case()
    threadmail.end_case()  # no process group here: nothing to check, no barrier

