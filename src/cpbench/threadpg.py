"""Ranks as threads on one device (``--launcher threads``): torch's threaded process group,
with point-to-point messages and bounded waits of cpbench's own.

torch's threaded group (``torch.testing._internal.distributed.multi_threaded_pg``, PyTorch's
own distributed test tooling) gives every thread its own ``torch.distributed`` world and
moves a collective's data between the threads' tensors. Its collectives wait forever and it
has no send / recv. ``ThreadedGroup`` keeps its data movers and its per-thread world, and:

- matches collectives per group by order (the n-th call of every member is one collective),
  posts them without waiting (``async_op`` and ``Work.wait`` / ``is_completed`` behave), and
  has the last member to arrive move the data, so a collective is complete once every member
  has posted it;
- sends through a mailbox: a send copies its tensor at once (its buffer is free at once),
  the matching receive (the n-th from that peer, group and tag in this case) copies the
  message into its buffer when waited on; ``batch_isend_irecv`` posts them one by one. The
  mailbox is strict where NCCL is not (on a GPU a mismatch corrupts data, silently): a
  buffer of another shape or dtype than its message raises, naming both ranks, shapes and
  dtypes; messages are keyed by the case (``threadmail.begin_case``), so none crosses to the
  next case on the groups a run keeps; ``threadmail.end_case`` fails the case whose mail was
  left undelivered or whose receives never completed;
- waits at most the group's timeout (``set_timeout``, which ``topology.set_timeout`` calls),
  then raises ``CollectiveError`` naming the waiting rank, the op, the group and the ranks
  that never came; a mismatched op (one rank's all_gather against another's all_reduce)
  fails at once, naming both;
- ``World.abort``: a rank gave up on the group (``launch.reform_world``, a rank that died):
  every wait in it fails at once, as gloo's peers do on a closed connection;
- on CUDA (every rank on the current device, GPU 0), every hand-over between threads
  synchronises the handing thread's current stream: a rank's before its tensors join a
  collective, the moving rank's after the move, a sender's after copying its message, a
  receiver's after copying it into its buffer (nothing here is timed: correctness first).

It proves correctness, never time or per-rank memory: the ranks share one device and its
allocator (``guards.not_measured``).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.testing._internal.distributed import multi_threaded_pg as mt

from cpbench import torchcompat

BACKEND = "cpbench-threaded"

_local = threading.local()


class CollectiveError(dist.DistError):
    """A collective or receive of the threaded group failed or timed out (``agreement``
    tells it from a strategy's own error by its type)."""


class Launch:
    """What the threads of one launch share: the store, and the world of each formation of
    the process group (``generation``: 0, then one more at each re-forming)."""

    def __init__(self, size: int):
        self.size = size
        self.store = dist.HashStore()
        self._worlds: dict[int, World] = {}
        self._lock = threading.Lock()

    def world(self, generation: int) -> World:
        with self._lock:
            return self._worlds.setdefault(generation, World())

    def abort(self, why: str) -> None:
        """Every wait of every world fails at once with ``why`` (a rank is gone)."""
        with self._lock:
            worlds = list(self._worlds.values())
        for w in worlds:
            w.abort(why)


class _Rendezvous:
    """One collective: each member's data until the last one comes and moves it."""

    def __init__(self, op: str, size: int):
        self.op, self.data = op, [None] * size
        self.arrived: set[int] = set()
        self.done = False
        self.error: str | None = None


class World:
    """One formation of the threaded process group: collectives in flight, messages not yet
    received, and why it was given up on (``aborted``)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.pending: dict[tuple, _Rendezvous] = {}
        self.mail: dict[tuple, torch.Tensor] = {}
        self.aborted: str | None = None

    def abort(self, why: str) -> None:
        with self.cond:
            self.aborted = self.aborted or why
            self.cond.notify_all()

    def join(self, group: ThreadedGroup, op: str, mover, data) -> _CollectiveWork:
        _stream_done(data)  # this rank's tensors are written before another thread reads them
        group.posted += 1
        key, me = (group.pg_name, group.posted), group.rank()
        with self.cond:
            rv = self.pending.setdefault(key, _Rendezvous(op, group.size()))
            if rv.op != op and rv.error is None:
                rv.error = (f"rank {group.global_rank(me)} posted {op} where rank "
                            f"{group.global_rank(min(rv.arrived))} posted {rv.op} (call "
                            f"{key[1]} on this group): the ranks' calls differ")
                self.cond.notify_all()
            rv.data[me] = data
            rv.arrived.add(me)
            if len(rv.arrived) == len(rv.data) and rv.error is None and not self.aborted:
                del self.pending[key]
                try:
                    mover.work(rv.data)
                    _stream_done(rv.data)
                except Exception as e:  # every member raises it at its wait
                    rv.error = f"{type(e).__name__}: {e}"
                rv.done, rv.data = rv.error is None, []
                self.cond.notify_all()
        return _CollectiveWork(self, group, rv)

    def wait_for(self, group: ThreadedGroup, ready, missing) -> str | None:
        """Block until ``ready()`` (under the lock), the world is aborted, or the group's
        timeout passes: None when ready, else why not."""
        with self.cond:
            self.cond.wait_for(lambda: ready() or self.aborted, group.timeout_s)
            if ready():
                return None
            return self.aborted or f"timed out after {group.timeout_s:g} s: {missing()}"


class _CollectiveWork(dist.Work):
    def __init__(self, world: World, group: ThreadedGroup, rv: _Rendezvous):
        super().__init__()
        self.world, self.group, self.rv = world, group, rv

    def is_completed(self) -> bool:
        return self.rv.done or self.rv.error is not None or self.world.aborted is not None

    def wait(self, timeout: timedelta | None = None) -> bool:
        rv, g = self.rv, self.group
        what = f"{rv.op} on ranks {g.members()}"

        def missing() -> str:
            never = [g.global_rank(r) for r in range(g.size()) if r not in rv.arrived]
            return f"rank(s) {', '.join(map(str, never))} never posted it"

        why = self.world.wait_for(g, lambda: rv.done or rv.error is not None, missing)
        if why is not None:  # a member posting it late fails at once too
            with self.world.cond:
                rv.error = rv.error or why
        if rv.error is not None:
            raise CollectiveError(f"rank {g.global_rank(g.rank())}: {what}: {rv.error}")
        return True


class _Sent(dist.Work):
    """A send: the message is in the mailbox already."""

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True


class _Received(dist.Work):
    def __init__(self, world: World, group: ThreadedGroup, key: tuple, buf: torch.Tensor):
        super().__init__()
        self.world, self.group, self.key, self.buf = world, group, key, buf
        self.copied = False

    def is_completed(self) -> bool:
        return self.copied or self.key in self.world.mail or self.world.aborted is not None

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self.copied:
            return True
        g, (_, src, _, tag, _, n) = self.group, self.key
        what = f"recv from rank {g.global_rank(src)} on ranks {g.members()} (tag {tag})"
        why = self.world.wait_for(g, lambda: self.key in self.world.mail,
                                  lambda: f"message {n + 1} from rank {g.global_rank(src)} "
                                          f"was never sent")
        if why is not None:
            raise CollectiveError(f"rank {g.global_rank(g.rank())}: {what}: {why}")
        with self.world.cond:
            message = self.world.mail.pop(self.key)
        self.group.waiting.discard(self)
        if message.shape != self.buf.shape or message.dtype != self.buf.dtype:
            raise CollectiveError(
                f"rank {g.global_rank(g.rank())}: {what}: rank {g.global_rank(src)} sent "
                f"{tuple(message.shape)} {message.dtype}, the buffer is "
                f"{tuple(self.buf.shape)} {self.buf.dtype}: a receive's buffer must match "
                f"its message (NCCL does not check; on a GPU this corrupts data)")
        self.buf.copy_(message)
        _stream_done([self.buf])  # the copy is done before the message is freed
        self.copied = True
        return True


def _stream_done(data) -> None:
    """On CUDA, wait for this thread's stream: the tensors in ``data`` are then written (or
    the copies into them done) before another thread uses them."""
    if any(isinstance(t, torch.Tensor) and t.is_cuda for t in mt.flatten_list(data)):
        torch.cuda.current_stream().synchronize()


# the options torch passes when a caller gives none (read, never changed)
_ALLTOALLOPTIONS = mt.AllToAllOptions()
_ALLGATHEROPTIONS = mt.AllgatherOptions()
_ALLREDUCEOPTIONS = mt.AllreduceOptions()
_BARRIEROPTIONS = mt.BarrierOptions()
_BROADCASTOPTIONS = mt.BroadcastOptions()
_REDUCESCATTEROPTIONS = mt.ReduceScatterOptions()
_SCATTEROPTIONS = mt.ScatterOptions()


class ThreadedGroup(mt.ProcessLocalGroup):
    """torch's threaded group with ordered, bounded, async collectives and a mailbox (see
    the module docstring)."""

    def __init__(self, rank: int, size: int, world: World, timeout: timedelta):
        super().__init__(rank, size)
        self.world, self.timeout_s = world, timeout.total_seconds()
        self.posted = 0
        self._sent: collections.Counter = collections.Counter()
        self._received: collections.Counter = collections.Counter()
        self.waiting: set[_Received] = set()  # receives posted, not yet copied

    keeps_own_timeout = True  # topology.set_timeout calls set_timeout (torch's setter cannot)

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout_s = timeout.total_seconds()

    def members(self) -> list[int]:
        return dist.get_process_group_ranks(self)

    def global_rank(self, group_rank: int) -> int:
        return self.members()[group_rank]

    def _post(self, op: str, mover, data):
        return self.world.join(self, op, mover, data)

    def allreduce(self, tensor_list, opts=_ALLREDUCEOPTIONS):
        return self._post("all_reduce", mt.AllReduce(opts.reduceOp), tensor_list)

    def allreduce_coalesced(self, tensor_list, opts=_ALLREDUCEOPTIONS):
        return self._post("all_reduce", mt.AllReduce(opts.reduceOp), tensor_list)

    def allgather(self, output_tensors, input_tensor, opts=_ALLGATHEROPTIONS):
        return self._post("all_gather", mt.AllGather(), (output_tensors, input_tensor))

    def alltoall(self, output_tensor_list, input_tensor_list, opts=_ALLTOALLOPTIONS):
        return self._post("all_to_all", mt.AllToAll(), (output_tensor_list, input_tensor_list))

    def all_to_all_single(self, output_buffer, input_buffer, output_split_sizes,
                          input_split_sizes, opts=_ALLTOALLOPTIONS):
        return self._post("all_to_all_single", mt.AllToAllBase(),
                          (output_buffer, input_buffer, output_split_sizes, input_split_sizes))

    def broadcast(self, tensor_list, opts=_BROADCASTOPTIONS):
        return self._post("broadcast", mt.Broadcast(opts.rootRank), tensor_list)

    def scatter(self, output_tensors, input_tensors, opts=_SCATTEROPTIONS):
        return self._post("scatter", mt.Scatter(opts.rootRank), (output_tensors, input_tensors))

    def gather(self, output_tensors, input_tensors, opts=_SCATTEROPTIONS):
        return self._post("gather", mt.Gather(opts.rootRank), (output_tensors, input_tensors))

    def reduce_scatter(self, output_tensor, scatter_list, opts=_REDUCESCATTEROPTIONS):
        return self._post("reduce_scatter", mt.ReduceScatter(opts.reduceOp),
                          (output_tensor, scatter_list))

    def barrier(self, opts=_BARRIEROPTIONS):
        return self._post("barrier", _Nothing(), None)

    def send(self, tensors, dst: int, tag: int = 0):
        # keyed by the case: a message never reaches a receive of another case
        key = (self.pg_name, self.rank(), dst, tag, case())
        self._sent[key] += 1
        message = tensors[0].detach().clone()
        _stream_done([message])  # copied before another thread reads it
        with self.world.cond:
            self.world.mail[(*key, self._sent[key] - 1)] = message
            self.world.cond.notify_all()
        return _Sent()

    def recv(self, tensors, src: int, tag: int = 0):
        key = (self.pg_name, src, self.rank(), tag, case())
        self._received[key] += 1
        work = _Received(self.world, self, (*key, self._received[key] - 1), tensors[0])
        self.waiting.add(work)
        return work

    def recv_anysource(self, tensors, tag: int = 0):
        raise CollectiveError("the threaded process group receives from a named rank only")

    def getBackendName(self) -> str:
        return BACKEND

    def _get_backend(self, device) -> _NoBackend:  # type: ignore[override]
        """torch >= 2.14's batch_isend_irecv asks a group's device backend whether it
        coalesces (2.13 asks only a plain ProcessGroup); this group has no such backend:
        its sends post one by one."""
        return _NO_BACKEND


# c10d's all_to_all_single calls ``alltoall_base`` up to torch 2.12 (torchcompat): torch's
# threaded group's own would wait forever, never abort and never sync streams
for _method in torchcompat.ALL_TO_ALL_SINGLE_METHODS:
    setattr(ThreadedGroup, _method, ThreadedGroup.all_to_all_single)


class _NoBackend:
    """What torch asks of a group's device backend, answered for the threaded group."""

    supports_coalescing = supports_splitting = supports_time_estimate = False


