"""usp: Unified Sequence Parallelism, a ulysses_degree × ring_degree mesh (yunchang's
LongContextAttention, arXiv 2405.07719).

Ulysses alone cannot use more ranks than heads and its all-to-alls are slow across nodes;
ring attention alone sends K/V N-1 times. USP does both: an all-to-all inside each Ulysses
group (u ranks) turns sequence shards into head shards (heads/u heads, u times the tokens),
a registered ring strategy (``ring_impl``, looked up by name and constructed on the ring
groups with heads/u heads) runs over the R = N/u ring positions, and a second all-to-all
returns out (the lse too, for a check) to the sequence layout. Backward is the reverse, the ring
strategy's own backward in the middle. K/V heads are replicated as in ``ulysses`` when
fewer than u.

``placement`` (topology.usp_mesh): head-first makes Ulysses groups consecutive ranks, so with
u <= ranks per node the all-to-alls stay inside a node and the ring crosses nodes;
ring-first makes ring groups consecutive, keeping the ring inside a node and sending the
all-to-alls across nodes.

Layout: every member of a Ulysses group has the same ring position p, and after the
all-to-all together they must hold exactly the ring strategy's token set for p in its order.
So a rank holds that set (ring_impl's seq_index of its ring position, S/R tokens) cut into u
contiguous pieces, the piece of its Ulysses position. It is keyed by (ring position,
Ulysses position), never by global rank: yunchang's "basic" layout gives rank r the r-th
contiguous S/N chunk, which is right only under head-first; under ring-first a Ulysses group
is strided ranks (0, R, 2R, ...), so its gathered tokens are not one contiguous block and
the ring's causal masking is wrong. (Its zigzag layout is keyed like this one.)

u = N leaves a ring of one rank: the kernel runs directly, exactly as ``ulysses``.

``--ring-window`` hands ``--ring-impl double-ring`` its window (ranks per inner ring of each
ring group; 0: its default, the ring group's ranks in a node).

``--burstengine-dkv-hop`` runs USP as BurstEngine's ``evaluation/kernel_bench/
benchmark_doublering.py`` ran it (docs/upstream/burstengine_usp.md): its ring is InternEvo's
double ring as one window over the whole ring group (the benchmark passes the ring group as
the inner, outer and both dK/dV groups, L158-162), and after the window the backward makes
one more dK/dV hop (InternEvo's hop to the next window, L410-414 of its copy of
``zigzag_ring_flash_attn_with_sliding_window.py``), in the activation dtype, on the dK/dV
group, awaited at once. With one window that hop goes to the ring successor, not to the rank
itself, so each rank ends with its ring predecessor's dK and dV: ``--check`` FAILS on dk and
dv. Reproduced as upstream ran it, defect included; off by default.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from cpbench import strategies
from cpbench.comm import RingComm
from cpbench.errors import Skipped, UsageError
from cpbench.strategies import register
from cpbench.strategies._rings import send_block
from cpbench.strategies.base import BWD, FWD, Message, Step, Strategy, option
from cpbench.strategies.layout import check_divisible, contiguous_index
from cpbench.strategies.ulysses import (
    head_layout_bytes,
    kv_replicas,
    local_attention,
    ulysses_attention,
    ulysses_messages,
    ulysses_tiles,
)
from cpbench.topology import (
    HEAD_FIRST,
    PLACEMENTS,
    RING_FIRST,
    divisors,
    group_of,
    node_local_block,
    usp_default_degree,
    usp_mesh,
)

RING_IMPLS = ("zigzag", "ring", "double-ring")


def ulysses_degree_option():
    """The mesh options usp and yunchang-usp share (one flag sets both)."""
    return option(0, "ranks per Ulysses group (the rest is ring); 0: the dimension placed "
                  "first fills a node (head-first: Ulysses groups, ring-first: rings)")


def placement_option():
    return option(HEAD_FIRST, "which groups are consecutive ranks (stay in a node)",
                  PLACEMENTS)


class _DkvHop(torch.autograd.Function):
    """BurstEngine's hop after its one window (its InternEvo copy L410-414): the identity
    forward; in backward the ring strategy's dK and dV go to the next rank of the dK/dV
    group (one message each, one batch) and what the previous rank sent takes their place,
    awaited at once (L414)."""

    @staticmethod
    def forward(ctx, group, k, v):
        ctx.group = group
        return k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dk, dv):
        comm = RingComm(ctx.group)
        got = send_block(comm, (dk, dv))
        comm.wait()
        return None, *got


@register
class Usp(Strategy):
    name = "usp"
    masks = frozenset({"documents", "window"})  # through its ring (any ring_impl) or kernel
    takes_sinks = True  # its heads' sinks, added by its ring (every ring_impl) or kernel
    description = ("ulysses all-to-all inside groups of u ranks × a ring strategy over N/u "
                   "ring positions (yunchang LongContextAttention)")

    @dataclass(frozen=True, kw_only=True)
    class Options:
        ulysses_degree: int = ulysses_degree_option()
        placement: str = placement_option()
        ring_impl: str = option("zigzag", "ring strategy run over the ring groups", RING_IMPLS)
        ring_window: int = option(0, "with --ring-impl double-ring: ranks per inner ring of "
                                  "each ring group; 0: double-ring's default (the ring "
                                  "group's ranks in a node)")
        burstengine_dkv_hop: bool = option(
            False, "USP as BurstEngine's benchmark_doublering.py ran it (with --ring-impl "
            "double-ring): one window over the ring group, then one more dK/dV hop, exposed; "
            "it hands each rank its ring predecessor's dK/dV, so --check FAILS "
            "(upstream's defect, reproduced: docs/upstream/burstengine_usp.md)")

    def __init__(self, *args, create_groups: bool = True, **kwargs):
        super().__init__(*args, create_groups=create_groups, **kwargs)  # validate() plans
        # after our "ulysses" groups, so every rank creates groups in the same order
        self.ring = self._ring_strategy(create_groups=create_groups)
        if self.ring is not None:
            self.groups.update(self.ring.groups)

    @classmethod
    def variants(cls, topo):
        n = topo.world_size
        u_node = node_local_block(topo, [list(range(n))])
        out = [cls.Options()]
        if 1 < u_node < n:  # a real 2-D mesh: the two placements differ
            out.append(cls.Options(placement=RING_FIRST))
        # pure ring and pure Ulysses (the latter only where heads allow)
        out += [cls.Options(ulysses_degree=d) for d in (1, n) if d != u_node]
        # a smaller head split leaves several ring members per node: double-ring's case
        # (LoongTrain's 2-D attention)
        smaller = [d for d in divisors(u_node) if 1 < d < u_node]
        if smaller:
            out.append(cls.Options(ulysses_degree=smaller[0], ring_impl="double-ring"))
        return out

    # -- the mesh ----------------------------------------------------------------------------

    def default_ulysses_degree(self, placement: str = HEAD_FIRST) -> int:
        """Whichever dimension is placed first fills the node (as InternEvo, yunchang and
        BurstEngine mean the placements): head-first, the largest Ulysses degree dividing the
        heads whose consecutive groups stay in a node; ring-first, the largest ring whose
        consecutive groups stay in a node (on 4 nodes × 8: a ring of 8 inside each node,
        Ulysses 4 across), the Ulysses degree the rest, where it divides the heads."""
        return usp_default_degree(self.topo, self.cp_lists, self.attn.heads, placement)

    def _plan(self) -> tuple[int, str, str]:
        """(ulysses degree, placement, ring impl); the a2a+p2p alias fixes the last two."""
        o = self.opts
        return (o.ulysses_degree or self.default_ulysses_degree(o.placement), o.placement,
                o.ring_impl)

    def held_bytes(self) -> int:
        return 0 if self.ring is None else self.ring.held_bytes()

    def accumulator_bytes(self, phase: str) -> int:
        ring = 0 if self.ring is None else self.ring.accumulator_bytes(phase)
        return ring + (head_layout_bytes(self, phase, self.replicas)
                       if self.ulysses_degree > 1 else 0)

    def receives_in_place(self, phase: str) -> bool:
        return self.ring is not None and self.ring.receives_in_place(phase)

    def late_accumulator_bytes(self, phase: str) -> int:
        return 0 if self.ring is None else self.ring.late_accumulator_bytes(phase)

    def merges(self) -> bool:
        return self.ring is not None  # no ring: Ulysses' one call, nothing to merge

    def kernel_head_share(self) -> float:
        return 1 / self.ulysses_degree

    def kernel_gqa(self) -> int:
        # K/V heads replicated when fewer than ranks: fewer query heads share each
        return max(1, self.attn.heads // (self.attn.num_kv_heads * self.replicas))

    def finish_bytes(self, phase: str) -> int:
        return 0 if self.ring is None else self.ring.finish_bytes(phase)

    def resolved_options(self) -> dict:
        resolved = {"ulysses_degree": self.ulysses_degree, "ring_degree": self.ring_degree,
                    "placement": self.placement, "ring_impl": self.ring_impl}
        ring = self.ring.resolved_options() if self.ring is not None else {}
        if ring != (dataclasses.asdict(type(self.ring.opts)()) if self.ring else {}):
            resolved["ring_options"] = ring  # what the ring resolved: double-ring's window
        return resolved

    def pad_multiples(self) -> tuple[int, int]:
        """The ring strategy's multiples over the R ring positions, the sequence also a
        multiple of N: a ring position's tokens are cut in u pieces."""
        u, _, impl = self._plan()
        n = self.cp_size
        if u < 1 or n % u or n == u:
            return 1, n
        ring = strategies.get(impl)
        doc, seq = ring.layout_multiples(n // u, ring.Options())
        return doc, math.lcm(seq, n)

    def validate(self) -> None:
        a, n = self.attn, self.cp_size
        self.ulysses_degree, self.placement, self.ring_impl = self._plan()
        u = self.ulysses_degree
        if u < 1 or n % u or a.heads % u:
            *most, last = [str(d) for d in divisors(n) if a.heads % d == 0]
            ok = f"{', '.join(most)} or {last}" if most else last
            raise UsageError(f"{self.name}: ulysses degree {u} must divide {n} ranks and "
                             f"{a.heads} heads; these do: {ok}")
        self.ring_degree = n // u
        check_divisible(a.seqlen, n, f"{self.name} {u}x{self.ring_degree} "
                        f"(S/{self.ring_degree} tokens per ring position cut in {u})")
        # the mesh of each CP list, by position in it, mapped back to ranks
        uly_pos, ring_pos = usp_mesh(n, u, self.placement)
        self.ulysses_lists = [[cp[i] for i in g] for cp in self.cp_lists for g in uly_pos]
        self.ring_lists = [[cp[i] for i in g] for cp in self.cp_lists for g in ring_pos]
        self.replicas = kv_replicas(a.num_kv_heads, u)
        self._check_ring_options()
        if self.ring_degree > 1 and not self.mask.plain:
            why = strategies.get(self.ring_impl).unsupported_mask(self.mask)
            if why:
                raise Skipped(f"usp with --ring-impl {self.ring_impl}: {why}")
        self._ring_strategy(create_groups=False)  # the ring strategy validates its part

    def _check_ring_options(self) -> None:
        """--ring-window and --burstengine-dkv-hop: both set up a double ring. Sets
        ``ring_window`` (0: double-ring's default) and ``burstengine_hop``."""
        # megatron-cp-a2a+p2p (a subclass) takes neither
        window = getattr(self.opts, "ring_window", 0)
        self.burstengine_hop = getattr(self.opts, "burstengine_dkv_hop", False)
        if (window or self.burstengine_hop) and self.ring_impl != "double-ring":
            given = "--ring-window" if window else "--burstengine-dkv-hop"
            raise UsageError(f"{self.name} {given} sets up the double ring: add --ring-impl "
                             f"double-ring (not {self.ring_impl})")
        r = self.ring_degree
        if r == 1 and window >= 0:  # no ring, no window (a sweep's window leaves u = N be)
            self.ring_window = 0
            return
        if window < 0 or (window and r % window):
            raise UsageError(f"{self.name} --ring-window {window} does not divide its ring of "
                             f"{r} ranks; use one of: {', '.join(map(str, divisors(r)))} (0: "
                             f"the ring group's ranks in a node)")
        if self.burstengine_hop and window not in (0, r):
            raise UsageError(f"{self.name} --burstengine-dkv-hop runs the double ring as "
                             f"BurstEngine did, one window over the ring of {r}: drop "
                             f"--ring-window or give {r}")
        self.ring_window = r if self.burstengine_hop else window

    def _ring_strategy(self, *, create_groups: bool) -> Strategy | None:
        """The ring strategy (its default options, double-ring's window from
        ``ring_window``) on the ring groups, for this rank's heads/u (and K/V heads/u after
        replication). None for a ring of one rank."""
        if self.ring_degree == 1:
            return None
        a, u = self.attn, self.ulysses_degree
        ring_attn = dataclasses.replace(a, heads=a.heads // u,
                                        kv_heads=a.num_kv_heads * self.replicas // u)
        cls = strategies.get(self.ring_impl)
        opts = cls.Options(window=self.ring_window) if self.ring_impl == "double-ring" else None
        return cls(ring_attn, self.topo, self.rank, kernel=self.kernel, options=opts,
                   create_groups=create_groups, cp_lists=self.ring_lists)

    def group_lists(self):
        return {"ulysses": self.ulysses_lists}  # the ring strategy creates its own

    def seq_index(self, rank: int) -> torch.Tensor:
        uly = group_of(rank, self.ulysses_lists)
        if self.ring is None:
            return contiguous_index(self.attn.seqlen, len(uly), uly.index(rank))
        # members of a Ulysses group share a ring position (a mesh invariant)
        assert len({self.ring.cp_index(r) for r in uly}) == 1
        ring_set = self.ring.seq_index(rank)
        return ring_set.chunk(len(uly))[uly.index(rank)]

    def _ring_set(self, rank: int) -> torch.Tensor:
        """The tokens ``rank``'s Ulysses group holds together after the all-to-all."""
        if self.ring is None:
            return torch.arange(self.attn.seqlen)
        return self.ring.seq_index(rank)

    def area_per_rank(self) -> list[int]:
        return [self._area(r) for r in range(self.world_size)]

    def _area(self, rank: int) -> int:
        # after the all-to-all a rank computes its group's token set on heads/u of the heads
        every = torch.arange(self.attn.seqlen)
        return self.mask.pairs(self._ring_set(rank), every) // self.ulysses_degree

    def area_per_step(self) -> list[list[int]] | None:
        steps = None if self.ring is None else self.ring.area_per_step()
        return None if steps is None else [[a // self.ulysses_degree for a in row]
                                           for row in steps]

    # -- the algorithm -----------------------------------------------------------------------

    def attention(self, q, k, v, sinks=None):
        if self.ring is None:
            inner = local_attention(self)
        else:
            inner = self._ring_then_hop if self.burstengine_hop else self.ring.attention
        return ulysses_attention(q, k, v, self.groups["ulysses"], inner, self.replicas,
                                 self.need_lse, sinks)

    def _ring_then_hop(self, q, k, v, sinks=None):
        """The double ring, whose backward is followed by BurstEngine's extra dK/dV hop on
        the ring's own dK/dV group (upstream passes that group as both dK/dV groups)."""
        assert self.ring is not None
        k, v = _DkvHop.apply(self.groups["inner_dkv"], k, v)
        return self.ring.attention(q, k, v, sinks)

    def _hop_messages(self) -> tuple[Message, ...]:
        """``_DkvHop``'s dK and dV, in the activation dtype (upstream's window returns them
        cast, L281), awaited at once (L414)."""
        assert self.ring is not None
        g = self.groups["inner_dkv"]
        s = self.ring.local_seqlen
        return tuple(Message("p2p", g.name, n, g.crosses_nodes, overlapped=False)
                     for n in (self.ring.k_bytes(s), self.ring.v_bytes(s)))

    def schedule(self) -> list[Step]:
        g = self.groups["ulysses"]
        a = self.attn
        msgs = ulysses_messages(self, g, a.seqlen // self.cp_size, a.num_kv_heads * self.replicas)
        if self.ring is None and not self.mask.plain:
            area = self._area(self.rank)
            tiles = ulysses_tiles(self)
            inner = [self.pairs_step(p, 0, area, (a.seqlen, a.seqlen), (), tiles)
                     for p in (FWD, BWD)]
        elif self.ring is None:
            inner = [self.kernel_step(p, 0, a.seqlen, a.seqlen, a.causal, head_share=g.size)
                     for p in (FWD, BWD)]
        else:
            inner = self.ring.schedule()  # its FLOPs already count heads/u heads
            if self.burstengine_hop:  # after the ring's last backward step, nothing to hide it
                inner.append(Step(BWD, 0, 0.0, self._hop_messages()))
        steps = []
        for phase in (FWD, BWD):
            # all-to-all, the ring strategy's steps, all-to-all (none when u = 1)
            seq = [s for s in inner if s.phase == phase]
            if msgs[f"{phase}_in"]:
                seq = [Step(phase, 0, 0.0, msgs[f"{phase}_in"]), *seq,
                       Step(phase, 0, 0.0, msgs[f"{phase}_out"])]
            steps += [dataclasses.replace(s, index=i) for i, s in enumerate(seq)]
        return steps
