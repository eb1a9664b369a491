"""rfa-zigzag, rfa-ring, rfa-stripe: ring-flash-attention's own functions (zhuzilin/
ring-flash-attention, the ``ring-flash-attn`` package), run as they are.

Each calls ``zigzag_ring_flash_attn_func`` / ``ring_flash_attn_func`` /
``stripe_flash_attn_func`` with the CP process group and ``return_attn_probs=True`` (which
hands back the lse for ``--check``); the library does its own ring (K and V as two messages,
a dK/dV ring in fp32 behind it) and calls flash-attn's interface for every block: on GPU
flash-attn itself (``--kernel flash-attn``) or, where it is absent, cpbench's implementation
of that interface on torch's FA2 ops (``--kernel sdpa``); on CPU cpbench's on the aten CPU
flash kernel ``sdpa-cpu`` uses (``kernels.flash_attn_cpu``).

Layouts, as the library's own tests shard inputs: zigzag, chunks r and 2N-1-r of 2N (its
twin ``zigzag``); ring, contiguous shards (``ring``); stripe, token i on rank i mod N. Zigzag
and stripe are causal only (the library asserts it).

Packed documents (``--documents``) go to the library's varlen functions with ``cu_seqlens``
(batch 1: the documents are the batch): ``rfa-zigzag`` runs
``zigzag_ring_flash_attn_varlen_func`` on every document cut in 2N chunks (its twin's layout
under documents), ``rfa-ring`` ``ring_flash_attn_varlen_func`` on every document cut in N
contiguous parts (the library's varlen layout; ``ring`` splits the packed sequence instead),
and ``rfa-llama3`` ``llama3_flash_attn_varlen_func`` (all-gather K/V, contiguous shards, with
the library's ``llama3_flash_attn_prepare_cu_seqlens``; also with a sliding window). The ring
varlen functions have the fp32 dQ aliasing of the others (ring_flash_attn_varlen.py:172,
zigzag_ring_flash_attn_varlen.py:283) and are refused in fp32; the llama3 one writes dQ
into its own buffer and runs in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from cpbench.errors import UsageError
from cpbench.strategies import register
from cpbench.strategies._upstream import (
    FLASH_KERNELS,
    check_flash_kernel,
    flash_attn_beneath,
    import_algorithms,
    no_schedule,
    unsupported_dtype,
)
from cpbench.strategies.base import Strategy, Upstream, option
from cpbench.strategies.layout import (
    ZigzagLayout,
    check_divisible,
    check_documents_divisible,
    contiguous_index,
)

PACKAGE, MODULE = "ring-flash-attn", "ring_flash_attn"


class _RingFlashAttn(Strategy):
    """One of ring-flash-attn's functions over the CP group."""
    pads_documents = False  # the library takes document lengths as they are
    # its buffers (llama3's one K/V all-gather buffer, out) are shaped like K and q
    no_v_head_dim = "ring-flash-attn sizes its buffers like K (flash-attn 2)"

    module: ClassVar[str]  # the library's file of the algorithm
    function: ClassVar[str]
    varlen: ClassVar[tuple[str, str] | None] = None  # (file, function) for --documents
    accepted_kernels = FLASH_KERNELS

    def __init__(self, *args, create_groups: bool = True, **kwargs):
        super().__init__(*args, create_groups=create_groups, **kwargs)
        self.beneath: str | None = None
        # what the varlen call takes beside q, k, v (prepare(), under --documents)
        self.varlen_args: tuple[Any, ...] | None = None
        if create_groups:  # about to run: the library and the flash-attn under it
            self.beneath = flash_attn_beneath(self.kernel)
            module, function = (self.varlen if self.attn.documents and self.varlen
                                else (self.module, self.function))
            self.fn = getattr(import_algorithms(MODULE, module), function)
            self.prepare()

    def prepare(self) -> None:
        """What the varlen call takes beside q, k, v, planned once on the host (the documents
        are fixed for a case): computed per call it would read tensor values back to the
        host inside the timed step (a sync per call). ``on_device`` moves it once."""
        if self.attn.documents:
            cu = self.local_cu_seqlens("cpu")
            self.varlen_args = (cu, int((cu[1:] - cu[:-1]).max()))

    def on_device(self, device) -> tuple:
        """``varlen_args`` with its tensors on ``device``, moved at the first call (a real
        run's warm-up) and kept: no copy in the timed steps."""
        moved = self.__dict__.setdefault("_moved", {})
        assert self.varlen_args is not None, "prepare() ran: the case has documents"
        if device not in moved:
            moved[device] = tuple(a.to(device) if isinstance(a, torch.Tensor) else a
                                  for a in self.varlen_args)
        return moved[device]

    def validate(self) -> None:
        check_flash_kernel(self)
        unsupported_dtype(self)
        if self.attn.documents and self.attn.batch != 1:
            raise UsageError(f"{self.name} runs {PACKAGE}'s varlen function on packed "
                             f"tokens: use --batch 1 (the documents are the batch)")
        super().validate()

    def local_cu_seqlens(self, device) -> torch.Tensor:
        """cu_seqlens of this rank's tokens: every document holds 1/N of its length here."""
        lengths = torch.tensor([0, *(self.attn.documents or ())], dtype=torch.int32, device=device)
        return (lengths.cumsum(0) // self.cp_size).to(torch.int32)

    def varlen_attention(self, q, k, v):
        """The varlen function on (tokens, heads, dim): out back to bshd, lse (h, t) to
        (1, h, t)."""
        cu, max_len = self.on_device(q.device)
        out, lse, _ = self.fn(q[0], k[0], v[0], cu, max_len,
                              softmax_scale=self.attn.softmax_scale, causal=self.attn.causal,
                              return_attn_probs=True, group=self.groups["rfa"].pg)
        return out.unsqueeze(0), lse.unsqueeze(0)

    def group_lists(self):
        return {"rfa": self.cp_lists}

    def attention(self, q, k, v, sinks=None):
        assert sinks is None, "a problem with sinks is refused on construction (takes_sinks)"
        if self.attn.documents:
            return self.varlen_attention(q, k, v)
        out, lse, _ = self.fn(q, k, v, softmax_scale=self.attn.softmax_scale,
                              causal=self.attn.causal, return_attn_probs=True,
                              group=self.groups["rfa"].pg)
        return out, lse

    def provenance(self) -> dict:
        return {**(super().provenance() or {}), "flash_attn": self.beneath}

    def schedule(self):
        no_schedule(self)


@register
class RfaZigzag(ZigzagLayout, _RingFlashAttn):
    name = "rfa-zigzag"
    description = "ring-flash-attn's zigzag_ring_flash_attn_func (the library's own code)"
    upstream = Upstream(PACKAGE, MODULE, twin="zigzag")
    causal_only = True
    masks = frozenset({"documents"})
    module, function = "zigzag_ring_flash_attn", "zigzag_ring_flash_attn_func"
    varlen = "zigzag_ring_flash_attn_varlen", "zigzag_ring_flash_attn_varlen_func"


@register
class RfaRing(_RingFlashAttn):
    name = "rfa-ring"
    description = "ring-flash-attn's ring_flash_attn_func (the library's own code)"
    upstream = Upstream(PACKAGE, MODULE, twin="ring")
    masks = frozenset({"documents"})
    module, function = "ring_flash_attn", "ring_flash_attn_func"
    varlen = "ring_flash_attn_varlen", "ring_flash_attn_varlen_func"

    @classmethod
    def layout_multiples(cls, cp_size: int, options) -> tuple[int, int]:
        return cp_size, cp_size  # every document cut in N (its varlen function)

    def validate(self) -> None:
        super().validate()
        check_divisible(self.attn.seqlen, self.cp_size, f"{self.name} over {self.cp_size} "
                        f"ranks")
        if self.attn.documents:
            check_documents_divisible(self.attn.documents, self.cp_size,
                                      f"{self.name} over {self.cp_size} ranks (varlen)")

    def seq_index(self, rank: int) -> torch.Tensor:
        n, r = self.cp_size, self.cp_index(rank)
        if not self.attn.documents:
            return contiguous_index(self.attn.seqlen, n, r)
        # the library's varlen layout: part r of N of every document, document by document
        starts = [0, *torch.tensor(self.attn.documents).cumsum(0).tolist()]
        return torch.cat([start + contiguous_index(length, n, r)
                          for start, length in zip(starts, self.attn.documents)])


@register
class RfaStripe(_RingFlashAttn):
    name = "rfa-stripe"
    description = ("ring-flash-attn's stripe_flash_attn_func: token i on rank i mod N "
                   "(the library's own code)")
    upstream = Upstream(PACKAGE, MODULE)
    causal_only = True
    module, function = "stripe_flash_attn", "stripe_flash_attn_func"

    def validate(self) -> None:
        super().validate()
        check_divisible(self.attn.seqlen, self.cp_size, f"{self.name} over {self.cp_size} "
                        f"ranks")

    def seq_index(self, rank: int) -> torch.Tensor:
        return torch.arange(self.cp_index(rank), self.attn.seqlen, self.cp_size)


@register
class RfaLlama3(_RingFlashAttn):
    name = "rfa-llama3"
    description = ("ring-flash-attn's llama3_flash_attn_varlen_func: all-gather K/V "
                   "(the library's own code)")
    upstream = Upstream(PACKAGE, MODULE, twin="llama3")
    masks = frozenset({"documents", "window"})
    module, function = "llama3_flash_attn_varlen", "llama3_flash_attn_varlen_func"

    @dataclass(frozen=True, kw_only=True)
    class Options:
        heads_k_stride: int = option(0, "K/V heads gathered at a time (0: all at once); "
                                     "fewer caps the gathered buffers")

    def validate(self) -> None:
        check_flash_kernel(self)  # its dQ is its own buffer: fp32 is right (no dtype refusal)
        if self.attn.batch != 1:
            raise UsageError(f"{self.name} runs {PACKAGE}'s varlen function on packed tokens: "
                             f"use --batch 1 (pack a batch as --documents)")
        if self.attn.window_size and not self.attn.causal:
            raise UsageError(f"{self.name}: the library aligns a window to the end of each "
                             f"rank's key slice, right only when causal; add --causal")
        check_divisible(self.attn.seqlen, self.cp_size, f"{self.name} over {self.cp_size} "
                        f"ranks")
        hk, stride = self.attn.num_kv_heads, self.opts.heads_k_stride
        if stride < 0 or (stride and hk % stride):
            raise UsageError(f"--heads-k-stride {stride} must divide the {hk} K/V heads, "
                             f"or be 0 (all at once)")

    def seq_index(self, rank: int) -> torch.Tensor:
        return contiguous_index(self.attn.seqlen, self.cp_size, self.cp_index(rank))

    def resolved_options(self) -> dict:
        return {"heads_k_stride": self.opts.heads_k_stride or self.attn.num_kv_heads}

    def twin_options(self) -> dict:
        # the library's layout and dK/dV dtype: llama3's row of the same problem
        return {**self.resolved_options(), "layout": "contiguous", "dkv_dtype": "activation"}

    def prepare(self) -> None:
        """The library's ``llama3_flash_attn_prepare_cu_seqlens`` (six ``.item()``: host
        syncs), once per case on the host rather than in every timed call."""
        prepare = import_algorithms(MODULE, self.module).llama3_flash_attn_prepare_cu_seqlens
        lengths = self.attn.documents or (self.attn.seqlen,)
        cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0)
        self.varlen_args = prepare(cu.to(torch.int32), self.attn.causal,
                                   self.cp_index(self.rank), self.cp_size)

    def attention(self, q, k, v, sinks=None):
        assert sinks is None, "a problem with sinks is refused on construction (takes_sinks)"
        cu_q, cu_k, max_q, max_k, k_slice = self.on_device(q.device)
        window = tuple(self.attn.window_size) if self.attn.window_size else (-1, -1)
        out, lse, _ = self.fn(q[0], k[0], v[0], cu_q, cu_k, max_q, max_k,
                              self.resolved_options()["heads_k_stride"], k_slice,
                              softmax_scale=self.attn.softmax_scale, causal=self.attn.causal,
                              window_size=window, return_attn_probs=True,
                              group=self.groups["rfa"].pg)
        return out.unsqueeze(0), lse.unsqueeze(0)
