"""Hugging Face adapter of Nemotron-H (``model_type`` ``"nemotron_h"``): Mamba-2 / attention
hybrids with dense or MoE (Nemotron 3 Nano) MLP blocks.

- Config: ``layers_block_type`` (or the older ``hybrid_override_pattern``) becomes
  ``hybrid_layer_pattern`` (``linear_attention`` -> ``M``, ``full_attention`` -> ``*``,
  ``mlp`` -> ``-``, ``moe`` -> ``E``); attention has no RoPE
  (``position_embedding_type="none"``), MLPs, experts and shared experts are squared ReLU
  (``mlp_activation="relu2"``), the Mamba mixers' fields go through
  :func:`~shardwork.models.hf.mamba_weights.mamba_config_from_hf` and the MoE fields through
  :func:`~shardwork.models.hf.moe_fields.nemotron_h_moe_fields` (DeepSeek-V3-style sigmoid
  routing with ``e_score_correction_bias``). The experts' latent projections
  (``moe_latent_size``) and MTP layers raise ``ValueError`` naming the field.
- Tensors: ``backbone.embeddings``, ``backbone.norm_f``, ``lm_head``; each block has one
  ``norm`` (shardwork's ``input_layernorm`` of a mixer layer, ``pre_mlp_layernorm`` of an MLP
  layer) and its part under ``mixer.``; an MoE block's ``mixer.gate`` (router weight and
  ``e_score_correction_bias``), per-expert ``mixer.experts.<e>.up_proj`` / ``down_proj`` (as
  transformers saves them; one shardwork key each) and ``mixer.shared_experts``. The Mamba
  mixers' fused ``in_proj`` / ``conv1d`` are converted whole (``converted`` layout).
"""

from __future__ import annotations

from typing import Any

from shardwork.models.config import GPTConfig
from shardwork.models.hf.adapter import HFAdapter
from shardwork.models.hf.mamba_weights import (
    mamba_config_from_hf,
    mamba_config_to_hf,
    mamba_from_hf,
    mamba_to_hf,
)
from shardwork.models.hf.moe_fields import nemotron_h_moe_fields, nemotron_h_moe_to_hf
from shardwork.models.spec import spec_for

__all__ = ["NEMOTRON_H"]

_BLOCKS = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
_SYMBOLS = {v: k for k, v in _BLOCKS.items()}
_PREFIX = "backbone.layers"


def _pattern(hf: dict[str, Any]) -> str:
    blocks = hf.get("layers_block_type")
    if blocks is None:
        return str(hf["hybrid_override_pattern"])
    unknown = sorted(set(blocks) - set(_BLOCKS))
    if unknown:
        raise ValueError(f"layers_block_type has {unknown}; valid: {sorted(_BLOCKS)}")
    return "".join(_BLOCKS[b] for b in blocks)


def _refuse(hf: dict[str, Any]) -> None:
    if hf.get("num_nextn_predict_layers"):
        raise ValueError(
            f"num_nextn_predict_layers={hf['num_nextn_predict_layers']} is not supported for "
            "nemotron_h; valid: 0"
        )
    for field, valid in (
        ("mlp_hidden_act", "relu2"),
        ("attention_bias", False),
        ("mlp_bias", False),
        ("residual_in_fp32", False),
    ):
        if hf.get(field, valid) != valid:
            raise ValueError(f"{field}={hf[field]!r} is not supported; valid: {valid!r}")


def _fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    pattern = _pattern(hf)
    _refuse(hf)
    heads = int(hf["num_attention_heads"])
    moe = nemotron_h_moe_fields(hf) if "E" in pattern else {}
    return moe | dict(
        num_layers=len(pattern),
        hidden_size=int(hf["hidden_size"]),
        num_attention_heads=heads,
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        head_dim=hf.get("head_dim") or None,
        ffn_hidden_size=int(hf["intermediate_size"]),
        vocab_size=int(hf["vocab_size"]),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_method_std=float(hf.get("initializer_range", 0.02)),
        hybrid_layer_pattern=pattern,
        position_embedding_type="none",
        mlp_activation="relu2",
        mamba=mamba_config_from_hf(hf),
    )


