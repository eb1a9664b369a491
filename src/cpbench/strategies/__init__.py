"""The strategy registry: one module per strategy in this package, plus third-party
strategies from the ``cpbench.strategies`` entry-point group. The driver only sees names.

The names are known without importing a strategy (``known_names``, ``check_names``): the
strategy modules import torch, which takes seconds, and the CLI checks ``--strategy`` (and
answers ``--help``) before it needs any; the modules are imported on the first ``get``."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import pkgutil
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Iterable

from cpbench.config import flag
from cpbench.errors import UsageError, did_you_mean
from cpbench.settings import Setting, settings_of

if TYPE_CHECKING:
    from cpbench.strategies.base import Strategy

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "cpbench.strategies"
# cpbench's own names, each with the module of this package that registers it: what the CLI
# checks names against before anything is imported. ``register`` refuses a module of this
# package registering a name it does not list here, so the two cannot drift apart.
BUILTIN: dict[str, str] = {
    "burst": "burst", "double-ring": "double_ring", "llama3": "llama3", "local": "local",
    "megatron-cp": "megatron_cp", "megatron-cp-a2a+p2p": "megatron_cp_a2a_p2p",
    "rfa-llama3": "rfa", "rfa-ring": "rfa", "rfa-stripe": "rfa", "rfa-zigzag": "rfa",
    "ring": "ring", "te-a2a": "te", "te-a2a+p2p": "te", "te-all-gather": "te", "te-p2p": "te",
    "torch-flex": "torch_flex", "torch-ring": "torch_ring", "ulysses": "ulysses", "usp": "usp",
    "yunchang-usp": "yunchang_usp", "zigzag": "zigzag",
}
_REGISTRY: dict[str, type[Strategy]] = {}
_SUPPORT_MODULES = {"base", "layout", "schedule"}
_loaded = False


def __getattr__(name: str) -> Any:  # ``Strategy`` imports torch: only when it is asked for
    if name == "Strategy":
        from cpbench.strategies.base import Strategy

        return Strategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    module = cls.__module__.removeprefix(f"{__name__}.")
    if cls.__module__.startswith(f"{__name__}.") and BUILTIN.get(cls.name) != module:
        raise AssertionError(f"{cls.__module__} registers {cls.name!r}: list it in "
                             f"{__name__}.BUILTIN")
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
    from cpbench.strategies.base import Strategy

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


def known_names() -> list[str]:
    """The names ``names`` gives, without importing a strategy: cpbench's own, those
    registered so far, and the installed plug-ins' entry-point names."""
    plugins = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return sorted(set(BUILTIN) | set(_REGISTRY) | plugins)


def unknown_error(name: str, known: Iterable[str]) -> UsageError:
    return UsageError(f"unknown strategy {name!r}{did_you_mean(name, list(known), str)}; "
                      "see cpbench strategies")


def check_names(given: Iterable[str]) -> None:
    """UsageError for the first unknown name in ``given`` ("all" is every one), without
    importing a strategy unless a plug-in is installed whose entry point is named otherwise
    than its strategy (then the plug-ins are loaded to be sure)."""
    unknown = [n for n in given if n != "all" and n not in known_names()]
    if unknown and not _loaded and any(True for _ in entry_points(group=ENTRY_POINT_GROUP)):
        unknown = [n for n in unknown if n not in names()]
    if unknown:
        raise unknown_error(unknown[0], known_names())


def own_names() -> list[str]:
    """cpbench's own strategies: those that declare their communication schedule (the
    adapters running a library's code, ``Strategy.upstream``, declare none)."""
    return [n for n in names() if get(n).upstream is None]


def get(name: str) -> type[Strategy]:
    _load()
    if name not in _REGISTRY:
        raise unknown_error(name, _REGISTRY)
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


__all__ = ["BUILTIN", "Strategy", "check_names", "get", "known_names", "make_options",
           "names", "option_settings", "own_names", "register"]
