"""Hugging Face adapters of Gemma 2 (``model_type`` ``"gemma2"``) and Gemma 3 text
(``"gemma3_text"``).

- Config: GeGLU (``hidden_activation="gelu_pytorch_tanh"``), embeddings scaled by
  ``sqrt(hidden)``, sandwich norms, zero-centred RMSNorm weights (``1 + w``), tied embeddings
  by default, ``query_pre_attn_scalar``, attention and final-logit soft-capping, and
  ``layer_types`` (``sliding_attention`` / ``full_attention``) as ``sliding_window`` with
  ``sliding_window_pattern`` (the period when the types repeat "n - 1 sliding, 1 global", else a
  0/1 tuple). Gemma 3 adds QK-norm and per-layer-type RoPE: ``rope_parameters`` keyed by layer
  type in 5.x (4.x: ``rope_theta``, ``rope_scaling`` and ``rope_local_base_freq``); the global
  layers' scaling is ``rope_scaling``, the sliding layers' base ``rope_local_theta`` (they must
  be unscaled). Attention biases and bidirectional attention are refused by name.
- Tensors: Llama names, plus ``post_attention_layernorm`` (the sandwich norm after attention),
  ``pre_feedforward_layernorm`` (shardwork's ``pre_mlp_layernorm``) and
  ``post_feedforward_layernorm``; ``q_norm`` / ``k_norm`` by the dense rules.
"""

from __future__ import annotations

from typing import Any

from shardwork.models.config import GPTConfig
from shardwork.models.hf.adapter import HFAdapter
from shardwork.models.hf.rope_map import rope_from_hf, rope_scaling_to_hf
from shardwork.models.hf.shared_fields import shared_fields_from_hf, shared_fields_to_hf
from shardwork.models.layer_options import is_sliding_window_layer

__all__ = ["GEMMA2", "GEMMA3_TEXT", "GEMMA_ADAPTERS"]

_SLIDING, _FULL = "sliding_attention", "full_attention"
_ACTIVATION = "gelu_pytorch_tanh"

_LAYER_RULES = (
    (r"post_attention_layernorm\.weight", r"post_attention_layernorm.weight"),
    (r"pre_mlp_layernorm\.weight", r"pre_feedforward_layernorm.weight"),
    (r"post_mlp_layernorm\.weight", r"post_feedforward_layernorm.weight"),
)


def _window_fields(hf: dict[str, Any], num_layers: int, default_period: int) -> dict[str, Any]:
    """``sliding_window`` and ``sliding_window_pattern`` of HF ``layer_types``."""
    types = hf.get("layer_types")
    if types is None:
        period = int(hf.get("sliding_window_pattern", default_period))
        types = [_SLIDING if (i + 1) % period else _FULL for i in range(num_layers)]
    if len(types) != num_layers or not set(types) <= {_SLIDING, _FULL}:
        raise ValueError(
            f"layer_types={types!r} is invalid: one of {(_SLIDING, _FULL)} per layer "
            f"(num_hidden_layers={num_layers})"
        )
    flags = tuple(int(t == _SLIDING) for t in types)
    window = hf.get("sliding_window")
    if not any(flags):
        return dict(sliding_window=None, sliding_window_pattern=None)
    if window is None:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is None")
    pattern: int | tuple[int, ...] | None = flags
    if all(flags):
        pattern = None
    elif 0 in flags:
        period = flags.index(0) + 1
        if flags == tuple(int((i + 1) % period != 0) for i in range(num_layers)):
            pattern = period
    return dict(sliding_window=int(window), sliding_window_pattern=pattern)


