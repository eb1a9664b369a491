"""Ranks as threads (``cpbench.threadpg`` through ``launch.run_threads``): every collective
cpbench's strategies use and the p2p mailbox move the right data, in subgroups too; per-rank
state stays per rank; a rank that raises, a collective a rank never posts, a message never
sent and mismatched calls each end with an error naming the rank and the op, in seconds."""

from __future__ import annotations

import contextlib
import logging
import re
import time

import pytest
import torch
import torch.distributed as dist

from cpbench import comm, ranklocal, topology, torchcompat
from cpbench.launch import RankError, run_threads
from cpbench.topology import Topology

N = 4


def _run(fn, nproc=N, collective_timeout=20.0):
    return run_threads(fn, nproc, timeout=60, collective_timeout=collective_timeout)


def test_collectives_move_every_ranks_data():
    def body(rank, world):
        mine = torch.arange(3, dtype=torch.float32) + 10 * rank
        total = mine.clone()
        dist.all_reduce(total)
        gathered = torch.empty(world * 3)
        dist.all_gather_into_tensor(gathered, mine)
        scattered = torch.empty(2)
        dist.reduce_scatter_tensor(scattered, torch.arange(2 * world, dtype=torch.float32))
        a2a = torch.empty(world, 2, dtype=torch.bfloat16)
        dist.all_to_all_single(a2a, torch.full((world, 2), rank, dtype=torch.bfloat16))
        root = torch.full((2,), float(rank))
        dist.broadcast(root, src=2)
        return total, gathered, scattered, a2a, root

    for rank, (total, gathered, scattered, a2a, root) in enumerate(_run(body)):
        ranks = torch.arange(N, dtype=torch.float32)
        assert torch.equal(total, sum(torch.arange(3.0) + 10 * r for r in range(N)))
        assert torch.equal(gathered, torch.cat([torch.arange(3.0) + 10 * r for r in range(N)]))
        assert torch.equal(scattered, N * torch.arange(2.0 * rank, 2 * rank + 2))
        assert torch.equal(a2a[:, 0].float(), ranks)  # member j's chunk from member j
        assert torch.equal(root, torch.full((2,), 2.0))


@pytest.mark.skipif(torchcompat.VERSION < torchcompat.CP_SINCE,
                    reason="functional collectives under threads hang on torch 2.5.1; only "
                           "torch's own CP (torch-ring, 2.10 on) calls them")
def test_a_functional_collective_moves_every_ranks_data():
    import torch.distributed._functional_collectives as funcol

    def body(rank, world):
        mine = torch.arange(3, dtype=torch.float32) + 10 * rank
        return funcol.wait_tensor(funcol.all_gather_tensor(mine, 0, dist.group.WORLD))

    for gathered in _run(body):
        assert torch.equal(gathered, torch.cat([torch.arange(3.0) + 10 * r for r in range(N)]))


def test_a_collective_inside_backward():
    class Summed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 1

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            dist.all_reduce(grad)
            return grad

    def body(rank, world):
        x = torch.full((2,), float(rank), requires_grad=True)
        (Summed.apply(x) * (rank + 1)).sum().backward()
        return x.grad

    for grad in _run(body):
        assert torch.equal(grad, torch.full((2,), float(sum(range(1, N + 1)))))


def test_mailbox_matches_messages_in_posting_order():
    """A ring by batch_isend_irecv; then two messages to the same peer with the same tag,
    their receives waited in reverse order, and one on another tag, and one to itself."""
    def body(rank, world):
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        got = torch.empty(2)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((2,), rank * 1.), nxt),
                                       dist.P2POp(dist.irecv, got, prv)])
        for r in reqs:
            r.wait()
        first, second, tagged, own = (torch.empty(1) for _ in range(4))
        sends = [dist.isend(torch.tensor([100. + rank]), nxt),
                 dist.isend(torch.tensor([200. + rank]), nxt),
                 dist.isend(torch.tensor([300. + rank]), nxt, tag=7),
                 dist.isend(torch.tensor([400. + rank]), rank)]
        recvs = [dist.irecv(t, src, tag=tag) for t, src, tag in
                 ((first, prv, 0), (second, prv, 0), (tagged, prv, 7), (own, rank, 0))]
        for r in reversed(recvs):
            r.wait()
        for s in sends:
            s.wait()
        return got, first, second, tagged, own

    for rank, (got, first, second, tagged, own) in enumerate(_run(body)):
        prv = (rank - 1) % N
        assert got.tolist() == [prv, prv]
        assert (first.item(), second.item(), tagged.item(), own.item()) == \
            (100 + prv, 200 + prv, 300 + prv, 400 + rank)


