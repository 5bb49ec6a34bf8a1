"""Config translation for Hugging Face MoE families: Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3.

- :func:`moe_config_from_hf` builds a ``GPTConfig`` with ``moe`` (and ``mla`` for DeepSeek-V3)
  from a ``config.json`` dict of transformers 4.x or 5.x; RoPE fields go through the dense
  bridge's parser (``rope_parameters`` or ``rope_theta`` + ``rope_scaling``, YaRN included).
- Routing semantics: Mixtral and Qwen3-MoE (``norm_topk_prob=True``) renormalise the top-k
  softmax (moe-router ``pre_softmax=False``); Qwen2-MoE with ``norm_topk_prob=False`` keeps the
  full-softmax values (``pre_softmax=True``); DeepSeek-V3 uses sigmoid scores, group-limited
  selection on ``score + e_score_correction_bias`` (the expert bias), renormalisation and
  ``routed_scaling_factor``.
- MoE layer placement: Qwen's ``decoder_sparse_step`` / ``mlp_only_layers`` become a 0/1
  ``layer_freq`` pattern; DeepSeek's ``first_k_dense_replace`` maps directly.
- :func:`hf_config_from_moe` writes the config back (4.x spelling for RoPE, which 5.x reads).
- Unsupported variants (DeepSeek without ``norm_topk_prob``, ``rope_interleave=False``, softmax
  scoring with group limits, sliding windows) raise ``ValueError`` naming the field.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwork.models.config import GPTConfig
from shardwork.models.hf.rope_map import rope_from_hf, rope_scaling_to_hf
from shardwork.models.mla_config import MLAConfig
from shardwork.models.moe.config import MoEConfig

__all__ = ["MOE_MODEL_TYPES", "hf_config_from_moe", "moe_config_from_hf", "moe_model_type"]

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
_ARCH = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


def _qwen_pattern(hf: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense = set(hf.get("mlp_only_layers") or ())
    return tuple(int(i not in dense and (i + 1) % step == 0) for i in range(num_layers))


def _mixtral_fields(hf: dict[str, Any], heads: int) -> dict[str, Any]:
    """Mixtral's attention and MoE fields (top-k softmax renormalised, no shared expert)."""
    return dict(
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        head_dim=hf.get("head_dim") or None,
        ffn_hidden_size=int(hf["intermediate_size"]),
        moe=MoEConfig(
            num_experts=int(hf["num_local_experts"]),
            top_k=int(hf["num_experts_per_tok"]),
            ffn_hidden_size=int(hf["intermediate_size"]),
        ),
    )


def _qwen_moe_fields(hf: dict[str, Any], mt: str, heads: int, layers: int) -> dict[str, Any]:
    """Qwen2-MoE / Qwen3-MoE attention and MoE fields (shared expert and its gate for Qwen2)."""
    shared = hf.get("shared_expert_intermediate_size") if mt == "qwen2_moe" else None
    fields = dict(
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        head_dim=hf.get("head_dim") or None,
        ffn_hidden_size=int(hf["intermediate_size"]),
        qk_layernorm=mt == "qwen3_moe",
        add_qkv_bias=bool(hf.get("qkv_bias", True)) if mt == "qwen2_moe" else False,
        moe=MoEConfig(
            num_experts=int(hf.get("num_experts") or hf["num_local_experts"]),
            top_k=int(hf["num_experts_per_tok"]),
            ffn_hidden_size=int(hf["moe_intermediate_size"]),
            pre_softmax=not hf.get("norm_topk_prob", False),
            shared_expert_ffn_hidden_size=int(shared) if shared else None,
            shared_expert_gate=bool(shared),
            layer_freq=_qwen_pattern(hf, layers),
        ),
    )
    if mt == "qwen3_moe" and hf.get("attention_bias"):
        raise ValueError("attention_bias=True with model_type='qwen3_moe' is not supported")
    return fields


def _deepseek_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's MLA and MoE fields (sigmoid scores, group-limited selection, expert bias)."""
    if not hf.get("norm_topk_prob", True):
        raise ValueError("norm_topk_prob=False with model_type='deepseek_v3' is not supported")
    if hf.get("rope_interleave", True) is False:
        raise ValueError("rope_interleave=False is not supported; valid: True (DeepSeek-V3)")
    if hf.get("attention_bias"):
        raise ValueError("attention_bias=True is not supported for deepseek_v3; valid: False")
    n_group = hf.get("n_group") or 1
    topk_group = hf.get("topk_group") or 1
    grouped = int(n_group) > 1
    shared = hf.get("n_shared_experts") or 0
    nope, rope = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
    fields = dict(
        head_dim=nope + rope,
        ffn_hidden_size=int(hf["intermediate_size"]),
        mla=MLAConfig(
            q_lora_rank=hf.get("q_lora_rank") or None,
            kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=int(hf["v_head_dim"]),
        ),
        moe=MoEConfig(
            num_experts=int(hf["n_routed_experts"]),
            top_k=int(hf["num_experts_per_tok"]),
            ffn_hidden_size=int(hf["moe_intermediate_size"]),
            score_function="sigmoid",
            top_k_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            num_groups=int(n_group) if grouped else None,
            group_top_k=int(topk_group) if grouped else None,
            enable_expert_bias=True,
            shared_expert_ffn_hidden_size=int(shared) * int(hf["moe_intermediate_size"])
            if shared
            else None,
            first_k_dense_replace=int(hf.get("first_k_dense_replace") or 0),
        ),
    )
    return fields


