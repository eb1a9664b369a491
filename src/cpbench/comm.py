"""Communication used by strategies: ring send/recv and all-to-all, on a ``Group``.

Every byte a strategy sends goes through here, so a ``trace()`` can count it and tests can
hold each strategy's declared communication schedule to what its code actually sends.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from cpbench import ranklocal, torchcompat
from cpbench.topology import Group


@dataclass(frozen=True)
class Sent:
    """One message this rank sent: the op, the group's name, its size in bytes, and the
    bytes its layout copies read and wrote (an all-to-all's: ``a2a_copied_bytes``)."""

    op: str
    group: str
    nbytes: int
    copied: int = 0


_TRACE: contextvars.ContextVar[list[Sent] | None] = contextvars.ContextVar("trace", default=None)
_INSIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("inside", default=False)


@contextlib.contextmanager
def trace() -> Iterator[list[Sent]]:
    """Record every message sent inside the block: ``with trace() as sent: ...``."""
    sent: list[Sent] = []
    token = _TRACE.set(sent)
    try:
        yield sent
    finally:
        _TRACE.reset(token)


class Counter:
    """Bytes this process sent while counting (``with counting() as c: ...; c.nbytes``)."""

    nbytes: int = 0


def _counters() -> list[Counter]:
    """This rank's active counters (``ranklocal``): seen from any thread of a rank's process,
    as a CUDA backward runs on autograd's device thread, where the trace's ContextVar is
    unset; one add per message, so counting every timed step costs nothing measurable."""
    return ranklocal.slot("comm.counters", list)


@contextlib.contextmanager
def counting():
    """Count the bytes this rank sends inside the block, whichever of its threads sends
    them."""
    c = Counter()
    counters = _counters()
    counters.append(c)
    try:
        yield c
    finally:
        counters.remove(c)


def _record(op: str, group: Group, nbytes: int, copied: int = 0) -> None:
    for c in _counters():
        c.nbytes += nbytes
    log = _TRACE.get()
    if log is not None:
        log.append(Sent(op, group.name, nbytes, copied))


KERNEL = "kernel"


def record_kernel() -> None:
    """Mark an attention kernel call in the trace (``Sent(KERNEL, "", 0)``), so a test can
    tell which messages a strategy posts before a step's kernel and which after it."""
    log = _TRACE.get()
    if log is not None:
        log.append(Sent(KERNEL, "", 0))


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class RingComm:
    """Point-to-point exchange with the ring neighbours of a group.

    ``send_recv`` queues a send to the next rank and a receive from the previous one
    (``reverse=True`` swaps the direction); ``commit`` posts everything queued as one batch
    so transfers overlap the compute that follows; ``wait`` blocks until they are done.

    One batch per ProcessGroup at a time, unless both rings say otherwise: NCCL ignores p2p
    tags and orders a communicator's operations, so a second ring on the same group queues
    behind the first; ``commit`` refuses that, so the CPU tests catch what would silently
    serialize on GPUs. Rings made with ``queue_behind=True`` share a group on purpose (as
    ring-flash-attn's K/V and dK/dV rings do, and the strategies reproducing it).
    """

    @staticmethod
    def _in_flight() -> weakref.WeakSet[RingComm]:
        """This rank's RingComms with a committed, unwaited batch; weak, so a ring abandoned
        by an exception (an OOM the driver records before going on) does not block the next
        case."""
        return ranklocal.slot("comm.in_flight", weakref.WeakSet)

    def __init__(self, group: Group, *, queue_behind: bool = False):
        self.group, self.queue_behind = group, queue_behind
        self._ops: list[dist.P2POp] = []
        self._reqs: list = []

    def send_recv(self, to_send: torch.Tensor, recv_buf: torch.Tensor | None = None,
                  *, reverse: bool = False) -> torch.Tensor:
        g = self.group
        dst, src = (g.prev_rank, g.next_rank) if reverse else (g.next_rank, g.prev_rank)
        to_send = to_send.contiguous()
        recv = torch.empty_like(to_send) if recv_buf is None else recv_buf
        self._ops.append(dist.P2POp(dist.isend, to_send, dst, g.pg))
        self._ops.append(dist.P2POp(dist.irecv, recv, src, g.pg))
        _record("p2p", g, nbytes(to_send))
        return recv

    def commit(self) -> None:
        assert not self._reqs, "wait() for the previous batch before committing another"
        if self._ops:
            busy = [c.group.name for c in RingComm._in_flight() if c.group.pg is self.group.pg
                    and not (self.queue_behind and c.queue_behind)]
            assert not busy, (f"group {self.group.name!r} shares its ProcessGroup with ring "
                              f"{busy[0]!r}, still in flight: concurrent rings need their own "
                              f"groups")
            self._reqs = dist.batch_isend_irecv(self._ops)
            RingComm._in_flight().add(self)
        self._ops = []

    def wait(self) -> None:
        for req in self._reqs:
            req.wait()
        RingComm._in_flight().discard(self)
        self._reqs = []


def in_collective() -> bool:
    """Whether this thread is inside one of our collectives. A tensor an op touches there
    that the caller did not make is the backend's own: gloo's reduce-scatter reduces a copy
    of its input and splits it in ``wait``. ``bench.memory`` leaves those out, as it does
    gloo's other buffers (a GPU's NCCL has no such copy, and the dry run none)."""
    return _INSIDE.get()


class _Collective:
    """Marks a collective (its post, or its wait) as ``in_collective``; given the buffers
    this module made for it, counted before the post, leaves only once the process group has
    let go of them: gloo's worker thread drops a finished collective (and the buffers it
    holds) a moment after waking its caller, and buffers freed then, on that thread, at a
    time the scheduler picks, made the CPU peak vary between runs by a buffer or two.
    Bounded: a backend that holds on longer is not waited for. On a GPU nothing is counted
    or waited for (the caching allocator decides when memory returns)."""

    def __init__(self, *buffers: torch.Tensor) -> None:
        self.before = [(t, _holders(t)) for t in buffers if t.device.type == "cpu"]

    def __enter__(self) -> None:
        self.token = _INSIDE.set(True)

    def __exit__(self, *exc) -> None:
        _INSIDE.reset(self.token)
        if not self.before or exc[0] is not None:
            return
        deadline = time.monotonic() + 0.05
        while any(now > was for t, held in self.before for now, was in zip(_holders(t), held)) \
                and time.monotonic() < deadline:
            time.sleep(0)


def _holders(t: torch.Tensor) -> tuple[int, int]:
    """Who holds ``t``: references to it, and tensors (views) on its storage."""
    uses = torchcompat.use_count(t) or 0
    return uses, torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _wire(t: torch.Tensor) -> torch.Tensor:
    # gloo's collectives lack some reduced-precision types; they travel as raw bytes.
    if t.dtype in (torch.bfloat16, torch.float16) and t.device.type == "cpu":
        return t.view(torch.uint8)
    return t


def _chunk_major(x: torch.Tensor, n: int, scatter_dim: int) -> tuple[torch.Tensor, int]:
    """``x`` with its scatter dim's n chunks made the leading dim (a view), and the bytes
    ``all_to_all``'s layout copies of it read and write besides the wire: the send buffer
    laid chunk-major (none when the view already is contiguous, as when the scatter dim is
    the outermost one of size over 1) and the received chunks laid side by side (always),
    each the whole tensor read once and written once. Real or meta ``x``: the one rule."""
    xs = x.unflatten(scatter_dim, (n, x.shape[scatter_dim] // n)).movedim(scatter_dim, 0)
    copies = 1 + (not xs.is_contiguous())
    return xs, 2 * copies * nbytes(xs)


def a2a_copied_bytes(shape: tuple[int, ...], element_size: int, n: int, scatter_dim: int
                     ) -> int:
    """The bytes ``all_to_all``'s own layout copies of a contiguous ``shape`` read and write
    besides the wire (``_chunk_major``). What the simulator prices over HBM
    (``Message.copied``); tests/unit/test_comm_copies.py counts them."""
    if n == 1:
        return 0
    # one byte an element (contiguity does not depend on the dtype), scaled to the real size
    meta = torch.empty(shape, dtype=torch.uint8, device="meta")
    return _chunk_major(meta, n, scatter_dim)[1] * element_size


def all_to_all(x: torch.Tensor, group: Group, *, scatter_dim: int, gather_dim: int
               ) -> torch.Tensor:
    """Split ``x`` into group.size chunks along scatter_dim, send chunk j to member j, and
    concatenate what arrives along gather_dim in member order."""
    n = group.size
    if n == 1:
        return x
    assert x.shape[scatter_dim] % n == 0, "scatter dim must divide by the group size"
    # Chunks of the scatter dim become the leading dim so all_to_all_single can split dim 0.
    xs, copied = _chunk_major(x, n, scatter_dim)
    xs = xs.contiguous()
    out = torch.empty_like(xs)
    _record("a2a", group, nbytes(xs) * (n - 1) // n, copied)
    with _Collective(out, xs):
        dist.all_to_all_single(out, xs, group=group.pg)  # in its dtype: what a GPU run sends
    # out[j] is member j's chunk, in x's dim order: lay the chunks side by side on gather_dim.
    return torch.cat(out.unbind(0), dim=gather_dim)


def all_gather(x: torch.Tensor, pg=None) -> list[torch.Tensor]:
    """Every rank's ``x`` (same shape everywhere), in rank order. For checks, not hot paths."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(pg))]
    dist.all_gather([_wire(p) for p in parts], _wire(x), group=pg)
    return parts


# torch 2.13 renames these tensor collectives and warns on the old names, which every torch
# has and which `cpbench comm` traces (looked up at each call, where its tracer patches them)
for _name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
    warnings.filterwarnings("ignore", f".*{_name}.* is deprecated", FutureWarning)


def all_gather_seq(x_bs: torch.Tensor, group: Group) -> torch.Tensor:
    """Every member's ``x`` (b, s, ...) laid end to end along dim 1, in member order (the
    members' group ranks are their sorted global ranks; ``ranks`` lists them so)."""
    return all_gather_seq_async(x_bs, group)()


def all_gather_seq_async(x_bs: torch.Tensor, group: Group):
    """``all_gather_seq`` posted without waiting; returns the call that waits for it and
    hands back its result (so the next gather can be posted while this one's result is
    used: ring-flash-attn's llama3 prefetch)."""
    n = group.size
    if n == 1:
        return lambda: x_bs
    x = x_bs.contiguous()
    # gathered along dim 0 (members' tensors end to end), then their s-slices side by side
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _record("ag", group, nbytes(x) * (n - 1))  # to each of the n-1 others
    # in its own dtype (gloo gathers bf16 / fp16), as ring-flash-attn's gathers travel
    # out's holders before the post (the work holds it until dropped; x is the caller's,
    # who may make views of it meanwhile; the work lets go of both at once)
    let_go = _Collective(out)
    with _Collective():
        work = [dist.all_gather_into_tensor(out, x, group=group.pg, async_op=True)]

    def wait() -> torch.Tensor:
        with let_go:
            work.pop().wait()
        return out.unflatten(0, (n, -1)).movedim(0, 1).flatten(1, 2)

    return wait


def reduce_scatter_seq(x_bs: torch.Tensor, group: Group) -> torch.Tensor:
    """The sum over members of ``x`` (b, n·s, ...), each member keeping its s-slice of dim 1
    (the transpose of ``all_gather_seq``)."""
    n = group.size
    if n == 1:
        return x_bs
    parts = x_bs.unflatten(1, (n, -1)).movedim(1, 0).contiguous()
    out = torch.empty(parts.shape[1:], dtype=x_bs.dtype, device=x_bs.device)
    _record("rs", group, nbytes(parts) * (n - 1) // n)
    with _Collective(out, parts):
        dist.reduce_scatter_tensor(out, parts.flatten(0, 1), group=group.pg)
    return out
