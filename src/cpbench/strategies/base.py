"""The strategy contract.

A strategy is one file in this package defining a ``Strategy`` subclass decorated with
``@register``. It owns:
- its layout: ``seq_index(rank)``, the global token positions a rank holds, in local order
  (sharding and gathering back for checks both follow from it);
- its process groups: ``group_lists()`` names rank lists taken from ``cpbench.topology``;
- ``attention(q, k, v) -> (out, lse)``: an autograd function doing communication and kernels;
- ``schedule()``: its communication and compute as data (``Step``s), read by the profiler
  breakdown and the simulator (``strategies.schedule``); tests hold it equal to the bytes the
  code really sends.
Options are a frozen dataclass (``Options``); the CLI is generated from its fields.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from cpbench import comm
from cpbench.config import AttentionConfig, padded
from cpbench.errors import Skipped, UsageError
from cpbench.kernels import masked
from cpbench.kernels.base import KernelBackend
from cpbench.mask import Mask, mask_of
from cpbench.metrics import attention_flops, pairs_flops
from cpbench.strategies._upstream import Upstream
from cpbench.strategies.blockbytes import BlockBytes
from cpbench.strategies.schedule import BWD, FWD, Message, Step
from cpbench.topology import Group, Topology, new_groups, plan_group

# the schedule's data and an adapter's library are part of the contract: strategies import
# them from here with the rest
__all__ = ["BWD", "FWD", "Message", "NoOptions", "Step", "Strategy", "Upstream", "option",
           "save_for_backward"]


@dataclass(frozen=True, kw_only=True)
class NoOptions:
    pass


def option(default, help: str, choices: tuple | None = None):
    """A strategy option field: its default, CLI help and allowed values."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def save_for_backward(ctx, strat: "Strategy", *tensors: torch.Tensor, lse: torch.Tensor) -> None:
    """What every strategy's autograd forward keeps: the strategy (its groups and options),
    the tensors its backward reads, and ``lse`` marked as an output without a gradient."""
    ctx.strat = strat
    ctx.save_for_backward(*tensors)
    ctx.mark_non_differentiable(lse)


