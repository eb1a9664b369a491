"""Hardware presets for the simulator: ``cpbench/sim/presets/*.yaml`` (``configs/hardware``).

A preset is a machine, not a strategy: the attention kernel's attained speed as a function of
the block it is given (``sim.curves``: per head dim, each point with its source), what a CP
step does around its kernel (merge, gradient sums, a fixed per-step cost), the links between
GPUs, and memory. Every number in a preset says where it comes from (a datasheet, a published
kernel figure, a stated rule, a measurement, or a fit to a published run: which rows) in the
YAML itself; ``source:`` sums that up in one line (``cpbench simulate --list-hardware``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from cpbench.errors import UsageError, unknown
from cpbench.sim import curves, provenance
from cpbench.sim.curves import KernelCurve, KernelSet
from cpbench.sim.provenance import Fit

__all__ = ["GB", "PRESET_DIR", "Hardware", "KernelCurve", "KernelSet", "Link", "Pass", "Probe",
           "from_dict", "load", "names", "preset_lines"]

# shipped with the package (configs/hardware in a checkout links here), so an installed
# cpbench finds them from any directory
PRESET_DIR = Path(__file__).resolve().parent / "presets"
GB = 1e9  # link speeds are decimal: GB/s as datasheets print them


@dataclass(frozen=True)
class Link:
    bandwidth_gbs: float  # per GPU, one direction
    latency_us: float


@dataclass(frozen=True)
class Pass:
    """A memory-bound pass over a block's elements: fixed + elements x per element."""

    fixed_us: float = 0.0
    ns_per_element: float = 0.0

    def seconds(self, elements: float) -> float:
        return (self.fixed_us * 1e3 + self.ns_per_element * elements) * 1e-9 if elements else 0.0


