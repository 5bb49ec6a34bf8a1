"""Type checks of a config dataclass's plain fields, run before its value checks.

A TOML file, a command line or a hand-built dict easily brings ``"False"`` for a bool (which
Python reads as true) or ``"1e-5"`` for a float (which fails later inside a comparison with a
message that names nothing). Each config calls :func:`check_field_types` first, so every
``bool``, ``int`` and ``float`` field (optionally ``| None``) is checked by its annotation,
and a new field is covered without anyone remembering to add a check.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["check_field_types"]

_PLAIN = {
    "bool": ((bool,), "True or False"),
    "int": ((int,), "an integer"),
    "float": ((int, float), "a number"),
}


def _expected(annotation: Any) -> tuple[tuple[type, ...], str, bool] | None:
    """``(accepted types, wording, None allowed)`` of a plain annotation, or None for others
    (strings, dtypes, tuples and nested configs check themselves)."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    parts = [part.strip() for part in text.split("|")]
    optional = "None" in parts
    parts = [part for part in parts if part != "None"]
    if len(parts) != 1 or parts[0] not in _PLAIN:
        return None
    types, wording = _PLAIN[parts[0]]
    return types, wording, optional


def check_field_types(config: Any) -> None:
    """Raise ``ValueError`` naming ``Class.field``, the value and the expected type for the
    first ``bool`` / ``int`` / ``float`` field holding another type (a bool is not accepted
    as a number)."""
    cls = type(config).__name__
    for field in dataclasses.fields(config):
        expected = _expected(field.type)
        if expected is None:
            continue
        types, wording, optional = expected
        value = getattr(config, field.name)
        if value is None and optional:
            continue
        is_bool = isinstance(value, bool)
        if isinstance(value, types) and (is_bool == (types == (bool,))):
            continue
        allowed = f"{wording} or None" if optional else wording
        raise ValueError(
            f"{cls}.{field.name}={value!r} is invalid: it must be {allowed} "
            f"(got {type(value).__name__})"
        )
