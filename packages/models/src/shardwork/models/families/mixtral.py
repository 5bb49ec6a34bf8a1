"""The Mixtral family: presets and what they are built from.

- Spec (:func:`~shardwork.models.spec.spec_for`): every layer ``LayerSpec("attention",
  "moe")`` (GQA; 8 experts, softmax over the top-2 logits, no shared expert).
- Hugging Face: ``model_type`` ``"mixtral"`` adapter
  :data:`shardwork.models.hf.moe_adapters.MIXTRAL`.
"""

from __future__ import annotations

from shardwork.models.families.twins import MOE_TINY, tiny_moe
from shardwork.models.moe.config import MoEConfig
from shardwork.models.preset_table import table_preset
from shardwork.moe_router import RouterConfig

__all__ = ["HF_MODEL_TYPES", "PRESETS", "PUBLISHED_PARAMS", "TINY_PRESETS"]

HF_MODEL_TYPES = ("mixtral",)

PRESETS = {
    "mixtral-8x7b": table_preset(
        "mixtral-8x7b",
        dict(
            num_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_query_groups=8,
            ffn_hidden_size=14336,
            vocab_size=32000,
            max_position_embeddings=32768,
            rope_theta=1e6,
            norm_epsilon=1e-5,
            moe=MoEConfig(
                router=RouterConfig(num_experts=8, hidden_size=4096, top_k=2),
                ffn_hidden_size=14336,
            ),
        ),
    )
}
"""Presets with the published shapes."""

TINY_PRESETS = {
    "tiny-mixtral-8x7b": table_preset(
        "tiny-mixtral-8x7b",
        MOE_TINY | dict(num_query_groups=2, rope_theta=1e6, moe=tiny_moe()),
        "Tiny twin of Mixtral: GQA, softmax top-2 renormalised, every layer MoE.",
    )
}
"""The tiny CPU twin."""

#: Published (total, active) parameter counts (model card; rounded).
PUBLISHED_PARAMS: dict[str, tuple[float, float]] = {"mixtral-8x7b": (46.7e9, 12.9e9)}
