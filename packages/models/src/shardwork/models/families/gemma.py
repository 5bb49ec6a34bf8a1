"""The Gemma 2 and Gemma 3 (text) families: presets and what they are built from.

- Spec (:func:`~shardwork.models.spec.spec_for`): every layer ``LayerSpec("attention",
  "dense")`` with a GeGLU MLP (``mlp_activation="geglu"``), sandwich norms (``sandwich_norm``),
  zero-centred RMSNorm weights, embeddings scaled by ``sqrt(hidden)`` (``scale_embedding``),
  tied embeddings and ``query_pre_attn_scalar``. Gemma 2: sliding-window layers alternating with
  global ones (``sliding_window_pattern=2``, layer 0 slides), attention soft-cap 50 and final
  logit soft-cap 30. Gemma 3: five sliding layers then one global (pattern 6), QK-norm, RoPE base
  10k on sliding layers (``rope_local_theta``) and 1M with linear scaling (factor 8, 4B and up)
  on global layers.
- Hugging Face: ``model_type`` ``"gemma2"`` / ``"gemma3_text"`` adapters
  :data:`~shardwork.models.hf.gemma.GEMMA2`, :data:`~shardwork.models.hf.gemma.GEMMA3_TEXT`.
- Parameter counts: those of transformers' ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM`` built
  from the published configs (tied head counted once); Gemma 2's equal the model cards', Gemma
  3's are the text models (the 4B/12B/27B cards count the vision tower too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardwork.fused_kernels import LinearRopeScaling
from shardwork.models.config import GPTConfig
from shardwork.models.families.twins import DENSE_TINY
from shardwork.models.preset_table import table_preset

__all__ = ["HF_MODEL_TYPES", "PRESETS", "PUBLISHED_PARAMS", "TINY_PRESETS"]

HF_MODEL_TYPES = ("gemma2", "gemma3_text")

_GEMMA = dict(
    mlp_activation="geglu",
    sandwich_norm=True,
    scale_embedding=True,
    layernorm_zero_centered_gamma=True,
    tie_word_embeddings=True,
    norm_epsilon=1e-6,
)
_GEMMA2 = _GEMMA | dict(
    vocab_size=256000,
    max_position_embeddings=8192,
    rope_theta=10000.0,
    sliding_window=4096,
    sliding_window_pattern=2,
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
)
_GEMMA3 = _GEMMA | dict(
    vocab_size=262208,
    max_position_embeddings=131072,
    rope_theta=1000000.0,
    rope_local_theta=10000.0,
    rope_scaling=LinearRopeScaling(factor=8.0),
    sliding_window=1024,
    sliding_window_pattern=6,
    qk_layernorm=True,
)


def _shape(layers: int, hidden: int, heads: int, groups: int, d: int, ffn: int, scalar: int):
    return dict(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=d,
        ffn_hidden_size=ffn,
        query_pre_attn_scalar=float(scalar),
    )


#: ``GPTConfig`` fields of each preset (Google's published configs).
_SHAPES: dict[str, dict[str, Any]] = {
    "gemma2-2b": _GEMMA2 | _shape(26, 2304, 8, 4, 256, 9216, 256),
    "gemma2-9b": _GEMMA2 | _shape(42, 3584, 16, 8, 256, 14336, 256),
    "gemma2-27b": _GEMMA2 | _shape(46, 4608, 32, 16, 128, 36864, 144),
    "gemma3-1b": _GEMMA3
    | _shape(26, 1152, 4, 1, 256, 6912, 256)
    | dict(vocab_size=262144, max_position_embeddings=32768, sliding_window=512, rope_scaling=None),
    "gemma3-4b": _GEMMA3 | _shape(34, 2560, 8, 4, 256, 10240, 256),
    "gemma3-12b": _GEMMA3 | _shape(48, 3840, 16, 8, 256, 15360, 256),
    "gemma3-27b": _GEMMA3 | _shape(62, 5376, 32, 16, 128, 21504, 168),
}

PRESETS = {name: table_preset(name, fields) for name, fields in _SHAPES.items()}
"""Presets with the published shapes."""


def _twin(big: Callable[..., GPTConfig]) -> Callable[..., GPTConfig]:
    """A tiny twin: 6 layers (so Gemma 3's five-sliding-one-global pattern appears once), window
    8 (shorter than test sequences), head_dim 16; a query_pre_attn_scalar other than head_dim
    where the big model's differs from its head_dim."""

    def make(**kw: Any) -> GPTConfig:
        ref = big()
        scalar = 16.0 if ref.query_pre_attn_scalar == ref.kv_channels else 24.0
        feat = {name: getattr(ref, name) for name in (*_GEMMA, *_GEMMA3, *_GEMMA2)}
        feat |= dict(
            num_layers=6,
            num_query_groups=2,
            head_dim=16,
            vocab_size=DENSE_TINY["vocab_size"],
            max_position_embeddings=DENSE_TINY["max_position_embeddings"],
            sliding_window=8,
            query_pre_attn_scalar=scalar,
        )
        if ref.rope_scaling is not None:
            feat["rope_scaling"] = LinearRopeScaling(factor=ref.rope_scaling.factor)
        return GPTConfig(**(DENSE_TINY | feat | kw))

    make.__doc__ = f"Tiny CPU twin of {big.__name__} (same features, toy sizes)."
    return make


TINY_PRESETS = {f"tiny-{name}": _twin(fn) for name, fn in PRESETS.items()}
"""Their tiny CPU twins (``tiny-<name>``)."""

#: transformers' parameter counts of the published configs (see the module docstring).
PUBLISHED_PARAMS: dict[str, int] = {
    "gemma2-2b": 2_614_341_888,
    "gemma2-9b": 9_241_705_984,
    "gemma2-27b": 27_227_128_320,
    "gemma3-1b": 999_885_952,
    "gemma3-4b": 3_880_263_168,
    "gemma3-12b": 11_766_034_176,
    "gemma3-27b": 27_009_346_304,
}
