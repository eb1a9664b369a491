"""The dataclass → setting schema: one ``Setting`` per field of the config dataclasses (and of
each strategy's ``Options``), which the CLI turns into a flag and the sweep loader uses to read
YAML values. Both read the same schema, so a flag and a sweep key mean the same thing."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from cpbench.config import (
    ATTENTION_HELP,
    ATTENTION_PARSE,
    DTYPE_NAMES,
    PADDINGS,
    AttentionConfig,
    RunConfig,
    flag,
)
from cpbench.errors import UsageError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


def base_type(annotation: Any) -> type:
    """int for ``int | None``; the annotation itself otherwise."""
    base: type = annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        base = next(a for a in typing.get_args(annotation) if a is not type(None))
    return base


@dataclass(frozen=True)
class Setting:
    """One field as a setting: its name, value type and how its text form is read."""

    name: str
    type: type
    help: str = ""
    choices: tuple[Any, ...] | None = None
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    default: Any = None

    @property
    def flag(self) -> str:
        return flag(self.name)

    @property
    def what(self) -> str:
        """What a value is, for messages: "an integer", "a number", or the type's name."""
        names: dict[object, str] = {int: "an integer", float: "a number"}
        return names.get(self.parse or self.type, self.type.__name__)

    def from_text(self, text: str) -> Any:
        """The value of ``text`` as given on the command line; UsageError when unreadable."""
        parse = self.parse or self.type
        try:
            return parse(text)
        except UsageError:
            raise
        except (TypeError, ValueError) as e:
            if parse in (int, float):
                raise UsageError(f"cannot read {text!r} as {self.what}") from None
            raise UsageError(str(e)) from None

    def from_yaml(self, value: Any) -> Any:
        """The value of a YAML scalar (a sweep setting); UsageError when it does not fit."""
        if value is None:
            return None
        if self.name in ("strategy", "documents", "window_size") and isinstance(value, list):
            value = ",".join(map(str, value))  # a YAML list: the flag's comma list
        if self.type is bool:
            if not isinstance(value, bool):
                raise UsageError(f"{self.name} must be true or false, got {value!r}")
            return value
        if self.parse is not None:
            return self.from_text(str(value))
        if self.type in (int, float) and isinstance(value, bool):
            raise UsageError(f"{self.name} must be a number, got {value!r}")
        try:
            return self.type(value)
        except (TypeError, ValueError):
            raise UsageError(f"cannot read {self.name}: {value!r} as "
                             f"{self.type.__name__}") from None


def settings_of(cls: type[DataclassInstance], *, help_map: Mapping[str, str] | None = None,
                parse_map: Mapping[str, Callable[[str], Any]] | None = None,
                choices_map: Mapping[str, tuple[Any, ...]] | None = None) -> list[Setting]:
    """The settings of a dataclass's fields; field metadata (``config.arg``,
    ``strategies.base.option``) first, then the maps given."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata
        out.append(Setting(
            name=f.name, type=base_type(hints[f.name]),
            help=meta.get("help") or (help_map or {}).get(f.name, ""),
            choices=meta.get("choices") or (choices_map or {}).get(f.name),
            parse=meta.get("parse") or (parse_map or {}).get(f.name),
            metavar=meta.get("metavar"), default=f.default))
    return out


def attention_settings() -> list[Setting]:
    return settings_of(AttentionConfig, help_map=ATTENTION_HELP, parse_map=ATTENTION_PARSE,
                       choices_map={"dtype": DTYPE_NAMES,
                                     "document_padding": PADDINGS})


def run_settings() -> list[Setting]:
    return settings_of(RunConfig)


def split(given: dict[str, Any]
          ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Settings by name → (RunConfig fields, AttentionConfig fields, strategy options)."""
    run_names = {f.name for f in dataclasses.fields(RunConfig)}
    attn_names = {f.name for f in dataclasses.fields(AttentionConfig)}
    run = {k: v for k, v in given.items() if k in run_names and v is not None}
    attention = {k: v for k, v in given.items() if k in attn_names and v is not None}
    options = {k: v for k, v in given.items()
               if k not in run_names | attn_names and v is not None}
    return run, attention, options
