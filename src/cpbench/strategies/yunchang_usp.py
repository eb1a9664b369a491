"""yunchang-usp: yunchang's own ``LongContextAttention`` (feifeibear/long-context-attention,
the ``yunchang`` package), run as it is: its process groups (``set_seq_parallel_pg``), its
Ulysses all-to-alls (q, k, v separately, then out; no lse), its ring implementations
(``RING_IMPL_DICT``: ``basic`` and ``zigzag``), flash-attn's interface beneath (on GPU
flash-attn, or where it is absent cpbench's implementation of it on torch's FA2 ops under
``--kernel sdpa``; on CPU cpbench's on the aten CPU flash kernel of ``sdpa-cpu``). yunchang
decides at import whether flash-attn exists (``yunchang.globals.HAS_FLASH_ATTN``), so the
interface is installed before yunchang is imported.

Options carry ``usp``'s names where the meaning is the same, so one command line sets both:
``--ulysses-degree`` (0: usp's default for this topology), ``--placement`` (head-first is
yunchang's ``use_ulysses_low=True``: Ulysses groups on consecutive ranks), ``--ring-impl`` with
yunchang's own values (``basic``, its default, and ``zigzag``).

Layout: yunchang's ``EXTRACT_FUNC_DICT`` helpers, as its tests shard inputs. ``zigzag`` is
keyed by (ring rank, Ulysses rank): chunks r and 2R-1-r of the ring's 2R, cut in u, piece u.
``basic`` gives rank r the r-th contiguous S/N chunk, which is the right layout only with
head-first groups (under ring-first a Ulysses group is strided ranks and the gathered tokens
are not contiguous), so basic with ring-first is refused rather than run wrong.

Checked: out, dq, dk, dv. ``LongContextAttention`` returns no lse (it drops the ring's).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from cpbench import ranklocal
from cpbench.errors import UsageError
from cpbench.strategies import register
from cpbench.strategies._upstream import (
    FLASH_KERNELS,
    check_flash_kernel,
    device_of,
    flash_attn_beneath,
    no_schedule,
    unsupported_dtype,
)
from cpbench.strategies.base import Strategy, Upstream, option
from cpbench.strategies.layout import check_divisible, contiguous_index, zigzag_index
from cpbench.strategies.usp import placement_option, ulysses_degree_option
from cpbench.topology import (
    HEAD_FIRST,
    RING_FIRST,
    cached_group,
    group_of,
    node_local_block,
    usp_default_degree,
    usp_mesh,
)

RING_IMPLS = ("basic", "zigzag")


@contextlib.contextmanager
def _cached_groups(seconds: float | None):
    """yunchang creates its groups with ``torch.distributed.new_group(ranks)`` at every
    ``set_seq_parallel_pg``, i.e. at every build: new communicators per case, piling up, and
    with torch's default timeout (30 min on gloo), not the case's. While it runs, its
    ``new_group`` goes through cpbench's group cache (``topology.cached_group``): made once
    per member list, reused by later builds, under the per-case timeout like cpbench's own.
    The patch is this rank's (``ranklocal.patch``: ranks as threads patch their own)."""
    import torch.distributed as dist

    calls = iter(range(1 << 30))

    def make(original):
        def new_group(ranks=None, *args, **kwargs):
            if args or set(kwargs) - {"timeout"}:  # not the call yunchang makes: leave it be
                return original(ranks, *args, **kwargs)
            # keyed by the call's place too: its Ulysses and ring groups never share one
            return cached_group(f"yunchang/{next(calls)}", ranks, seconds, original)

        return new_group

    with ranklocal.patch((dist,), "new_group", make):
        yield


def _groups_per_rank() -> None:
    """yunchang keeps its groups in a process-wide singleton (``yunchang.globals.
    PROCESS_GROUP``), read by ``LongContextAttention()``: made per rank (``ranklocal``), so
    ranks run as threads each build with their own groups; one rank per process sees what
    it always saw."""
    from yunchang.globals import PROCESS_GROUP

    holder = type(PROCESS_GROUP)
    if isinstance(holder.__dict__.get("RING_PG"), property):
        return
    for name in ("ULYSSES_PG", "RING_PG"):
        def get(_self, name=name):
            return ranklocal.slot("yunchang.groups", dict).get(name)

        def put(_self, value, name=name):
            ranklocal.slot("yunchang.groups", dict)[name] = value

        setattr(holder, name, property(get, put))


