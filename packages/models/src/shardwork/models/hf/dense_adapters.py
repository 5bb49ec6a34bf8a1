"""Hugging Face adapters of the dense families: ``llama`` (Llama 2/3/3.1/3.2), ``qwen2`` (QKV
bias), ``qwen3`` (QK-norm).

They share every field but the attention variant; unsupported features (o_proj/MLP biases,
activations other than SiLU, sliding windows) raise ``ValueError`` naming the field instead of
silently loading a different model. Tensor names are the dense ``KEY_RULES``.
"""

from __future__ import annotations

from typing import Any

from shardwork.models.config import GPTConfig
from shardwork.models.hf.adapter import HFAdapter
from shardwork.models.hf.shared_fields import shared_fields_from_hf, shared_fields_to_hf
from shardwork.models.layer_options import non_default_layer_options

__all__ = ["DENSE_ADAPTERS", "LLAMA", "QWEN2", "QWEN3"]


def _dense_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """``GPTConfig`` fields every dense family reads the same way (after the shared checks)."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported; valid: 'silu' (SwiGLU)")
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported; valid: False")
    if hf.get("use_sliding_window"):
        raise ValueError("use_sliding_window=True is not supported; valid: False")
    shared = shared_fields_from_hf(hf)
    return shared | dict(
        num_query_groups=int(hf.get("num_key_value_heads") or shared["num_attention_heads"]),
        head_dim=hf.get("head_dim") or None,
        ffn_hidden_size=int(hf["intermediate_size"]),
        qk_layernorm=False,
        add_qkv_bias=False,
    )


def _dense_to_hf(config: GPTConfig) -> dict[str, Any]:
    return shared_fields_to_hf(config) | {
        "intermediate_size": config.ffn_hidden_size,
        "head_dim": config.kv_channels,
        "attention_bias": False,
    }


def _is_dense(config: GPTConfig) -> bool:
    # Llama/Qwen layers have none of the hybrid families' options (gate, partial or no RoPE, ...)
    plain = not non_default_layer_options(config)
    return config.moe is None and config.mla is None and plain


def _llama_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    fields = _dense_fields(hf)
    if hf.get("attention_bias"):
        raise ValueError(
            "attention_bias=True (llama: biases on q/k/v and o_proj) is not supported; valid: False"
        )
    return fields


def _qwen3_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    fields = _dense_fields(hf) | dict(qk_layernorm=True)
    if hf.get("attention_bias"):
        raise ValueError("attention_bias=True with model_type='qwen3' is not supported")
    return fields


LLAMA = HFAdapter(
    model_type="llama",
    architecture="LlamaForCausalLM",
    fields_from_hf=_llama_from_hf,
    fields_to_hf=lambda c: _dense_to_hf(c) | {"mlp_bias": False},
    claims=lambda c: _is_dense(c) and not c.qk_layernorm and not c.add_qkv_bias,
)
QWEN2 = HFAdapter(
    model_type="qwen2",
    architecture="Qwen2ForCausalLM",
    # Qwen2's q/k/v always carry biases (o_proj none), whatever attention_bias says
    fields_from_hf=lambda hf: _dense_fields(hf) | dict(add_qkv_bias=True),
    fields_to_hf=_dense_to_hf,
    claims=lambda c: _is_dense(c) and not c.qk_layernorm and c.add_qkv_bias,
)
QWEN3 = HFAdapter(
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    fields_from_hf=_qwen3_from_hf,
    fields_to_hf=_dense_to_hf,
    claims=lambda c: _is_dense(c) and c.qk_layernorm and not c.add_qkv_bias,
)
DENSE_ADAPTERS = (LLAMA, QWEN2, QWEN3)
