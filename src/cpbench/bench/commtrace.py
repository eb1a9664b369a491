"""Every torch.distributed call a strategy makes, traced where the libraries make them.

cpbench's own strategies and the upstream ones (ring-flash-attn, yunchang, torch's ring)
call torch.distributed directly, so the trace is taken there, not in ``cpbench.comm``: inside
``traced()``, the collectives and point-to-point sends of ``torch.distributed`` are wrapped
(``isend`` in both namespaces, so the ``P2POp``\\ s a ``batch_isend_irecv`` posts are seen
one by one), and torch's functional collectives (``_c10d_functional``, what torch's ring
uses) are seen through a dispatch mode.

Each event: the op, the dtype, the bytes this rank puts on the wire to other ranks (a send:
the tensor; an all-to-all: the chunks for the others; an all-gather: its input once per other
member; a reduce-scatter: the chunks for the others; an all-reduce: 2(n-1)/n of the tensor, as
a ring does it; a broadcast: the tensor once per other member, from the source), the group's
members, and how many attention kernel calls this rank had made before it (the aten flash
attention ops, forward or backward, seen by the same dispatch mode: cpbench's kernels, the
CPU flash-attn interface beneath the libraries, and torch's ring all call them). Receives are
not counted: each byte once, at its sender. Summed over ranks, the bytes are the traffic of
one step.
"""

from __future__ import annotations

import contextlib
import functools
import typing
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from cpbench import ranklocal, torchcompat

# the wrapped functions and how many bytes each sends, from (input nbytes, group size)
_SENDS = {
    "isend": lambda b, n: b, "send": lambda b, n: b,
    "all_to_all_single": lambda b, n: b * (n - 1) // n,
    "all_gather": lambda b, n: b * (n - 1), "all_gather_into_tensor": lambda b, n: b * (n - 1),
    "reduce_scatter_tensor": lambda b, n: b * (n - 1) // n,
    "all_reduce": lambda b, n: 2 * b * (n - 1) // n,
    "broadcast": lambda b, n: b * (n - 1),
}
# ops reported under one name: a p2p send whichever call posts it
_OP = {"isend": "p2p", "send": "p2p", "all_gather_into_tensor": "all_gather"}


@dataclass(frozen=True)
class Event:
    """One call this rank made: op (p2p, all_to_all_single, all_gather, …), dtype, bytes it
    sent to other ranks, the group's members, and the kernel calls before it."""

    op: str
    dtype: str
    nbytes: int
    group: tuple[int, ...]
    kernels_before: int


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _members(group) -> tuple[int, ...]:
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


class _Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.kernels = 0

    def add(self, name: str, t: torch.Tensor, members: tuple[int, ...]) -> None:
        nbytes = _SENDS[name](t.numel() * t.element_size(), len(members))
        self.events.append(Event(_OP.get(name, name), _dtype(t), nbytes, members,
                                 self.kernels))


def _first_tensor(name: str, args, kwargs) -> torch.Tensor:
    """The tensor whose size says what is sent: the input of a collective."""
    if name in ("all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor"):
        return kwargs.get("input", args[1] if len(args) > 1 else None)
    if name == "all_gather":
        return kwargs.get("tensor", args[1] if len(args) > 1 else None)
    return kwargs.get("tensor", args[0] if args else None)


def _wrap(rec: _Recorder, name: str, original):
    @functools.wraps(original)
    def traced_call(*args, **kwargs):
        group = kwargs.get("group")
        if group is None and name in ("all_to_all_single", "all_gather", "all_reduce",
                                      "all_gather_into_tensor", "reduce_scatter_tensor",
                                      "broadcast"):
            group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
        rec.add(name, _first_tensor(name, args, kwargs), _members(group))
        return original(*args, **kwargs)

    return traced_call


class _Functional(TorchDispatchMode):
    """torch's functional collectives (``_c10d_functional.*``), as torch's ring issues them."""

    OPS = ("all_gather_into_tensor", "all_to_all_single", "reduce_scatter_tensor",
           "all_reduce")

    def __init__(self, rec: _Recorder):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name in self.OPS:
            self._record(name, args)
        elif name.startswith("_scaled_dot_product_flash_attention"):  # an attention kernel
            self.rec.kernels += 1
        return func(*args, **(kwargs or {}))

    def _record(self, name: str, args) -> None:
        t, group_name = args[0], args[-1]
        members = tuple(dist.get_process_group_ranks(_group_by_name(group_name)))
        if name == "all_to_all_single":  # (input, output_splits, input_splits, group)
            splits, me = args[2], members.index(dist.get_rank())
            row = t.numel() // max(1, sum(splits)) * t.element_size()
            nbytes = sum(s for i, s in enumerate(splits) if i != me) * row
            self.rec.events.append(Event(name, _dtype(t), nbytes, members, self.rec.kernels))
            return
        self.rec.add(name, t, members)


def _group_by_name(group_name: str):
    from torch.distributed import distributed_c10d as c10d

    # GroupName: a NewType of str in the torch mypy reads; a cast, as older torch lacks it
    return c10d._resolve_process_group(typing.cast("c10d.GroupName", group_name))


_PATCHED = ("isend", "send", "all_to_all_single", "all_gather", "all_gather_into_tensor",
            "reduce_scatter_tensor", "all_reduce", "broadcast")


# the functional collectives torch's FlexAttention CP calls (_cp_custom_ops.py), by the
# functional op each issues: their names depend on the torch (torchcompat)
_FUNCOL = torchcompat.flex_cp_collectives()


def _wrap_funcol(rec: _Recorder, name: str, original):
    @functools.wraps(original)
    def traced_call(t, *args, **kwargs):
        group = kwargs.get("group", args[-1] if args else None)
        group = _group_by_name(group) if isinstance(group, str) else group
        rec.add(_FUNCOL[name], t, _members(group))
        return original(t, *args, **kwargs)

    return traced_call


@contextlib.contextmanager
def held():
    """Keep the tracing wrappers' dispatchers in place for the block (``ranklocal.hold``):
    around ranks run as threads, where one rank's trace must not change the functions
    another rank's posted ops were made with."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed import distributed_c10d as c10d

    with ranklocal.hold((dist, c10d), _PATCHED), ranklocal.hold((funcol,), tuple(_FUNCOL)):
        yield


@contextlib.contextmanager
def traced(dispatch: bool = True):
    """Within the block, every torch.distributed call of this rank is recorded:
    ``with traced() as events: ...`` (a list of Event). ``dispatch=False``: no dispatch mode
    (torch.compile refuses to run under one: FlexAttention compiles even eagerly), so the
    functional collectives are seen where torch's FlexAttention CP calls them, and no kernel
    is counted. The wrappers are this rank's (``ranklocal.patch``): ranks run as threads
    each trace their own calls."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed import distributed_c10d as c10d

    rec = _Recorder()
    with contextlib.ExitStack() as patches:
        for n in _PATCHED:  # one wrapper in both namespaces: P2POp checks ``op`` by identity
            patches.enter_context(ranklocal.patch(
                (dist, c10d), n, functools.partial(_wrap, rec, n)))
        if not dispatch:
            for n in _FUNCOL:
                patches.enter_context(ranklocal.patch(
                    (funcol,), n, functools.partial(_wrap_funcol, rec, n)))
        with _Functional(rec) if dispatch else contextlib.nullcontext():
            yield rec.events
