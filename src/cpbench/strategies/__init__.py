"""The strategy registry: one module per strategy in this package, plus third-party
strategies from the ``cpbench.strategies`` entry-point group. The driver only sees names."""

from __future__ import annotations

import importlib
import logging
import pkgutil
from importlib.metadata import entry_points

from cpbench.strategies.base import Strategy

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "cpbench.strategies"
_REGISTRY: dict[str, type[Strategy]] = {}
_SUPPORT_MODULES = {"base", "layout"}
_loaded = False


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    other = _REGISTRY.get(cls.name)
    if other is not None and other is not cls:
        raise ValueError(f"two strategies are named {cls.name!r}: "
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


def get(name: str) -> type[Strategy]:
    _load()
    if name not in _REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; choose from: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def make_options(cls: type[Strategy], given: dict):
    """Build ``cls.Options`` from user-given values; reject options it does not take."""
    import dataclasses

    fields = {f.name: f for f in dataclasses.fields(cls.Options)}
    unknown = sorted(set(given) - set(fields))
    if unknown:
        takes = ", ".join(f"--{n.replace('_', '-')}" for n in fields) or "no options"
        raise ValueError(
            f"strategy {cls.name} does not take {', '.join('--' + u.replace('_', '-') for u in unknown)}"
            f"; it takes: {takes}"
        )
    for name, value in given.items():
        choices = fields[name].metadata.get("choices")
        if choices and value not in choices:
            raise ValueError(f"{cls.name} --{name.replace('_', '-')} must be one of "
                             f"{', '.join(map(str, choices))}, got {value!r}")
    return cls.Options(**given)


__all__ = ["Strategy", "get", "make_options", "names", "register"]
