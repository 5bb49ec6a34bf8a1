"""``MLAConfig``: the shapes of multi-head latent attention (``GPTConfig.mla``), validated on
construction.

Its own module so that ``GPTConfig`` (which holds one) and :mod:`shardwork.models.mla` (which
builds the layer from one) both depend on it, and not on each other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from shardwork.models.field_types import check_field_types

__all__ = ["MLAConfig"]


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"MLAConfig.{name}={value!r} is invalid: it must be an integer >= 1")


@dataclass(frozen=True, kw_only=True)
class MLAConfig:
    """Shapes of multi-head latent attention (``GPTConfig.mla``)."""

    kv_lora_rank: int
    """Key/value latent width ``rkv`` (DeepSeek-V3: 512)."""
    qk_nope_head_dim: int
    """Per-head query/key features without position (DeepSeek-V3: 128)."""
    qk_rope_head_dim: int
    """Per-head query/key features with RoPE; the key part is shared by all heads (64)."""
    v_head_dim: int
    """Per-head value width (128)."""
    q_lora_rank: int | None = None
    """Query latent width ``rq`` (DeepSeek-V3: 1536); None: one full query projection (V2-Lite)."""

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _positive(name, getattr(self, name))
        if self.q_lora_rank is not None:
            _positive("q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"MLAConfig.qk_rope_head_dim={self.qk_rope_head_dim} is invalid: RoPE needs an "
                "even width"
            )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def validate(self, config: Any) -> None:
        """Checks against the enclosing ``GPTConfig``."""
        if config.num_query_groups not in (None, config.num_attention_heads):
            raise ValueError(
                f"GPTConfig.num_query_groups={config.num_query_groups} is invalid with MLA: latent "
                "attention has one key/value head per query head (leave it None)"
            )
        if config.qk_layernorm or config.add_qkv_bias:
            raise ValueError("GPTConfig.qk_layernorm / add_qkv_bias do not apply to MLA: set False")

    def check_layout(self, parallel: Any) -> None:
        """Nothing beyond GPTConfig's head-count checks (heads split over tp)."""

    def replace(self, **changes: Any) -> MLAConfig:
        return dataclasses.replace(self, **changes)
