"""The ``[model]`` settings checked against GPTConfig's own fields, and applied to a base model.

- Names and types come from the dataclasses themselves (GPTConfig, MoEConfig, RouterConfig,
  MLAConfig, MTPConfig, the rope scalings), so the trainer declares no model field of its own
  and a new GPTConfig field is configurable the day it exists.
- Fields another section decides are refused, naming that section (``params_dtype`` is
  ``precision.dtype``, the seeds are ``seed``, ...); the router's ``hidden_size`` is the model's.
- :func:`apply_model_settings` applies checked settings to a base GPTConfig: the model's own
  fields first, then each nested table, changing the base's nested config or building one.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from shardwork.fused_kernels import Llama3RopeScaling, YarnRopeScaling
from shardwork.models import (
    GatedDeltaNetConfig,
    GPTConfig,
    MambaConfig,
    MLAConfig,
    MoEConfig,
    MTPConfig,
)
from shardwork.moe_router import RouterConfig
from shardwork.trainer.config.values import coerce_value, describe_type

#: Classes named in GPTConfig's annotations, for ``typing.get_type_hints``: config.py imports
#: the nested configs only for type checking, so their names must be supplied.
_TYPE_NAMES = {
    c.__name__: c
    for c in (
        MoEConfig,
        MLAConfig,
        MTPConfig,
        MambaConfig,
        RouterConfig,
        Llama3RopeScaling,
        YarnRopeScaling,
        GatedDeltaNetConfig,
    )
}

#: (class, field) that the model table may not set, and the setting that decides it.
OWNED_ELSEWHERE: dict[tuple[type, str], str] = {
    (GPTConfig, "params_dtype"): "precision.dtype",
    (GPTConfig, "compute_dtype"): "precision.dtype",
    (GPTConfig, "sequence_parallel"): "parallel.sequence_parallel",
    (GPTConfig, "init_seed"): "seed",
    (GPTConfig, "dropout_seed"): "seed",
    (RouterConfig, "hidden_size"): "model.hidden_size (the router reads the hidden states)",
}

#: Fields a nested config built from a table takes from the model when the table omits them.
FROM_MODEL: dict[tuple[type, str], str] = {
    (RouterConfig, "hidden_size"): "hidden_size",
    (RouterConfig, "init_std"): "init_method_std",
}


def config_fields(cls: type) -> dict[str, Any]:
    """``{field name: resolved annotation}`` of the settable fields of dataclass ``cls``."""
    hints = typing.get_type_hints(cls, localns=_TYPE_NAMES)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def nested_classes(annotation: Any) -> tuple[type, ...]:
    """The dataclasses an annotation admits (``MoEConfig | None`` → ``(MoEConfig,)``)."""
    members = typing.get_args(annotation) or (annotation,)
    return tuple(m for m in members if dataclasses.is_dataclass(m))


def _read_table(classes: tuple[type, ...], table: dict, where: str, problems: list[str]) -> dict:
    """``table`` checked against the fields of one of ``classes`` (a union such as
    ``rope_scaling`` admits several): the first class that takes every key reads it."""
    trial: list[str] = []
    for cls in classes:
        trial = []
        out = read_settings(cls, table, where, trial)
        if not trial:
            return out
    problems.extend(trial)
    return {}


def read_settings(cls: type, table: dict[str, Any], where: str, problems: list[str]) -> dict:
    """The keys of ``table`` checked as fields of ``cls`` (nested tables recursively); each
    problem names ``where.key``, the value and what is valid."""
    fields = config_fields(cls)
    out: dict[str, Any] = {}
    for key, value in table.items():
        at = f"{where}.{key}"
        if key not in fields:
            settable = [k for k in fields if (cls, k) not in OWNED_ELSEWHERE]
            if cls is GPTConfig:
                settable.append("preset")
            problems.append(
                f"{at}: unknown key; valid keys in [{where}] ({cls.__name__}): "
                + ", ".join(sorted(settable))
            )
            continue
        owner = OWNED_ELSEWHERE.get((cls, key))
        if owner is not None:
            problems.append(f"{at}: not set in [{where}]; it is {owner}")
            continue
        classes = nested_classes(fields[key])
        if classes and isinstance(value, dict):
            out[key] = _read_table(classes, value, at, problems)
            continue
        try:
            out[key] = coerce_value(value, fields[key])
        except TypeError:
            problems.append(f"{at}={value!r}: invalid type; valid: {describe_type(fields[key])}")
    return out


def _build_nested(cls: type, settings: dict[str, Any], model: GPTConfig, where: str) -> Any:
    """A new ``cls`` from ``settings``: a nested config the base model does not have yet (a
    dense preset given ``[model.moe]``), so the table must hold its required fields."""
    taken = set(settings) | {name for owner, name in FROM_MODEL if owner is cls}
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.init
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and f.name not in taken
    ]
    if missing:
        raise ValueError(
            f"[{where}]: builds a new {cls.__name__} (the base model has none) and must set "
            + ", ".join(missing)
        )
    kwargs = {}
    for name, value in settings.items():
        if isinstance(value, dict):
            classes = nested_classes(config_fields(cls)[name])
            kwargs[name] = _build_nested(_pick(classes, value), value, model, f"{where}.{name}")
        else:
            kwargs[name] = value
    for (owner, name), model_field in FROM_MODEL.items():
        if owner is cls and name not in kwargs:
            kwargs[name] = getattr(model, model_field)
    return cls(**kwargs)


def _pick(classes: tuple[type, ...], settings: dict[str, Any]) -> type:
    """The class of a union whose fields take every key of ``settings``."""
    for cls in classes:
        if set(settings) <= set(config_fields(cls)):
            return cls
    return classes[0]


def _takes(current: Any, settings: dict[str, Any]) -> bool:
    """Whether ``current``'s class has every key of ``settings`` (a ``[model.rope_scaling]``
    of YaRN keys on a Llama-3-scaled preset builds a new YaRN config instead)."""
    return set(settings) <= set(config_fields(type(current)))


def _nested_after(owner: Any, name: str, table: dict[str, Any], model: GPTConfig, where: str):
    """The nested config ``owner.name`` with ``table`` applied: the owner's own one changed, or
    a new one built when it has none (or one of another class, see :func:`_takes`)."""
    current = getattr(owner, name)
    if current is None or not _takes(current, table):
        classes = nested_classes(config_fields(type(owner))[name])
        return _build_nested(_pick(classes, table), table, model, where)
    changes = {
        key: _nested_after(current, key, value, model, f"{where}.{key}")
        if isinstance(value, dict)
        else value
        for key, value in table.items()
    }
    return dataclasses.replace(current, **changes)


class _WithChanges:
    """``base`` read through ``changes`` (attribute lookups only; never validated itself)."""

    def __init__(self, base: GPTConfig, changes: dict[str, Any]) -> None:
        self._base, self._changes = base, changes

    def __getattr__(self, name: str) -> Any:
        return self._changes[name] if name in self._changes else getattr(self._base, name)


def apply_model_settings(base: GPTConfig, settings: dict[str, Any]) -> GPTConfig:
    """``base`` with the checked ``settings`` applied: the model's own fields first (so a new
    ``hidden_size`` reaches the router, see ``GPTConfig.replace``), then each nested table,
    changing the base's nested config or building one it lacks. Raises ValueError (from the
    configs' own checks) naming the field."""
    scalars = {k: v for k, v in settings.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in settings.items() if isinstance(v, dict)}
    try:
        model = base.replace(**scalars)
    except ValueError:
        if not tables:
            raise
        # A field that needs a table of the same settings (a hybrid pattern's MTP depths need
        # [model.mtp]): everything in one replace, the tables built against base + scalars.
        preview = _WithChanges(base, scalars)
        nested = {
            name: _nested_after(base, name, table, preview, f"model.{name}")
            for name, table in tables.items()
        }
        return base.replace(**scalars, **nested)
    for name, table in settings.items():
        if isinstance(table, dict):
            model = model.replace(
                **{name: _nested_after(model, name, table, model, f"model.{name}")}
            )
    return model
