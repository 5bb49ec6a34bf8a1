"""Hugging Face adapter of GPT-2 (``model_type`` ``"gpt2"``, ``GPT2LMHeadModel``).

- Config: ``n_embd``, ``n_layer``, ``n_head``, ``n_inner`` (None: ``4·n_embd``),
  ``n_positions`` (rows of the learned position table), ``layer_norm_epsilon``,
  ``initializer_range``, ``tie_word_embeddings``, ``resid_pdrop`` / ``attn_pdrop`` (dropouts;
  ``embd_pdrop`` must equal ``resid_pdrop``: one ``hidden_dropout`` covers both), and the
  classic GPT options ``normalization="layernorm"``, ``position_embedding_type=
  "learned_absolute"``, ``mlp_activation="gelu_tanh"`` (``activation_function`` ``gelu_new``
  or ``gelu_pytorch_tanh``, both the tanh approximation) and biases on every projection.
  Variants shardwork's layers cannot express raise ``ValueError`` naming the field:
  ``scale_attn_by_inverse_layer_idx``, ``reorder_and_upcast_attn``, ``scale_attn_weights=False``,
  ``add_cross_attention``, other activations.
- Tensors: ``Conv1D`` layers store ``[in, out]`` (``y = x W + b``), shardwork's linears
  ``[out, in]``, so every projection is transposed; ``c_attn`` fuses ``q | k | v`` along its
  output columns (not interleaved per head), split into the ``linear_qkv`` blocks; biases,
  LayerNorms (``ln_1``, ``ln_2``, ``ln_f``), ``wte`` and ``wpe`` are copied. Import reads names
  with or without the ``transformer.`` prefix (OpenAI's original checkpoints have none);
  export writes ``GPT2LMHeadModel``'s (``transformer.…``, plus ``lm_head.weight`` when untied).
  All conversion happens in ``convert_from_hf`` / ``convert_to_hf`` (``converted`` layout); the
  key rules name the same tensors for error messages.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from shardwork.models.config import GPTConfig
from shardwork.models.hf.adapter import HFAdapter

__all__ = ["GPT2"]

_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
_PREFIX = "transformer.h"
#: The classic GPT options every GPT-2 has (fields of GPTConfig).
_OPTIONS = dict(
    normalization="layernorm",
    position_embedding_type="learned_absolute",
    mlp_activation="gelu_tanh",
    add_qkv_bias=True,
    add_proj_bias=True,
    add_mlp_bias=True,
)
#: (shardwork key suffix in a layer, HF name suffix in ``h.<i>.``, Conv1D weight to transpose)
_LAYER_TENSORS = (
    ("input_layernorm.weight", "ln_1.weight", False),
    ("input_layernorm.bias", "ln_1.bias", False),
    ("self_attention.linear_proj.weight", "attn.c_proj.weight", True),
    ("self_attention.linear_proj.bias", "attn.c_proj.bias", False),
    ("pre_mlp_layernorm.weight", "ln_2.weight", False),
    ("pre_mlp_layernorm.bias", "ln_2.bias", False),
    ("mlp.fc1.weight", "mlp.c_fc.weight", True),
    ("mlp.fc1.bias", "mlp.c_fc.bias", False),
    ("mlp.fc2.weight", "mlp.c_proj.weight", True),
    ("mlp.fc2.bias", "mlp.c_proj.bias", False),
)
_GLOBAL_TENSORS = (
    ("embedding.word_embeddings.weight", "wte.weight"),
    ("embedding.position_embeddings.weight", "wpe.weight"),
    ("decoder.final_norm.weight", "ln_f.weight"),
    ("decoder.final_norm.bias", "ln_f.bias"),
)
_QKV = "self_attention.linear_qkv"


def _refuse(hf: dict[str, Any]) -> None:
    act = hf.get("activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        raise ValueError(
            f"activation_function={act!r} is not supported for gpt2; valid: {', '.join(_ACTIVATIONS)} "
            "(GELU, tanh approximation)"
        )
    for field, valid in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("reorder_and_upcast_attn", False),
        ("add_cross_attention", False),
    ):
        if hf.get(field, valid) != valid:
            raise ValueError(f"{field}={hf[field]!r} is not supported for gpt2; valid: {valid!r}")
    resid, embd = hf.get("resid_pdrop", 0.1), hf.get("embd_pdrop", 0.1)
    if embd != resid:
        raise ValueError(
            f"embd_pdrop={embd!r} is not supported with resid_pdrop={resid!r}: shardwork has one "
            "hidden_dropout for the embedding and the residual branches; valid: equal values"
        )


def _fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    _refuse(hf)
    h = int(hf["n_embd"])
    return _OPTIONS | dict(
        num_layers=int(hf["n_layer"]),
        hidden_size=h,
        num_attention_heads=int(hf["n_head"]),
        ffn_hidden_size=int(hf.get("n_inner") or 4 * h),
        vocab_size=int(hf["vocab_size"]),
        max_position_embeddings=int(hf["n_positions"]),
        norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        init_method_std=float(hf.get("initializer_range", 0.02)),
        hidden_dropout=float(hf.get("resid_pdrop", 0.1)),
        attention_dropout=float(hf.get("attn_pdrop", 0.1)),
    )


def _fields_to_hf(config: GPTConfig) -> dict[str, Any]:
    return {
        "vocab_size": config.vocab_size,
        "n_positions": config.max_position_embeddings,
        "n_embd": config.hidden_size,
        "n_layer": config.num_layers,
        "n_head": config.num_attention_heads,
        "n_inner": config.ffn_hidden_size,
        "activation_function": "gelu_new",
        "resid_pdrop": config.hidden_dropout,
        "embd_pdrop": config.hidden_dropout,
        "attn_pdrop": config.attention_dropout,
        "layer_norm_epsilon": config.norm_epsilon,
        "initializer_range": config.init_method_std,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": config.tie_word_embeddings,
    }


def _claims(config: GPTConfig) -> bool:
    """GPT-2: the classic options, multi-head attention of ``h / heads`` wide heads, nothing
    else (no MoE, MLA, MTP, hybrid mixers, QK-norm, output gate or zero-centred norms)."""
    options = all(getattr(config, name) == value for name, value in _OPTIONS.items())
    others = (config.moe, config.mla, config.mtp, config.mamba, config.linear_attention)
    return (
        options
        and all(part is None for part in others)
        and config.hybrid_layer_pattern is None
        and config.linear_attention_freq is None
        and config.kv_heads == config.num_attention_heads
        and config.kv_channels * config.num_attention_heads == config.hidden_size
        and not (config.qk_layernorm or config.attention_output_gate)
        and not config.layernorm_zero_centered_gamma
    )


def _convert_from_hf(hf: dict, config: GPTConfig, layers: set[int]) -> dict:
    """Shardwork keys of decoder layers ``layers`` and of the tensors outside layers."""
    tensors = {name.removeprefix("transformer."): t for name, t in hf.items()}
    out = {key: tensors[name] for key, name in _GLOBAL_TENSORS if name in tensors}
    if "lm_head.weight" in hf and not config.tie_word_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    h = config.hidden_size
    for i in layers:
        src, dst = f"h.{i}.", f"decoder.layers.{i}."
        for key, name, transpose in _LAYER_TENSORS:
            if src + name in tensors:
                t = tensors[src + name]
                out[dst + key] = t.t() if transpose else t
        for part in ("weight", "bias"):
            fused = tensors.get(f"{src}attn.c_attn.{part}")
            if fused is None:
                continue
            # Conv1D [h, 3h] -> [3h, h]: rows q | k | v (bias [3h] the same order).
            rows = fused.t() if part == "weight" else fused
            for block, t in zip("qkv", rows.split(h), strict=True):
                out[f"{dst}{_QKV}.{part}.{block}"] = t
    return out


def _convert_to_hf(state: dict, config: GPTConfig) -> dict:
    """HF tensors of every shardwork key (popped from ``state``)."""
    out = {f"transformer.{name}": state.pop(key) for key, name in _GLOBAL_TENSORS}
    if "output_layer.weight" in state:
        out["lm_head.weight"] = state.pop("output_layer.weight")
    for i in range(config.num_layers):
        src, dst = f"decoder.layers.{i}.", f"{_PREFIX}.{i}."
        for key, name, transpose in _LAYER_TENSORS:
            t = state.pop(src + key)
            out[dst + name] = t.t().contiguous() if transpose else t
        for part in ("weight", "bias"):
            blocks = [state.pop(f"{src}{_QKV}.{part}.{b}") for b in "qkv"]
            fused = torch.cat(blocks, dim=0)
            out[f"{dst}attn.c_attn.{part}"] = fused.t().contiguous() if part == "weight" else fused
    return out


# The names of the same tensors as key rules (export converts every key itself; import's error
# for a missing tensor names the HF tensor through them).
_LAYER_RULES = (
    *((re.escape(key), name) for key, name, _ in _LAYER_TENSORS),
    (r"self_attention\.linear_qkv\.(weight|bias)\.(?:q|k|v)", r"attn.c_attn.\1"),
)
_GLOBAL_RULES = (
    *((re.escape(key), f"transformer.{name}") for key, name in _GLOBAL_TENSORS),
    (r"output_layer\.weight", "lm_head.weight"),
)

GPT2 = HFAdapter(
    model_type="gpt2",
    architecture="GPT2LMHeadModel",
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
