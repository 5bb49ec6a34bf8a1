"""Presets as table rows: a dict of ``GPTConfig`` fields becomes a preset function.

Used by the family modules (:mod:`shardwork.models.families`) so
every preset is data (its fields) plus one shared constructor with keyword overrides.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardwork.models.config import GPTConfig

__all__ = ["table_preset"]


def table_preset(name: str, fields: dict[str, Any], doc: str = "") -> Callable[..., GPTConfig]:
    """A preset function: ``GPTConfig(**(fields | overrides))``, validated on every call."""

    def make(**kw: Any) -> GPTConfig:
        return GPTConfig(**(fields | kw))

    make.__name__ = make.__qualname__ = name.replace("-", "_").replace(".", "")
    make.__doc__ = doc or f"The {name} preset (keyword overrides go to GPTConfig)."
    return make
