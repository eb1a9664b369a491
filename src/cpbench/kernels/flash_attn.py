"""flash-attn 2 and FlashAttention-3 (Hopper) through their internal, lse-returning functions.

The public ``flash_attn_func`` hides the lse we need for merging, so we call the private
``_flash_attn_forward`` / ``_flash_attn_backward``. Their signatures are not stable:

- flash-attn < 2.7 takes ``window_size`` as a tuple (added in 2.3; softcap in 2.6; alibi in
  2.4; deterministic in 2.5) and returns (out, q, k, v, out_padded, softmax_lse, S_dmask[,
  rng_state]);
- flash-attn >= 2.7 takes ``window_size_left`` / ``window_size_right`` and returns (out,
  softmax_lse, S_dmask, rng_state); with torch >= 2.4 the functions are ``torch.library``
  custom ops, whose Python signature is just (*args, **kwargs);
- FA3 (``flash_attn_interface`` module of hopper/) went from (q, k, v, softmax_scale, causal,
  ...) returning a 7-tuple to ~35 mostly-optional parameters returning (out, softmax_lse,
  ...); its backward calls causal ``is_causal`` since mid 2025.

So we read the real parameter names and map our arguments onto them by keyword; the mapping
functions are pure so tests can check them against every signature without a GPU.
Causal with seq_q != seq_k is bottom-right aligned in flash-attn (>= 2.1), unlike the torch
reference, hence ``causal_unequal=False``. flash-attn 2 also offers the varlen contract
(``_flash_attn_varlen_forward`` / ``_backward``, mapped the same way), which masked blocks
(documents, windows) run on; FA3 does not here: its varlen is a second API generation to map
(the 2024 separate function, the 2025 single forward), left for when it is needed.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from importlib import metadata
from typing import Any, Collection, Sequence

import torch

from cpbench.kernels.base import ALIGN_BYTES as ALIGN_BYTES  # re-exported
from cpbench.kernels.base import KernelBackend, check_shapes, cuda_flash, flash_ready

NO_WINDOW = (-1, -1)  # flash-attn's "no sliding window"

# Inputs that some FA3 version has and that we never use (varlen, paged/appended KV, rotary,
# fp8 descaling, a preallocated out). None means "not given" in every version.
_FA3_UNUSED_INPUTS = (
    "k_new", "v_new", "qv", "out_", "cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_k_new",
    "seqused_q", "seqused_k", "sequed_q", "sequed_k", "max_seqlen_q", "max_seqlen_k",
    "page_table", "kv_batch_idx", "leftpad_k", "rotary_cos", "rotary_sin", "seqlens_rotary",
    "q_descale", "k_descale", "v_descale", "descale_q", "descale_k", "descale_v",
    "scheduler_metadata",
)


def _pick(candidates: dict[str, Any], params: Sequence[str], required: Collection[str],
          what: str) -> dict[str, Any]:
    """The candidates the function accepts; fail loudly if it needs one we cannot fill."""
    missing = [p for p in required if p not in candidates]
    if missing:
        raise TypeError(f"{what} requires {missing}, unknown to cpbench: unsupported version")
    return {name: candidates[name] for name in params if name in candidates}


def _window_and_softcap() -> dict[str, Any]:
    # Both spellings are offered; _pick keeps whichever the version has.
    return dict(window_size=NO_WINDOW, window_size_left=-1, window_size_right=-1, softcap=0.0)


def fa2_forward_kwargs(params: Sequence[str], *, q, k, v, dropout_p: float,
                       softmax_scale: float, causal: bool,
                       required: Collection[str] = ()) -> dict[str, Any]:
    cand = dict(q=q, k=k, v=v, dropout_p=dropout_p, softmax_scale=softmax_scale,
                causal=causal, alibi_slopes=None, return_softmax=False,
                **_window_and_softcap())
    return _pick(cand, params, required, "flash_attn._flash_attn_forward")


def fa2_backward_kwargs(params: Sequence[str], *, dout, q, k, v, out, softmax_lse, dq, dk, dv,
                        dropout_p: float, softmax_scale: float, causal: bool,
                        deterministic: bool = False,
                        required: Collection[str] = ()) -> dict[str, Any]:
    cand = dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=softmax_lse, dq=dq, dk=dk, dv=dv,
                dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                alibi_slopes=None, deterministic=deterministic, rng_state=None,
                **_window_and_softcap())
    return _pick(cand, params, required, "flash_attn._flash_attn_backward")


def fa3_forward_kwargs(params: Sequence[str], *, q, k, v, softmax_scale: float, causal: bool,
                       required: Collection[str] = ()) -> dict[str, Any]:
    # Tuning knobs (num_splits, pack_gqa, sm_margin, ...) are left at the library's defaults.
    cand = dict.fromkeys(_FA3_UNUSED_INPUTS)
    cand.update(q=q, k=k, v=v, out=None, softmax_scale=softmax_scale, causal=causal,
                attention_chunk=0, **_window_and_softcap())
    return _pick(cand, params, required, "flash_attn_interface._flash_attn_forward")


def fa3_backward_kwargs(params: Sequence[str], *, dout, q, k, v, out, softmax_lse, dq, dk, dv,
                        softmax_scale: float, causal: bool, deterministic: bool = False,
                        required: Collection[str] = ()) -> dict[str, Any]:
    cand = dict.fromkeys(_FA3_UNUSED_INPUTS)
    cand.update(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=softmax_lse, dq=dq, dk=dk, dv=dv,
                softmax_scale=softmax_scale, causal=causal, is_causal=causal,
                deterministic=deterministic, **_window_and_softcap())
    return _pick(cand, params, required, "flash_attn_interface._flash_attn_backward")


def _window(window: tuple[int, int]) -> dict[str, Any]:
    left, right = (int(x) for x in window)
    return dict(window_size=(left, right), window_size_left=left, window_size_right=right,
                softcap=0.0)


_VARLEN_UNUSED = dict(alibi_slopes=None, block_table=None, leftpad_k=None, seqused_k=None,
                      zero_tensors=False, rng_state=None)


def fa2_varlen_forward_kwargs(params: Sequence[str], *, q, k, v, cu_q, cu_k, max_q: int,
                              max_k: int, softmax_scale: float, causal: bool,
                              window: tuple[int, int] = NO_WINDOW,
                              required: Collection[str] = ()) -> dict[str, Any]:
    cand = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=int(max_q),
                max_seqlen_k=int(max_k), dropout_p=0.0, softmax_scale=softmax_scale,
                causal=causal, return_softmax=False, **_VARLEN_UNUSED, **_window(window))
    return _pick(cand, params, required, "flash_attn._flash_attn_varlen_forward")


def fa2_varlen_backward_kwargs(params: Sequence[str], *, dout, q, k, v, out, softmax_lse, dq,
                               dk, dv, cu_q, cu_k, max_q: int, max_k: int,
                               softmax_scale: float, causal: bool,
                               window: tuple[int, int] = NO_WINDOW, deterministic: bool = False,
                               required: Collection[str] = ()) -> dict[str, Any]:
    cand = dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=softmax_lse, dq=dq, dk=dk, dv=dv,
                cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=int(max_q),
                max_seqlen_k=int(max_k), dropout_p=0.0, softmax_scale=softmax_scale,
                causal=causal, deterministic=deterministic, **_VARLEN_UNUSED,
                **_window(window))
    return _pick(cand, params, required, "flash_attn._flash_attn_varlen_backward")


# Where (out, lse) sit in each version's forward result, keyed by its length: 7 = FA2 2.0
# and FA3 before 2025, 8 = FA2 2.1-2.6 (adds rng_state), 4 = FA2 >= 2.7 and FA3 since 2025.
_OUT_LSE_INDEX = {4: (0, 1), 7: (0, 5), 8: (0, 5)}


def unpack_forward(result: Sequence[Any]) -> tuple[Any, Any]:
    """(out, softmax_lse) from whatever tuple this version's internal forward returned."""
    try:
        i_out, i_lse = _OUT_LSE_INDEX[len(result)]
    except KeyError:
        raise TypeError(f"unexpected {len(result)}-tuple from _flash_attn_forward") from None
    return result[i_out], result[i_lse]