@dataclass(frozen=True)
class Probe:
    side: int
    heads: int
    head_dim: int
    busy_ms: float
    alone_ms: float


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    gpus_per_node: int  # the default topology's node size
    nodes: int  # the default topology's node count
    memory_gib: float  # per GPU, what the allocator can hand out
    peak_tflops: float  # dense bf16/fp16, datasheet
    kernel_fwd: KernelCurve
    kernel_bwd: KernelCurve
    step_overhead_us: float  # per kernel step: launch, stream waits, p2p posting
    intra: Link  # inside a node (NVLink / NVSwitch)
    inter: Link  # one GPU's share of the inter-node network when it alone sends
    node_inter_gbs: float  # all of a node's NICs together, one direction
    dtypes: tuple[str, ...] = ("bf16", "fp16")
    # a causal (diagonal) block's own curves where measured (``cpbench calibrate``): half its
    # tiles are masked, so it attains less per FLOP than a full block of the same side
    kernel_fwd_causal: KernelCurve | None = None
    kernel_bwd_causal: KernelCurve | None = None
    # what a message posted before a kernel and awaited after it adds to the step, as a
    # multiple of its time alone on the link, where measured (``cpbench calibrate`` on CPUs,
    # where the transport's thread shares the kernel's core and nothing hides); None on
    # GPUs: it moves while the kernel runs
    overlapped: float | None = None
    # a kernel's speed-up when the other ranks of its node wait instead of computing: 1 on
    # GPUs (a device each); measured on CPUs, which share memory bandwidth and caches
    idle_speedup: float = 1.0
    # what a step does around its kernel call: the forward's merge of a block into the
    # rank's fp32 (out, lse), the backward's gradient sums (``sim.sharing``); measured per
    # element by ``cpbench calibrate`` on CPUs, bytes per element over the HBM bandwidth on
    # GPUs (a preset says where its figure comes from)
    merge: Pass = Pass()
    accumulate: Pass = Pass()
    # a measured preset's reading of the machine (``cpbench calibrate``): a full forward of
    # ``side`` tokens with every rank busy and with one alone, ms; the self-check's yardstick
    probe: Probe | None = None
    # the head dim of the kernel_* curves above (None: they serve any head dim) and the
    # curves of the preset's other head dims
    kernel_head_dim: int | None = None
    other_kernels: tuple[tuple[int, KernelSet], ...] = ()
    # the kernel's rate inside a CP run over its curve's (the kernel benchmarked alone), per
    # phase: NCCL's kernels run beside it; 1 where not measured
    kernel_in_cp: tuple[float, float] = (1.0, 1.0)
    memory_bandwidth_gbs: float | None = None  # HBM, datasheet: GPU presets' merge passes
    source: str = ""  # where the preset's numbers come from, one line
    # the published rows a fit used (``fit:``; ``sim.provenance``): which rows of a
    # validation are in-sample; None: nothing in the preset was fitted to published rows
    fit: Fit | None = None
    # a measured preset's load reading: the share of the cores other processes used while
    # ``cpbench calibrate`` measured (None: no reading, e.g. a preset from before it)
    calibration_load: float | None = None
    # the attention kernel the curves above price (``--kernel``), and every kernel the preset
    # has curves for: (name, one line on its figures, its source names), the default first
    kernel_name: str = "unnamed"
    kernel_choices: tuple[tuple[str, str, tuple[str, ...]], ...] = ()
    # what a prediction on this preset rests on (``sim.provenance.evidence``): the published
    # CP rows it was validated on with this kernel, or that it has none
    evidence: str = provenance.NO_EVIDENCE
    stated_error: float | None = None  # its held-out median |error|, where it has one
    # the whole tiles the kernel computes a varlen call's pieces in, (fwd, bwd)
    tiles: tuple[curves.Tiles, curves.Tiles] = (curves.Tiles(), curves.Tiles())
    # a GQA backward's own fp32 dK / dV sums, zeroed and converted once per call over every
    # key it is given (``kernel.gqa_sums``: FA3's): a pass over the call's K / V elements
    gqa_sums: Pass = Pass()
    # the kernel's curves were benchmarked at a fixed count of work tiles (batch x L constant,
    # FlashAttention's benchmarks): below a curve's first point each tile pays its fixed cost
    # (``curves.KernelCurve.looping``); false (``kernel.fixed_tile_count``: a fixed batch, the
    # rise with L the call's own): below it a piece runs at the first point's rate
    fixed_tile_count: bool = True

    def kernels(self) -> tuple[tuple[int | None, KernelSet], ...]:
        first = KernelSet(self.kernel_fwd, self.kernel_bwd, self.kernel_fwd_causal,
                          self.kernel_bwd_causal)
        return ((self.kernel_head_dim, first), *self.other_kernels)

    def kernel(self, phase: str, causal: bool = False, head_dim: int | None = None
               ) -> KernelCurve:
        """The curve a block of this phase, causal or not, at this head dim is priced on
        (the nearest head dim the preset gives): the kernel as benchmarked alone."""
        return curves.nearest(self.kernels(), head_dim, phase).curve(phase, causal)

    def rate(self, phase: str, causal: bool, head_dim: int | None, side: float) -> float:
        """TFLOP/s of a CP step's kernel call: the curve, times the kernel's rate inside a
        CP run over its rate alone (``kernel_in_cp``)."""
        in_cp = self.kernel_in_cp[0 if phase == "fwd" else 1]
        return self.kernel(phase, causal, head_dim).tflops(side) * in_cp

    def curves(self) -> tuple[KernelCurve, ...]:
        return tuple(c for _, ks in self.kernels() for c in ks.curves())

    def kernel_notes(self, head_dim: int | None, causal: bool) -> list[str]:
        """Where this problem's blocks are priced on no figure of their own: said under every
        table, never scaled silently (``sim.curves.gaps``)."""
        return curves.gaps(self.kernel_name, self.kernels(), head_dim, causal)


def _number(d: dict, key: str, source: str, kind=float, default=None):
    value = d.get(key, default) if default is not None else d[key]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        ok = ok and float(value).is_integer()
    if not ok or not math.isfinite(value):
        what = "a whole number" if kind is int else "a number"
        raise UsageError(f"{source}: {key} must be {what}, got {value!r}")
    return kind(value)


