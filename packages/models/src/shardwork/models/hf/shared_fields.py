"""The config fields every Hugging Face family (dense and MoE) translates the same way.

Layer count, widths, head count, vocabulary, context length, RoPE (through
:mod:`.rope_map`), norm epsilon, tied embeddings and init std, read from a ``config.json``
dict and written back. Each adapter adds its family's own fields and checks on top.
"""

from __future__ import annotations

from typing import Any

from shardwork.models.config import GPTConfig
from shardwork.models.hf.rope_map import rope_from_hf, rope_scaling_to_hf
from shardwork.models.layer_options import non_default_layer_options

__all__ = ["plain_transformer", "shared_fields_from_hf", "shared_fields_to_hf"]


def shared_fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """``GPTConfig`` fields read the same way from every family's ``config.json``."""
    theta, scaling = rope_from_hf(hf)
    return dict(
        num_layers=int(hf["num_hidden_layers"]),
        hidden_size=int(hf["hidden_size"]),
        num_attention_heads=int(hf["num_attention_heads"]),
        vocab_size=int(hf["vocab_size"]),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_method_std=float(hf.get("initializer_range", 0.02)),
    )


def shared_fields_to_hf(config: GPTConfig) -> dict[str, Any]:
    """``config.json`` keys written the same way for every family (SwiGLU: ``silu``)."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.norm_epsilon,
        "rope_theta": config.rope_theta,
        "rope_scaling": rope_scaling_to_hf(config.rope_scaling),
        "tie_word_embeddings": config.tie_word_embeddings,
        "initializer_range": config.init_method_std,
        "attention_dropout": config.attention_dropout,
    }


def plain_transformer(config: GPTConfig) -> bool:
    """Whether ``config`` uses none of the hybrid families' options (Mamba / DeltaNet mixers,
    a layer pattern, or a layer option away from its default: gated, RoPE-less or partially
    rotated attention, zero-centred norms, squared-ReLU MLPs, MLP biases): the
    Llama-lineage adapters claim only such configs."""
    return (
        config.mamba is None
        and config.linear_attention is None
        and config.hybrid_layer_pattern is None
        and not non_default_layer_options(config)
    )
