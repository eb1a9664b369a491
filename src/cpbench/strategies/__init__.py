"""The strategy registry: one module per strategy in this package, plus third-party
strategies from the ``cpbench.strategies`` entry-point group. The driver only sees names."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import pkgutil
from importlib.metadata import entry_points

from cpbench.config import flag
from cpbench.errors import UsageError, did_you_mean
from cpbench.settings import Setting, settings_of
from cpbench.strategies.base import Strategy

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "cpbench.strategies"
_REGISTRY: dict[str, type[Strategy]] = {}
_SUPPORT_MODULES = {"base", "layout", "schedule"}
_loaded = False


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    other = _REGISTRY.get(cls.name)
    if other is not None and other is not cls:
        raise UsageError(f"two strategies are named {cls.name!r}: "
                         f"{other.__module__}.{other.__qualname__} and "
                         f"{cls.__module__}.{cls.__qualname__}; rename or uninstall one")
    _REGISTRY[cls.name] = cls
    return cls


def _load() -> None:
    global _loaded
    if _loaded:
        return
    for mod in pkgutil.iter_modules(__path__):
        if mod.name not in _SUPPORT_MODULES and not mod.name.startswith("_"):
            importlib.import_module(f"{__name__}.{mod.name}")
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        # a broken plug-in must not take every command down with it
        try:
            cls = ep.load()
        except Exception as e:  # noqa: BLE001 - whatever its import raises
            log.warning("skipping strategy entry point %r (%s): %s: %s", ep.name, ep.value,
                        type(e).__name__, e)
            continue
        if not (isinstance(cls, type) and issubclass(cls, Strategy)):
            log.warning("skipping strategy entry point %r (%s): %r is not a Strategy "
                        "subclass", ep.name, ep.value, cls)
            continue
        register(cls)
    _loaded = True


def names() -> list[str]:
    _load()
    return sorted(_REGISTRY)


def own_names() -> list[str]:
    """cpbench's own strategies: those that declare their communication schedule (the
    adapters running a library's code, ``Strategy.upstream``, declare none)."""
    return [n for n in names() if get(n).upstream is None]


def get(name: str) -> type[Strategy]:
    _load()
    if name not in _REGISTRY:
        raise UsageError(f"unknown strategy {name!r}{did_you_mean(name, _REGISTRY)}; choose "
                         f"from: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def option_settings() -> dict[str, list[tuple[str, Setting]]]:
    """Option name → [(strategy, its Setting)] over every registered strategy, so the CLI
    and the sweep loader offer one flag / key per option, whichever strategies take it."""
    found: dict[str, list[tuple[str, Setting]]] = {}
    for name in names():
        for setting in settings_of(get(name).Options):
            found.setdefault(setting.name, []).append((name, setting))
    return found


def make_options(cls: type[Strategy], given: dict):
    """Build ``cls.Options`` from user-given values; reject options it does not take."""
    fields = {f.name: f for f in dataclasses.fields(cls.Options)}
    unknown = sorted(set(given) - set(fields))
    if unknown:
        takes = ", ".join(flag(n) for n in fields) or "no options"
        raise UsageError(f"strategy {cls.name} does not take "
                         f"{', '.join(flag(u) for u in unknown)}; it takes: {takes}")
    for name, value in given.items():
        choices = fields[name].metadata.get("choices")
        if choices and value not in choices:
            raise UsageError(f"{cls.name} {flag(name)} must be one of "
                             f"{', '.join(map(str, choices))}, got {value!r}")
    return cls.Options(**given)


__all__ = ["Strategy", "get", "make_options", "names", "option_settings", "own_names",
           "register"]
