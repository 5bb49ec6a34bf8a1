"""Hugging Face adapter of Qwen3-Next (``model_type`` ``"qwen3_next"``).

- Config: every layer is a mixer + MoE layer; ``layer_types`` (``linear_attention`` /
  ``full_attention``) become ``linear_attention_freq`` (the interval when the layers follow
  ``full_attention_interval``, a 0/1 tuple otherwise) with the ``linear_*`` fields as
  ``linear_attention`` (:func:`~shardwork.models.hf.deltanet_weights.deltanet_config_from_hf`).
  Full attention is gated (``attention_output_gate``), QK-normed and rotates
  ``partial_rotary_factor`` of each head; every RMSNorm is zero-centred (``1 + w``,
  ``layernorm_zero_centered_gamma``). The MoE reads like Qwen2-MoE's (renormalised top-k, a
  shared expert behind a sigmoid gate). Qwen3-Next's MTP weights are not part of the
  transformers model and are not read.
- Tensors: Llama/Qwen names; the Gated DeltaNet's ``in_proj_qkvz`` / ``in_proj_ba`` /
  ``conv1d`` and the gated ``q_proj`` are converted whole (``converted`` layout), experts
  per expert as Qwen2-MoE stores them.
"""

from __future__ import annotations

from typing import Any

from shardwork.models.config import GPTConfig, is_linear_attention_layer
from shardwork.models.hf.adapter import HFAdapter
from shardwork.models.hf.deltanet_weights import (
    deltanet_config_from_hf,
    deltanet_config_to_hf,
    deltanet_from_hf,
    deltanet_to_hf,
)
from shardwork.models.hf.gated_attention_weights import merge_gated_q_proj, split_gated_q_proj
from shardwork.models.hf.moe_adapters import QWEN2_MOE
from shardwork.models.hf.moe_fields import qwen_moe_fields, qwen_moe_to_hf
from shardwork.models.hf.shared_fields import shared_fields_from_hf, shared_fields_to_hf

__all__ = ["QWEN3_NEXT"]

_TYPES = ("full_attention", "linear_attention")


def _linear_freq(hf: dict[str, Any], num_layers: int) -> int | tuple[int, ...]:
    types = hf.get("layer_types")
    interval = int(hf.get("full_attention_interval", 4))
    if types is None:
        return interval
    if len(types) != num_layers or not set(types) <= set(_TYPES):
        raise ValueError(f"layer_types={types!r} is invalid: one of {_TYPES} per layer")
    flags = tuple(int(t == "linear_attention") for t in types)
    periodic = tuple(int((i + 1) % interval != 0) for i in range(num_layers))
    return interval if flags == periodic else flags


def _rotary_percent(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))


def _fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf.get('hidden_act')!r} is not supported; valid: 'silu'")
    if hf.get("attention_bias"):
        raise ValueError("attention_bias=True with model_type='qwen3_next' is not supported")
    fields = shared_fields_from_hf(hf) | qwen_moe_fields(hf, qwen2=True)
    return fields | dict(
        qk_layernorm=True,
        add_qkv_bias=False,
        attention_output_gate=True,
        layernorm_zero_centered_gamma=True,
        rotary_percent=_rotary_percent(hf),
        linear_attention=deltanet_config_from_hf(hf),
        linear_attention_freq=_linear_freq(hf, fields["num_layers"]),
    )


def _fields_to_hf(config: GPTConfig) -> dict[str, Any]:
    layers = range(config.num_layers)
    types = [_TYPES[int(is_linear_attention_layer(config, i))] for i in layers]
    freq = config.linear_attention_freq
    out = shared_fields_to_hf(config) | qwen_moe_to_hf(config, qwen2=True)
    out |= deltanet_config_to_hf(config.linear_attention)
    out.pop("qkv_bias", None)
    out.pop("rope_scaling", None)
    return out | {
        "num_experts_per_tok": config.moe.router.top_k,
        "layer_types": types,
        "full_attention_interval": freq if isinstance(freq, int) else 4,
        "attention_bias": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": config.rope_theta,
            "partial_rotary_factor": config.rotary_percent,
        },
    }


def _claims(config: GPTConfig) -> bool:
    return config.linear_attention is not None and config.hybrid_layer_pattern is None


def _attention_prefixes(config: GPTConfig, layer: int) -> tuple[str, str]:
    key = f"decoder.layers.{layer}.self_attention."
    name = f"model.layers.{layer}." + (
        "linear_attn." if is_linear_attention_layer(config, layer) else "self_attn."
    )
    return key, name


def _convert_from_hf(hf: dict, config: GPTConfig, layers: set[int]) -> dict:
    out = {}
    heads, d = config.num_attention_heads, config.kv_channels
    for i in sorted(layers):
        key, name = _attention_prefixes(config, i)
        if is_linear_attention_layer(config, i):
            out |= deltanet_from_hf(hf, name, config.linear_attention, key_prefix=key)
        else:
            q, gate = split_gated_q_proj(hf[name + "q_proj.weight"], num_heads=heads, head_dim=d)
            out |= {key + "linear_qkv.weight.q": q, key + "linear_qkv.weight.gate": gate}
    return out


def _convert_to_hf(state: dict, config: GPTConfig) -> dict:
    out = {}
    heads, d = config.num_attention_heads, config.kv_channels
    for i in range(config.num_layers):
        key, name = _attention_prefixes(config, i)
        if is_linear_attention_layer(config, i):
            out |= deltanet_to_hf(state, key, config.linear_attention, prefix=name)
            for k in [k for k in state if k.startswith(key)]:
                del state[k]
        else:
            q = state.pop(key + "linear_qkv.weight.q")
            gate = state.pop(key + "linear_qkv.weight.gate")
            out[name + "q_proj.weight"] = merge_gated_q_proj(q, gate, num_heads=heads, head_dim=d)
    return out


QWEN3_NEXT = HFAdapter(
    model_type="qwen3_next",
    architecture="Qwen3NextForCausalLM",
    fields_from_hf=_fields_from_hf,
    fields_to_hf=_fields_to_hf,
    claims=_claims,
    # MoE tensors as Qwen2-MoE names them; q/k norms and k/v/o projections by KEY_RULES.
    layer_rules=QWEN2_MOE.layer_rules,
    weight_layout="converted",
    convert_from_hf=_convert_from_hf,
    convert_to_hf=_convert_to_hf,
)
