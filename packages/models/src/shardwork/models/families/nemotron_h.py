"""The Nemotron-H family (Mamba-2 / attention hybrids, dense or MoE): presets and what they
are built from.

- Spec (:func:`~shardwork.models.spec.spec_for` of ``hybrid_layer_pattern``): one part per
  layer, Mamba-2 (``M``), squared-ReLU MLP (``-``), MoE (``E``: squared-ReLU experts and
  shared expert, sigmoid routing with an expert bias, Nemotron 3 Nano) or attention without
  RoPE (``*``), each behind its own RMSNorm; Nemotron-H-8B is ``M-M-M-M*-`` ... with 4
  attention layers of 52.
- Hugging Face: ``model_type`` ``"nemotron_h"`` adapter
  :data:`shardwork.models.hf.nemotron_h.NEMOTRON_H`.
"""

from __future__ import annotations

import math
from typing import Any

from shardwork.models.families.twins import DENSE_TINY, MOE_TINY, tiny_moe
from shardwork.models.mamba_config import MambaConfig
from shardwork.models.preset_table import table_preset

__all__ = ["HF_MODEL_TYPES", "PRESETS", "PUBLISHED_PARAMS", "TINY_PRESETS"]

HF_MODEL_TYPES = ("nemotron_h",)

_PATTERN_52 = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
_HYBRID = dict(position_embedding_type="none", mlp_activation="relu2", norm_epsilon=1e-5)
# transformers' NemotronH mixer clamps dt to (time_step_min, inf) = (1e-3, inf).
_DT_LIMIT = (1e-3, math.inf)

#: ``GPTConfig`` fields of each preset (NVIDIA's published Nemotron-H shapes).
_SHAPES: dict[str, dict[str, Any]] = {
    "nemotron-h-8b": _HYBRID
    | dict(
        num_layers=52,
        hybrid_layer_pattern=_PATTERN_52,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        head_dim=128,
        ffn_hidden_size=21504,
        vocab_size=131072,
        max_position_embeddings=8192,
        mamba=MambaConfig(
            num_heads=128, head_dim=64, state_size=128, num_groups=8, dt_limit=_DT_LIMIT
        ),
    ),
    "nemotron-h-4b": _HYBRID
    | dict(
        num_layers=52,
        hybrid_layer_pattern=_PATTERN_52,
        hidden_size=3072,
        num_attention_heads=32,
        num_query_groups=8,
        head_dim=128,
        ffn_hidden_size=12288,
        vocab_size=131072,
        max_position_embeddings=8192,
        mamba=MambaConfig(
            num_heads=112, head_dim=64, state_size=128, num_groups=8, dt_limit=_DT_LIMIT
        ),
    ),
}

_TINY = (
    DENSE_TINY
    | _HYBRID
    | dict(
        num_layers=4,
        hybrid_layer_pattern="M-*-",
        num_query_groups=2,
        # chunk 8 < the tests' sequences, so the scan passes state between chunks
        mamba=MambaConfig(
            num_heads=4, head_dim=16, state_size=8, num_groups=2, chunk_size=8, dt_limit=_DT_LIMIT
        ),
    )
)

_TINY_MOE = _TINY | dict(
    init_method_std=MOE_TINY["init_method_std"],
    hybrid_layer_pattern="ME*E",
    # Nemotron 3 Nano's routing: sigmoid scores selected with an expert bias, renormalised
    # and scaled (2.5), logits in fp32; one squared-ReLU shared expert
    moe=tiny_moe(
        router=dict(
            score_function="sigmoid",
            enable_expert_bias=True,
            top_k_scaling_factor=2.5,
            router_dtype="fp32",
        ),
        shared_expert_ffn_hidden_size=48,
    ),
)

PRESETS = {name: table_preset(name, fields) for name, fields in _SHAPES.items()}
"""Presets with the published shapes."""
TINY_PRESETS = {
    "tiny-nemotron-h-8b": table_preset(
        "tiny-nemotron-h-8b",
        _TINY,
        "Tiny twin of Nemotron-H: Mamba-2 (2 B/C groups), squared-ReLU MLP, attention without "
        "RoPE, one part per layer (pattern 'M-*-').",
    ),
    "tiny-nemotron-h-moe": table_preset(
        "tiny-nemotron-h-moe",
        _TINY_MOE,
        "Tiny twin of Nemotron-H with MoE blocks (Nemotron 3 Nano): Mamba-2, attention without "
        "RoPE and MoE layers of 8 squared-ReLU experts (top-2, sigmoid scores with an expert "
        "bias, scaled 2.5) plus a squared-ReLU shared expert (pattern 'ME*E').",
    ),
}
"""Their tiny CPU twins."""

#: No exact published count: NVIDIA rounds (8B, 4B).
PUBLISHED_PARAMS: dict[str, int] = {}
