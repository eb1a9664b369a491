"""The strategy registry: duplicate names are a ValueError; a third-party entry point that
fails to load is skipped with a warning instead of breaking every command; the names are
known, and checked, without importing a strategy (or torch)."""

from __future__ import annotations

import logging
import subprocess
import sys
from importlib.metadata import EntryPoint

import pytest

from cpbench import strategies
from cpbench.strategies.zigzag import Zigzag


@pytest.fixture
def plugins(monkeypatch):
    """Install fake entry points; the registry reloads with them and is restored after."""
    strategies.names()  # the built-ins, loaded once
    monkeypatch.setattr(strategies, "_REGISTRY", dict(strategies._REGISTRY))
    monkeypatch.setattr(strategies, "_loaded", False)

    def install(*eps):
        monkeypatch.setattr(strategies, "entry_points",
                            lambda group: list(eps) if group == "cpbench.strategies" else [])
    return install


def _ep(name, value):
    return EntryPoint(name=name, value=value, group="cpbench.strategies")


class Zigzag2(Zigzag):
    name = "zigzag-2"


class NotZigzag(Zigzag):
    name = "zigzag"


def test_third_party_strategy_registers(plugins):
    plugins(_ep("z2", f"{__name__}:Zigzag2"))
    assert strategies.get("zigzag-2") is Zigzag2


def test_broken_entry_point_is_skipped_with_a_warning(plugins, caplog):
    plugins(_ep("gone", "no_such_module_xyz:Strategy"), _ep("odd", "math:pi"),
            _ep("z2", f"{__name__}:Zigzag2"))
    with caplog.at_level(logging.WARNING, logger="cpbench.strategies"):
        names = strategies.names()
    assert "zigzag-2" in names and "zigzag" in names
    assert "'gone'" in caplog.text and "ModuleNotFoundError" in caplog.text
    assert "'odd'" in caplog.text and "not a Strategy subclass" in caplog.text


def test_duplicate_name_is_a_value_error(plugins):
    plugins(_ep("dup", f"{__name__}:NotZigzag"))
    with pytest.raises(ValueError, match="two strategies are named 'zigzag'.*NotZigzag"):
        strategies.names()
    strategies.register(Zigzag)  # the same class again is fine


def test_the_names_known_without_importing_are_the_loaded_registrys():
    """``BUILTIN`` (what the CLI checks names against before torch is imported) lists every
    strategy this package registers, each under the module that registers it."""
    own = {n: strategies.get(n).__module__ for n in strategies.names()
           if strategies.get(n).__module__.startswith("cpbench.strategies.")}
    assert own == {n: f"cpbench.strategies.{m}" for n, m in strategies.BUILTIN.items()}
    assert set(strategies.known_names()) >= set(strategies.names())


def test_a_module_registering_an_unlisted_name_is_refused():
    class Unlisted(Zigzag):
        name = "zigzag-unlisted"
    Unlisted.__module__ = "cpbench.strategies.zigzag"
    with pytest.raises(AssertionError, match="list it in cpbench.strategies.BUILTIN"):
        strategies.register(Unlisted)


def test_names_are_checked_without_importing_a_strategy():
    code = ("import sys\nfrom cpbench import strategies\n"
            "strategies.check_names(['zigzag', 'all'])\n"
            "try:\n    strategies.check_names(['zigzg'])\nexcept ValueError as e:\n"
            "    print(e)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or "
            "m.startswith('cpbench.strategies.')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    said, imported = done.stdout.splitlines()
    assert said == "unknown strategy 'zigzg' (did you mean zigzag?); see cpbench strategies"
    assert imported == "[]"