def _dtypes(value, source: str) -> tuple[str, ...]:
    # a measured preset names the dtype its kernel curve was measured in (fp32 on a CPU)
    if not (isinstance(value, list) and value and all(v in ("fp32", "bf16", "fp16")
                                                       for v in value)):
        raise UsageError(f"{source}: dtypes must be a list of fp32, bf16, fp16, got {value!r}")
    return tuple(value)


def _probe(d, where: str) -> Probe | None:
    if d is None:
        return None
    if not isinstance(d, dict):
        raise UsageError(f"{where}: a mapping of side, heads, head_dim, busy_ms, alone_ms")
    probe = Probe(*(_number(d, k, where, int) for k in ("side", "heads", "head_dim")),
                  *(_number(d, k, where) for k in ("busy_ms", "alone_ms")))
    if min(probe.side, probe.heads, probe.head_dim, probe.busy_ms, probe.alone_ms) <= 0:
        raise UsageError(f"{where}: every value must be positive")
    return probe


def _flag(d: dict, key: str, source: str, default: bool) -> bool:
    """A preset's true / false setting (``default`` when absent); anything else refused."""
    value = d.get(key, default)
    if not isinstance(value, bool):
        raise UsageError(f"{source}: {key} must be true or false, got {value!r}")
    return value


def _pass(d: dict, key: str, source: str, hbm_gbs: float | None) -> Pass:
    """A memory pass: ``fixed_us`` + ``ns_per_element`` (measured), or ``bytes_per_element``
    over the preset's ``memory_bandwidth_gbs`` (1 byte / (GB/s) is 1 ns)."""
    if d.get(key) is None:
        return Pass()
    where = f"{source}: {key}"
    if not isinstance(d[key], dict):
        raise UsageError(f"{where}: a mapping of fixed_us and ns_per_element, or of "
                         f"bytes_per_element")
    if "bytes_per_element" in d[key]:
        if hbm_gbs is None:
            raise UsageError(f"{where}: bytes_per_element needs the preset's "
                             f"memory_bandwidth_gbs")
        p = Pass(_number(d[key], "fixed_us", where, default=0.0),
                 _number(d[key], "bytes_per_element", where) / hbm_gbs)
    else:
        p = Pass(_number(d[key], "fixed_us", where), _number(d[key], "ns_per_element", where))
    if p.fixed_us < 0 or p.ns_per_element < 0:
        raise UsageError(f"{where}: its figures must be >= 0")
    return p


def _in_cp(k: dict, source: str) -> tuple[float, float]:
    d = k.get("in_cp")
    if d is None:
        return 1.0, 1.0
    where = f"{source}: kernel.in_cp"
    if not isinstance(d, dict):
        raise UsageError(f"{where}: a mapping of fwd and bwd (each > 0, at most 1)")
    fwd, bwd = _number(d, "fwd", where, default=1.0), _number(d, "bwd", where, default=1.0)
    if not (0 < fwd <= 1 and 0 < bwd <= 1):
        raise UsageError(f"{where}: fwd and bwd must be > 0 and at most 1")
    return fwd, bwd


def _kernel_section(d: dict, source: str, kernel: str | None) -> tuple[str, dict, tuple]:
    """(the kernel's name, its ``kernel:`` section, every kernel's (name, summary, sources)).
    ``kernel:`` holds the first kernel's curves (``name:``: fa2, fa3, cudnn, fa4, measured)
    and the step's own terms (``in_cp``, ``step_overhead_us``); ``kernels:`` other kernels'
    curves in the same format, which take its terms; ``default_kernel:`` the one a plain
    ``--hardware`` prices."""
    base, others = d["kernel"], d.get("kernels") or {}
    if not isinstance(base, dict) or not isinstance(others, dict):
        raise TypeError("kernel and kernels must be mappings")
    first = str(base.get("name", "unnamed"))
    choices = {first: base, **others}
    for name, section in others.items():  # each parses, chosen or not: fail at load
        if not isinstance(section, dict):
            raise UsageError(f"{source}: kernels.{name} must be a mapping like kernel:")
        curves.parse(section, f"{source}: kernels.{name}")
    name = kernel or str(d.get("default_kernel", first))
    if name not in choices:
        raise UsageError(f"{Path(source).stem} has no {name} curves (its kernels: "
                         f"{', '.join(choices)}); choose one of those with --kernel")
    terms = {key: base[key] for key in ("in_cp", "step_overhead_us") if key in base}
    section = base if name == first else {**terms, **others[name]}
    default = str(d.get("default_kernel", first))
    listed = tuple((n, " ".join(str(c.get("summary", "")).split()),
                    tuple(c.get("sources") or ())) for n, c in choices.items())
    listed = tuple(sorted(listed, key=lambda c: c[0] != default))
    return name, section, listed


