"""Reading and validating a sweep config: every case expanded, typed and planned before
anything runs; every error listed at once, each with the case it came from."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import yaml

from cpbench import models, strategies
from cpbench.bench import plan as planning
from cpbench.config import (
    GPU_ATTENTION,
    GPU_ITERS,
    AttentionConfig,
    RunConfig,
    resolved_documents,
)
from cpbench.errors import UsageError, did_you_mean
from cpbench.mask import parse_size
from cpbench.settings import Setting, attention_settings, run_settings, split

TOP_KEYS = ("topology", "timeout", "base", "sweep", "cases", "description")
# settings of the sweep itself, not passed to `cpbench run`; the two protocols set seqlen:
# tokens_per_rank (weak scaling: S = tokens × CP ranks, MagiAttention's 8K-per-GPU curves),
# total_tokens (a fixed token budget split as batch × S: S = total / batch)
# model: a --model preset (cpbench.models), its fields under the case's own
SWEEP_ONLY = ("timeout", "tokens_per_rank", "total_tokens", "model")
PROTOCOLS = ("tokens_per_rank", "total_tokens")
RESERVED = ("out",)  # the sweep sets these


class SweepError(UsageError):
    """A sweep config that cannot run; ``errors`` lists every problem found."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__(f"{len(errors)} error(s) in the sweep config:\n  " + "\n  ".join(errors))


@dataclass(frozen=True)
class SweepCase:
    index: int  # 1-based, in run order
    settings: dict  # `cpbench run` settings (typed), timeout excluded
    label: str  # the settings that differ from base
    timeout: float | None
    plan: planning.Plan
    keys: tuple[str, ...] = ()  # results.record_key of every row the plan expects


@dataclass(frozen=True)
class Sweep:
    path: str
    cases: tuple[SweepCase, ...]
    nodes: int | None  # None: local --nproc ranks
    gpus_per_node: int | None


def settings_by_name() -> dict[str, Setting]:
    """Every setting a case may give: `cpbench run`'s flags, strategy options included."""
    found = {s.name: s for s in [*attention_settings(), *run_settings()]}
    for name, owners in strategies.option_settings().items():
        found.setdefault(name, owners[0][1])
    return found


def _check_keys(where: str, mapping, allowed: dict, errors: list[str]) -> dict:
    if not isinstance(mapping, dict):
        errors.append(f"{where}: expected a mapping of settings, got {type(mapping).__name__}")
        return {}
    good = {}
    for k, v in mapping.items():
        name = str(k).replace("-", "_")
        if name in RESERVED:
            errors.append(f"{where}: {name!r} is set by `cpbench sweep` (use --out); drop it")
        elif name not in allowed and name not in SWEEP_ONLY:
            errors.append(f"{where}: unknown setting {k!r}"
                          + did_you_mean(name, [*allowed, *SWEEP_ONLY])
                          + "; settings are `cpbench run` flags, e.g. seqlen, strategy")
        else:
            good[name] = v
    return good


def _label(settings: dict, base: dict) -> str:
    diff = {k: v for k, v in settings.items() if k not in base or base[k] != v}
    return " ".join(f"{k}={v}" for k, v in diff.items()) or "base"


def _refused(build, fields: dict) -> list[str]:
    """Every value of ``fields`` that ``build`` (a config's constructor) refuses, one message
    each: a config raises at the first bad field, so each value that fails alone (defaults
    around it) and still fails beside the case's other values is named; a combination with no
    single culprit, as the config says it."""
    def error(given: dict) -> str | None:
        try:
            build(given)
        except UsageError as e:
            return " ".join(str(e).split())
        return None

    whole = error(fields)
    if whole is None:
        return []
    alone = [k for k in fields if error({k: fields[k]}) is not None]
    found = [error({j: v for j, v in fields.items() if j == k or j not in alone}) for k in alone]
    found.append(error({j: v for j, v in fields.items() if j not in alone}))  # the rest
    return list(dict.fromkeys(m for m in found if m is not None)) or [whole]


def _value_errors(settings: dict) -> list[str]:
    """Every bad value of a case that needs no plan to see: unknown strategy names, and what
    RunConfig and AttentionConfig refuse (each checks its fields in turn: the plan would stop
    at the first)."""
    fields, attention, _ = split(settings)
    errors = []
    for name in settings.get("strategy", ()):
        if name != "all":
            try:
                strategies.get(name)
            except UsageError as e:
                errors.append(str(e))
    errors += _refused(lambda f: RunConfig(**f, out="none"), fields)
    errors += _refused(lambda f: AttentionConfig(**resolved_documents(f, 0)), attention)
    return errors


def _plan(settings: dict, topology: tuple | None) -> planning.Plan:
    fields, attention, options = split(settings)
    run = RunConfig(**fields, out="none")
    if topology is None:
        return planning.plan(run, attention, options, launcher="self")
    # planned as its torchrun job would be; what fits is decided where it runs (each launch
    # plans again there), not against this host's memory
    return planning.plan(run, attention, options, launcher="torchrun",
                         job=(topology[0] * topology[1], topology[1]))


