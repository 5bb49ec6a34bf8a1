"""The MoE families' presets (Mixtral, Qwen-MoE, DeepSeek) and their tiny twins, gathered.

Each family module under :mod:`shardwork.models.families` declares its presets (functions
returning a :class:`GPTConfig` with ``moe``, and ``mla`` / ``mtp`` for DeepSeek; keyword
overrides go to the GPTConfig); they are also in ``shardwork.models.PRESETS``.
``PUBLISHED_MOE_PARAMS`` holds the published (total, active) counts the calculator is checked
against (model cards; rounded, so compared with a tolerance).
"""

from __future__ import annotations

from collections.abc import Callable

from shardwork.models.config import GPTConfig
from shardwork.models.families import MOE_FAMILIES

__all__ = ["MOE_PRESETS", "PUBLISHED_MOE_PARAMS"]

MOE_PRESETS: dict[str, Callable[..., GPTConfig]] = {
    name: fn for family in MOE_FAMILIES for name, fn in family.PRESETS.items()
}
MOE_PRESETS |= {name: fn for family in MOE_FAMILIES for name, fn in family.TINY_PRESETS.items()}

#: Published (total, active) parameter counts; DeepSeek-V3's 671B excludes its 14B MTP module.
PUBLISHED_MOE_PARAMS: dict[str, tuple[float, float]] = {
    name: n for family in MOE_FAMILIES for name, n in family.PUBLISHED_PARAMS.items()
}
