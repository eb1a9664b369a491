"""te-p2p, te-a2a, te-a2a+p2p, te-all-gather: TransformerEngine's ``DotProductAttention`` with
``set_context_parallel_group(..., cp_comm_type=...)`` (transformer-engine 2.x), run as it is.
GPU only: TE's context parallelism needs CUDA streams and its CUDA kernels; never run here,
its argument mapping is unit-tested against TE's real signatures (tests/unit/test_te_mapping.py).

Read at NVIDIA/TransformerEngine v2.18 (27486e03),
``transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py``:
``__init__`` L370-393, ``set_context_parallel_group`` L565-604, ``forward`` L989-1018; every
argument is passed by keyword (2.12 inserted ``bottom_right_diagonal`` mid-signature).

- Layout, every comm type: DualChunkSwap (context_parallel.py L4957-5012), chunks r and
  2N-1-r of 2N, keyed by TE's cp rank, which is the rank's index in the sorted group (torch
  sorts a group's members). a2a+p2p: cp_rank = A·p2p_rank + a2a_rank (L1418-1419), so the
  level-1 (all-to-all) groups are consecutive blocks of A and the rings take every A-th rank.
- Output: (b, s_local, h·d), reshaped to (b, s_local, h, d). No lse: the public module hands
  out none, so checks compare out, dq, dk, dv.
- Constraints TE enforces under CP: bf16 / fp16 (its fp32 backend is disabled under CP), S
  divisible by 2N, heads and kv heads divisible by the all-to-all size (no K/V replication).
- ``--documents``: qkv_format "thd" (``thd_kwargs``); every document cut into 2N chunks,
  rank r holding chunks r and 2N-1-r of each, document by document (common/fused_attn/
  context_parallel.cu L83-113, ``thd_partition_indices_kernel``: ``zigzag_documents_index``).
  p2p, a2a, all_gather take thd; a2a+p2p does not (context_parallel.py L5021-5023).
- ``--window-size``: a2a and all_gather only (context_parallel.py L5054-5060).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from cpbench.errors import Skipped, UsageError
from cpbench.strategies import register
from cpbench.strategies._upstream import no_schedule
from cpbench.strategies.base import Strategy, Upstream
from cpbench.strategies.layout import ZigzagLayout
from cpbench.strategies.megatron_cp_a2a_p2p import a2a_degree_option, default_a2a_degree

PACKAGE, MODULE = "transformer-engine", "transformer_engine"


# comm types whose CP path takes qkv_format "thd" (a2a+p2p asserts it away: CP L5021-5023)
THD_COMM_TYPES = ("p2p", "a2a", "all_gather")
# comm types whose CP path takes a sliding window (CP L5054-5060, "does not support sliding
# window attention with cp_comm_type")
WINDOW_COMM_TYPES = ("a2a", "all_gather")


def te_window(attn, comm_type: str) -> tuple[int, int] | None:
    """The ``window_size`` TE is given for cpbench's ``--window-size`` (None: no window)."""
    if attn.window_size is None:
        return None
    left, right = attn.window_size
    if attn.causal:
        # causal already bounds the right side, and TE wants (x, 0) under a causal mask
        # (utils.py L2467-2480 check_set_window_size): the same mask
        window = (left, 0)
    elif (left < 0) != (right < 0):
        raise Skipped(f"TransformerEngine takes a non-causal window as (-1, -1) or (>=0, >=0), "
                      f"not {attn.window_size} (utils.py L2489-2492); give both sides")
    else:
        window = (left, right)
    if window not in ((-1, 0), (-1, -1)) and comm_type not in WINDOW_COMM_TYPES:
        raise Skipped(f"TransformerEngine's cp_comm_type {comm_type} takes no sliding window "
                      f"(context_parallel.py L5054-5060); use te-a2a or te-all-gather")
    return window


def thd_kwargs(documents: tuple[int, ...], batch: int) -> dict[str, Any]:
    """``forward``'s THD arguments for ``batch`` rows of the packed ``documents``, one
    sequence per document per row (rows flatten into t in row order)."""
    lengths = torch.tensor(tuple(documents) * batch, dtype=torch.int32)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    # GLOBAL, not per rank: the lengths of whole documents. TE's test builds them so
    # (tests/pytorch/attention/run_attention_with_cp.py L112-134, partitioned per rank by
    # tex.thd_get_partitioned_indices L470-477) and divides them itself: p2p by N (CP
    # L1447-1450), all_gather by 2N (L3144-3151); a2a uses them as they are, its all-to-all
    # giving each rank whole documents (L4399-4454). Padded = unpadded (every length divides
    # by 2N, refused otherwise), the same tensor, so no padding between sequences.
    # max_seqlen global too, the longest document (DPA L1361-1373 would round it up to 64).
    return dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                cu_seqlens_kv_padded=cu, max_seqlen_q=max(documents),
                max_seqlen_kv=max(documents))