def _topology(doc: dict, errors: list[str]) -> tuple[int, int] | None:
    topo = doc.get("topology")
    if topo is None:
        return None
    if not isinstance(topo, dict) or set(topo) - {"nodes", "gpus_per_node"} or not all(
            isinstance(topo.get(k), int) and topo[k] >= 1 for k in ("nodes", "gpus_per_node")):
        errors.append(f"topology: expected {{nodes: N, gpus_per_node: G}} with positive "
                      f"integers, got {topo!r}")
        return None
    return topo["nodes"], topo["gpus_per_node"]


def _raw_cases(doc: dict, spec: dict, errors: list[str]) -> tuple[dict, list[dict]]:
    """(base, the untyped settings of every case): the sweep's product, then its cases."""
    base = _check_keys("base", doc.get("base") or {}, spec, errors)
    axes = _check_keys("sweep", doc.get("sweep") or {}, spec, errors)
    for k, v in axes.items():
        if not isinstance(v, list) or not v:
            errors.append(f"sweep: {k} must be a non-empty list of values, got {v!r}")
    values = [v if isinstance(v, list) else [v] for v in axes.values()]
    raw = [{**base, **dict(zip(axes, combo))} for combo in itertools.product(*values)] \
        if axes else []
    extra = doc.get("cases") or []
    if not isinstance(extra, list):
        errors.append("cases: expected a list of mappings of settings")
        extra = []
    for i, c in enumerate(extra, 1):
        raw.append({**base, **_check_keys(f"cases[{i}]", c, spec, errors)})
    return base, raw if axes or extra else [dict(base)]


def protocol_seqlen(raw: dict, settings: dict, world: int | None) -> int | None:
    """The sequence length a protocol key sets (None: no protocol key in this case).
    ``world``: the ranks of a GPU topology, None for local ranks (``nproc``, default 4)."""
    given = [k for k in PROTOCOLS if raw.get(k) is not None]
    if not given:
        return None
    if len(given) > 1 or "seqlen" in raw:
        raise UsageError(f"{' and '.join([*given, *(['seqlen'] if 'seqlen' in raw else [])])} "
                         f"each set the sequence length; give one of them")
    key = given[0]
    tokens = parse_size(str(raw[key]))
    if key == "tokens_per_rank":
        return tokens * (world or settings.get("nproc") or planning.DEFAULT_NPROC)
    batch = settings.get("batch", 1)
    if tokens % batch:
        raise UsageError(f"total_tokens {tokens} does not split into batch {batch} equal "
                         f"sequences; give a batch that divides it")
    return tokens // batch


def _typed(raw: dict, spec: dict, default_timeout, gpu: bool,
           world: int | None = None) -> tuple[dict, float | None, list[str]]:
    """(typed settings, timeout, errors) of one case."""
    settings, errors = {}, []
    for k, v in raw.items():
        if k in SWEEP_ONLY:
            continue
        try:
            settings[k] = spec[k].from_yaml(v)
        except UsageError as e:
            errors.append(str(e))
    if raw.get("model") is not None:
        try:
            settings, _ = models.resolve(str(raw["model"]), settings)
        except UsageError as e:
            errors.append(str(e))
    try:
        seqlen = protocol_seqlen(raw, settings, world)
    except UsageError as e:
        errors.append(str(e))
    else:
        if seqlen is not None:
            settings["seqlen"] = seqlen
    timeout = raw.get("timeout", default_timeout)
    if timeout is not None and (isinstance(timeout, bool) or
                                not isinstance(timeout, (int, float)) or timeout <= 0):
        errors.append(f"timeout must be a positive number of seconds, got {timeout!r}")
    if gpu and settings.get("nproc") is not None:
        errors.append("nproc starts local CPU ranks; this config has a topology (torchrun): "
                      "drop nproc")
    return settings, None if timeout is None else float(timeout), errors


def _cases(raw_cases: list[dict], base: dict, spec: dict, doc: dict,
           topology: tuple | None, errors: list[str]) -> list[SweepCase]:
    cases: list[SweepCase] = []
    seen: dict[str, int] = {}  # a case's record key -> the first case that has it
    found: dict[str, list[tuple[int, str]]] = {}  # an error -> the cases (and labels) with it
    for i, raw in enumerate(raw_cases, 1):
        label = _label(raw, base)
        world = topology[0] * topology[1] if topology else None
        settings, timeout, bad = _typed(raw, spec, doc.get("timeout"), topology is not None,
                                        world)
        bad += _value_errors(settings)
        for e in bad:
            found.setdefault(e, []).append((i, label))
        if bad:
            continue
        try:
            p = _plan(settings, topology)
        except UsageError as e:
            found.setdefault(" ".join(str(e).split()), []).append((i, label))
            continue
        keys = p.keys()
        repeated = next((seen[k] for k in keys if k in seen), None)
        if repeated is not None:
            errors.append(f"case {i} ({label}): repeats a row of case {repeated}; drop one")
        for k in keys:
            seen.setdefault(k, i)
        cases.append(SweepCase(index=i, settings=settings, label=label,
                               timeout=timeout, plan=p, keys=keys))
    errors += [_grouped(message, where) for message, where in found.items()]
    return cases


