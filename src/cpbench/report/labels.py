"""How a row is named in every table, plot and progress line: ``strategy (options)``."""

from __future__ import annotations


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