def te_kwargs(attn, comm_type: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``DotProductAttention.__init__`` kwargs, ``forward`` kwargs besides q, k, v) for a
    cpbench problem: bshd, or thd under documents; ``pick`` keeps those a version has."""
    thd = bool(attn.documents)
    if thd and comm_type not in THD_COMM_TYPES:
        raise Skipped(f"TransformerEngine's cp_comm_type {comm_type} does not take packed "
                      f"documents (qkv_format thd: context_parallel.py L5021-5023)")
    fmt = "thd" if thd else "bshd"
    # thd needs a padding mask type (DPA L1347-1349)
    mask = {(False, True): "causal", (False, False): "no_mask",
            (True, True): "padding_causal", (True, False): "padding"}[thd, attn.causal]
    window = te_window(attn, comm_type)
    # kv_channels: one int, or (K's, V's) head dims for MLA (DotProductAttention's tuple)
    channels = attn.head_dim if attn.v_head_dim is None else (attn.head_dim, attn.v_head_dim)
    init = dict(num_attention_heads=attn.heads, kv_channels=channels,
                num_gqa_groups=attn.num_kv_heads, attention_dropout=0.0, qkv_format=fmt,
                attn_mask_type=mask, window_size=window, sequence_parallel=False, tp_size=1,
                tp_group=None, layer_number=1, attention_type="self",
                softmax_scale=attn.softmax_scale, softmax_type="vanilla",
                return_max_logit=False, cp_comm_type=comm_type)
    # bshd: max_seqlen / cu_seqlens left out: TE derives them from the local shapes and
    # multiplies by the CP size (dot_product_attention.py L1334-1342); a global one would be
    # multiplied again
    forward = dict(attention_mask=None, qkv_format=fmt, attn_mask_type=mask,
                   window_size=window, checkpoint_core_attention=False,
                   core_attention_bias_type="no_bias", core_attention_bias=None,
                   alibi_slopes=None, fast_zero_fill=True, inference_params=None,
                   pad_between_seqs=False, fp8_output=False, num_splits=1)
    if thd:
        forward.update(thd_kwargs(attn.documents, attn.batch))
    return init, forward


def pick(candidates: dict[str, Any], params, required=(), what: str = "") -> dict[str, Any]:
    """The candidates a signature accepts; TypeError if it requires one we cannot fill."""
    missing = [p for p in required if p not in candidates]
    if missing:
        raise TypeError(f"{what} requires {missing}, unknown to cpbench: unsupported version")
    return {name: candidates[name] for name in params if name in candidates}


def hierarchical_lists(cp: list[int], a2a: int) -> tuple[list[list[int]], list[list[int]]]:
    """(level-1 lists, level-2 lists) of a2a+p2p: consecutive blocks of ``a2a`` ranks, and
    the ranks with the same position in their block (Megatron's create_hierarchical_groups)."""
    return ([cp[i:i + a2a] for i in range(0, len(cp), a2a)],
            [cp[i::a2a] for i in range(a2a)])


class _TransformerEngine(ZigzagLayout, Strategy):
    pads_documents = False  # the library takes document lengths as they are
    comm_type: ClassVar[str]
    upstream = Upstream(PACKAGE, MODULE, cuda_only=True)
    returns_lse = False
    masks = frozenset({"documents", "window"})

    def __init_subclass__(cls, *, comm_type: str, twin: str, note: str = "", **kwargs):
        """A variant: TE's DotProductAttention with one ``cp_comm_type``, its row compared
        with cpbench's ``twin`` (``note``: what the comm type does, where its name does not
        say)."""
        super().__init_subclass__(**kwargs)
        cls.comm_type = comm_type
        cls.description = (f"TransformerEngine DotProductAttention, cp_comm_type "
                           f"{comm_type}{note} (GPU only)")
        cls.upstream = Upstream(PACKAGE, MODULE, twin=twin, cuda_only=True)

    def __init__(self, *args, create_groups: bool = True, **kwargs):
        super().__init__(*args, create_groups=create_groups, **kwargs)
        self.module = self._module() if create_groups else None

    def v_head_dim_refusal(self) -> str | None:
        if self.comm_type == "p2p":  # AttnFuncWithCPAndKVP2P's enable_mla: K, V flattened
            return None
        # read in TE's p2p path only; its other comm types are not verified with it
        return "cpbench read it in TE's p2p path only"

    def validate(self) -> None:
        a = self.attn
        if a.dtype == "fp32":
            raise UsageError("TransformerEngine's CP takes bf16 / fp16 only")
        heads_split = self.a2a_size()
        if heads_split < 1 or self.cp_size % heads_split:
            raise UsageError(f"the all-to-all size {heads_split} must divide the "
                             f"{self.cp_size} CP ranks")
        if heads_split > 1 and (a.heads % heads_split or a.num_kv_heads % heads_split):
            raise UsageError(f"heads {a.heads} and kv heads {a.num_kv_heads} must "
                             f"divide by the all-to-all size {heads_split} (TE does not "
                             f"replicate K/V heads)")
        super().validate()  # the layout: documents divisible by 2N (TE asserts it: .cu L102)
        te_kwargs(a, self.comm_type)  # what TE refuses for this comm type, before any collective

    @classmethod
    def unsupported_mask(cls, mask):
        why = super().unsupported_mask(mask)
        if why is None:
            return None
        cites = {"documents": "qkv_format thd: context_parallel.py L5021-5023",
                 "window": "sliding window: context_parallel.py L5054-5060"}
        return f"{why}: TransformerEngine refuses it for cp_comm_type {cls.comm_type} " \
               f"({'; '.join(cites[k] for k in sorted(mask.kinds - cls.masks))})"

    def a2a_size(self) -> int:
        return 1

    def group_lists(self):
        return {"cp": self.cp_lists}

    def cp_group_arg(self):
        return self.groups["cp"].pg

    def _module(self):
        import transformer_engine.pytorch as te

        init, forward = te_kwargs(self.attn, self.comm_type)
        dpa = te.DotProductAttention(**_for(te.DotProductAttention.__init__, init))
        self.forward_kwargs = _for(dpa.forward, _to_cuda(forward))
        self.stream = torch.cuda.Stream()
        dpa.set_context_parallel_group(self.cp_group_arg(), sorted(self.cp_lists[0]),
                                       self.stream, cp_comm_type=self.comm_type)
        return dpa

    def attention(self, q, k, v, sinks=None):
        assert sinks is None, "a problem with sinks is refused on construction (takes_sinks)"
        shape = q.shape
        if self.attn.documents:  # thd: (b, s_local, h, d) -> (t, h, d), rows in order
            q, k, v = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v))
        out = self.module(q, k, v, **self.forward_kwargs)
        out = out[0] if isinstance(out, tuple) else out
        return out.view(shape), None

    def schedule(self):
        no_schedule(self)