def test_subgroups_contiguous_and_strided_and_a_ring_in_one():
    def body(rank, world):
        topo = Topology(world_size=world, ranks_per_node=2)
        node = topology.new_groups(topo, "node", rank, topology.contiguous_groups(world, 2))
        strided = topology.new_groups(topo, "across", rank, topology.strided_groups(world, 2))
        x, y = torch.tensor([float(rank)]), torch.tensor([float(rank)])
        dist.all_reduce(x, group=node.pg)
        dist.all_reduce(y, group=strided.pg)
        ring = comm.RingComm(strided)
        got = ring.send_recv(torch.tensor([rank * 1.0]))
        ring.commit()
        ring.wait()
        return x.item(), y.item(), got.item(), strided.ranks

    for rank, (node_sum, across_sum, got, members) in enumerate(_run(body)):
        assert node_sum == sum(topology.group_of(rank, topology.contiguous_groups(N, 2)))
        assert across_sum == sum(members) and members == (rank % 2, rank % 2 + 2)
        assert got == members[1 - members.index(rank)]  # the ring of two: the other member


def test_async_collective_completes_when_the_last_member_posts():
    def body(rank, world):
        total = torch.ones(1)
        if rank == 0:
            work = dist.all_reduce(total, async_op=True)
            before = work.is_completed()
            for peer in range(1, world):  # the others post theirs only after this message
                dist.send(torch.ones(1), peer)
            work.wait()
            return before, work.is_completed(), total.item()
        dist.recv(torch.empty(1), 0)
        dist.all_reduce(total)
        return None

    assert _run(body)[0] == (False, True, N)


def test_per_rank_state_stays_with_its_rank():
    """comm's byte counters and topology's group cache are each rank's own."""
    def body(rank, world):
        topo = Topology(world_size=world, ranks_per_node=world)
        group = topology.new_groups(topo, "ring", rank, [list(range(world))])
        ring = comm.RingComm(group)
        with comm.counting() as counted:  # rank r sends r + 1 floats
            ring.send_recv(torch.ones(rank + 1), torch.empty((rank - 1) % world + 1))
            ring.commit()
            ring.wait()
        cached = [pg for _, pg in topology._pg_cache().values()]
        return counted.nbytes, ranklocal.rank(), cached == [group.pg], group.pg

    results = _run(body)
    assert [(n, r, mine) for n, r, mine, _ in results] == \
        [(4 * (r + 1), r, True) for r in range(N)]
    assert len({id(pg) for *_, pg in results}) == N  # each its own (all alive here)
    assert ranklocal.rank() is None  # the launching thread is no rank


def test_only_rank_zeros_thread_logs(capsys):
    from cpbench.report import console

    def body(rank, world):
        console.setup(rank, "table")
        logging.getLogger("cpbench").info("from rank %d", rank)
        return None

    console.setup(0, "table")
    _run(body)
    assert capsys.readouterr().out.splitlines() == ["from rank 0"]


def test_a_raising_rank_is_named_and_its_peers_stop_waiting():
    def body(rank, world):
        if rank == 2:
            raise ValueError("boom on purpose")
        dist.all_reduce(torch.ones(1))  # waits on rank 2, which never comes

    t0 = time.monotonic()
    with pytest.raises(RankError) as e:
        _run(body, collective_timeout=300.0)
    assert "rank 2 failed" in str(e.value) and "boom on purpose" in str(e.value)
    assert time.monotonic() - t0 < 30  # not the collective timeout: the others were told


def test_a_collective_never_posted_times_out_naming_rank_and_op():
    def body(rank, world):
        if rank != 1:  # rank 1 skips it
            dist.all_reduce(torch.ones(1))

    with pytest.raises(RankError) as e:
        _run(body, collective_timeout=1.0)
    found = re.search(r"^rank (\d) failed:.*CollectiveError: rank (\d): all_reduce on ranks "
                      r"\[0, 1, 2, 3\]: timed out after 1 s: rank\(s\) 1 never posted it$",
                      str(e.value), re.S)
    assert found and found[1] == found[2] and found[1] != "1", str(e.value)


