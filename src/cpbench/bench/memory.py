"""Peak memory of one step, and the up-front estimate that rejects sizes that cannot fit.

GPU: ``torch.cuda.max_memory_allocated`` after resetting the peak — every byte the caching
allocator handed out to tensors at the worst moment of the step (inputs included, the
allocator's cached-but-free blocks excluded), as the seed tables report it.

CPU: torch keeps no allocator statistics, and tracemalloc / RSS deltas miss tensor memory
(tensor storage is not Python-allocated, and freed blocks stay in the process). So the meter
is a ``TorchDispatchMode`` that sees every tensor an aten op takes or returns during the
step, counts its *storage* once (views share it), and uncounts it when the storage is freed
(a weakref finalizer on the storage object, which torch keeps alive exactly as long as the
storage). What the CPU figure counts: the storages of the tensors handed in as the step's
inputs, plus every storage an aten op created, read or wrote during the step (from its first
use until it is freed), at the moment their live sum peaked. Not counted: scratch memory a
kernel allocates outside tensors, buffers inside gloo (tensors first seen inside one of
``comm``'s collectives included: gloo's reduce-scatter splits its own copy of the input in
``wait``), Python objects, allocator overhead/fragmentation, nor a wrapper subclass's
data-less storage (its inner tensors count). A storage can be freed on another thread
(gloo's worker drops a finished collective there), so the count is kept under a lock.
It is therefore comparable across strategies on CPU (same inputs, same kernels) but not byte
for byte with the GPU figure. On fake CUDA tensors (the dry run) the meter also adds, while a
FlashAttention-2 backward op runs, the buffers that kernel allocates inside its C++ call
(``kernels.fa2_workspace``), which the GPU's figure counts.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from cpbench import comm
from cpbench.bench.env import meminfo_bytes
from cpbench.kernels import fa2_workspace


class StorageMeter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.lock = threading.Lock()

    def track(self, t: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(t):
            # a wrapper (functional collectives' AsyncCollectiveTensor) has a storage of its
            # full size but no data: the memory is its inner tensors'
            for inner in t.__tensor_flatten__()[0]:
                self.track(getattr(t, inner))
            return
        storage = t.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        with self.lock:
            if nbytes == 0 or key in self.live:
                return
            self.live[key] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        with self.lock:
            self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if comm.in_collective():  # the backend's own tensors, or the caller's (already seen)
            return out
        for t in tree_flatten((out, args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        # a kernel's own buffers, alive with its inputs and results while it ran
        inside = fa2_workspace.op_bytes(func, args, kwargs)
        self.peak = max(self.peak, self.current + inside)
        return out


def peak_bytes(fn: Callable[[], object], *, device: str,
               inputs: Iterable[torch.Tensor] = ()) -> int:
    """Peak bytes held during ``fn()`` on this rank (see the module docstring for what counts).
    ``inputs``: tensors alive before the step that belong to it (counted on CPU; on GPU the
    allocator sees them anyway)."""
    if device == "cuda":
        gpu = torch.cuda.current_device()
        torch.cuda.synchronize(gpu)
        torch.cuda.reset_peak_memory_stats(gpu)  # the peak so far is an earlier case's
        fn()
        torch.cuda.synchronize(gpu)
        return int(torch.cuda.max_memory_allocated(gpu))
    meter = StorageMeter()
    for t in inputs:
        meter.track(t)
    with meter:
        fn()
    return meter.peak


# -- estimates before anything runs ----------------------------------------------------------

def step_lower_bound(*, batch: int, local_seqlen: int, heads: int, kv_heads: int,
                     head_dim: int, element_size: int, v_head_dim: int | None = None) -> int:
    """Bytes a rank cannot do without in a forward + backward: q, out, dout, dq and k, v, dk,
    dv of its shard in the activation dtype (no buffers, no accumulators: a lower bound, so
    a rejection is never wrong). out, dout, v and dv at V's head dim."""
    dv = head_dim if v_head_dim is None else v_head_dim
    tokens = batch * local_seqlen * element_size
    return tokens * (heads + kv_heads) * 2 * (head_dim + dv)


def check_bytes(*, batch: int, seqlen: int, heads: int, kv_heads: int, head_dim: int,
                element_size: int, v_head_dim: int | None = None) -> tuple[int, int]:
    """(per rank, rank 0 extra) bytes of ``--check``: every rank holds the global q, k, v,
    dout; rank 0 also builds the float64 reference one head at a time, whose S×S score,
    probability and gradient matrices (about 5 live at once) dominate."""
    dv = head_dim if v_head_dim is None else v_head_dim  # v and dout at V's width
    per_rank = batch * seqlen * element_size * (heads + kv_heads) * (head_dim + dv)
    reference = 5 * batch * seqlen * seqlen * 8
    return per_rank, reference


def capacity_bytes(device: str, local_ranks: int) -> int | None:
    """The most memory one rank could have: the GPU's total, or the machine's total RAM
    shared by the ``local_ranks`` ranks on it; None when unknown. Totals, not what is free
    now: under torchrun every rank runs this check on its own, and a figure that moves
    (MemAvailable) could let one rank accept a size that another rejects."""
    if device == "cuda":
        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    total = meminfo_bytes("MemTotal")
    return None if total is None else total // max(1, local_ranks)

