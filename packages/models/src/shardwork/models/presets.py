"""Presets with the real families' shapes, and tiny CPU twins with the same structure.

Presets are table rows (``_DENSE``: the ``GPTConfig`` fields of each model, family fields
shared by dict union) turned into functions returning a :class:`GPTConfig` with keyword
overrides (``preset("llama3-8b", params_dtype=torch.bfloat16, sequence_parallel=True)``).
``PRESETS`` maps names to them. Published parameter counts (``PUBLISHED_PARAMS``) are checked against the calculator
and the meta-device model in the tests.

Tiny twins (``tiny_<name>``) keep the family's features (GQA ratio, tied embeddings, QKV bias,
QK-norm, RoPE scaling) at widths that run in milliseconds on a CPU, with a vocabulary that
is *not* a multiple of ``make_vocab_size_divisible_by`` so padding is exercised.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardwork.fused_kernels import Llama3RopeScaling
from shardwork.models.config import GPTConfig
from shardwork.models.preset_table import table_preset
from shardwork.models.presets_moe import MOE_PRESETS

__all__ = ["PRESETS", "PUBLISHED_PARAMS", "preset"]


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
_QWEN = dict(rope_theta=1000000.0, norm_epsilon=1e-6)

#: ``GPTConfig`` fields of each dense preset (a row may extend a family's shared fields).
_DENSE: dict[str, dict[str, Any]] = {
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
_DENSE["llama3.1-8b"] = _DENSE["llama3-8b"] | _LLAMA31_LONG
_DENSE["llama3.1-70b"] = _DENSE["llama3-70b"] | _LLAMA31_LONG
_ORDER = ("llama2-7b", "llama3-8b", "llama3.1-8b", "llama3-70b", "llama3.1-70b", "llama3.2-1b")
_ORDER += ("llama3.2-3b", "qwen2.5-7b", "qwen3-8b")


_TINY = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    ffn_hidden_size=96,
    vocab_size=250,
    make_vocab_size_divisible_by=16,
    max_position_embeddings=256,
)


def _tiny(big: Callable[..., GPTConfig], **extra: Any) -> Callable[..., GPTConfig]:
    def make(**kw: Any) -> GPTConfig:
        ref = big()
        feat = dict(
            num_query_groups=2 if ref.kv_heads < ref.num_attention_heads else None,
            tie_word_embeddings=ref.tie_word_embeddings,
            add_qkv_bias=ref.add_qkv_bias,
            qk_layernorm=ref.qk_layernorm,
            rope_theta=ref.rope_theta,
            rope_scaling=None
            if ref.rope_scaling is None
            else Llama3RopeScaling(
                factor=ref.rope_scaling.factor,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
            norm_epsilon=ref.norm_epsilon,
        )
        return GPTConfig(**(_TINY | feat | extra | kw))

    make.__doc__ = f"Tiny CPU twin of {big.__name__} (same features, toy sizes)."
    return make


PRESETS: dict[str, Callable[..., GPTConfig]] = {
    name: table_preset(name, _DENSE[name]) for name in _ORDER
}
PRESETS |= {f"tiny-{name}": _tiny(fn) for name, fn in list(PRESETS.items())}
PRESETS |= MOE_PRESETS  # Mixtral, Qwen-MoE, DeepSeek and their tiny twins (presets_moe.py)

#: Published parameter counts (model cards / safetensors totals).
PUBLISHED_PARAMS: dict[str, int] = {
    "llama2-7b": 6_738_415_616,
    "llama3-8b": 8_030_261_248,
    "llama3.1-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3.1-70b": 70_553_706_496,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-8b": 8_190_735_360,
}


def preset(name: str, **overrides: Any) -> GPTConfig:
    """The config of preset ``name`` with ``overrides`` applied."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; valid: {', '.join(sorted(PRESETS))}")
    return PRESETS[name](**overrides)
