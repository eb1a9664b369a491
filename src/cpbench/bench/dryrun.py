"""The engine of ``cpbench dryrun``: a ``cpbench run`` case's real code, rank by rank, on fake
tensors with a fake process group, in one process.

For one rank: torch's ``fake`` backend (``FakeStore``) stands in for the world, so the strategy
builds its real groups; inputs of the rank's shard shape are fake tensors on the run's device
(``FakeTensorMode``: shapes, dtypes and devices, no data); then the timed step runs as the
driver runs it — the strategy's ``attention`` (its communication and kernel calls) and the
backward — with

- every storage an op creates counted live until freed, inputs included (``bench.memory``'s
  meter, the figure ``cpbench run`` reports on CPU): the peak of the forward and of the
  whole step;
- every ``torch.distributed`` call traced (``bench.commtrace``, as ``cpbench comm``), the
  bytes per phase, collective and group;
- a host sync inside the step an error, with the line that made it: ``.item()``,
  ``.tolist()``, a data-dependent shape (fake tensors have no data to answer with), and on
  CUDA a copy between host and device (a pageable copy stalls the host as a sync does);
- any other exception the code raises on that device an error, with its file and line.

Host-side planning a strategy does once per case (its layout, the masked kernel's tiles) runs
for real on the CPU, as in a real run's first step: ``seq_index`` is computed before the fake
mode, and ``Strategy.tiles`` plans outside it. One untimed forward first (a real run's
warm-up: caches filled, first-call set-up), then the measured step. No time is measured:
fake kernels take none. On CUDA the backward walks the graph without the engine
(``bench.fakegrad``: the engine needs a real CUDA context) and streams and events are
recording stand-ins (``bench.fakecuda``); on CPU the engine runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

from cpbench import kernels, results, strategies, torchcompat
from cpbench.bench import fakecuda, fakegrad
from cpbench.bench.commtrace import Event, traced
from cpbench.bench.memory import StorageMeter
from cpbench.bench.sentcount import declared
from cpbench.config import AttentionConfig
from cpbench.errors import UsageError
from cpbench.kernels import masked
from cpbench.strategies.base import Strategy
from cpbench.topology import Topology, forget_groups

# frames inside these are where an error surfaces, not where it was made
_INTERNAL = (os.path.dirname(torch.__file__), os.path.dirname(__file__))


@dataclass
class RankResult:
    """What one rank's dry run found. ``status``: ok, or failed with ``error`` and ``where``
    (file:line); peaks in bytes; ``events``: phase → the torch.distributed calls."""

    rank: int
    status: str = results.OK
    error: str | None = None
    where: str | None = None
    peak_fwd_bytes: int | None = None
    peak_fwd_bwd_bytes: int | None = None
    events: dict[str, list[Event]] = field(default_factory=dict)

    def sent_bytes(self, phase: str) -> int:
        return sum(e.nbytes for e in self.events.get(phase, ()))


class HostSync(RuntimeError):
    """The timed step made the host wait for the device."""


class _SyncGuard(TorchDispatchMode):
    """Raises ``HostSync`` on ``.item()`` of a device tensor (a fake one: a host tensor's value
    is there to read) and, on CUDA, on any copy between host and device."""

    def __init__(self, device: str):
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if name == "_local_scalar_dense":
            if not isinstance(args[0], FakeTensor):  # a host tensor: its value is there
                with unset_fake_temporarily():
                    return func(*args, **kwargs)
            raise HostSync("a tensor's value read on the host (.item() / int() / .tolist())")
        if self.device == "cuda" and name in ("_to_copy", "copy_"):
            _check_copy(name, args, kwargs)
        return func(*args, **kwargs)


def _check_copy(name: str, args, kwargs) -> None:
    src = args[1] if name == "copy_" else args[0]
    dst_type = args[0].device.type if name == "copy_" else \
        torch.device(kwargs.get("device") or src.device).type
    if {src.device.type, dst_type} == {"cpu", "cuda"}:
        raise HostSync(f"a copy {src.device.type} -> {dst_type} of {tuple(src.shape)} "
                       f"(the host waits for it)")


def where(exc: BaseException) -> str:
    """file:line of the innermost frame outside torch and cpbench's dry-run machinery; an
    upstream library's frame is named as such."""
    frames = traceback.extract_tb(exc.__traceback__)
    outside = [f for f in frames if not f.filename.startswith(_INTERNAL)] or frames
    f = outside[-1]
    path = f.filename
    for marker in ("site-packages" + os.sep, "src" + os.sep):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{path}:{f.lineno}"


