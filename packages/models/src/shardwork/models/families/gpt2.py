"""The GPT-2 family (OpenAI's GPT-2: 124M, medium, large, XL): presets and what they are built
from. Its options are Megatron's classic GPT options, plain ``GPTConfig`` fields.

- Spec (:func:`~shardwork.models.spec.spec_for`): every layer ``LayerSpec("attention", "gelu",
  norm="layernorm")`` and a LayerNorm final norm (``normalization="layernorm"``, weight and
  bias, eps 1e-5); multi-head attention with biases on the fused QKV and the output projection
  (``add_qkv_bias``, ``add_proj_bias``); the non-gated GELU MLP (``mlp_activation="gelu_tanh"``,
  GPT-2's ``gelu_new``) with biases (``add_mlp_bias``); no rotary table: a learned
  ``[1024, h]`` position table is added at the embedding
  (``position_embedding_type="learned_absolute"``); the head is tied to the embedding.
- Hugging Face: ``model_type`` ``"gpt2"`` adapter :data:`shardwork.models.hf.gpt2.GPT2`
  (Conv1D ``[in, out]`` weights and the fused ``c_attn``, converted on import and export).
"""

from __future__ import annotations

from typing import Any

from shardwork.models.families.twins import DENSE_TINY
from shardwork.models.preset_table import table_preset

__all__ = ["HF_MODEL_TYPES", "PRESETS", "PUBLISHED_PARAMS", "TINY_PRESETS"]

HF_MODEL_TYPES = ("gpt2",)

_GPT2 = dict(
    vocab_size=50257,
    max_position_embeddings=1024,
    norm_epsilon=1e-5,
    normalization="layernorm",
    position_embedding_type="learned_absolute",
    mlp_activation="gelu_tanh",
    add_qkv_bias=True,
    add_proj_bias=True,
    add_mlp_bias=True,
    tie_word_embeddings=True,
)


def _shape(layers: int, hidden: int, heads: int) -> dict[str, Any]:
    # GPT-2's MLP is 4h wide (n_inner unset).
    return _GPT2 | dict(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=4 * hidden
    )


#: ``GPTConfig`` fields of each preset (the published GPT-2 shapes).
_SHAPES: dict[str, dict[str, Any]] = {
    "gpt2": _shape(12, 768, 12),
    "gpt2-medium": _shape(24, 1024, 16),
    "gpt2-large": _shape(36, 1280, 20),
    "gpt2-xl": _shape(48, 1600, 25),
}

PRESETS = {name: table_preset(name, fields) for name, fields in _SHAPES.items()}
"""Presets with the published shapes."""
TINY_PRESETS = {
    "tiny-gpt2": table_preset(
        "tiny-gpt2",
        DENSE_TINY
        | _GPT2
        | dict(
            vocab_size=DENSE_TINY["vocab_size"],
            max_position_embeddings=DENSE_TINY["max_position_embeddings"],
            ffn_hidden_size=4 * DENSE_TINY["hidden_size"],
        ),
        "Tiny twin of GPT-2: LayerNorm, learned absolute positions (256), GELU-tanh MLP 4h "
        "wide, biases on every projection, tied head.",
    ),
}
"""Their tiny CPU twin."""

#: Published parameter counts (Hugging Face's ``num_parameters()`` of GPT2LMHeadModel, the
#: tied head counted once).
PUBLISHED_PARAMS: dict[str, int] = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
}
