"""Every preset by name: the families' presets (:mod:`shardwork.models.families`) gathered.

A preset is a function returning a :class:`GPTConfig` with keyword overrides
(``preset("llama3-8b", params_dtype=torch.bfloat16, sequence_parallel=True)``). ``PRESETS``
maps names to them: the dense families' presets, their tiny twins (``tiny-<name>``), then the
MoE families' (:data:`~shardwork.models.presets_moe.MOE_PRESETS`). Published parameter counts
(``PUBLISHED_PARAMS``) are checked against the calculator and the meta-device model in the
tests. A family is added in its own module under ``families/``, listed in
``families.DENSE_FAMILIES`` or ``MOE_FAMILIES``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardwork.models.config import GPTConfig
from shardwork.models.families import DENSE_FAMILIES
from shardwork.models.presets_moe import MOE_PRESETS

__all__ = ["PRESETS", "PUBLISHED_PARAMS", "preset"]

PRESETS: dict[str, Callable[..., GPTConfig]] = {
    name: fn for family in DENSE_FAMILIES for name, fn in family.PRESETS.items()
}
PRESETS |= {name: fn for family in DENSE_FAMILIES for name, fn in family.TINY_PRESETS.items()}
PRESETS |= MOE_PRESETS  # Mixtral, Qwen-MoE, DeepSeek and their tiny twins

#: Published parameter counts of the dense presets (model cards / safetensors totals).
PUBLISHED_PARAMS: dict[str, int] = {
    name: n for family in DENSE_FAMILIES for name, n in family.PUBLISHED_PARAMS.items()
}


def preset(name: str, **overrides: Any) -> GPTConfig:
    """The config of preset ``name`` with ``overrides`` applied."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; valid: {', '.join(sorted(PRESETS))}")
    return PRESETS[name](**overrides)