@contextlib.contextmanager
def fake_world(rank: int, world: int):
    """This process as ``rank`` of ``world`` on torch's fake backend (no peers exist)."""
    import torch.distributed as dist

    if dist.is_initialized():
        forget_groups()
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world, store=torchcompat.fake_store())
    try:
        yield
    finally:
        forget_groups()
        dist.destroy_process_group()


def _real(fn):
    """``fn`` run outside the fake mode: host-side planning on real CPU tensors."""
    def run(*args, **kwargs):
        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    return run


@contextlib.contextmanager
def _host_planning(strat: Strategy):
    """Layout, positions and the masked kernel's plans on real CPU tensors, as a real run's
    first step plans them (``Strategy.positions`` / ``held_positions`` / ``sorted_positions``
    / ``tiles`` and ``masked.Block``'s lazily planned parts)."""
    for part in _parts(strat):  # a composite's inner strategies (usp's ring) plan alike
        index = {r: part.seq_index(r) for r in range(part.world_size)}
        # the instance's own (its __dict__ shadows the method): every strategy object
        part.__dict__["seq_index"] = index.__getitem__
    saved: dict[tuple[type, str], Any] = {(Strategy, n): Strategy.__dict__[n]
                                          for n in ("positions", "held_positions",
                                                    "sorted_positions", "tiles")}
    saved.update({(masked.Block, n): masked.Block.__dict__[n] for n in _BLOCK_PLANS})
    for (cls, name), attr in saved.items():
        if isinstance(attr, functools.cached_property):
            wrapped = functools.cached_property(_real(attr.func))
            wrapped.__set_name__(cls, name)
        else:
            wrapped = _real(attr)
        setattr(cls, name, wrapped)
    try:
        yield
    finally:
        for (cls, name), attr in saved.items():
            setattr(cls, name, attr)


_BLOCK_PLANS = ("pairs", "tiles", "varlen", "calls")  # masked.Block's parts planned on first use


def _parts(strat: Strategy) -> list[Strategy]:
    """``strat`` and the strategies it holds, at any depth."""
    found = [strat]
    for value in vars(strat).values():
        if isinstance(value, Strategy) and value is not strat:
            found += _parts(value)
    return found


def _inputs(strat: Strategy, attn: AttentionConfig, device: str) -> dict:
    shape = (attn.batch, strat.local_seqlen)

    def rand(name):
        t = torch.empty(*shape, *attn.widths[name], dtype=attn.torch_dtype, device=device)
        return t.requires_grad_(name != "dout")

    x = {name: rand(name) for name in ("q", "k", "v", "dout")}
    if attn.sinks:  # fp32, one per query head
        x["sinks"] = torch.empty(attn.heads, device=device).requires_grad_()
    return x


def _step(strat: Strategy, x: dict, device: str, fwd_only: bool, r: RankResult) -> None:
    """The measured step: forward (and backward), each traced, one meter over both."""
    meter = StorageMeter()
    for t in x.values():
        meter.track(t)
    with meter, _SyncGuard(device):
        with traced(dispatch=not strat.compiles) as fwd, fakegrad.recording():
            out, _lse = strat.attend(x["q"], x["k"], x["v"], x.get("sinks"))
        r.events["fwd"] = list(fwd)
        r.peak_fwd_bytes = meter.peak
        if not fwd_only:
            with traced(dispatch=not strat.compiles) as bwd:
                (fakegrad.backward if device == "cuda" else torch.Tensor.backward)(
                    out, x["dout"])
            r.events["bwd"] = list(bwd)
        del out, _lse
    r.peak_fwd_bwd_bytes = meter.peak


