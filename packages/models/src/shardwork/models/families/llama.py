"""The Llama family (Llama 2, Llama 3, 3.1, 3.2): presets and what they are built from.

- Spec (:func:`~shardwork.models.spec.spec_for`): every layer ``LayerSpec("attention",
  "dense")`` (GQA except Llama 2, SwiGLU MLP), rotary over the whole head (halves rotated),
  Llama 3.1/3.2 with Llama-3 RoPE scaling; Llama 3.2 ties the embeddings.
- Hugging Face: ``model_type`` ``"llama"`` adapter
  :data:`shardwork.models.hf.dense_adapters.LLAMA`.
"""

from __future__ import annotations

from typing import Any

from shardwork.fused_kernels import Llama3RopeScaling
from shardwork.models.families.twins import dense_twin
from shardwork.models.preset_table import table_preset

__all__ = ["HF_MODEL_TYPES", "PRESETS", "PUBLISHED_PARAMS", "TINY_PRESETS"]

HF_MODEL_TYPES = ("llama",)


def _llama31_scaling(factor: float = 8.0) -> Llama3RopeScaling:
    return Llama3RopeScaling(
        factor=factor,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )


_LLAMA3 = dict(vocab_size=128256, num_query_groups=8, rope_theta=500000.0, norm_epsilon=1e-5)
_LLAMA32 = _LLAMA3 | dict(
    tie_word_embeddings=True, max_position_embeddings=131072, rope_scaling=_llama31_scaling(32.0)
)
_LLAMA31_LONG = dict(rope_scaling=_llama31_scaling(), max_position_embeddings=131072)

#: ``GPTConfig`` fields of each preset (a row may extend the family's shared fields).
_SHAPES: dict[str, dict[str, Any]] = {
    "llama2-7b": dict(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        ffn_hidden_size=11008,
        vocab_size=32000,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        norm_epsilon=1e-5,
    ),
    "llama3-8b": _LLAMA3
    | dict(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        ffn_hidden_size=14336,
        max_position_embeddings=8192,
    ),
    "llama3-70b": _LLAMA3
    | dict(
        num_layers=80,
        hidden_size=8192,
        num_attention_heads=64,
        ffn_hidden_size=28672,
        max_position_embeddings=8192,
    ),
    "llama3.2-1b": _LLAMA32
    | dict(
        num_layers=16, hidden_size=2048, num_attention_heads=32, head_dim=64, ffn_hidden_size=8192
    ),
    "llama3.2-3b": _LLAMA32
    | dict(
        num_layers=28, hidden_size=3072, num_attention_heads=24, head_dim=128, ffn_hidden_size=8192
    ),
}
_SHAPES["llama3.1-8b"] = _SHAPES["llama3-8b"] | _LLAMA31_LONG
_SHAPES["llama3.1-70b"] = _SHAPES["llama3-70b"] | _LLAMA31_LONG
_ORDER = ("llama2-7b", "llama3-8b", "llama3.1-8b", "llama3-70b", "llama3.1-70b", "llama3.2-1b")
_ORDER += ("llama3.2-3b",)

PRESETS = {name: table_preset(name, _SHAPES[name]) for name in _ORDER}
"""Presets with the published shapes."""
TINY_PRESETS = {f"tiny-{name}": dense_twin(fn) for name, fn in PRESETS.items()}
"""Their tiny CPU twins (``tiny-<name>``)."""

#: Published parameter counts (model cards / safetensors totals).
PUBLISHED_PARAMS: dict[str, int] = {
    "llama2-7b": 6_738_415_616,
    "llama3-8b": 8_030_261_248,
    "llama3.1-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3.1-70b": 70_553_706_496,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
}
