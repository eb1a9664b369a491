"""``comm.a2a_copied_bytes`` is what ``comm.all_to_all`` copies: its layout copies counted op
by op (a dispatch mode on each rank, two ranks as threads) against the figure the simulator
prices (``Message.copied``), for either direction of Ulysses' all-to-alls, batch 1 and 2."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cpbench import comm, topology
from cpbench.launch import run_threads
from cpbench.topology import Topology

_COPIES = {torch.ops.aten.clone.default, torch.ops.aten.cat.default,
           torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default}


class _Copied(TorchDispatchMode):
    """Bytes read and written by the copies dispatched on this thread outside the collective
    itself (the threaded group's own delivery copies are a backend's, not cpbench's)."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _COPIES and not comm.in_collective():
            self.nbytes += 2 * out.numel() * out.element_size()
        return out


@pytest.mark.parametrize("shape,scatter,gather", [
    ((1, 6, 4, 3), 2, 1), ((1, 8, 2, 3), 1, 2), ((2, 6, 4, 3), 2, 1), ((2, 8, 2, 3), 1, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a2a_copied_bytes_is_what_all_to_all_copies(shape, scatter, gather, dtype):
    def body(rank, world):
        group = topology.new_groups(Topology(world_size=world, ranks_per_node=world), "all",
                                    rank, topology.contiguous_groups(world, world))
        x = torch.randn(shape).to(dtype)
        with _Copied() as seen:
            out = comm.all_to_all(x, group, scatter_dim=scatter, gather_dim=gather)
        return seen.nbytes, out.shape

    stated = comm.a2a_copied_bytes(shape, torch.empty((), dtype=dtype).element_size(), 2,
                                   scatter)
    for copied, shape_out in run_threads(body, 2, timeout=60):
        assert copied == stated, (copied, stated)
        assert shape_out[scatter] * 2 == shape[scatter]  # it moved what it says