def _to_cuda(kwargs: dict) -> dict:
    """Tensors moved once, one copy per tensor: cu_seqlens and the padded ones stay the same
    object, which TE reads as "no padding between sequences" (DPA L1549-1556)."""
    moved: dict[int, torch.Tensor] = {}
    for v in kwargs.values():
        if isinstance(v, torch.Tensor) and id(v) not in moved:
            moved[id(v)] = v.to(torch.device("cuda", torch.cuda.current_device()))
    return {k: moved.get(id(v), v) if isinstance(v, torch.Tensor) else v
            for k, v in kwargs.items()}


def _for(fn, candidates: dict) -> dict:
    import inspect

    params = [p for p in inspect.signature(fn).parameters if p != "self"]
    return pick(candidates, params, what=getattr(fn, "__qualname__", str(fn)))


@register
class TeP2P(_TransformerEngine, comm_type="p2p", twin="megatron-cp"):
    name = "te-p2p"
    masks = frozenset({"documents"})


@register
class TeAllGather(_TransformerEngine, comm_type="all_gather", twin="llama3"):
    name = "te-all-gather"

    def twin_options(self) -> dict:
        # TE's all_gather: chunks r and 2N-1-r, every head gathered at once, dK/dV in the
        # activation dtype (context_parallel.py v2.18 L3252, L3766-3775, L4098-4121)
        return {"layout": "zigzag", "dkv_dtype": "activation",
                "heads_k_stride": self.attn.num_kv_heads}


@register
class TeA2A(_TransformerEngine, comm_type="a2a", twin="ulysses"):
    name = "te-a2a"

    def a2a_size(self) -> int:
        return self.cp_size


@register
class TeA2AP2P(_TransformerEngine, comm_type="a2a+p2p", twin="megatron-cp-a2a+p2p",
               note=": all-to-all inside a node, p2p ring across"):
    name = "te-a2a+p2p"
    masks = frozenset()

    @dataclass(frozen=True, kw_only=True)
    class Options:
        a2a_degree: int = a2a_degree_option()

    def a2a_size(self) -> int:
        return self.opts.a2a_degree or default_a2a_degree(self)

    def group_lists(self):
        level1, level2 = hierarchical_lists(self.cp_lists[0], self.a2a_size())
        return {"a2a": level1, "p2p": level2}

    def cp_group_arg(self):
        return [self.groups["a2a"].pg, self.groups["p2p"].pg]  # this order (CP L5017-5020)

    def resolved_options(self) -> dict:
        return {"a2a_degree": self.a2a_size(), "p2p_degree": self.cp_size // self.a2a_size()}

    def twin_options(self) -> dict:
        return self.resolved_options()
