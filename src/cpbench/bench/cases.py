"""Which cases a ``cpbench run`` request runs (``bench.plan`` validates the rest).

The strategies named (``all``: every one), each with the variants it suggests for the topology
and the options given; then each variant built on every rank without groups (pure) to see
whether the config allows it and a rank's shard fits. Variants a strategy merely suggests (and,
under ``all``, whole strategies: a library not installed, a device it does not run on, a
config it refuses) that cannot run are skipped with a one-line note; a strategy asked for by
name with no runnable variant is an error.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from cpbench import metrics, strategies
from cpbench.bench import memory
from cpbench.config import AttentionConfig, flag
from cpbench.errors import Skipped, UsageError
from cpbench.kernels import masked_varlen
from cpbench.mask import mask_of, size_text
from cpbench.strategies._upstream import case_kernel
from cpbench.topology import Topology


@dataclass(frozen=True)
class Case:
    """One row: a strategy and one set of its options."""

    strategy: str
    options: Any
    kernel: str | None = None  # None: the plan's (else see strategies._upstream.case_kernel)
    packing: int | None = None  # under --packings K: which packing (Plan.packed) it runs
    round: int | None = None  # under --rounds K: which round (0-based) times it

    @property
    def label(self) -> str:
        """The strategy and the options it runs with that differ from its defaults (a line
        per case fits a terminal; the record keeps every option)."""
        default = type(self.options)()
        fields = {f.name: getattr(self.options, f.name)
                  for f in dataclasses.fields(self.options)
                  if getattr(self.options, f.name) != getattr(default, f.name)}
        text = f"{self.strategy} ({', '.join(f'{k}={v}' for k, v in fields.items())})" \
            if fields else self.strategy
        text = text if self.packing is None else f"{text} [packing {self.packing}]"
        return text if self.round is None else f"{text} [round {self.round}]"


def expand_cases(names: tuple[str, ...], given: dict, topo: Topology) -> list[Case]:
    if "all" in names:
        names = tuple(sorted(strategies.names()))
    classes = [strategies.get(n) for n in dict.fromkeys(names)]  # unknown → lists the names
    takes = {cls.name: {f.name for f in dataclasses.fields(cls.Options)} for cls in classes}
    for opt in given:
        if not any(opt in t for t in takes.values()):
            if len(classes) == 1:
                strategies.make_options(classes[0], given)  # raises, naming what it takes
            owners = [n for n in strategies.names()
                      if opt in {f.name for f in dataclasses.fields(strategies.get(n).Options)}]
            raise UsageError(f"no selected strategy takes {flag(opt)} (it is an option of "
                             f"{', '.join(owners) or 'no strategy'}); drop it or add one "
                             f"of those to --strategy")
    cases = []
    for cls in classes:
        mine = {k: v for k, v in given.items() if k in takes[cls.name]}
        strategies.make_options(cls, mine)  # checks choices
        variants = [dataclasses.replace(v, **mine) for v in cls.variants(topo)]
        cases += [Case(cls.name, v) for v in dict.fromkeys(variants)]
    return cases


def _no_masked_kernel(cls, attn: AttentionConfig, backend, device: str) -> str | None:
    """Why cpbench's own strategies cannot run this mask with ``backend`` on ``device``
    (masked blocks off the CPU run as varlen calls; adapters bring their own kernels)."""
    if cls.upstream is not None or mask_of(attn).plain:
        return None
    return masked_varlen.device_refusal(backend, device)


class Unavailable(UsageError):
    """A strategy this machine cannot run at all (its library missing, the wrong device):
    under ``all`` a skipped line, never the reason given when only a baseline would run."""


def _validate_case(case: Case, attn: AttentionConfig, topo: Topology, backend, device: str,
                   capacity: int | None, threads: bool = False) -> Any:
    """Build the strategy on every rank without groups (pure) and check that a rank's shard
    can fit in ``capacity`` bytes; returns rank 0's instance. ``threads``: ranks as threads
    of one process (--launcher threads)."""
    cls = strategies.get(case.strategy)
    why = cls.unavailable(device) or (threads and cls.no_threads)
    if why:
        raise Unavailable(f"{case.strategy} cannot run here: {why}")
    if cls.causal_only and not attn.causal:
        raise UsageError(f"{case.strategy} only runs causal attention; drop --no-causal")
    why = cls.unsupported_mask(mask_of(attn)) or _no_masked_kernel(cls, attn, backend, device)
    if why:
        raise Skipped(f"{case.label}: {why}")
    try:
        built = [cls(attn, topo, r, kernel=backend, options=case.options, create_groups=False)
                 for r in range(topo.world_size)]
    except UsageError as e:  # named once: the message may start with the strategy's name
        raise type(e)(str(e) if str(e).startswith(f"{case.strategy} ")
                      else f"{case.label}: {e}") from None
    strat = built[0]
    need = memory.step_lower_bound(local_seqlen=max(b.local_seqlen for b in built),
                                   **shape(attn))
    if capacity is not None and need > capacity:
        fix = "lower --seqlen" + (
            " or add ranks" if strat.ranks_per_problem > 1 else " (it holds all S each rank)")
        raise UsageError(
            f"{case.label} at {size_text(attn.seqlen)} needs >= {metrics.gib(need)} a rank for its "
            f"tensors, {metrics.gib(capacity)} here; {fix}")
    return strat


def shape(attn: AttentionConfig) -> dict:
    return dict(batch=attn.batch, heads=attn.heads, kv_heads=attn.num_kv_heads,
                head_dim=attn.head_dim, element_size=attn.element_size,
                v_head_dim=attn.v_head_dim)


def runnable(cases: list[Case], names: tuple[str, ...], attn: AttentionConfig,
             topo: Topology, backend, device: str, capacity: int | None, *,
             auto: bool = False, elsewhere: bool = False, threads: bool = False
             ) -> tuple[list, list[str]]:
    """The cases the config allows, each with rank 0's strategy, and why the others are left
    out. ``auto``: the kernel was auto's pick, which a library's strategy may run on its own
    kernel instead (see ``case_kernel``; ``elsewhere`` as for ``bench.plan._kernel``). Variants a
    strategy merely suggests (and, under ``all``, whole strategies) that cannot run this
    config or cannot fit are skipped; a strategy asked for by name with no runnable variant
    is an error, and so is nothing runnable but a no-CP baseline. ``threads``: ranks as
    threads (a strategy's ``no_threads`` says why it cannot run so)."""
    first_error: dict[str, UsageError]  # strategy name -> why its first variant cannot run
    built, skipped, first_error, first_skip = [], [], {}, None
    for case in cases:
        mine, note = case_kernel(strategies.get(case.strategy), backend,
                                 request(attn, device), auto=auto, elsewhere=elsewhere)
        if mine is not backend:
            case = dataclasses.replace(case, kernel=mine.name)
        try:
            built.append((case, _validate_case(case, attn, topo, mine, device, capacity,
                                               threads)))
            skipped += [note] if note and note not in skipped else []
        except Skipped as e:  # skipped even when named: the others still answer
            skipped.append(str(e))
            first_skip = first_skip or e
        except UsageError as e:
            if str(e) not in skipped:  # once per strategy, not per variant (a missing library)
                skipped.append(str(e))
            first_error.setdefault(case.strategy, e)
    ran = {case.strategy for case, _ in built}
    for name in names:
        if name != "all" and name not in ran and name in first_error:
            raise first_error[name]
    # a baseline alone compares with nothing: say what keeps the CP strategies out, where the
    # config could change it (not a library this machine lacks; at one rank none is CP)
    fixable = [e for e in first_error.values() if not isinstance(e, Unavailable)]
    if fixable and topo.world_size > 1 and \
            not any(strat.ranks_per_problem > 1 for _, strat in built):
        raise fixable[0]
    if not built:
        raise next(iter(first_error.values()), None) or first_skip or UsageError(
            "no case to run")
    return built, skipped


def request(attn: AttentionConfig, device: str) -> dict:
    """What a kernel backend is asked to run (KernelBackend.unsupported_reason's fields)."""
    return dict(device=device, dtype=attn.torch_dtype, head_dim=attn.head_dim,
                heads=attn.heads, kv_heads=attn.num_kv_heads, v_head_dim=attn.v_head_dim)