def _yaml_error(path: str | os.PathLike, e: yaml.YAMLError) -> str:
    """A YAML error in one line: where it is and what the parser expected (PyYAML says it in
    four lines, each with its mark)."""
    mark = getattr(e, "problem_mark", None)
    where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark else str(path)
    problem = getattr(e, "problem", None) or " ".join(str(e).split())
    context = getattr(e, "context", None)
    return f"{where}: not YAML: {problem}" + (f" ({context})" if context else "")


def _grouped(message: str, where: list[tuple[int, str]]) -> str:
    """One line for an error and every case it is in: ``case 3 (its label): ...`` for one,
    ``cases 1-4, 7: ...`` for more (the message names the bad value)."""
    if len(where) == 1:
        return f"case {where[0][0]} ({where[0][1]}): {message}"
    runs: list[list[int]] = []
    for i, _ in where:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return "cases " + ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r))
                                for r in runs) + f": {message}"


def _preset_keys(raw: dict) -> set[str]:
    """The fields a case's ``model`` preset sets: the GPU defaults stay under them (a bad
    name is reported with the case's typed settings)."""
    try:
        return set(models.get(str(raw["model"])).fields()) if raw.get("model") else set()
    except UsageError:
        return set()


def load(path: str | os.PathLike) -> Sweep:
    """Read and validate a sweep config; raises SweepError listing every problem."""
    try:
        with open(path) as f:
            doc = yaml.safe_load(f) or {}
    except OSError as e:
        raise SweepError([f"{path}: {e.strerror or e}"]) from None
    except yaml.YAMLError as e:
        raise SweepError([_yaml_error(path, e)]) from None
    if not isinstance(doc, dict):
        raise SweepError([f"{path}: expected a mapping with base / sweep / cases"])
    errors = [f"top level: unknown key {k!r}; allowed: {', '.join(TOP_KEYS)}"
              for k in doc if k not in TOP_KEYS]
    spec = settings_by_name()
    topology = _topology(doc, errors)
    base, raw_cases = _raw_cases(doc, spec, errors)
    if topology is not None:
        # GPU runs: seed 001's defaults, written out, so that the command lines and the rows'
        # keys do not depend on whether the machine checking the sweep has a GPU
        gpu_defaults = {**GPU_ATTENTION, **GPU_ITERS}
        raw_cases = [{**{k: v for k, v in gpu_defaults.items()
                         if (k != "seqlen" or not any(raw.get(p) for p in PROTOCOLS))
                         and k not in _preset_keys(raw)}, **raw}
                     for raw in raw_cases]
        base = {**gpu_defaults, **base}
    cases = _cases(raw_cases, base, spec, doc, topology, errors)
    if errors:
        raise SweepError(errors)
    nodes, gpus = topology or (None, None)
    return Sweep(path=str(path), cases=tuple(cases), nodes=nodes, gpus_per_node=gpus)


def per_strategy(settings: dict, nodes: int | None = None,
                 gpus_per_node: int | None = None) -> Sweep:
    """``cpbench run`` settings as a sweep of one case per strategy (``--strategy all`` →
    one case each), so each strategy gets its own launch: on NCCL a rank failing inside a
    strategy's communication ends its launch, not the run (``cpbench sweep --run``, the
    sbatch script). Options go to the strategies that take them. ``nodes`` /
    ``gpus_per_node``: a torchrun job (planned as its rank 0 would), else ``--nproc`` ranks.
    A baseline is timed once (bracketing it needs one launch for all)."""
    topology = (nodes, gpus_per_node) if nodes else None
    if topology and settings.get("nproc") is not None:
        raise UsageError("--nproc starts local CPU ranks; under torchrun drop it")
    whole = _plan(settings, topology)
    owners = strategies.option_settings()
    cases = []
    for i, name in enumerate(dict.fromkeys(c.strategy for c in whole.cases), 1):
        mine = {k: v for k, v in settings.items()
                if k not in owners or name in (n for n, _ in owners[k])}
        mine["strategy"] = (name,)
        p = _plan(mine, topology)
        cases.append(SweepCase(index=i, settings=mine, label=name, timeout=None, plan=p,
                               keys=p.keys()))
    return Sweep(path="the run flags", cases=tuple(cases), nodes=nodes,
                 gpus_per_node=gpus_per_node)
