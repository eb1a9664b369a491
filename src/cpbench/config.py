"""Frozen, keyword-only configuration dataclasses: the single source of truth for a run."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from cpbench import traces
from cpbench.errors import UsageError
from cpbench.mask import (
    pad_documents,
    parse_documents,
    parse_size,
    parse_window,
    resolve_documents,
)

if TYPE_CHECKING:
    import torch

# the dtype names, torch-free: the CLI parses and checks them without importing torch (which
# takes seconds); ``DTYPES`` maps them to torch's dtypes, imported on first use
DTYPE_NAMES = ("fp32", "bf16", "fp16")
_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
FORMATS = ("table", "markdown", "csv", "json")  # how results print (cpbench run and report)
DEVICES = ("auto", "cpu", "cuda")
LAUNCHERS = ("processes", "threads")  # how --nproc starts its ranks
PADDINGS = ("pad", "refuse")  # --document-padding


def torch_dtypes() -> dict[str, torch.dtype]:
    """Dtype name → torch dtype (imports torch)."""
    return dict(_torch_dtypes())


@lru_cache(maxsize=1)
def _torch_dtypes() -> dict[str, torch.dtype]:
    # read millions of times by the simulator's schedules: built once (callers get copies)
    import torch

    return {name: getattr(torch, attr) for name, attr in _TORCH_DTYPES.items()}


@lru_cache(maxsize=None)
def _element_size(dtype: str) -> int:
    return _torch_dtypes()[dtype].itemsize


def __getattr__(name: str) -> Any:  # DTYPES, built (and torch imported) when first read
    if name == "DTYPES":
        return torch_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def flag(name: str) -> str:
    """The command-line flag of a config or option field: ``head_dim`` → ``--head-dim``."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """The attention problem, in global terms (``seqlen`` is the whole sequence)."""

    batch: int = 1
    seqlen: int = 4096
    heads: int = 8
    kv_heads: int | None = None  # None: same as heads (no GQA)
    head_dim: int = 64
    v_head_dim: int | None = None  # None: same as head_dim (MLA: Q/K 192, V 128)
    dtype: str = "fp32"
    causal: bool = True
    # the mask beyond causal (cpbench.mask): document lengths (resolved: a distribution is
    # sampled by ``resolved_documents`` before the config is built) and flash-attn's window
    documents: tuple[int, ...] | None = None
    window_size: tuple[int, int] | None = None
    max_document: int | None = None  # the cap of sampled documents (default: S / 4)
    # a document a strategy's layout cannot split: padded to its multiple, or refused
    document_padding: str = "pad"
    sinks: bool = False  # one learnable logit per query head in each softmax (gpt-oss)

    def __post_init__(self) -> None:
        for name in ("batch", "seqlen", "heads", "head_dim", "v_head_dim"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UsageError(f"{name} must be a positive integer, got "
                                 f"{getattr(self, name)}; give {flag(name)} 1 or more")
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise UsageError(
                f"kv_heads {self.kv_heads} must divide heads {self.heads}; use one of: "
                + ", ".join(str(d) for d in range(1, self.heads + 1) if self.heads % d == 0)
            )
        if self.dtype not in DTYPE_NAMES:
            raise UsageError(f"unknown dtype {self.dtype!r}; choose one of: "
                             f"{', '.join(DTYPE_NAMES)}")
        if self.document_padding not in PADDINGS:
            raise UsageError(f"--document-padding {self.document_padding!r}: choose one of "
                             f"{', '.join(PADDINGS)}")
        if isinstance(self.documents, str):
            raise UsageError("a --documents distribution must be sampled before the problem "
                             "is built (cpbench.mask.resolve_documents)")
        if self.documents is not None:
            object.__setattr__(self, "documents", resolve_documents(
                self.documents, self.seqlen, 0, self.max_document))
        if self.v_head_dim == self.head_dim:
            object.__setattr__(self, "v_head_dim", None)  # the same problem, the same record
        if self.window_size is not None:
            # (-1, -1) is no window at all: the same problem as none, so the same record
            window = tuple(self.window_size)
            object.__setattr__(self, "window_size", None if window == (-1, -1) else window)

    @property
    def num_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def dv(self) -> int:
        """V's head dim (and out's): ``v_head_dim``, or ``head_dim`` when equal."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def widths(self) -> dict[str, tuple[int, int]]:
        """(heads, head dim) of each input: q and k on the Q/K width, v and dout on V's."""
        h, hk = self.heads, self.num_kv_heads
        return {"q": (h, self.head_dim), "k": (hk, self.head_dim), "v": (hk, self.dv),
                "dout": (h, self.dv)}

    @property
    def torch_dtype(self) -> torch.dtype:
        return _torch_dtypes()[self.dtype]

    @property
    def softmax_scale(self) -> float:
        return float(self.head_dim ** -0.5)  # int ** negative is typed Any

    @property
    def element_size(self) -> int:
        return _element_size(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["document_padding"] == "pad":
            # the default left out: records from before the flag keep their keys (a sweep
            # resumes, a compare matches them); AttentionConfig(**d) reads it back the same
            del d["document_padding"]
        if not d["sinks"]:
            del d["sinks"]  # likewise: a record without sinks reads as before the flag
        if d["v_head_dim"] is None:
            del d["v_head_dim"]  # equal widths: as records before the flag
        return d


@dataclass(frozen=True, kw_only=True)
class PaddedAttention(AttentionConfig):
    """The problem a strategy computes after padding (``padded``): ``documents`` are the
    layout's lengths (pad included; a pad-only segment may end the sequence), ``seqlen``
    their sum, ``padding`` the pad tokens at the end of each (``cpbench.mask.Mask``)."""

    padding: tuple[int, ...] = ()

    @property
    def real_documents(self) -> tuple[int, ...]:
        return tuple(d - p for d, p in zip(self.documents or (), self.padding) if d > p)


def padded(attn: AttentionConfig, doc_multiple: int, seq_multiple: int) -> AttentionConfig:
    """``attn`` with its documents padded to these multiples (``mask.pad_documents``), or
    ``attn`` itself when they already fit (nothing to pad, or refused by
    ``--document-padding refuse``: the strategy's own check then says why)."""
    if not attn.documents or attn.document_padding != "pad":
        return attn
    if attn.seqlen % math.lcm(doc_multiple, seq_multiple) == 0 and all(
            d % doc_multiple == 0 for d in attn.documents):
        return attn  # already splits (a composite's inner strategy on its padded problem)
    real = attn.real_documents if isinstance(attn, PaddedAttention) else attn.documents
    layout, padding = pad_documents(real, sum(real), doc_multiple, seq_multiple)
    fields = {f.name: getattr(attn, f.name) for f in dataclasses.fields(AttentionConfig)}
    return PaddedAttention(**{**fields, "seqlen": sum(layout), "documents": layout},
                           padding=padding)


def resolved_documents(attention: dict[str, Any], seed: int) -> dict[str, Any]:
    """``attention`` (AttentionConfig fields) with a ``documents`` distribution sampled with
    ``seed``: every strategy of a run, and of a sweep's case group, sees the same lengths."""
    docs = attention.get("documents")
    if docs is None:
        return attention
    seqlen = attention.get("seqlen", CPU_ATTENTION["seqlen"])
    return {**attention, "documents": resolve_documents(docs, seqlen, seed,
                                                        attention.get("max_document"))}


def packed_problems(attention: dict[str, Any], seed: int, packings: int
                    ) -> tuple[AttentionConfig, ...]:
    """The problem of each of ``packings`` packings: the ``documents`` distribution sampled
    with seeds ``seed``, ``seed + 1``, ... (one problem when ``packings`` is 1). A training
    run packs different documents every step; one packing is one step's imbalance."""
    if packings > 1 and not isinstance(attention.get("documents"), str):
        raise UsageError(f"--packings {packings} samples packings of a --documents "
                         f"distribution; give one (e.g. --documents lognormal:8k,1.0 or "
                         f"trace:magiattention), or drop --packings")
    return tuple(AttentionConfig(**resolved_documents(attention, seed + i))
                 for i in range(packings))


# -- the benchmark run (owned by the driver; the CLI is generated from these fields) ----------

_T = TypeVar("_T")


def arg(default: _T, help: str, *, choices: tuple[str, ...] | None = None,
        parse: Callable[[str], Any] | None = None, metavar: str | None = None) -> _T:
    """A config field with its CLI help, allowed values and a parser for its text form."""
    return dataclasses.field(default=default, metadata={
        "help": help, "choices": choices, "parse": parse, "metavar": metavar})


def parse_names(text: str) -> tuple[str, ...]:
    """``zigzag`` / ``ring,zigzag`` / ``all`` → a tuple of names (checked by the driver)."""
    names = tuple(n.strip() for n in str(text).split(",") if n.strip())
    if not names:
        raise UsageError("--strategy needs a name, a comma list of names, or all")
    return names


# Help for AttentionConfig's fields on the command line (the fields themselves stay minimal).
ATTENTION_HELP = {
    "batch": "batch size B",
    "seqlen": "global sequence length S, split over the CP ranks (8k = 8192, 128K, 1M)",
    "heads": "query heads H",
    "kv_heads": "key/value heads (GQA; must divide --heads); default: --heads",
    "head_dim": "head dimension D (of Q and K)",
    "v_head_dim": "head dimension DV of V and the output (MLA: 128 beside --head-dim 192); "
                  "default: --head-dim",
    "dtype": "activation dtype",
    "causal": "causal (lower-triangular) mask; inside documents and windows it keeps its "
              "meaning",
    "documents": "packed documents (attention never crosses one): lengths summing to "
                 "--seqlen (4k,2k,1k,1k) or a distribution sampled with --seed: "
                 "uniform:MIN-MAX, lognormal:MEDIAN,SIGMA, trace:NAME (a real length trace "
                 "shipped with cpbench: " + ", ".join(traces.TRACES) + "; trace:NAME,split"
                 ",midpoint draws it as MagiAttention's benchmark does: long documents split "
                 "at --max-document, bins as midpoints; trace:NAME,packs: its packs, --seed "
                 "K its pack K), file:PATH (one length a line, or a "
                 "histogram in the traces' format)",
    "window_size": "sliding window LEFT,RIGHT as flash-attn's window_size: query i sees keys "
                   "i-LEFT..i+RIGHT (-1: unbounded; 1023,0 with --causal: itself and the "
                   "1,023 before)",
    "max_document": "cap of each sampled document length (default: a quarter of --seqlen)",
    "document_padding": "a document whose length a strategy's layout cannot split (zigzag: "
                        "a multiple of 2N): pad it to that multiple, pad tokens attending "
                        "to nothing (TransformerEngine's cu_seqlens_padded), or refuse the "
                        "strategy",
    "sinks": "attention sinks (gpt-oss): one learnable fp32 logit per query head joins every "
             "query's softmax denominator, adding no value; a strategy that cannot add it "
             "once per query is skipped",
}
ATTENTION_PARSE = {"seqlen": parse_size, "documents": parse_documents,
                   "window_size": parse_window, "max_document": parse_size}

# Defaults per device. GPU: seed 001's setting (its 128K row). CPU: small and fp32 (bf16 is
# 2-3x slower on CPUs without native bf16), sized so `make bench` runs every strategy in well
# under a minute on 2 cores.
# AttentionConfig fields by name (values of several types: Any to a reader)
GPU_ATTENTION: dict[str, Any] = {"batch": 1, "seqlen": 131072, "heads": 40, "head_dim": 128,
                                 "dtype": "bf16", "causal": True}
CPU_ATTENTION: dict[str, Any] = {"batch": 1, "seqlen": 1024, "heads": 8, "head_dim": 64,
                                 "dtype": "fp32", "causal": True}
GPU_ITERS = {"warmup": 5, "iters": 20}
CPU_ITERS = {"warmup": 2, "iters": 5}


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """How a benchmark runs and is measured; the attention problem is ``AttentionConfig`` and
    each strategy's options its own ``Options``. ``None`` fields are filled per device by
    ``resolved()`` before anything runs, so a record always holds concrete values."""

    strategy: tuple[str, ...] = arg(("all",), "a strategy name, a comma list, or all "
                                    "(see `cpbench strategies`)", parse=parse_names,
                                    metavar="NAME[,NAME...]|all")
    kernel: str = arg("auto", "attention kernel backend (auto: on CUDA FlashAttention-3 "
                      "on sm90 when installed, else flash-attn 2, never the plain reference; "
                      "sdpa-cpu on CPU)")
    device: str = arg("auto", "where ranks compute (auto: cuda under torchrun or --launcher "
                      "threads when a GPU is present, else cpu; --nproc processes always "
                      "run on cpu)", choices=DEVICES)
    ranks_per_node: int | None = arg(None, "ranks per (emulated) node; default: "
                                     "LOCAL_WORLD_SIZE under torchrun, a value giving >= 2 "
                                     "nodes with --nproc")
    warmup: int | None = arg(None, "untimed steps first, at least (default: 5 GPU, 2 CPU): more "
                             "follow while the step time still moves, up to --iters more; "
                             "0: none")
    iters: int | None = arg(None, "timed iterations (default: 20 GPU, 5 CPU)")
    fwd_only: bool = arg(False, "time the forward only")
    check: bool = arg(False, "first compare out, lse, dq, dk, dv with the float64 reference "
                      "(small --seqlen only); a FAIL exits non-zero")
    seed: int = arg(0, "random seed of the inputs")
    out: str | None = arg(None, "append JSONL records here (default: "
                          "runs/<utc>_<strategy>_<seqlen>/results.jsonl; 'none': no file)",
                          metavar="FILE.jsonl")
    profile: str | None = arg(None, "after the timing, profile a few more steps per case "
                              "(torch.profiler): one Chrome trace per rank in "
                              "DIR/<case>_<strategy>/rank{r}.trace.json.gz, the slowest "
                              "rank's breakdown (parts, idle, exposed communication) in the "
                              "record", metavar="DIR")
    format: str = arg("table", "how the summary prints", choices=FORMATS)
    details: bool = arg(False, "after each case its block (configuration, performance, checks, "
                        "load balance), not one line (table format; `cpbench report "
                        "--details` re-renders them from the records)")
    wide: bool = arg(False, "the summary with every column (default: it fits the terminal, "
                     "120 columns when it is not one; the records keep every field)")
    nproc: int | None = arg(None, "start this many local ranks (--launcher) instead of running "
                            "under torchrun (default: 4)")
    launcher: str = arg("processes", "how --nproc starts its ranks: processes (one gloo "
                        "rank each, on cpu) or threads (all in this process, on one device: "
                        "GPU 0 or cpu; for --check: builds, checks and runs one untimed step, "
                        "times nothing)", choices=LAUNCHERS)
    collective_timeout: float | None = arg(None, "seconds a rank waits for its peers in one "
                                           "collective (the process groups' timeout) before "
                                           "the case is recorded as failed and the group is "
                                           "formed again (default: per case, from a "
                                           "pessimistic estimate of its step time, at least "
                                           "60 s)", metavar="SECONDS")
    deadline: float | None = arg(None, "--nproc only: seconds before the whole run is "
                                 "stopped (default: none)", metavar="SECONDS")
    packings: int = arg(1, "with a --documents distribution: sample K packings of it (seeds "
                        "--seed, --seed+1, ...), each a case of its own; reports show each "
                        "strategy's median over them and their spread", metavar="K")
    max_minutes: float = arg(10.0, "refuse, before anything runs, a case estimated to take "
                             "longer than this (a probe of the kernel on this machine, "
                             "scaled by FLOPs); 0: no limit", metavar="MINUTES")
    rounds: int = arg(1, "time every case K times in A B … B A order (each round all cases, "
                      "alternate rounds reversed, the baseline included), so the machine's "
                      "drift cancels instead of favouring whichever case ran first; reports "
                      "pool a case's rounds and print the drift between them", metavar="K")

    def __post_init__(self) -> None:
        for name in ("ranks_per_node", "iters", "nproc", "packings", "rounds"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UsageError(f"{flag(name)} must be a positive integer, got {value}")
        if self.warmup is not None and self.warmup < 0:
            raise UsageError(f"--warmup must be >= 0, got {self.warmup}")
        if self.max_minutes < 0:
            raise UsageError(f"--max-minutes must be >= 0 (0: no limit), got {self.max_minutes}")
        for name in ("collective_timeout", "deadline"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UsageError(f"{flag(name)} must be a positive number of seconds, "
                                 f"got {value}")
        for name, allowed in (("format", FORMATS), ("device", DEVICES),
                              ("launcher", LAUNCHERS)):
            if getattr(self, name) not in allowed:
                raise UsageError(f"--{name} must be one of {', '.join(allowed)}, "
                                 f"got {getattr(self, name)!r}")

    def resolved(self, device: str) -> "RunConfig":
        """Fill per-device defaults (``device`` is "cpu" or "cuda")."""
        iters = GPU_ITERS if device == "cuda" else CPU_ITERS
        return dataclasses.replace(
            self, device=device,
            warmup=iters["warmup"] if self.warmup is None else self.warmup,
            iters=iters["iters"] if self.iters is None else self.iters)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["strategy"] = list(self.strategy)
        return d


def default_attention(device: str) -> dict[str, Any]:
    """The attention shape used where the command line leaves a field out."""
    return dict(GPU_ATTENTION if device == "cuda" else CPU_ATTENTION)
