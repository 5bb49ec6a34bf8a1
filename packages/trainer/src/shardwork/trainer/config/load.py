"""TOML <-> :class:`TrainConfig`, with every key and value checked against the dataclasses.

- Unknown sections or keys are errors that list the valid ones (a typo never
  passes silently).
- Values are checked against the field's type (int, float, bool, str,
  Literal choices, lists, (step, size) pairs, dicts); ints are accepted for
  floats. TOML has no null: ``"none"`` sets an optional field to None, and
  :func:`config_to_toml` writes None that way, so printed configs load back.
- All problems are reported together in one :class:`ConfigError`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from shardwork.trainer.config.sections import TrainConfig
from shardwork.trainer.errors import UserError


class ConfigError(UserError, ValueError):
    """One or more configuration problems, each naming the field, the value and what is valid."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in self.problems))


def _describe(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return '"none"'
    if origin is list:
        return f"a list of {_describe(typing.get_args(annotation)[0])}"
    if origin is tuple:
        return "a pair [" + ", ".join(_describe(a) for a in typing.get_args(annotation)) + "]"
    if origin is dict:
        return "a table"
    return getattr(annotation, "__name__", str(annotation))


def _coerce(value: Any, annotation: Any) -> Any:
    """``value`` converted to ``annotation``, or raise TypeError."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        if type(None) in args and isinstance(value, str) and value.lower() == "none":
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg)
            except TypeError:
                continue
        raise TypeError
    if origin is Literal:
        if value in typing.get_args(annotation):
            return value
        raise TypeError
    if origin is list:
        if not isinstance(value, list):
            raise TypeError
        (item,) = typing.get_args(annotation)
        return [_coerce(v, item) for v in value]
    if origin is tuple:
        items = typing.get_args(annotation)
        if not isinstance(value, list | tuple) or len(value) != len(items):
            raise TypeError
        return tuple(_coerce(v, t) for v, t in zip(value, items))
    if origin is dict:
        if not isinstance(value, dict):
            raise TypeError
        _, item = typing.get_args(annotation)
        return {str(k): _coerce(v, item) for k, v in value.items()}
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise TypeError
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TypeError
    if annotation is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise TypeError
    if annotation is str:
        if isinstance(value, str):
            return value
        raise TypeError
    raise TypeError


def _build(cls: type, table: dict[str, Any], path: str, problems: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        where = f"{path}{key}"
        if key not in fields:
            problems.append(
                f"{where}: unknown key; valid keys in [{path.rstrip('.') or 'top level'}]: "
                + ", ".join(sorted(fields))
            )
            continue
        annotation = hints[key]
        if dataclasses.is_dataclass(annotation):
            if not isinstance(value, dict):
                problems.append(f"{where}={value!r}: must be a table [{where}]")
                continue
            kwargs[key] = _build(annotation, value, f"{where}.", problems)
            continue
        try:
            kwargs[key] = _coerce(value, annotation)
        except TypeError:
            problems.append(f"{where}={value!r}: invalid type; valid: {_describe(annotation)}")
    return cls(**kwargs)


def config_from_dict(table: dict[str, Any]) -> TrainConfig:
    """Build a :class:`TrainConfig` from nested dicts (a parsed TOML file); raise ConfigError."""
    problems: list[str] = []
    config = _build(TrainConfig, table, "", problems)
    if problems:
        raise ConfigError(problems)
    return config


def load_config(path: str | Path) -> TrainConfig:
    """Read a TOML config file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"--config={str(path)!r}: no such file"])
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"--config={str(path)!r}: not valid TOML ({exc})"]) from exc
    except OSError as exc:
        raise ConfigError([f"--config={str(path)!r}: cannot read it ({exc.strerror})"]) from exc
    return config_from_dict(table)


def _toml_key(key: str) -> str:
    """A bare TOML key when possible, else quoted ('moe.aux_loss_coeff' must stay one key)."""
    if re.fullmatch(r"[A-Za-z0-9_-]+", key):
        return key
    return json.dumps(key)


def _toml_value(value: Any) -> str:
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def config_to_toml(config: Any) -> str:
    """The config as TOML text that :func:`load_config` reads back to an equal config."""
    top: list[str] = []
    sections: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            lines = [f"[{f.name}]"]
            for sub in dataclasses.fields(value):
                lines.append(f"{sub.name} = {_toml_value(getattr(value, sub.name))}")
            sections.append("\n".join(lines))
        else:
            top.append(f"{f.name} = {_toml_value(value)}")
    return "\n".join(top) + "\n\n" + "\n\n".join(sections) + "\n"