def dry_rank(name: str, options, attn: AttentionConfig, topo: Topology, rank: int, *,
             kernel_name: str, device: str, fwd_only: bool = False) -> RankResult:
    """Rank ``rank``'s real code of one case on fake tensors (see the module docstring)."""
    if why := torchcompat.dry_run_unavailable(device):
        raise UsageError(why)  # on fake CUDA torch would abort the process, not raise
    r = RankResult(rank)
    cls = strategies.get(name)
    cuda = fakecuda.streams() if device == "cuda" else contextlib.nullcontext()
    # TorchScript's fusers compile CUDA kernels through the driver (ring-flash-attn scripts
    # its lse merge): off, so its ops run one by one, as they do before a fuser kicks in
    with fake_world(rank, topo.world_size), cuda, _fusers_off():
        try:
            strat = cls(attn, topo, rank, kernel=kernels.get(kernel_name), options=options)
            with _host_planning(strat), torchcompat.fake_tensor_mode():
                x = _inputs(strat, attn, device)
                out, _ = strat.attend(x["q"], x["k"], x["v"],  # warm-up: caches, set-up
                                         x.get("sinks"))
                del out, _
                _step(strat, x, device, fwd_only, r)
        except Exception as e:  # every error the code raises there is the row's finding
            r.status = results.FAILED
            kind = "host sync" if _is_sync(e) else type(e).__name__
            r.error, r.where = f"{kind}: {' '.join(str(e).split())[:300]}", where(e)
    return r


@contextlib.contextmanager
def _fusers_off():
    """``torch.jit.fuser("none")`` without its nvfuser toggles (each warns once per rank)."""
    c = torch._C
    old = c._jit_can_fuse_on_cpu(), c._jit_can_fuse_on_gpu(), c._jit_texpr_fuser_enabled()
    c._jit_override_can_fuse_on_cpu(False)
    c._jit_override_can_fuse_on_gpu(False)
    c._jit_set_texpr_fuser_enabled(False)
    try:
        yield
    finally:
        c._jit_override_can_fuse_on_cpu(old[0])
        c._jit_override_can_fuse_on_gpu(old[1])
        c._jit_set_texpr_fuser_enabled(old[2])


def _is_sync(e: BaseException) -> bool:
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )

    return isinstance(e, (HostSync, DataDependentOutputException, DynamicOutputShapeException))


# -- which ranks to run ----------------------------------------------------------------------

def _role(strat: Strategy) -> tuple:
    """What makes a rank's run differ from another's: its shard's length, the groups it is
    in (sizes, its position's kind, whether they cross nodes) and its declared schedule (each
    step's FLOPs, block shape and messages, in order). Ranks with equal roles allocate and
    send alike. Without a schedule (an adapter), every rank is its own role."""
    groups = tuple((g.name, len(g.ranks), g.crosses_nodes) for g in strat.groups.values())
    try:
        steps = tuple(strat.schedule())
    except UsageError:
        return (strat.rank,)
    return strat.local_seqlen, groups, steps


def distinct_ranks(name: str, options, attn: AttentionConfig, topo: Topology, *,
                   kernel_name: str) -> dict[int, list[int]]:
    """Representative rank → the ranks alike to it (``_role``), built without groups."""
    cls = strategies.get(name)
    alike: dict[tuple, list[int]] = {}
    for rank in range(topo.world_size):
        strat = cls(attn, topo, rank, kernel=kernels.get(kernel_name), options=options,
                    create_groups=False)
        alike.setdefault(_role(strat), []).append(rank)
    return {ranks[0]: ranks for ranks in alike.values()}


def schedule_bytes(name: str, options, attn: AttentionConfig, topo: Topology, rank: int, *,
                   kernel_name: str) -> dict[str, int] | None:
    """Bytes per phase the strategy declares this rank sends (None: it declares none)."""
    return declared(strategies.get(name)(attn, topo, rank, kernel=kernels.get(kernel_name),
                                         options=options, create_groups=False))


def case_options(name: str, options: dict):
    """The Options instance of ``name`` from given values (a test's shorthand)."""
    cls = strategies.get(name)
    return dataclasses.replace(cls.Options(), **options)