def from_dict(d: dict, source: str = "preset", kernel: str | None = None) -> Hardware:
    if not isinstance(d, dict):
        raise UsageError(f"{source}: a preset is a YAML mapping (see configs/hardware/"
                         f"a800-sxm.yaml), not {type(d).__name__}")
    try:
        kernel_name, k, choices = _kernel_section(d, source, kernel)
        intra, inter = d["intra_node"], d["inter_node"]
        if not all(isinstance(x, dict) for x in (k, intra, inter)):
            raise TypeError("kernel, intra_node and inter_node must be mappings")
        if not isinstance(d["name"], str):
            raise TypeError(f"name must be text, got {d['name']!r}")
        (dim, first), *others = curves.parse(k, f"{source}: kernel")
        assert first.bwd is not None  # parse: the first head dim gives both phases
        hbm = None if d.get("memory_bandwidth_gbs") is None else \
            _number(d, "memory_bandwidth_gbs", source)
        if hbm is not None and not hbm > 0:
            raise UsageError(f"{source}: memory_bandwidth_gbs must be positive, got {hbm:g}")
        hw = Hardware(
            name=d["name"], description=str(d.get("description", "")),
            gpus_per_node=_number(d, "gpus_per_node", source, int),
            nodes=_number(d, "nodes", source, int, default=1),
            memory_gib=_number(d, "memory_gib", source),
            peak_tflops=_number(d, "peak_tflops_bf16", source),
            kernel_fwd=first.fwd, kernel_bwd=first.bwd,
            step_overhead_us=_number(k, "step_overhead_us", f"{source}: kernel", default=0.0),
            intra=Link(_number(intra, "bandwidth_gbs", f"{source}: intra_node"),
                       _number(intra, "latency_us", f"{source}: intra_node")),
            inter=Link(_number(inter, "bandwidth_gbs_per_gpu", f"{source}: inter_node"),
                       _number(inter, "latency_us", f"{source}: inter_node")),
            node_inter_gbs=_number(inter, "node_bandwidth_gbs", f"{source}: inter_node"),
            kernel_fwd_causal=first.fwd_causal, kernel_bwd_causal=first.bwd_causal,
            dtypes=_dtypes(d.get("dtypes", ["bf16", "fp16"]), source),
            overlapped=(None if d.get("overlapped") is None
                        else _number(d, "overlapped", source)),
            idle_speedup=_number(d, "idle_speedup", source, default=1.0),
            merge=_pass(d, "merge", source, hbm),
            accumulate=_pass(d, "accumulate", source, hbm),
            probe=_probe(d.get("probe"), f"{source}: probe"),
            kernel_head_dim=dim, other_kernels=tuple((n, ks) for n, ks in others if n),
            kernel_in_cp=_in_cp(k, source), memory_bandwidth_gbs=hbm,
            source=" ".join(str(d.get("source", "")).split()),
            fit=provenance.parse_fit(d.get("fit"), f"{source}: fit"),
            calibration_load=provenance.parse_load(d.get("load"), f"{source}: load"),
            kernel_name=kernel_name, kernel_choices=choices,
            evidence=provenance.evidence(d.get("evidence"), kernel_name, f"{source}: evidence"),
            stated_error=provenance.stated_error(d.get("evidence"), kernel_name),
            tiles=curves.parse_tiles(k, f"{source}: kernel"),
            gqa_sums=_pass(k, "gqa_sums", f"{source}: kernel", hbm),
            fixed_tile_count=_flag(k, "fixed_tile_count", f"{source}: kernel", True),
        )
    except KeyError as e:
        raise UsageError(f"{source}: missing field {e.args[0]!r} (see configs/hardware/"
                         f"a800-sxm.yaml for a complete preset)") from None
    except (TypeError, AttributeError) as e:
        raise UsageError(f"{source}: malformed preset ({e}); see configs/hardware/"
                         f"a800-sxm.yaml") from None
    _check(hw, source)
    return hw


