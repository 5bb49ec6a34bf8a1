"""The Qwen MoE family (Qwen2-MoE, Qwen3-MoE): presets and what they are built from.

- Spec (:func:`~shardwork.models.spec.spec_for`): every layer ``LayerSpec("attention",
  "moe")``. Qwen3-MoE: QK-norm, top-8 of 128 renormalised, no shared expert. Qwen2-MoE: QKV
  bias, softmax over all experts without renormalising, a shared expert scaled by a sigmoid
  gate.
- Hugging Face: ``model_type`` ``"qwen2_moe"`` / ``"qwen3_moe"``
  adapters :data:`~shardwork.models.hf.moe_adapters.QWEN2_MOE`,
  :data:`~shardwork.models.hf.moe_adapters.QWEN3_MOE`.
"""

from __future__ import annotations

from typing import Any

from shardwork.models.families.twins import MOE_TINY, tiny_moe
from shardwork.models.moe.config import MoEConfig
from shardwork.models.preset_table import table_preset
from shardwork.moe_router import RouterConfig

__all__ = ["HF_MODEL_TYPES", "PRESETS", "PUBLISHED_PARAMS", "TINY_PRESETS"]

HF_MODEL_TYPES = ("qwen2_moe", "qwen3_moe")

_QWEN = dict(rope_theta=1e6, max_position_embeddings=32768, norm_epsilon=1e-6)

#: ``GPTConfig`` fields of each preset.
_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": _QWEN
    | dict(
        num_layers=48,
        hidden_size=2048,
        num_attention_heads=32,
        num_query_groups=4,
        head_dim=128,
        ffn_hidden_size=6144,
        vocab_size=151936,
        qk_layernorm=True,
        max_position_embeddings=40960,
        moe=MoEConfig(
            router=RouterConfig(num_experts=128, hidden_size=2048, top_k=8),
            ffn_hidden_size=768,
        ),
    ),
    "qwen2-57b-a14b": _QWEN
    | dict(
        num_layers=28,
        hidden_size=3584,
        num_attention_heads=28,
        num_query_groups=4,
        ffn_hidden_size=18944,
        vocab_size=151936,
        add_qkv_bias=True,
        moe=MoEConfig(
            router=RouterConfig(num_experts=64, hidden_size=3584, top_k=8, pre_softmax=True),
            ffn_hidden_size=2560,
            shared_expert_ffn_hidden_size=20480,
            shared_expert_gate=True,
        ),
    ),
}

#: Tiny twins: (docstring, fields over ``MOE_TINY``), keyed by the big preset's name.
_TINY_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-30b-a3b": (
        "Tiny twin of Qwen3-30B-A3B: QK-norm, GQA, top-4 of 8 renormalised.",
        dict(
            num_query_groups=2,
            head_dim=16,
            qk_layernorm=True,
            rope_theta=1e6,
            norm_epsilon=1e-6,
            moe=tiny_moe(router=dict(top_k=4)),
        ),
    ),
    "qwen2-57b-a14b": (
        "Tiny twin of Qwen2-MoE: QKV bias, softmax without renormalising, gated shared expert.",
        dict(
            num_query_groups=2,
            add_qkv_bias=True,
            rope_theta=1e6,
            norm_epsilon=1e-6,
            moe=tiny_moe(
                router=dict(top_k=4, pre_softmax=True),
                shared_expert_ffn_hidden_size=48,
                shared_expert_gate=True,
            ),
        ),
    ),
}

PRESETS = {name: table_preset(name, fields) for name, fields in _SHAPES.items()}
"""Presets with the published shapes."""
TINY_PRESETS = {
    f"tiny-{name}": table_preset(f"tiny-{name}", MOE_TINY | fields, doc)
    for name, (doc, fields) in _TINY_SHAPES.items()
}
"""Their tiny CPU twins (``tiny-<name>``)."""

#: Published (total, active) parameter counts (model cards; rounded).
PUBLISHED_PARAMS: dict[str, tuple[float, float]] = {
    "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "qwen2-57b-a14b": (57.4e9, 14.2e9),
}
