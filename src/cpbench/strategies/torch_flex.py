"""torch-flex: PyTorch's own context parallel for FlexAttention, run as it is (torch 2.13's
``tensor/experimental/_context_parallel``): the attention module parallelized with
``_ContextParallel(seq_dim=2, attention_type=FLEX)``, whose pre-hook all-gathers K and V
(``flex_cp_allgather``: functional all-gathers in the activation dtype; its backward
reduce-scatters dK and dV, _cp_custom_ops.py), the local queries attending to the whole
sequence through the block mask ``_create_cp_block_mask`` makes of the mask for this rank's
shard (the mask rewritten to global, load-balanced positions), and the inputs laid out by one
of torch's load balancers (``--load-balancer``, one row each; _load_balancer.py):
- ``head-tail`` (``_HeadTailLoadBalancer``, torch's default when causal): 2N chunks, rank r
  holding chunks r and 2N-1-r of the whole sequence (its twin: ``llama3 --layout zigzag``);
- ``per-document`` (``_PerDocumentHeadTailLoadBalancer``): the same within every document
  (torch asserts every length divides by 2N), so documents only;
- ``ptrr`` (``_PTRRLoadBalancer``): the mask's 128-token query blocks dealt round-robin by
  their count of non-empty key blocks (processing-time round robin);
- ``none``: contiguous shards (twin: ``llama3 --layout contiguous``).
torch requires the sequence to divide by N x 128 (the block size; ``_create_cp_block_mask``).
The mask is cpbench's own (``Mask.key_interval``: documents, causal, window) as a mask_mod.
The kernel is FlexAttention compiled by ``torch.compile`` (as torch's tests and torchtitan
call it), not ``--kernel``; the record's ``upstream`` says so.
CPU: torch's FlexAttention has no backward on CPU (flex_attention.py ``_validate_device``
raises), so runs there are refused; its forward runs on CPU (eager) and the tests check it.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from cpbench import torchcompat
from cpbench.errors import Skipped, UsageError
from cpbench.strategies import register
from cpbench.strategies._upstream import no_schedule
from cpbench.strategies.base import Strategy, Upstream, option
from cpbench.strategies.layout import contiguous_index, nearest_multiple

BALANCERS = ("head-tail", "per-document", "ptrr", "none")
BLOCK = 128  # torch.nn.attention.flex_attention._DEFAULT_SPARSE_BLOCK_SIZE
_CP = torchcompat.CP_PACKAGE


def _cp():
    return importlib.import_module(_CP)


def _mask_mod(mask, seqlen: int, device):
    """The mask as FlexAttention's mask_mod over global positions: each query's key interval
    (cpbench's one definition), looked up per query."""
    lo, hi = (t.to(device) for t in mask.key_interval(torch.arange(seqlen)))
    return lambda b, h, q_idx, kv_idx: (kv_idx >= lo[q_idx]) & (kv_idx <= hi[q_idx])


def _block_counts(mask, seqlen: int) -> torch.Tensor:
    """Per 128-query block, how many 128-key blocks hold a visible pair: what PTRR reads of
    a BlockMask (``kv_num_blocks + full_kv_num_blocks``), from the rows' key intervals."""
    lo, hi = mask.key_interval(torch.arange(seqlen))
    lo, hi = lo.clamp(min=0), hi.clamp(max=seqlen - 1)
    seen = lo <= hi
    rows, first, last = (torch.arange(seqlen) // BLOCK)[seen], lo[seen] // BLOCK, hi[seen] // BLOCK
    nb = seqlen // BLOCK
    # +1 where a row's key blocks start, -1 past their end: covered where the sum is > 0
    edges = torch.zeros(nb, nb + 1, dtype=torch.int64)
    ones = torch.ones(len(rows), dtype=torch.int64)
    edges.index_put_((rows, first), ones, accumulate=True)
    edges.index_put_((rows, last + 1), -ones, accumulate=True)
    return (edges.cumsum(1)[:, :nb] > 0).sum(1)


class _Flex(torch.nn.Module):
    """The attention module torch's CP parallelizes: FlexAttention with the lse."""

    def __init__(self, scale: float, gqa: bool, compiled: bool):
        super().__init__()
        from torch.nn.attention.flex_attention import flex_attention

        self.scale, self.gqa = scale, gqa
        self.fn = (torch.compile(flex_attention, dynamic=False, fullgraph=True) if compiled
                   else flex_attention)

    def forward(self, q, k, v, block_mask=None):
        from torch.nn.attention.flex_attention import AuxRequest

        out, aux = self.fn(q, k, v, block_mask=block_mask, scale=self.scale,
                           enable_gqa=self.gqa, return_aux=AuxRequest(lse=True))
        return out, aux.lse


@register
class TorchFlex(Strategy):
    name = "torch-flex"
    description = ("PyTorch native context parallel for FlexAttention: K/V all-gathered, "
                   "its load balancers (head-tail, per-document, PTRR)")
    upstream = Upstream("torch", _CP, twin="llama3", cuda_only=True,
                        torch_since=torchcompat.CP_SINCE)
    masks = frozenset({"documents", "window"})
    compiles = True  # FlexAttention (and its block mask) run through torch.compile
    # each rank thread would compile FlexAttention at once, and torch.compile is not
    # thread-safe (its dynamo state is the process's)
    no_threads = ("its FlexAttention runs through torch.compile, which is not thread-safe: "
                  "run it under torchrun (one process per rank)")

    @dataclass(frozen=True, kw_only=True)
    class Options:
        load_balancer: str = option("head-tail", "torch's load balancer: head-tail, "
                                    "per-document (documents only), ptrr or none", BALANCERS)

    @classmethod
    def variants(cls, topo) -> list:
        return [cls.Options(load_balancer=b) for b in BALANCERS]

    @classmethod
    def unavailable(cls, device: str) -> str | None:
        if why := torchcompat.needs(torchcompat.CP_SINCE, "FlexAttention CP"):
            return why
        if not hasattr(_cp(), "_PTRRLoadBalancer"):
            return f"torch {torch.__version__} has no FlexAttention context parallel"
        if device != "cuda":
            # torch/nn/attention/flex_attention.py's _validate_device raises
            return (f"torch {torch.__version__}'s FlexAttention has no backward on {device}: "
                    f"CUDA GPUs only")
        return None

    def __init__(self, *args, create_groups: bool = True, **kwargs):
        super().__init__(*args, create_groups=create_groups, **kwargs)
        if create_groups:  # about to run: torch's module, mesh and block mask
            cuda = torch.cuda.is_available() and "cuda" in self.kernel.devices
            self._build("cuda" if cuda else "cpu")

    def validate(self) -> None:
        a, n, lb = self.attn, self.cp_size, self.opts.load_balancer
        if lb not in BALANCERS:
            raise UsageError(f"{self.name} --load-balancer must be one of "
                             f"{', '.join(BALANCERS)}, got {lb!r}")
        if a.seqlen % (n * BLOCK):
            raise UsageError(f"seqlen {a.seqlen} cannot be split: torch's FlexAttention CP "
                             f"needs a multiple of {n} ranks x {BLOCK} (its block size); try "
                             f"--seqlen {nearest_multiple(a.seqlen, n * BLOCK)}")
        if lb == "per-document":
            if not a.documents:
                raise Skipped(f"{self.name} --load-balancer per-document balances documents; "
                              f"without --documents it is head-tail")
            bad = [d for d in a.documents if d % (2 * n)]
            if bad:
                raise Skipped(f"{self.name} per-document: torch cuts each document in "
                              f"{2 * n} chunks (it asserts every length divides by {2 * n}); "
                              f"{len(bad)} do not (e.g. {bad[0]})")

    def group_lists(self):
        return {"cp": self.cp_lists}

    def balancer(self, device, block_mask=None):
        """torch's load balancer object for this problem (None: none)."""
        cp, lb, n = _cp(), self.opts.load_balancer, self.cp_size
        if lb == "head-tail":
            return cp._HeadTailLoadBalancer(self.attn.seqlen, n, device)
        if lb == "per-document":
            return cp._PerDocumentHeadTailLoadBalancer([list(self.attn.documents)], n, device)
        if lb == "ptrr":
            if block_mask is None:  # planning: the counts PTRR reads, without compiling
                counts = _block_counts(self.mask, self.attn.seqlen).to(device)
                block_mask = SimpleNamespace(kv_num_blocks=counts.view(1, 1, -1),
                                             full_kv_num_blocks=None, BLOCK_SIZE=(BLOCK, BLOCK))
            return cp._PTRRLoadBalancer(block_mask, n)
        return None

    @functools.cached_property
    def _order(self) -> torch.Tensor | None:
        """The balancer's permutation of the sequence (rank r's shard is its r-th 1/N)."""
        lb = self.balancer("cpu")
        return None if lb is None else lb._generate_indices(restore=False)[0].long()

    def seq_index(self, rank: int) -> torch.Tensor:
        n, r = self.cp_size, self.cp_index(rank)
        if self._order is None:
            return contiguous_index(self.attn.seqlen, n, r)
        return self._order.view(n, -1)[r]

    def _build(self, device: str) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.parallel import parallelize_module
        from torch.nn.attention.flex_attention import create_block_mask

        cp, a = _cp(), self.attn
        self.mesh = DeviceMesh.from_group(self.groups["cp"].pg, device)
        self.module = _Flex(a.softmax_scale, a.num_kv_heads != a.heads, device == "cuda")
        parallelize_module(self.module, self.mesh, cp._ContextParallel(
            seq_dim=2, attention_type=cp._ContextParallel.AttentionType.FLEX))
        mask_mod = _mask_mod(self.mask, a.seqlen, device)
        whole = None
        if self.opts.load_balancer == "ptrr":  # PTRR reads the whole problem's block mask
            whole = torch.compile(create_block_mask, dynamic=False, fullgraph=True)(
                mask_mod, 1, 1, a.seqlen, a.seqlen, device=device)
        lb = self.balancer(device, whole)
        if lb is not None:  # the layout planned on the host is the one torch shards by
            assert self._order is not None
            assert torch.equal(lb._generate_indices()[0].long().cpu(), self._order)
        # without a balancer torch falls back to head-tail unless its global option says no
        # (as _context_parallel_shard sets it): set for the call, restored after
        options = cp._cp_options
        saved, options.enable_load_balance = options.enable_load_balance, lb is not None
        try:
            self.block_mask = cp._attention._create_cp_block_mask(
                mask_mod, 1, 1, a.seqlen, a.seqlen, self.mesh, lb)
        finally:
            options.enable_load_balance = saved

    def attention(self, q, k, v, sinks=None):
        assert sinks is None, "a problem with sinks is refused on construction (takes_sinks)"
        out, lse = self.module(*(t.transpose(1, 2) for t in (q, k, v)),
                               block_mask=self.block_mask)
        return out.transpose(1, 2), lse

    def resolved_options(self) -> dict:
        return {"load_balancer": self.opts.load_balancer}

    def twin_options(self) -> dict:
        layout = {"head-tail": "zigzag", "none": "contiguous"}.get(self.opts.load_balancer)
        return {"layout": layout, "dkv_dtype": "activation",
                "heads_k_stride": self.attn.num_kv_heads} if layout else {}

    def provenance(self) -> dict:
        found = super().provenance()
        assert found is not None, "an adapter: upstream is set"
        if not self.twin_options():  # per-document, PTRR: no layout of llama3's is theirs
            found.update(twin=None)
        return {**found, "kernel": "FlexAttention (torch.compile on CUDA), not --kernel"}

    def schedule(self):
        no_schedule(self)
