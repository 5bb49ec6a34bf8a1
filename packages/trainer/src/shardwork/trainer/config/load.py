"""TOML <-> :class:`TrainConfig`, with every key and value checked against the dataclasses.

- Unknown sections or keys are errors that list the valid ones (a typo never
  passes silently).
- Values are checked against the field's type (:mod:`.values`); ``[model]`` keys against
  GPTConfig's own fields when the config is validated (:mod:`.model_settings`; reading stays
  torch-free). TOML has no null: ``"none"`` sets an optional
  field to None, and :func:`config_to_toml` writes None that way, so printed configs load back.
- All problems are reported together in one :class:`ConfigError`. A file in an older format
  that can be read unambiguously is converted, and each conversion is a notice on stderr.
"""

from __future__ import annotations

import dataclasses
import sys
import tomllib
import typing
from pathlib import Path
from typing import Any

from shardwork.trainer.config.model_table import convert_overrides
from shardwork.trainer.config.sections import ModelSection, TrainConfig
from shardwork.trainer.config.values import coerce_value, describe_type, dump_toml
from shardwork.trainer.errors import UserError


class ConfigError(UserError, ValueError):
    """One or more configuration problems, each naming the field, the value and what is valid."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in self.problems))


def read_model_section(table: dict[str, Any], problems: list[str], notices: list[str]):
    """The ``[model]`` table as a :class:`ModelSection`; its GPTConfig keys are checked by
    ``validate_config`` (that needs shardwork.models, which loads torch)."""
    table = convert_overrides(table, notices, problems)
    preset = table.get("preset")
    try:
        preset = None if preset is None else coerce_value(preset, str | None)
    except TypeError:
        problems.append(f'model.preset={preset!r}: invalid type; valid: a preset name or "none"')
        preset = None
    return ModelSection(preset=preset, settings={k: v for k, v in table.items() if k != "preset"})


def _build(cls: type, table: dict[str, Any], path: str, problems: list[str], notices) -> Any:
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
        if dataclasses.is_dataclass(annotation) and not isinstance(value, dict):
            problems.append(f"{where}={value!r}: must be a table [{where}]")
        elif annotation is ModelSection:
            kwargs[key] = read_model_section(value, problems, notices)
        elif dataclasses.is_dataclass(annotation):
            kwargs[key] = _build(annotation, value, f"{where}.", problems, notices)
        else:
            try:
                kwargs[key] = coerce_value(value, annotation)
            except TypeError:
                problems.append(
                    f"{where}={value!r}: invalid type; valid: {describe_type(annotation)}"
                )
    return cls(**kwargs)


def config_from_dict(table: dict[str, Any], notices: list[str] | None = None) -> TrainConfig:
    """Build a :class:`TrainConfig` from nested dicts (a parsed TOML file); raise ConfigError.
    Conversions of an older format are appended to ``notices`` (dropped when None)."""
    problems: list[str] = []
    config = _build(TrainConfig, table, "", problems, [] if notices is None else notices)
    if problems:
        raise ConfigError(problems + _model_key_problems(config))
    return config


def _model_key_problems(config: TrainConfig) -> list[str]:
    """The ``[model]`` table's unknown or mistyped keys, which ``validate_config`` checks after
    this module: added to this module's own problems, one run lists every mistake instead of
    showing the model's only once the rest is fixed."""
    if not config.model.settings:
        return []
    # A valid config parses torch-free; only this error path pays for loading torch.
    # deferred import: shardwork.models loads torch (seconds)
    from shardwork.models import GPTConfig
    from shardwork.trainer.config.model_settings import read_settings

    found: list[str] = []
    read_settings(GPTConfig, config.model.settings, "model", found)
    return found


def load_config(path: str | Path) -> TrainConfig:
    """Read a TOML config file; each conversion from an older format is a notice on stderr."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError([f"--config={str(path)!r}: is a directory; valid: a TOML file"])
    if not path.is_file():
        raise ConfigError([f"--config={str(path)!r}: no such file"])
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"--config={str(path)!r}: not valid TOML ({exc})"]) from exc
    except UnicodeDecodeError as exc:  # TOML is UTF-8 text: a binary or Latin-1 file
        raise ConfigError(
            [
                f"--config={str(path)!r}: not UTF-8 text, so not a TOML file ({exc.reason} at byte "
                f"{exc.start})"
            ]
        ) from None
    except OSError as exc:
        raise ConfigError([f"--config={str(path)!r}: cannot read it ({exc.strerror})"]) from exc
    notices: list[str] = []
    config = config_from_dict(table, notices)
    for notice in notices:
        print(f"shardwork-train: notice: {path}: {notice}", file=sys.stderr)
    return config


def config_table(config: Any) -> dict[str, Any]:
    """The config as nested dicts, in the shape of its TOML file."""
    table: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, ModelSection):
            table[f.name] = {"preset": value.preset, **value.settings}
        elif dataclasses.is_dataclass(value):
            table[f.name] = config_table(value)
        else:
            table[f.name] = value
    return table


def config_to_toml(config: Any) -> str:
    """The config as TOML text that :func:`load_config` reads back to an equal config."""
    return dump_toml(config_table(config))