_NO_BACKEND = _NoBackend()


class _Nothing:
    def work(self, data) -> None:
        pass


def _create(prefix_store, rank: int, size: int, timeout: timedelta) -> ThreadedGroup:
    return ThreadedGroup(rank, size, _local.launch.world(_local.generation), timeout)


if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Around a launch, in the launching thread: every thread its own torch.distributed
    world (torch's ThreadLocalWorld) and group names (functional collectives resolve
    groups by name); the process as it was afterwards."""
    torchcompat.complete_threaded_world(mt)
    mt._install_threaded_pg()
    torchcompat.set_thread_isolation(True)
    try:
        yield
    finally:
        torchcompat.set_thread_isolation(False)
        mt._uninstall_threaded_pg()


def init(launch: Launch, rank: int, device: str, timeout_s: float) -> None:
    """Form this rank thread's world (a collective of the launch's threads)."""
    _local.launch, _local.generation = launch, 0
    torch.autograd.set_multithreading_enabled(False)  # a backward runs in this rank's thread
    if device == "cuda":
        torch.cuda.set_device(0)  # every rank on GPU 0: current device is per thread
    dist.init_process_group(BACKEND, rank=rank, world_size=launch.size, store=launch.store,
                            timeout=timedelta(seconds=timeout_s))


def threaded() -> bool:
    """Whether this thread is a rank of a threaded launch."""
    return getattr(_local, "launch", None) is not None


def leave_world(why: str) -> None:
    """This rank gives up on its world (every wait in it fails) and will form the next."""
    _local.launch.world(_local.generation).abort(why)
    _local.generation += 1


def case() -> int:
    """The case this rank thread is in (``threadmail.begin_case``); its messages' key."""
    return getattr(_local, "case", 0)


def set_case(index: int) -> None:
    _local.case = index


def current_world() -> World:
    """This rank thread's world (its formation of the process group)."""
    return _local.launch.world(_local.generation)


def finish() -> None:
    """Tear this rank thread's world down."""
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    _local.launch = None


def store() -> c10d.Store:
    return _local.launch.store
