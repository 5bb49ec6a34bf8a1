"""Typed values of a config file: checking a TOML value against a field's annotation, and
writing values back as TOML.

- :func:`coerce_value` converts a parsed TOML value to a field's annotation (int, float, bool,
  str, ``Literal`` choices, lists, fixed and variable-length tuples, dicts, unions) or raises
  ``TypeError``; ints are accepted for floats. TOML has no null, so ``"none"`` (any case)
  stands for None where the annotation allows it.
- :func:`describe_type` says in words what an annotation accepts, for error messages.
- :func:`dump_toml` writes nested dicts as TOML: scalars first, then one ``[a.b]`` table per
  nested dict, None as ``"none"`` — so what it writes loads back to the same values.
"""

from __future__ import annotations

import json
import re
import types
import typing
from typing import Any, Literal


def is_optional(annotation: Any) -> bool:
    """Whether ``annotation`` is a union that admits None."""
    origin = typing.get_origin(annotation)
    return origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(annotation)


def describe_type(annotation: Any) -> str:
    """What ``annotation`` accepts, in words ("one of 'a', 'b'", "int or \"none\"")."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return '"none"'
    if origin is list:
        return f"a list of {describe_type(typing.get_args(annotation)[0])}"
    if origin is tuple:
        items = typing.get_args(annotation)
        if len(items) == 2 and items[1] is Ellipsis:
            return f"a list of {describe_type(items[0])}"
        return "a pair [" + ", ".join(describe_type(a) for a in items) + "]"
    if origin is dict:
        return "a table"
    return getattr(annotation, "__name__", str(annotation))


def _coerce_union(value: Any, annotation: Any) -> Any:
    args = typing.get_args(annotation)
    if type(None) in args and isinstance(value, str) and value.lower() == "none":
        return None
    for arg in args:
        if arg is type(None):
            continue
        try:
            return coerce_value(value, arg)
        except TypeError:
            continue
    raise TypeError


def _coerce_tuple(value: Any, annotation: Any) -> tuple:
    items = typing.get_args(annotation)
    if not isinstance(value, list | tuple):
        raise TypeError
    if len(items) == 2 and items[1] is Ellipsis:  # tuple[int, ...]: any length
        return tuple(coerce_value(v, items[0]) for v in value)
    if len(value) != len(items):
        raise TypeError
    return tuple(coerce_value(v, t) for v, t in zip(value, items))


def _coerce_scalar(value: Any, annotation: Any) -> Any:
    # bool is a subclass of int in Python, so `True` must not pass as an int or a float.
    if annotation is bool and isinstance(value, bool):
        return value
    if annotation is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if annotation is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if annotation is str and isinstance(value, str):
        return value
    raise TypeError


def coerce_value(value: Any, annotation: Any) -> Any:
    """``value`` converted to ``annotation``, or raise TypeError."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, annotation)
    if origin is Literal:
        if value in typing.get_args(annotation):
            return value
        raise TypeError
    if origin is list:
        if not isinstance(value, list):
            raise TypeError
        (item,) = typing.get_args(annotation)
        return [coerce_value(v, item) for v in value]
    if origin is tuple:
        return _coerce_tuple(value, annotation)
    if origin is dict:
        if not isinstance(value, dict):
            raise TypeError
        _, item = typing.get_args(annotation)
        return {str(k): coerce_value(v, item) for k, v in value.items()}
    return _coerce_scalar(value, annotation)


def toml_key(key: str) -> str:
    """A bare TOML key when possible, else a quoted one."""
    if re.fullmatch(r"[A-Za-z0-9_-]+", key):
        return key
    return json.dumps(key)


def toml_value(value: Any) -> str:
    """One value as TOML text (None as ``"none"``)."""
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def dump_toml(table: dict[str, Any], prefix: str = "") -> str:
    """Nested dicts as TOML text: this table's scalars, then a ``[prefix.key]`` table for each
    nested dict (recursively; a nested dict without scalars still gets its header)."""
    scalars = [
        f"{toml_key(k)} = {toml_value(v)}" for k, v in table.items() if not isinstance(v, dict)
    ]
    blocks = []
    if prefix:
        blocks.append("\n".join([f"[{prefix}]", *scalars]))
    elif scalars:
        blocks.append("\n".join(scalars))
    for key, value in table.items():
        if isinstance(value, dict):
            name = f"{prefix}.{toml_key(key)}" if prefix else toml_key(key)
            blocks.append(dump_toml(value, name).rstrip("\n"))
    return "\n\n".join(blocks) + "\n"