def _common_from_hf(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or _ACTIVATION
    if act != _ACTIVATION:
        raise ValueError(
            f"hidden_activation={act!r} is not supported for model_type={model_type!r}; valid: "
            f"{_ACTIVATION!r} (GeGLU with tanh GELU)"
        )
    for name in ("attention_bias", "use_bidirectional_attention"):
        if hf.get(name):
            raise ValueError(f"{name}=True with model_type={model_type!r} is not supported")
    shared = shared_fields_from_hf(hf)
    heads = shared["num_attention_heads"]
    return shared | dict(
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or shared["hidden_size"] // heads),
        ffn_hidden_size=int(hf["intermediate_size"]),
        # Gemma ties the head to the embedding unless the config says otherwise.
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        attention_dropout=float(hf.get("attention_dropout") or 0.0),
        mlp_activation="geglu",
        scale_embedding=True,
        sandwich_norm=True,
        layernorm_zero_centered_gamma=True,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        attn_logit_softcapping=hf.get("attn_logit_softcapping"),
        final_logit_softcapping=hf.get("final_logit_softcapping"),
    )


def _gemma2_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    fields = _common_from_hf(hf, "gemma2")
    return fields | _window_fields(hf, fields["num_layers"], default_period=2)


def _gemma3_rope(hf: dict[str, Any]) -> dict[str, Any]:
    """Global ``rope_theta`` / ``rope_scaling`` and the sliding layers' ``rope_local_theta``."""
    params = hf.get("rope_parameters") or {}
    if _FULL in params or _SLIDING in params:  # transformers 5.x: per layer type
        full = params.get(_FULL) or {"rope_theta": 1_000_000.0}
        local = params.get(_SLIDING) or {"rope_theta": 10_000.0}
    else:  # 4.x: rope_theta / rope_scaling on global layers, rope_local_base_freq on sliding ones
        full = {"rope_theta": hf.get("rope_theta", 1_000_000.0)} | (hf.get("rope_scaling") or {})
        local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    theta, scaling = rope_from_hf({"rope_parameters": full})
    local_theta, local_scaling = rope_from_hf({"rope_parameters": local})
    if local_scaling is not None:
        raise ValueError(
            f"rope_parameters[{_SLIDING!r}]={local!r} is not supported: sliding-window layers "
            "rotate without scaling; valid rope_type: 'default'"
        )
    return dict(rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta)


def _gemma3_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    fields = _common_from_hf(hf, "gemma3_text") | _gemma3_rope(hf) | dict(qk_layernorm=True)
    fields |= _window_fields(hf, fields["num_layers"], default_period=6)
    if fields["sliding_window"] is None:
        fields["rope_local_theta"] = None  # no sliding layers: one table for every layer
    return fields


def _common_to_hf(config: GPTConfig) -> dict[str, Any]:
    out = shared_fields_to_hf(config)
    for name in ("hidden_act", "rope_theta", "rope_scaling"):
        out.pop(name)
    types = [
        _SLIDING if is_sliding_window_layer(config, i) else _FULL for i in range(config.num_layers)
    ]
    return out | {
        "hidden_activation": _ACTIVATION,
        "intermediate_size": config.ffn_hidden_size,
        "head_dim": config.kv_channels,
        "attention_bias": False,
        "query_pre_attn_scalar": _scalar_to_hf(config),
        "attn_logit_softcapping": config.attn_logit_softcapping,
        "final_logit_softcapping": config.final_logit_softcapping,
        # transformers needs an integer even when no layer slides (then it is unused).
        "sliding_window": config.sliding_window or config.max_position_embeddings,
        "layer_types": types,
    }


def _scalar_to_hf(config: GPTConfig) -> int | float:
    """``query_pre_attn_scalar``: transformers' config declares an int, so integral values go
    out as ints (None: head_dim, the plain scale)."""
    scalar = config.query_pre_attn_scalar or config.kv_channels
    return int(scalar) if float(scalar).is_integer() else scalar


def _rope_parameters(theta: float, scaling) -> dict[str, Any]:
    return (rope_scaling_to_hf(scaling) or {"rope_type": "default"}) | {"rope_theta": theta}


def _gemma2_to_hf(config: GPTConfig) -> dict[str, Any]:
    return _common_to_hf(config) | {
        "rope_parameters": _rope_parameters(config.rope_theta, config.rope_scaling)
    }


def _gemma3_to_hf(config: GPTConfig) -> dict[str, Any]:
    full = _rope_parameters(config.rope_theta, config.rope_scaling)
    local = full
    if config.rope_local_theta is not None:
        local = _rope_parameters(config.rope_local_theta, None)
    return _common_to_hf(config) | {"rope_parameters": {_FULL: full, _SLIDING: local}}


def _is_gemma(c: GPTConfig) -> bool:
    """Gemma's layer: GeGLU, sandwich norms, scaled embeddings, zero-centred norms, and nothing
    of the other families (MoE, MLA, hybrid mixers, biases, gated or partial RoPE)."""
    return (
        c.mlp_activation == "geglu"
        and c.sandwich_norm
        and c.scale_embedding
        and c.layernorm_zero_centered_gamma
        and c.moe is None
        and c.mla is None
        and c.mtp is None
        and c.mamba is None
        and c.linear_attention is None
        and c.hybrid_layer_pattern is None
        and not c.add_qkv_bias
        and not c.add_mlp_bias
        and not c.attention_output_gate
        and c.position_embedding_type == "rope"
        and c.rotary_percent == 1.0
    )


GEMMA2 = HFAdapter(
    model_type="gemma2",
    architecture="Gemma2ForCausalLM",
    fields_from_hf=_gemma2_from_hf,
    fields_to_hf=_gemma2_to_hf,
    claims=lambda c: _is_gemma(c) and not c.qk_layernorm and c.rope_local_theta is None,
    layer_rules=_LAYER_RULES,
)
GEMMA3_TEXT = HFAdapter(
    model_type="gemma3_text",
    architecture="Gemma3ForCausalLM",
    fields_from_hf=_gemma3_from_hf,
    fields_to_hf=_gemma3_to_hf,
    claims=lambda c: _is_gemma(c) and c.qk_layernorm,
    layer_rules=_LAYER_RULES,
)
GEMMA_ADAPTERS = (GEMMA2, GEMMA3_TEXT)
