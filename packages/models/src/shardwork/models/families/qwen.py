"""The dense Qwen family (Qwen2.5, Qwen3): presets and what they are built from.

- Spec (:func:`~shardwork.models.spec.spec_for`): every layer ``LayerSpec("attention",
  "dense")``; Qwen2.5 adds a QKV bias, Qwen3 per-head QK-norm (``qk_layernorm``) and an
  explicit ``head_dim``; rope theta 1e6.
- Hugging Face: ``model_type`` ``"qwen2"`` / ``"qwen3"`` adapters
  :data:`~shardwork.models.hf.dense_adapters.QWEN2`, :data:`~shardwork.models.hf.dense_adapters.QWEN3`.
"""

from __future__ import annotations

from typing import Any

from shardwork.models.families.twins import dense_twin
from shardwork.models.preset_table import table_preset

__all__ = ["HF_MODEL_TYPES", "PRESETS", "PUBLISHED_PARAMS", "TINY_PRESETS"]

HF_MODEL_TYPES = ("qwen2", "qwen3")

_QWEN = dict(rope_theta=1000000.0, norm_epsilon=1e-6)

#: ``GPTConfig`` fields of each preset.
_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-7b": _QWEN
    | dict(
        num_layers=28,
        hidden_size=3584,
        num_attention_heads=28,
        num_query_groups=4,
        ffn_hidden_size=18944,
        vocab_size=152064,
        add_qkv_bias=True,
        max_position_embeddings=32768,
    ),
    "qwen3-8b": _QWEN
    | dict(
        num_layers=36,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        head_dim=128,
        ffn_hidden_size=12288,
        vocab_size=151936,
        qk_layernorm=True,
        max_position_embeddings=40960,
    ),
}

PRESETS = {name: table_preset(name, fields) for name, fields in _SHAPES.items()}
"""Presets with the published shapes."""
TINY_PRESETS = {f"tiny-{name}": dense_twin(fn) for name, fn in PRESETS.items()}
"""Their tiny CPU twins (``tiny-<name>``)."""

#: Published parameter counts (model cards / safetensors totals).
PUBLISHED_PARAMS: dict[str, int] = {
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-8b": 8_190_735_360,
}
