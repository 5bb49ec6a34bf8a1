"""Translate between a Hugging Face ``config.json`` (transformers 4.x or 5.x) and ``GPTConfig``.

- Families: ``llama`` (Llama 2/3/3.1/3.2), ``qwen2`` (QKV bias), ``qwen3`` (QK-norm).
- RoPE: 5.x ``rope_parameters`` ({"rope_type", "rope_theta", ...}) or 4.x ``rope_theta`` +
  ``rope_scaling`` ({"rope_type" or "type", ...}); types ``default``, ``llama3``, ``yarn``.
- Unsupported features (o_proj/MLP biases, activations other than SiLU, sliding windows)
  raise ``ValueError`` naming the field instead of silently loading a different model.
- Export writes the 4.x spelling (``rope_theta`` + ``rope_scaling``), which transformers 5.x
  also reads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from shardwork.models.config import GPTConfig
from shardwork.models.hf.moe_config import hf_config_from_moe, moe_config_from_hf
from shardwork.models.hf.rope_map import rope_from_hf, rope_scaling_to_hf

__all__ = ["SUPPORTED_MODEL_TYPES", "gpt_config_from_hf", "hf_config_from_gpt", "read_hf_config"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a checkpoint folder as a dict."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder!s} has no config.json; valid: a Hugging Face checkpoint folder")
    return json.loads(path.read_text())


def gpt_config_from_hf(hf: dict[str, Any], **overrides: Any) -> GPTConfig:
    """A ``GPTConfig`` for the HF config dict ``hf`` (``overrides`` win, e.g. dtypes, tp options)."""
    model_type = hf.get("model_type")
    if model_type in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"):  # hf/moe_config.py
        return moe_config_from_hf(hf, **overrides)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type={model_type!r} is not supported; valid: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported; valid: 'silu' (SwiGLU)")
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported; valid: False")
    if hf.get("use_sliding_window"):
        raise ValueError("use_sliding_window=True is not supported; valid: False")
    attention_bias = bool(hf.get("attention_bias", False))
    if model_type == "llama" and attention_bias:
        raise ValueError(
            "attention_bias=True (llama: biases on q/k/v and o_proj) is not supported; valid: False"
        )
    if model_type == "qwen3" and attention_bias:
        raise ValueError("attention_bias=True with model_type='qwen3' is not supported")
    theta, scaling = rope_from_hf(hf)
    heads = int(hf["num_attention_heads"])
    kw: dict[str, Any] = dict(
        num_layers=int(hf["num_hidden_layers"]),
        hidden_size=int(hf["hidden_size"]),
        num_attention_heads=heads,
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        head_dim=hf.get("head_dim") or None,
        ffn_hidden_size=int(hf["intermediate_size"]),
        vocab_size=int(hf["vocab_size"]),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        qk_layernorm=model_type == "qwen3",
        add_qkv_bias=model_type == "qwen2",
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_method_std=float(hf.get("initializer_range", 0.02)),
    )
    return GPTConfig(**(kw | overrides))


def _model_type(config: GPTConfig) -> str:
    if config.qk_layernorm:
        if config.add_qkv_bias:
            raise ValueError("qk_layernorm together with add_qkv_bias has no Hugging Face family")
        return "qwen3"
    return "qwen2" if config.add_qkv_bias else "llama"


def hf_config_from_gpt(config: GPTConfig, *, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """A ``config.json`` dict that transformers (4.x and 5.x) loads as the same model."""
    if config.moe is not None or config.mla is not None:  # MoE families: hf/moe_config.py
        return hf_config_from_moe(config, dtype=dtype)
    model_type = _model_type(config)
    dt = str(dtype or config.params_dtype).removeprefix("torch.")
    out: dict[str, Any] = {
        "architectures": [_ARCH[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.kv_channels,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.norm_epsilon,
        "rope_theta": config.rope_theta,
        "rope_scaling": rope_scaling_to_hf(config.rope_scaling),
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": config.attention_dropout,
        "initializer_range": config.init_method_std,
        "torch_dtype": dt,
        "dtype": dt,
    }
    if model_type == "llama":
        out["mlp_bias"] = False
    return out