def _all_to_all(world):
    dist.all_to_all_single(torch.empty(world), torch.ones(world))


def _all_gather(world):
    dist.all_gather_into_tensor(torch.empty(world), torch.ones(1))


def _reduce_scatter(world):
    dist.reduce_scatter_tensor(torch.empty(1), torch.ones(world))


@pytest.mark.parametrize("post,op", [(_all_to_all, "all_to_all_single"),
                                     (_all_gather, "all_gather"),
                                     (_reduce_scatter, "reduce_scatter")])
def test_every_tensor_collective_is_bounded_and_aborts(post, op):
    """Each entry point c10d has for these (its names differ across torch versions:
    torchcompat) reaches cpbench's group: a collective one rank never posts times out
    naming it, and a rank that fails first frees its peers at once (torch 2.11's stock
    ``alltoall_base`` waited forever)."""
    def skipped(rank, world):
        if rank != 1:
            post(world)

    with pytest.raises(RankError) as e:
        _run(skipped, collective_timeout=1.0)
    assert f"{op} on ranks [0, 1, 2, 3]: timed out after 1 s: rank(s) 1 never posted it" \
        in str(e.value), str(e.value)

    def failing(rank, world):
        if rank == 1:
            raise ValueError("boom on purpose")
        post(world)

    t0 = time.monotonic()
    with pytest.raises(RankError) as e:
        _run(failing, collective_timeout=300.0)
    assert "rank 1 failed" in str(e.value) and time.monotonic() - t0 < 30


def test_a_message_never_sent_times_out_naming_the_receive():
    def body(rank, world):
        if rank == 0:
            dist.recv(torch.empty(1), src=3)

    with pytest.raises(RankError) as e:
        _run(body, collective_timeout=1.0)
    assert str(e.value).startswith("rank 0 failed:")
    assert "rank 0: recv from rank 3 on ranks [0, 1, 2, 3] (tag 0): timed out after 1 s: " \
           "message 1 from rank 3 was never sent" in str(e.value)


def test_mismatched_collectives_fail_at_once_naming_both():
    def body(rank, world):
        if rank == 0:
            out = torch.empty(world)
            dist.all_gather_into_tensor(out, torch.ones(1))
        else:
            dist.all_reduce(torch.ones(1))

    t0 = time.monotonic()
    with pytest.raises(RankError) as e:
        _run(body, collective_timeout=300.0)
    assert "posted all_gather where rank" in str(e.value) or \
        "posted all_reduce where rank 0 posted all_gather" in str(e.value)
    assert time.monotonic() - t0 < 30


def test_a_patch_and_a_trace_are_their_ranks_own():
    """ranklocal.patch: rank 0's patch of a torch.distributed function sees rank 0's calls
    alone, and the function is torch's again after; commtrace.traced (the upstream
    adapters' byte count) records each rank's own sends."""
    from cpbench.bench import commtrace

    original, isend = dist.all_reduce, dist.isend

    def body(rank, world):
        calls = []

        def make(orig):
            def counted(*args, **kwargs):
                calls.append(rank)
                return orig(*args, **kwargs)

            return counted

        patch = ranklocal.patch((dist,), "all_reduce", make) if rank == 0 else None
        with patch or contextlib.nullcontext():
            dist.all_reduce(torch.ones(1))
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        with commtrace.traced() as events:  # rank r sends r + 1 floats
            for req in dist.batch_isend_irecv([
                    dist.P2POp(dist.isend, torch.ones(rank + 1), nxt),
                    dist.P2POp(dist.irecv, torch.empty(prv + 1), prv)]):
                req.wait()
        return calls, [(e.op, e.nbytes) for e in events]

    with commtrace.held():
        results = _run(body)
    assert [calls for calls, _ in results] == [[0], [], [], []]
    assert [events for _, events in results] == [[("p2p", 4 * (r + 1))] for r in range(N)]
    assert dist.all_reduce is original and dist.isend is isend  # torch's own again