def _fields_to_hf(config: GPTConfig) -> dict[str, Any]:
    moe = nemotron_h_moe_to_hf(config) if config.moe is not None else {}
    return (
        moe
        | {
            "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_layers,
            "layers_block_type": [_SYMBOLS[c] for c in config.hybrid_layer_pattern],
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.kv_heads,
            "head_dim": config.kv_channels,
            "intermediate_size": config.ffn_hidden_size,
            "mlp_hidden_act": "relu2",
            "mlp_bias": False,
            "attention_bias": False,
            "max_position_embeddings": config.max_position_embeddings,
            "tie_word_embeddings": config.tie_word_embeddings,
            "initializer_range": config.init_method_std,
            "attention_dropout": config.attention_dropout,
            "residual_in_fp32": False,
            "num_nextn_predict_layers": 0,
        }
        | mamba_config_to_hf(config.mamba, norm_epsilon=config.norm_epsilon)
    )


def _claims(config: GPTConfig) -> bool:
    return config.mamba is not None and config.hybrid_layer_pattern is not None


def _convert_from_hf(hf: dict, config: GPTConfig, layers: set[int]) -> dict:
    spec, out = spec_for(config), {}
    for i in sorted(layers):
        if spec.layers[i].mixer == "mamba":
            key = f"decoder.layers.{i}.self_attention."
            out.update(mamba_from_hf(hf, f"{_PREFIX}.{i}.mixer.", out_prefix=key))
    return out


def _convert_to_hf(state: dict, config: GPTConfig) -> dict:
    spec, out = spec_for(config), {}
    for i, layer in enumerate(spec.layers):
        if layer.mixer == "mamba":
            key = f"decoder.layers.{i}.self_attention."
            out.update(mamba_to_hf(state, key, hf_prefix=f"{_PREFIX}.{i}.mixer."))
            for k in [k for k in state if k.startswith(key)]:
                del state[k]
    return out


_LAYER_RULES = (
    # one norm per block, whichever part the block holds
    (r"(?:input_layernorm|pre_mlp_layernorm)\.weight", "norm.weight"),
    (r"self_attention\.linear_qkv\.weight\.(q|k|v)", r"mixer.\1_proj.weight"),
    (r"self_attention\.linear_proj\.weight", "mixer.o_proj.weight"),
    (r"mlp\.fc1\.weight", "mixer.up_proj.weight"),
    (r"mlp\.fc2\.weight", "mixer.down_proj.weight"),
    # MoE blocks: router, expert bias, per-expert squared-ReLU experts, shared expert
    (r"mlp\.router\.weight", "mixer.gate.weight"),
    (r"mlp\.router\.expert_bias", "mixer.gate.e_score_correction_bias"),
    (r"mlp\.experts\.linear_fc1\.weight\.(\d+)", r"mixer.experts.\1.up_proj.weight"),
    (r"mlp\.experts\.linear_fc2\.weight\.(\d+)", r"mixer.experts.\1.down_proj.weight"),
    (r"mlp\.shared_experts\.fc1\.weight", "mixer.shared_experts.up_proj.weight"),
    (r"mlp\.shared_experts\.fc2\.weight", "mixer.shared_experts.down_proj.weight"),
)
_GLOBAL_RULES = (
    (r"embedding\.word_embeddings\.weight", "backbone.embeddings.weight"),
    (r"decoder\.final_norm\.weight", "backbone.norm_f.weight"),
    (r"output_layer\.weight", "lm_head.weight"),
)

NEMOTRON_H = HFAdapter(
    model_type="nemotron_h",
    architecture="NemotronHForCausalLM",
    fields_from_hf=_fields_from_hf,
    fields_to_hf=_fields_to_hf,
    claims=_claims,
    layer_rules=_LAYER_RULES,
    weight_layout="converted",
    hf_layer_prefix=_PREFIX,
    global_rules=_GLOBAL_RULES,
    convert_from_hf=_convert_from_hf,
    convert_to_hf=_convert_to_hf,
)