def moe_config_from_hf(hf: dict[str, Any], **overrides: Any) -> GPTConfig:
    """A ``GPTConfig`` for an HF MoE config dict (``overrides`` win)."""
    mt = hf.get("model_type")
    if mt not in MOE_MODEL_TYPES:
        raise ValueError(f"model_type={mt!r} is not an MoE family; valid: {MOE_MODEL_TYPES}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf.get('hidden_act')!r} is not supported; valid: 'silu'")
    if hf.get("use_sliding_window") or (mt == "mixtral" and hf.get("sliding_window")):
        raise ValueError("sliding_window is not supported; valid: None")
    theta, scaling = rope_from_hf(hf)
    layers = int(hf["num_hidden_layers"])
    heads = int(hf["num_attention_heads"])
    kw: dict[str, Any] = dict(
        num_layers=layers,
        hidden_size=int(hf["hidden_size"]),
        num_attention_heads=heads,
        vocab_size=int(hf["vocab_size"]),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_method_std=float(hf.get("initializer_range", 0.02)),
    )
    if mt == "mixtral":
        kw |= _mixtral_fields(hf, heads)
    elif mt in ("qwen2_moe", "qwen3_moe"):
        kw |= _qwen_moe_fields(hf, mt, heads, layers)
    else:
        kw |= _deepseek_fields(hf)
    return GPTConfig(**(kw | overrides))


def moe_model_type(config: GPTConfig) -> str:
    """The HF family of an MoE ``GPTConfig`` (ValueError if none matches)."""
    m = config.moe
    if config.mla is not None:
        return "deepseek_v3"
    if m is None:
        raise ValueError("config has no moe: use the dense bridge")
    if config.qk_layernorm:
        return "qwen3_moe"
    if config.add_qkv_bias or m.shared_expert_ffn_hidden_size is not None or m.pre_softmax:
        return "qwen2_moe"
    return "mixtral"


def hf_config_from_moe(config: GPTConfig, *, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """A ``config.json`` dict transformers loads as the same MoE model."""
    mt, m = moe_model_type(config), config.moe
    dt = str(dtype or config.params_dtype).removeprefix("torch.")
    out: dict[str, Any] = {
        "architectures": [_ARCH[mt]],
        "model_type": mt,
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
        "num_experts_per_tok": m.top_k,
        "torch_dtype": dt,
        "dtype": dt,
    }
    if mt == "mixtral":
        out |= {
            "num_local_experts": m.num_experts,
            "intermediate_size": m.ffn_hidden_size,
            "head_dim": config.kv_channels,
            "sliding_window": None,
        }
    elif mt in ("qwen2_moe", "qwen3_moe"):
        pattern = [int(m.is_moe_layer(i)) for i in range(config.num_layers)]
        out |= {
            "num_experts": m.num_experts,
            "moe_intermediate_size": m.ffn_hidden_size,
            "intermediate_size": config.ffn_hidden_size,
            "norm_topk_prob": not m.pre_softmax,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, v in enumerate(pattern) if not v],
            "head_dim": config.kv_channels,
            "use_sliding_window": False,
        }
        if mt == "qwen2_moe":
            out["shared_expert_intermediate_size"] = m.shared_expert_ffn_hidden_size or 0
            out["qkv_bias"] = config.add_qkv_bias
    else:
        mla = config.mla
        shared = m.shared_expert_ffn_hidden_size or 0
        if shared % m.ffn_hidden_size:
            raise ValueError(
                f"shared_expert_ffn_hidden_size={shared} is not a multiple of the expert width "
                f"{m.ffn_hidden_size}: DeepSeek-V3 counts shared experts (n_shared_experts)"
            )
        out |= {
            "n_routed_experts": m.num_experts,
            "moe_intermediate_size": m.ffn_hidden_size,
            "intermediate_size": config.ffn_hidden_size,
            "n_shared_experts": shared // m.ffn_hidden_size,
            "routed_scaling_factor": m.top_k_scaling_factor or 1.0,
            "n_group": m.num_groups or 1,
            "topk_group": m.group_top_k or 1,
            "norm_topk_prob": True,
            "first_k_dense_replace": m.first_k_dense_replace,
            "q_lora_rank": mla.q_lora_rank,
            "kv_lora_rank": mla.kv_lora_rank,
            "qk_nope_head_dim": mla.qk_nope_head_dim,
            "qk_rope_head_dim": mla.qk_rope_head_dim,
            "v_head_dim": mla.v_head_dim,
            "rope_interleave": True,
            "attention_bias": False,
            "num_nextn_predict_layers": config.mtp.num_layers if config.mtp is not None else 0,
        }
    return out