def _check(hw: Hardware, source: str) -> None:
    """The ranges a preset's values must lie in."""
    positive = {"memory_gib": hw.memory_gib, "peak_tflops_bf16": hw.peak_tflops,
                "gpus_per_node": hw.gpus_per_node, "nodes": hw.nodes,
                "intra_node.bandwidth_gbs": hw.intra.bandwidth_gbs,
                "inter_node.bandwidth_gbs_per_gpu": hw.inter.bandwidth_gbs,
                "inter_node.node_bandwidth_gbs": hw.node_inter_gbs}
    not_negative = {"kernel.step_overhead_us": hw.step_overhead_us,
                    "intra_node.latency_us": hw.intra.latency_us,
                    "inter_node.latency_us": hw.inter.latency_us}
    if not hw.idle_speedup >= 1:
        raise UsageError(f"{source}: idle_speedup must be >= 1, got {hw.idle_speedup:g}")
    if hw.overlapped is not None and not hw.overlapped >= 0:
        raise UsageError(f"{source}: overlapped must be >= 0, got {hw.overlapped:g}")
    for name, value in positive.items():
        if not value > 0:
            raise UsageError(f"{source}: {name} must be positive, got {value:g}")
    for name, value in not_negative.items():
        if not value >= 0:
            raise UsageError(f"{source}: {name} must be >= 0, got {value:g}")
    top = max(t for curve in hw.curves() for _, t in curve.points)
    if top > hw.peak_tflops:
        raise UsageError(f"{source}: a kernel curve reaches {top:g} TFLOP/s, above the "
                         f"peak {hw.peak_tflops:g}")


def names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def preset_of_table(table: str) -> tuple[str, str | None] | None:
    """(preset, kernel) whose ``evidence:`` (or ``fit:`` or ``scored_once:``, kernel None:
    the default) names this published table (matched by file name, as ``provenance``
    matches it), else None."""
    want = Path(table).name
    for name in names():
        with open(PRESET_DIR / f"{name}.yaml") as f:
            d = yaml.safe_load(f) or {}
        for kernel, stated in (d.get("evidence") or {}).items():
            if want in (Path(f).name for f in stated.get("files", ())):
                return name, kernel
        others = [(d.get("fit") or {}).get("file", ""), *(d.get("scored_once") or ())]
        if want in (Path(f).name for f in others):
            return name, None
    return None


def preset_lines() -> list[tuple[str, str]]:
    """(name, one line: its default cluster and description) per shipped preset, read from
    the files themselves, as ``simulate --help`` and ``--list-hardware`` print them (a preset
    added is listed; one that cannot be read says so rather than breaking the help)."""
    out = []
    for name in names():
        try:
            with open(PRESET_DIR / f"{name}.yaml") as f:
                d = yaml.safe_load(f)
            line = (f"{d.get('nodes', 1)} x {d['gpus_per_node']} by default; "
                    f"{' '.join(str(d.get('description') or d['name']).split())}")
        except (OSError, yaml.YAMLError, TypeError, KeyError, AttributeError) as e:
            line = f"(unreadable: {type(e).__name__})"
        out.append((name, line))
    return out


def load(name_or_path: str, kernel: str | None = None) -> Hardware:
    """A preset by name (``a800-sxm``) or a YAML file path, its curves those of ``kernel``
    (None: the preset's default kernel)."""
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") and path.exists()):
        path = PRESET_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        # a YAML file's path is the other answer: the names alone pass 120 columns
        raise UsageError(unknown("preset", name_or_path, names(), "--list-hardware")
                         + " (or give a .yaml)")
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise UsageError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    return from_dict(data, str(path), kernel)