class Strategy(BlockBytes, ABC):
    name: ClassVar[str]
    description: ClassVar[str]
    Options: ClassVar[type] = NoOptions
    causal_only: ClassVar[bool] = False
    upstream: ClassVar[Upstream | None] = None  # set by adapters running a library's code
    # per device, the kernels a library's code runs (None: whatever --kernel gives); under
    # ``auto`` the plan hands the strategy one of these (strategies._upstream.case_kernel)
    accepted_kernels: ClassVar[dict[str, tuple[str, ...]] | None] = None
    returns_lse: ClassVar[bool] = True  # False: attention() returns (out, None)
    # its code runs torch.compile, which refuses to run under a Python dispatch mode: its
    # traffic is traced without one (``bench.commtrace.traced(dispatch=False)``)
    compiles: ClassVar[bool] = False
    # why it cannot run with ranks as threads of one process on one device (--launcher
    # threads, cpbench.threadpg), or None; the plan skips it with this reason
    no_threads: ClassVar[str | None] = None
    # the masks beyond causal it computes exactly ("documents", "window"); under any other
    # its row is skipped with the reason (never run silently wrong)
    masks: ClassVar[frozenset[str]] = frozenset()
    # whether it computes padded documents as cpbench.mask defines them (pad tokens attend to
    # nothing): an adapter handing document lengths to a library as they are does not
    pads_documents: ClassVar[bool] = True
    # why it cannot compute a V head dim of its own (MLA's --v-head-dim), or None: it can
    # (cpbench's own strategies carry K, V, out and their gradients each at its width)
    no_v_head_dim: ClassVar[str | None] = None
    # whether it adds sinks (--sinks) once per query, after its last merge (merge.add_sink)
    takes_sinks: ClassVar[bool] = False

    def __init__(self, attn: AttentionConfig, topo: Topology, rank: int, *,
                 kernel: KernelBackend, options=None, create_groups: bool = True,
                 cp_lists: list[list[int]] | None = None):
        """``cp_lists``: the rank lists this strategy splits the sequence over, each in ring
        order (default: one list of every rank). A composite strategy (USP) passes its ring
        groups here and runs this strategy inside them on its own head slice."""
        self.attn, self.topo, self.rank, self.kernel = attn, topo, rank, kernel
        # whether attention() must return the lse where it costs communication (a check
        # does; the timed path does not, as the systems the strategies are named after)
        self.need_lse = False
        self.opts = options if options is not None else self.Options()
        self.cp_lists = cp_lists or [list(range(topo.world_size))]
        # the problem as this layout computes it: documents padded to its multiples
        self.attn = padded(attn, *self.pad_multiples())
        if self.attn is not attn and not self.pads_documents:
            doc_m, seq_m = self.pad_multiples()
            raise Skipped(f"{self.name} hands document lengths to its library as they are, "
                          f"and its layout needs each a multiple of {doc_m} (the sequence "
                          f"a multiple of {seq_m}): refused, not padded; give such lengths")
        self.refuse_what_it_cannot_compute()
        self.validate()
        build = new_groups if create_groups else plan_group
        self.groups: dict[str, Group] = {
            name: build(topo, name, rank, lists) for name, lists in self.group_lists().items()
        }

    # -- what each strategy defines ------------------------------------------------------------

    @classmethod
    def variants(cls, topo: Topology) -> list:
        """Option sets worth running side by side on ``topo`` (e.g. both USP placements).
        ``--strategy all`` runs each; the test matrix checks each. Default: the defaults."""
        return [cls.Options()]

    @classmethod
    def layout_multiples(cls, cp_size: int, options) -> tuple[int, int]:
        """(document, sequence) multiples its layout over ``cp_size`` ranks splits evenly
        (``options``: this strategy's): contiguous shards by default, any document length
        and a sequence of N equal shards. Zigzag layouts say (2N, 2N)."""
        return 1, cp_size

    def pad_multiples(self) -> tuple[int, int]:
        """(document, sequence) multiples this instance pads its documents to (see
        ``config.padded``); what the plan, the simulator and the dry run read back as the
        record's ``padding``. Runs before ``validate``. Default: ``layout_multiples``."""
        return self.layout_multiples(self.cp_size, self.opts)

    def padding(self) -> dict | None:
        """The record's ``padding`` section (None without documents): real and padded
        lengths, the pad tokens and their share of the padded sequence."""
        a = self.attn
        if not a.documents:
            return None
        pads = getattr(a, "padding", ()) or (0,) * len(a.documents)
        real = [d - p for d, p in zip(a.documents, pads) if d > p]
        doc_m, seq_m = self.pad_multiples()
        return {"document_multiple": doc_m, "sequence_multiple": seq_m,
                "real_seqlen": sum(real), "padded_seqlen": a.seqlen,
                "padded_tokens": sum(pads), "fraction": sum(pads) / a.seqlen,
                "tail_tokens": pads[-1] if len(real) < len(a.documents) else 0,
                "padded_lengths": list(a.documents)}

    def validate(self) -> None:  # noqa: B027 - an optional hook: most strategies accept all
        """Raise ValueError, saying what would work, for a config this strategy cannot run.
        Pure: runs before any collective."""

    @abstractmethod
    def group_lists(self) -> dict[str, list[list[int]]]:
        """Role name → rank lists (from cpbench.topology), in creation order."""

    @abstractmethod
    def seq_index(self, rank: int) -> torch.Tensor:
        """Global sequence positions held by ``rank``, in local order."""

    @abstractmethod
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  sinks: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Local q, k, v (b, s_local, h, d) → local out (b, s_local, h, d), lse (b, h, s_local)
        (None where ``returns_lse`` is False: a library that does not hand it out).
        ``sinks`` (h,), given where ``attn.sinks``: its gradient is this rank's queries'
        share (``merge.sink_grad``); the caller sums it over the ranks."""

    def attend(self, q, k, v, sinks=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``attention`` as the bench calls it: ``sinks`` handed over only where the problem
        has them (a plugin's three-argument ``attention`` runs every other problem)."""
        assert (sinks is not None) == self.attn.sinks, "sinks given where the problem has them"
        return self.attention(q, k, v) if sinks is None else self.attention(q, k, v, sinks)

    @abstractmethod
    def schedule(self) -> list[Step]:
        """This rank's forward and backward steps: FLOPs and messages."""

    @classmethod
    def unsupported_mask(cls, mask: Mask) -> str | None:
        """Why this strategy cannot take ``mask`` (None: it can)."""
        missing = sorted(mask.kinds - cls.masks)
        if not missing:
            return None
        flags = " and ".join("--" + k.replace("window", "window-size") for k in missing)
        return f"{cls.name} does not support {flags} (masks it takes: " \
               f"{', '.join(sorted(cls.masks)) or 'causal or full only'})"

    def refuse_what_it_cannot_compute(self) -> None:
        """Raise, whoever builds it (the driver, the simulator, a harness through the Python
        API), for attention this strategy would compute wrong: non-causal for a causal-only
        one, a mask it does not declare. The driver asks the same first (``unsupported_mask``)
        to skip a row with the reason before any process starts."""
        if self.causal_only and not self.attn.causal:
            raise UsageError(f"{self.name} only runs causal attention; drop --no-causal")
        if self.attn.sinks and not self.takes_sinks:
            library = f" ({self.upstream.package})" if self.upstream else ""
            raise Skipped(f"{self.name}{library} cannot add attention sinks once per query; "
                          f"drop --sinks")
        why = self.unsupported_mask(self.mask)
        if why:
            raise Skipped(why)
        if self.attn.v_head_dim is not None and (why := self.v_head_dim_refusal()):
            raise Skipped(f"{self.name} refuses --v-head-dim: {why}")

    def v_head_dim_refusal(self) -> str | None:
        """Why this instance cannot compute V at a head dim of its own (``no_v_head_dim``
        unless an adapter's options decide it); cpbench's own strategies run their kernel,
        which must take it (built through the Python API, no plan checked it before)."""
        if self.upstream is None and not self.kernel.unequal_head_dims:
            return f"its kernel {self.kernel.name} takes one head dim for Q, K and V"
        return self.no_v_head_dim

    def area_per_rank(self) -> list[int]:
        """Attended (query, key) pairs each rank computes, from its layout and the mask:
        by default a rank computes its own queries against every key they see (sequence
        split); head-split strategies override it."""
        every = torch.arange(self.attn.seqlen)
        return [self.mask.pairs(self.seq_index(r), every) for r in range(self.world_size)]

    def area_per_step(self) -> list[list[int]] | None:
        """Per rank, the pairs of each ring step (None: no ring steps)."""
        return None

    def balance(self) -> dict:
        """The record's ``balance``: attended pairs per rank (and per ring step) and
        ``imbalance`` = max / mean over ranks (1.0: every rank computes the same area)."""
        per_rank = self.area_per_rank()
        mean = sum(per_rank) / len(per_rank)
        return {"area_per_rank": per_rank, "area_per_step": self.area_per_step(),
                "imbalance": max(per_rank) / mean if mean else 1.0}

    def merges(self) -> bool:
        """Whether each kernel call's result is merged into the rank's fp32 (out, lse) and
        its gradients summed into fp32 partial sums (the simulator prices those passes). A
        ring's, even of one step (``local``), are; a strategy that returns its one call's
        result as it is says False."""
        return True

    def kernel_head_share(self) -> float:
        """The share of the heads one kernel call on this rank computes (1: all of them;
        a Ulysses all-to-all leaves 1 / its degree)."""
        return 1.0

    def kernel_gqa(self) -> int:
        """Query heads per K/V head in this rank's kernel calls (a kernel that packs them
        into one tile's rows fills it with that many: ``sim.curves.Tiles``)."""
        return max(1, self.attn.heads // self.attn.num_kv_heads)

    @classmethod
    def unavailable(cls, device: str) -> str | None:
        """Why this strategy cannot run on ``device`` on this machine (a library missing, a
        GPU-only library on CPU), or None. Checked before anything is built."""
        return cls.upstream.unavailable(device) if cls.upstream else None

    def provenance(self) -> dict | None:
        """For an adapter: the library and version that ran (and the kernel beneath it),
        kept in the record as ``upstream``, with its twin: cpbench's strategy of the same
        algorithm and the resolved options the twin's row must have to be the same problem
        (``twin_options``); None for cpbench's own strategies."""
        if self.upstream is None:
            return None
        return {"package": self.upstream.package, "version": self.upstream.version(),
                "twin": self.upstream.twin, "twin_options": self.twin_options()}

    def twin_options(self) -> dict:
        """The twin's resolved options that make its row this one's counterpart (e.g. the
        same Ulysses × ring mesh); default: any."""
        return {}

    def resolved_options(self) -> dict:
        """The options as actually used, defaults resolved (e.g. a window of 0 → ranks per
        node): what a result record stores beside the options given."""
        return dataclasses.asdict(self.opts)

    # -- shared helpers -----------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.topo.world_size

    @property
    def cp_size(self) -> int:
        return len(self.cp_lists[0])

    @property
    def ranks_per_problem(self) -> int:
        """Ranks that share one attention problem: per-GPU TFLOPs divide its FLOPs by this.
        Every rank for a CP strategy; 1 for a no-CP baseline (each rank solves it alone)."""
        return self.world_size

    @property
    def mask(self) -> Mask:
        cached = self.__dict__.get("_mask")  # read at every step of a schedule: once a problem
        if cached is None or cached[0] is not self.attn:
            cached = self.__dict__["_mask"] = self.attn, mask_of(self.attn)
        return cached[1]

    def ring_rank(self, position: int) -> int:
        """The rank at ``position`` of this rank's CP ring."""
        return next(ranks for ranks in self.cp_lists if self.rank in ranks)[position]

    def positions(self, ranks) -> torch.Tensor:
        """The global positions ``ranks`` hold, one after the other (a gathered sequence)."""
        return torch.cat([self.seq_index(r) for r in ranks])

    def held_positions(self, rows) -> torch.Tensor:
        """The global positions of this rank's local ``rows`` (a slice or a numpy index)."""
        index = self.seq_index(self.rank)
        return index[rows] if isinstance(rows, slice) else index[torch.from_numpy(rows)]

    def sorted_positions(self, ranks):
        """``positions(ranks)`` sorted (values) and the order that sorts them (indices): a
        gathered sequence put back in sequence order."""
        return self.positions(ranks).sort()

    def tiles(self, key, q_pos: torch.Tensor, k_pos: torch.Tensor) -> masked.Block:
        """The masked kernel's plan for these global query and key positions, cached under
        ``key`` (the same blocks recur every iteration); false when nothing is visible."""
        cache = self.__dict__.setdefault("_tiles", {})
        if key not in cache:
            cache[key] = masked.Block(self.mask, q_pos, k_pos)
        return cache[key]

    def ring_tiles(self, src: int) -> masked.Block:
        """The masked kernel's plan of the local queries against ring position ``src``'s
        K/V block (the real pass's and the simulator's step use the same one)."""
        return self.tiles(("ring", src), self.seq_index(self.rank),
                          self.seq_index(self.ring_rank(src)))

    def masked_forward(self, q, k, v, tiles: masked.Block):
        comm.record_kernel()
        return masked.block_forward(self.kernel, tiles, q, k, v,
                                    softmax_scale=self.attn.softmax_scale)

    def masked_backward(self, dout, q, k, v, out, lse, tiles: masked.Block):
        comm.record_kernel()
        return masked.block_backward(self.kernel, tiles, dout, q, k, v, out, lse,
                                     softmax_scale=self.attn.softmax_scale)

    def pairs_step(self, phase: str, index: int, pairs: float, shape: tuple[int, int],
                   messages=(), block: masked.Block | None = None) -> Step:
        """A step computing ``pairs`` attended pairs (a masked block) of ``shape``; with the
        ``block``'s plan, also what its largest varlen call packs."""
        a = self.attn
        flops = pairs_flops(pairs, batch=a.batch, heads=a.heads, head_dim=a.head_dim,
                            mode=phase, v_head_dim=a.v_head_dim)
        calls = block.calls if block is not None and pairs else None
        packed, spectrum = calls if calls is not None else (None, ())
        return Step(phase, index, flops, tuple(messages), (*shape, False) if pairs else None,
                    packed, spectrum)

    def cp_index(self, rank: int) -> int:
        """``rank``'s position in its CP ring: what its sequence shard is keyed by."""
        return next(ranks.index(rank) for ranks in self.cp_lists if rank in ranks)

    @property
    def local_seqlen(self) -> int:
        # read at every step of a schedule (the simulator builds one per rank): the layout's
        # length once per (problem, rank), not a fresh index each time
        cached = self.__dict__.get("_local_seqlen")
        if (cached is None or cached[0] is not self.attn or cached[1] != self.rank
                or cached[2] is not self.cp_lists):
            cached = self.__dict__["_local_seqlen"] = (
                self.attn, self.rank, self.cp_lists, len(self.seq_index(self.rank)))
        return cached[3]

    def shard(self, x_bs: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """This rank's part of a global tensor whose dim 1 is the sequence."""
        idx = self.seq_index(self.rank if rank is None else rank).to(x_bs.device)
        return x_bs.index_select(1, idx)

    def unshard(self, parts: list[torch.Tensor], seq_dim: int = 1) -> torch.Tensor:
        """Inverse of ``shard`` given every rank's local tensor (rank order)."""
        first = parts[0]
        shape = list(first.shape)
        shape[seq_dim] = self.attn.seqlen
        out = first.new_empty(shape)
        for r, part in enumerate(parts):
            out.index_copy_(seq_dim, self.seq_index(r).to(out.device), part)
        return out

    def block_flops(self, seqlen_q: int, seqlen_k: int, causal: bool, mode: str = FWD) -> float:
        return attention_flops(batch=self.attn.batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                               heads=self.attn.heads, head_dim=self.attn.head_dim,
                               causal=causal, mode=mode, v_head_dim=self.attn.v_head_dim)

    def kernel_step(self, phase: str, index: int, seqlen_q: int, seqlen_k: int, causal: bool,
                    messages=(), *, head_share: int = 1) -> Step:
        """A step computing one (seqlen_q × seqlen_k) block on 1/``head_share`` of the heads."""
        flops = self.block_flops(seqlen_q, seqlen_k, causal, phase) / head_share
        return Step(phase, index, flops, tuple(messages), (seqlen_q, seqlen_k, causal))

    def kernel_call(self, name: str, *args, causal: bool):
        comm.record_kernel()
        fn = getattr(self.kernel, name)
        return fn(*args, causal=causal, softmax_scale=self.attn.softmax_scale)