def signature_params(fn) -> tuple[tuple[str, ...], frozenset[str]]:
    """(parameter names, those without a default) of a function or torch custom op."""
    fn = getattr(fn, "_init_fn", fn)  # torch.library.custom_op's CustomOpDef wraps the function
    schema = getattr(fn, "_schema", None) or getattr(getattr(fn, "default", None), "_schema", None)
    # OpOverload / OpOverloadPacket (torch.ops.flash_attn...)
    if schema is not None and hasattr(schema, "arguments"):
        args = schema.arguments
        return tuple(a.name for a in args), frozenset(a.name for a in args
                                                     if not a.has_default_value())
    sig = inspect.signature(fn)
    kinds = {p.kind for p in sig.parameters.values()}
    if kinds <= {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
        raise TypeError(f"cannot read the parameters of {fn!r}")
    names = tuple(n for n, p in sig.parameters.items() if p.kind not in
                  (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD))
    return names, frozenset(n for n in names if sig.parameters[n].default is inspect._empty)


@functools.lru_cache(maxsize=None)  # failures raise, so they are not cached
def _load(module: str):
    mod = importlib.import_module(module)
    if getattr(mod, "CPBENCH_CPU_INTERFACE", False):  # flash_attn_cpu.install()'s module
        raise ImportError(f"{module} is cpbench's CPU interface, not flash-attn")
    fwd, bwd = mod._flash_attn_forward, mod._flash_attn_backward
    return fwd, signature_params(fwd), bwd, signature_params(bwd)


def import_error(module: str) -> str | None:
    """Why ``module`` does not load, as its exception says it (one line), or None. Not only
    ImportError: a build against another torch or CUDA fails with OSError (a missing
    libcudart), RuntimeError or an undefined symbol, and that is what the user must see. A
    module not there says so without its type's name (the line has 120 columns)."""
    try:
        _load(module)
    except ModuleNotFoundError as e:
        return " ".join(str(e).split())
    except Exception as e:
        return " ".join(f"{type(e).__name__}: {e}".split())
    return None


def _importable(module: str) -> bool:
    return import_error(module) is None


def provenance(module: str) -> dict | None:
    """The installed distribution behind ``module`` (FA3 installs as flashattn-hopper,
    flash_attn or flash_attn_3, depending on the build), its version and file."""
    if not _importable(module):
        return None
    mod = importlib.import_module(module)
    dists = metadata.packages_distributions().get(module.split(".")[0], [])
    dist = dists[0] if dists else None
    version = metadata.version(dist) if dist else getattr(mod, "__version__", None)
    return {"module": module, "distribution": dist, "version": version,
            "path": getattr(mod, "__file__", None)}


def fa3_generation(forward_params: Sequence[str]) -> int:
    """2024 for the first FA3 builds (``_flash_attn_forward(q, k, v, softmax_scale, causal,
    ...)``, varlen a separate function), 2025 for the one forward with ``cu_seqlens_q``."""
    return 2025 if "cu_seqlens_q" in forward_params else 2024


def fa3_limits_for(capability: tuple[int, int] | None, generation: int, dtype: torch.dtype,
                   head_dim: int) -> str | None:
    """Why FA3 cannot run forward and backward here, or None (pure: tests give it any GPU and
    build). ``capability``: the GPU's (major, minor), None when unknown (planned elsewhere)."""
    if capability is not None and capability[0] != 9:
        return (f"flash-attn3 needs a Hopper GPU (sm90); this one is "
                f"sm{capability[0]}{capability[1]}")
    if generation == 2024:
        if head_dim not in (64, 128):  # forward: 64, 128, 256; backward: up to 128
            return (f"this flash-attn3 build (2024 API) runs the forward at head_dim 64, 128 "
                    f"or 256 and the backward up to 128, got {head_dim}; update it")
        if dtype != torch.float16:
            return "this flash-attn3 build (2024 API) runs the backward in fp16 only; update it"
    return None


def _fa3_limits(device: str, dtype: torch.dtype, head_dim: int) -> str | None:
    capability = torch.cuda.get_device_capability() if device == "cuda" and \
        torch.cuda.is_available() else None
    _, (params, _), _, _ = _load(FA3_MODULE)
    return fa3_limits_for(capability, fa3_generation(params), dtype, head_dim)


_ready = flash_ready  # the guard every CUDA flash kernel's inputs pass (kernels.base)


def forward_inputs(q, k, v) -> tuple[torch.Tensor, ...]:
    """q, k, v as the forward kernel gets them."""
    return tuple(_ready(t) for t in (q, k, v))


def backward_inputs(dout, q, k, v, out, lse) -> tuple[torch.Tensor, ...]:
    """dout, q, k, v, out, lse as the backward kernel gets them. lse is read as a dense fp32
    (b, h, s) array: a zigzag half of it is a strided view, always copied (small)."""
    q, k, v = (_ready(t) for t in (q, k, v))
    # out and dout may come from an fp32 merge but must match q's dtype
    dout, out = _ready(dout.to(q.dtype)), _ready(out.to(q.dtype))
    return dout, q, k, v, out, _ready(lse.float().contiguous())


def _make_fns(module: str, fwd_map, bwd_map):
    def forward(q, k, v, *, causal: bool, softmax_scale: float):
        check_shapes(q, k, v, causal)
        fn, (params, required), _, _ = _load(module)
        q, k, v = forward_inputs(q, k, v)
        kwargs = fwd_map(params, q=q, k=k, v=v, softmax_scale=float(softmax_scale),
                         causal=bool(causal), required=required)
        return unpack_forward(fn(**kwargs))

    def backward(dout, q, k, v, out, lse, *, causal: bool, softmax_scale: float):
        check_shapes(q, k, v, causal)
        _, _, fn, (params, required) = _load(module)
        # The kernels take any strides with a unit last one (flash-attn 2.8's own backward
        # only fixes a non-unit last stride): copy only then (or for a misaligned base), not
        # the half-blocks a ring hands over for batch > 1 (a copy in the timed region).
        # (flash-attn 2.0.x gave wrong grads for a non-contiguous dout, issue #355: >= 2.1.)
        dout, q, k, v, out, lse = backward_inputs(dout, q, k, v, out, lse)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        fn(**bwd_map(params, dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk,
                     dv=dv, softmax_scale=float(softmax_scale), causal=bool(causal),
                     required=required))
        return dq, dk, dv  # written in place; the return value differs across versions

    return forward, backward


@functools.lru_cache(maxsize=None)
def _load_varlen(module: str):
    _load(module)  # the same checks (a real flash-attn, not cpbench's CPU interface)
    mod = importlib.import_module(module)
    fwd, bwd = mod._flash_attn_varlen_forward, mod._flash_attn_varlen_backward
    return fwd, signature_params(fwd), bwd, signature_params(bwd)


def _varlen_lse(lse: torch.Tensor, total_q: int) -> torch.Tensor:
    # (heads, total_q) in flash-attn 2.8.3 (its fake impl and varlen_fwd); older releases
    # padded it to (batch, heads, max_seqlen_q), which would need the sequence lengths on
    # the host to unpad (a sync): refused rather than guessed
    if lse.dim() != 2 or lse.shape[1] != total_q:
        raise TypeError(f"flash-attn's varlen lse has shape {tuple(lse.shape)}, not (heads, "
                        f"{total_q}): this version pads it; update flash-attn")
    return lse


def _make_varlen_fns(module: str, loader=None):
    """varlen_forward / varlen_backward of the kernel contract (kernels.base) through
    ``module``'s ``_flash_attn_varlen_forward`` / ``_backward`` (``loader``: tests)."""
    load = loader or (lambda: _load_varlen(module))

    def varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, *, causal: bool,
                       softmax_scale: float, window=NO_WINDOW):
        fn, (params, required), _, _ = load()
        q, k, v = forward_inputs(q, k, v)
        out, lse = unpack_forward(fn(**fa2_varlen_forward_kwargs(
            params, q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k,
            softmax_scale=float(softmax_scale), causal=bool(causal), window=tuple(window),
            required=required)))
        return out, _varlen_lse(lse, q.shape[0])

    def varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, causal: bool,
                        softmax_scale: float, window=NO_WINDOW):
        _, _, fn, (params, required) = load()
        q, k, v = (_ready(t) for t in (q, k, v))
        dout, out = _ready(dout.to(q.dtype)), _ready(out.to(q.dtype))
        lse = _ready(lse.float().contiguous())
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        fn(**fa2_varlen_backward_kwargs(
            params, dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv,
            cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k, softmax_scale=float(softmax_scale),
            causal=bool(causal), window=tuple(window), required=required))
        return dq, dk, dv  # written in place

    return varlen_forward, varlen_backward


