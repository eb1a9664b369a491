"""Model presets: the attention shape of published models, each value from a source read.

``--model NAME`` (run, sweep, dryrun, simulate) sets the ``AttentionConfig`` fields of one
entry; flags given beside it override it (``resolve``: which ones, for the one line the
commands print). ``cpbench models`` lists the entries with their sources.

An entry is one layer kind: gpt-oss alternates a sliding-window layer with a full one, so it
has two entries. The MLA models (DeepSeek-V3, Kimi K2) are entered as they train: the latent
is up-projected to every head before attention (DeepSeek-V3's ``attn_impl = "naive"``: K is
``[k_nope, k_pe]`` per head), so K has as many heads as Q (MHA) with the Q/K width
``qk_nope_head_dim + qk_rope_head_dim`` = 192 and V the width ``v_head_dim`` = 128. The
absorbed form (one shared latent head) is an inference kernel's, not what context
parallelism shards in training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from cpbench.config import flag
from cpbench.errors import UsageError, did_you_mean


@dataclass(frozen=True, kw_only=True)
class Preset:
    """One model's attention shape and where each value comes from."""

    name: str
    model: str  # the published model, as its owner names it
    heads: int
    kv_heads: int
    head_dim: int  # Q and K
    v_head_dim: int  # V and the output
    window_size: tuple[int, int] | None  # flash-attn's (left, right); None: full causal
    sinks: bool
    dtype: str
    source: str

    def fields(self) -> dict[str, Any]:
        """The ``AttentionConfig`` fields this entry sets: ``kv_heads`` and ``v_head_dim``
        only where they differ from ``heads`` and ``head_dim`` (the config's None means the
        same), so a preset's record matches a run of the same shape given by flags."""
        out: dict[str, Any] = {"heads": self.heads, "head_dim": self.head_dim,
                               "dtype": self.dtype, "causal": True, "sinks": self.sinks,
                               "window_size": self.window_size}
        if self.kv_heads != self.heads:
            out["kv_heads"] = self.kv_heads
        if self.v_head_dim != self.head_dim:
            out["v_head_dim"] = self.v_head_dim
        return out

    def shape(self) -> str:
        """``H=64 KV=8 D=64 DV=64 window 127,0 sinks bf16``."""
        window = "full" if self.window_size is None else \
            "window " + ",".join(map(str, self.window_size))
        return (f"H={self.heads} KV={self.kv_heads} D={self.head_dim} DV={self.v_head_dim} "
                f"{window}{' sinks' if self.sinks else ''} {self.dtype}")


_LLAMA_SOURCE = ("meta-llama/llama-models models/sku_list.py, {sku} model_args: dim {dim}, "
                 "n_heads {h}, n_kv_heads 8; head dim = dim // n_heads = 128 "
                 "(models/llama3/reference_impl/model.py); bf16 weights (sku_list.py: "
                 "\"BF16 weights\")")
_GPT_OSS_SOURCE = ("openai/gpt-oss gpt_oss/torch/model.py: ModelConfig (the 120b's: 36 layers, "
                   "128 experts) num_attention_heads 64, num_key_value_heads 8, head_dim 64, "
                   "sliding_window 128; AttentionBlock: sliding_window on layers with "
                   "layer_idx % 2 == 0, else 0 (full); sinks = Parameter(num_attention_heads, "
                   "bfloat16), a logit joined to each softmax row and dropped (W[..., :-1]); "
                   "bf16 q/k/v projections")
_MLA_NOTE = ("training shape: K = [k_nope, k_pe] per head (inference/model.py, attn_impl "
             "\"naive\"): MHA, D = qk_nope_head_dim + qk_rope_head_dim, "
             "softmax_scale = D ** -0.5 as cpbench's; attention in bf16 (model.py: bf16 "
             "Linear, scores .type_as(x)); YaRN's mscale factor not modelled")

PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset(name="llama3-8b", model="meta-llama/Llama-3.1-8B", heads=32, kv_heads=8,
           head_dim=128, v_head_dim=128, window_size=None, sinks=False, dtype="bf16",
           source=_LLAMA_SOURCE.format(sku="meta_llama3_1_8b", dim=4096, h=32)),
    Preset(name="llama3-70b", model="meta-llama/Llama-3.1-70B", heads=64, kv_heads=8,
           head_dim=128, v_head_dim=128, window_size=None, sinks=False, dtype="bf16",
           source=_LLAMA_SOURCE.format(sku="meta_llama3_1_70b", dim=8192, h=64)),
    Preset(name="llama3-405b", model="meta-llama/Llama-3.1-405B", heads=128, kv_heads=8,
           head_dim=128, v_head_dim=128, window_size=None, sinks=False, dtype="bf16",
           source=_LLAMA_SOURCE.format(sku="meta_llama3_1_405b", dim=16384, h=128)),
    Preset(name="qwen3-235b-a22b", model="Qwen/Qwen3-235B-A22B", heads=64, kv_heads=4,
           head_dim=128, v_head_dim=128, window_size=None, sinks=False, dtype="bf16",
           source="config.json num_attention_heads 64, num_key_value_heads 4, head_dim 128 "
                  "(head_dim is set, not hidden_size / heads: 4096 / 64 = 64), as "
                  "transcribed by AI-Hypercomputer/maxtext src/MaxText/configs/models/"
                  "qwen3-235b-a22b.yml (base_num_query_heads 64, base_num_kv_heads 4, "
                  "head_dim 128); Qwen's own config.json was not readable here; BF16 "
                  "weights (vllm-ascend tutorial Qwen3-235B-A22B: \"BF16 version\")"),
    Preset(name="deepseek-v3", model="deepseek-ai/DeepSeek-V3", heads=128, kv_heads=128,
           head_dim=192, v_head_dim=128, window_size=None, sinks=False, dtype="bf16",
           source="deepseek-ai/DeepSeek-V3 inference/configs/config_671B.json: n_heads 128, "
                  "qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128 (its \"dtype\": "
                  "\"fp8\" is the GEMM weights'); " + _MLA_NOTE),
    Preset(name="kimi-k2", model="moonshotai/Kimi-K2-Instruct", heads=64, kv_heads=64,
           head_dim=192, v_head_dim=128, window_size=None, sinks=False, dtype="bf16",
           source="MoonshotAI/Kimi-K2 README model summary: 64 attention heads, MLA; its "
                  "config.json reuses DeepseekV3ForCausalLM with qk_nope_head_dim 128, "
                  "qk_rope_head_dim 64, v_head_dim 128 (read in copies of that config.json, "
                  "not Moonshot's file itself); " + _MLA_NOTE.replace("inference/model.py",
                                                                     "DeepSeek-V3's model.py")),
    Preset(name="gpt-oss-120b", model="openai/gpt-oss-120b (full layers)", heads=64,
           kv_heads=8, head_dim=64, v_head_dim=64, window_size=None, sinks=True,
           dtype="bf16", source=_GPT_OSS_SOURCE + "; this entry: the odd (full) layers"),
    Preset(name="gpt-oss-120b-swa", model="openai/gpt-oss-120b (sliding layers)", heads=64,
           kv_heads=8, head_dim=64, v_head_dim=64, window_size=(127, 0), sinks=True,
           dtype="bf16", source=_GPT_OSS_SOURCE + "; this entry: the even (sliding) layers: "
           "mask tril(diagonal=-128) leaves keys i-127..i, flash-attn's window (127, 0)"),
)}


def get(name: str) -> Preset:
    """The preset ``name``; UsageError naming the choices."""
    if name not in PRESETS:
        # the names alone would pass 120 columns: `cpbench models` lists them with sources
        raise UsageError(f"unknown model {name!r}{did_you_mean(name, PRESETS)}; "
                         "`cpbench models` lists the presets")
    return PRESETS[name]


def resolve(name: str | None, given: Mapping[str, Any]
            ) -> tuple[dict[str, Any], dict[str, tuple[Any, Any]]]:
    """(the ``AttentionConfig`` fields: preset ``name``'s under ``given``'s, the overrides:
    field → (given, preset's) where a given field differs from the preset's). No name: the
    given fields as they are."""
    if name is None:
        return dict(given), {}
    entry = get(name)
    preset = entry.fields()
    overrides = {k: (v, preset.get(k)) for k, v in given.items()
                 if k in preset and v != preset[k]}
    for k in ("kv_heads", "v_head_dim"):  # left out where equal: an override all the same
        if given.get(k) not in (None, getattr(entry, k)) and k not in preset:
            overrides[k] = (given[k], getattr(entry, k))
    fields = {k: v for k, v in {**preset, **given}.items() if v is not None}
    return fields, overrides


def note(name: str, overrides: Mapping[str, tuple[Any, Any]]) -> str:
    """The one line a command prints for ``--model``: the preset's shape and what the flags
    beside it changed."""
    line = f"--model {name}: {get(name).shape()}"
    if overrides:
        line += "; overridden: " + ", ".join(
            f"{flag(k)} {_text(v)} (preset {_text(was)})" for k, (v, was) in overrides.items())
    return line


def _text(value: Any) -> str:
    """A value as its flag takes it: ``127,0``; on / off; none (no window)."""
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else str(value)
