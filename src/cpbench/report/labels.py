"""How a row is named in every table, plot and progress line: ``strategy (options)``."""

from __future__ import annotations

from typing import Iterable


def options_label(record: dict) -> str:
    """The options that set this row apart, as the strategy resolved them: a placement bare,
    the others as k=v where they differ from the strategy's defaults (an automatic 0 that
    resolved to 2 shows as 2) or are not options at all (e.g. a ring degree the strategy
    derived); "-" when none do."""
    cfg = record["config"]
    shown = {**cfg["options"], **(record.get("resolved") or {})}
    defaults = cfg.get("option_defaults", {})
    parts = [str(shown["placement"])] if "placement" in shown else []
    parts += [f"{k}={option_text(v)}" for k, v in shown.items()
              if k != "placement" and (k not in defaults or defaults[k] != v)]
    return " ".join(parts) or "-"


def option_text(value) -> str:
    """An option's value as labels print it; nested options (a composite strategy's inner
    one) as ``{k=v,…}``."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}={option_text(v)}" for k, v in value.items()) + "}"
    return str(value)


def joined(strategy: str, options: str) -> str:
    """``strategy (options)``, or the strategy alone when no option sets it apart ("-")."""
    return strategy if options == "-" else f"{strategy} ({options})"


def row_label(record: dict) -> str:
    """A record's row: ``strategy (options)``."""
    return joined(record["config"]["strategy"], options_label(record))


def head_dim_text(attention: dict) -> str:
    """The head dim, V's beside it where it has its own (MLA): ``192`` or ``192/128``."""
    dv = attention.get("v_head_dim")
    return f"{attention['head_dim']}" + (f"/{dv}" if dv is not None else "")


def window_text(attention: dict) -> str:
    """The seeds' "Window Size": flash-attn's (left, right), (-1, -1) when unbounded."""
    w = attention.get("window_size")
    return f"({w[0]}, {w[1]})" if w else "(-1, -1)"


def documents_text(attention: dict) -> str:
    """Packed documents in a cell: how many and the longest ("-" for one sequence)."""
    docs = attention.get("documents")
    return f"{len(docs)} (max {max(docs)})" if docs else "-"


def mask_text(attention: dict) -> str:
    """The mask in words: causal / full, within documents, with a window (and sinks, which
    the softmax of every row takes besides its keys)."""
    text = "causal" if attention["causal"] else "full"
    docs = attention.get("documents")
    if docs:
        shown = ",".join(map(str, docs[:8])) + (f",… ({len(docs)} in all)" if len(docs) > 8
                                                 else "")
        text += f" within documents {shown}"
    if attention.get("window_size"):
        text += f", window {window_text(attention)}"
    if attention.get("sinks"):
        text += ", sinks"
    return text


def rank_unit(records: list[dict]) -> str:
    """What one rank is, in headers and titles: "GPU" when every record ran (or was
    simulated) on CUDA devices, one rank each; "rank" otherwise (CPU processes, or ranks as
    threads sharing one device), so a CPU run never claims GPUs."""
    return unit_of((r["config"]["run"]["device"], (r.get("env") or {}).get("launcher"))
                   for r in records)


def unit_of(devices: Iterable[tuple[str, str | None]]) -> str:
    """``rank_unit`` from (device, launcher) pairs, e.g. a frame's rows."""
    pairs = list(devices)
    gpus = all(device == "cuda" and launcher != "threads" for device, launcher in pairs)
    return "GPU" if pairs and gpus else "rank"


def ranks_text(unit: str) -> str:
    """The unit's plural as a title says it: "GPUs", "ranks"."""
    return f"{unit}s"