FA2_MODULE = "flash_attn.flash_attn_interface"
FA3_MODULE = "flash_attn_interface"  # hopper/setup.py installs it as a top-level module


def _backend(module: str, name: str, description: str, fwd_map, bwd_map,
             **fields: Any) -> KernelBackend:
    """The CUDA flash kernel behind ``module``'s internal functions (``fwd_map`` and
    ``bwd_map``: its API's keyword arguments)."""
    forward, backward = _make_fns(module, fwd_map, bwd_map)
    return cuda_flash(name=name, description=description, forward=forward, backward=backward,
                      is_importable=lambda: _importable(module),
                      import_error=lambda: import_error(module),
                      provenance=lambda: provenance(module), **fields)


_fa2_varlen_fwd, _fa2_varlen_bwd = _make_varlen_fns(FA2_MODULE)
FLASH_ATTN = _backend(FA2_MODULE, "flash-attn",
                      "flash-attn 2 (_flash_attn_forward/_flash_attn_backward), CUDA",
                      functools.partial(fa2_forward_kwargs, dropout_p=0.0),
                      functools.partial(fa2_backward_kwargs, dropout_p=0.0),
                      varlen_forward=_fa2_varlen_fwd, varlen_backward=_fa2_varlen_bwd)
FLASH_ATTN3 = _backend(FA3_MODULE, "flash-attn3",
                       "FlashAttention-3 for Hopper (flash_attn_interface), CUDA sm90",
                       fa3_forward_kwargs, fa3_backward_kwargs, limits=_fa3_limits)