@register
class YunchangUsp(Strategy):
    name = "yunchang-usp"
    description = ("yunchang's LongContextAttention: Ulysses all-to-all x its ring "
                   "(the library's own code)")
    returns_lse = False
    upstream = Upstream("yunchang", "yunchang", twin="usp")
    accepted_kernels = FLASH_KERNELS
    no_v_head_dim = "its ring is ring-flash-attn's (flash-attn 2)"

    @dataclass(frozen=True, kw_only=True)
    class Options:
        ulysses_degree: int = ulysses_degree_option()
        placement: str = placement_option()
        ring_impl: str = option("basic", "yunchang's ring (RING_IMPL_DICT)", RING_IMPLS)

    @classmethod
    def variants(cls, topo):
        n = topo.world_size
        u_node = node_local_block(topo, [list(range(n))])
        out = [cls.Options(), cls.Options(ring_impl="zigzag")]
        if 1 < u_node < n:  # a real 2-D mesh: ring-first differs (basic cannot run it)
            out.append(cls.Options(ring_impl="zigzag", placement=RING_FIRST))
        return out

    def __init__(self, *args, create_groups: bool = True, **kwargs):
        super().__init__(*args, create_groups=create_groups, **kwargs)
        self.beneath = self.layer = None
        if create_groups:
            self.beneath = flash_attn_beneath(self.kernel)
            self.layer = self._layer()

    def validate(self) -> None:
        check_flash_kernel(self)
        unsupported_dtype(self)
        a, n, o = self.attn, self.cp_size, self.opts
        u = o.ulysses_degree or usp_default_degree(
            self.topo, self.cp_lists, math.gcd(a.heads, a.num_kv_heads), o.placement)
        if u < 1 or n % u or a.heads % u or a.num_kv_heads % u:
            raise UsageError(f"ulysses degree {u} must divide the {n} ranks, the "
                             f"{a.heads} heads and the {a.num_kv_heads} kv heads (yunchang "
                             f"does not replicate K/V heads); give --ulysses-degree")
        if o.ring_impl == "zigzag" and not a.causal:
            raise UsageError("--ring-impl zigzag is causal only (yunchang asserts "
                             "it); use --ring-impl basic")
        if o.ring_impl == "basic" and o.placement == RING_FIRST and u not in (1, n):
            raise UsageError("--ring-impl basic with ring-first: yunchang's basic "
                             "layout is right only with head-first groups; use head-first "
                             "or --ring-impl zigzag")
        if u == n and device_of(self.kernel) == "cpu":
            raise UsageError(f"a ring of one rank: yunchang's ring still "
                             f"sends to the rank itself, which gloo cannot; on CPU give "
                             f"--ulysses-degree below {n}")
        check_divisible(a.seqlen, 2 * n if o.ring_impl == "zigzag" else n,
                        f"{self.name} {o.ring_impl} over {n} ranks")
        self.ulysses_degree, self.ring_degree = u, n // u
        self.ulysses_lists, self.ring_lists = usp_mesh(n, u, o.placement)

    def group_lists(self):
        return {}  # yunchang creates its own (set_seq_parallel_pg)

    def _layer(self):
        import yunchang
        from yunchang import globals as yunchang_globals

        if not yunchang_globals.HAS_FLASH_ATTN:  # decided once, at its first import
            raise UsageError("yunchang was imported in this process before flash-attn's "
                             "interface was installed, so it runs without flash-attn; start "
                             "cpbench afresh (the strategy installs it before importing "
                             "yunchang)")
        _groups_per_rank()
        with _cached_groups(self.topo.group_timeout_s):
            yunchang.set_seq_parallel_pg(self.ulysses_degree, self.ring_degree, self.rank,
                                         self.world_size,
                                         use_ulysses_low=self.opts.placement == HEAD_FIRST)
        return yunchang.LongContextAttention(ring_impl_type=self.opts.ring_impl)

    def seq_index(self, rank: int) -> torch.Tensor:
        uly, ring = group_of(rank, self.ulysses_lists), group_of(rank, self.ring_lists)
        s, u, r = self.attn.seqlen, len(uly), len(ring)
        if self.opts.ring_impl == "basic":  # basic_extract_local: the rank-th of N chunks
            return contiguous_index(s, self.world_size, rank)
        return zigzag_index(s, r, ring.index(rank)).chunk(u)[uly.index(rank)]

    def attention(self, q, k, v, sinks=None):
        assert sinks is None, "a problem with sinks is refused on construction (takes_sinks)"
        out = self.layer(q, k, v, softmax_scale=self.attn.softmax_scale,
                         causal=self.attn.causal)
        return out, None

    def resolved_options(self) -> dict:
        return {"ulysses_degree": self.ulysses_degree, "ring_degree": self.ring_degree,
                "placement": self.opts.placement, "ring_impl": self.opts.ring_impl}

    def twin_options(self) -> dict:
        """usp with the same mesh and placement, over the same ring (basic is usp's ring)."""
        return {"ulysses_degree": self.ulysses_degree, "placement": self.opts.placement,
                "ring_impl": "ring" if self.opts.ring_impl == "basic" else "zigzag"}

    def provenance(self) -> dict:
        return {**(super().provenance() or {}), "flash_attn": self.beneath}

    def schedule(self):
        no_schedule(self)
