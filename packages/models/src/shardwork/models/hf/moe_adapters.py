"""Hugging Face adapters of the MoE families: Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3.

- Config: ``moe`` (and ``mla`` for DeepSeek-V3) from a ``config.json`` dict of transformers
  4.x or 5.x; RoPE fields go through the dense bridge's parser (``rope_parameters`` or
  ``rope_theta`` + ``rope_scaling``, YaRN included); export writes the 4.x spelling, which
  5.x reads.
- Routing semantics: Mixtral and Qwen3-MoE (``norm_topk_prob=True``) renormalise the top-k
  softmax (moe-router ``pre_softmax=False``); Qwen2-MoE with ``norm_topk_prob=False`` keeps the
  full-softmax values (``pre_softmax=True``); DeepSeek-V3 uses sigmoid scores, group-limited
  selection on ``score + e_score_correction_bias`` (the expert bias), renormalisation and
  ``routed_scaling_factor``.
- MoE layer placement: Qwen's ``decoder_sparse_step`` / ``mlp_only_layers`` become a 0/1
  ``layer_freq`` pattern; DeepSeek's ``first_k_dense_replace`` maps directly.
- Tensor names (``layer_rules``): routers (``block_sparse_moe.gate`` for Mixtral on disk,
  ``mlp.gate`` elsewhere), per-expert tensors (``w1/w3/w2`` for Mixtral,
  ``gate_proj/up_proj/down_proj`` elsewhere), ``e_score_correction_bias``, shared experts
  (``shared_expert`` + ``shared_expert_gate`` for Qwen2-MoE, ``shared_experts`` for
  DeepSeek-V3) and DeepSeek's MLA projections.
- Unsupported variants (DeepSeek without ``norm_topk_prob``, ``rope_interleave=False``,
  sliding windows) raise ``ValueError`` naming the field.
"""

from __future__ import annotations

from typing import Any

from shardwork.models.config import GPTConfig
from shardwork.models.hf.adapter import HFAdapter
from shardwork.models.hf.moe_fields import (
    deepseek_fields,
    deepseek_to_hf,
    mixtral_fields,
    mixtral_to_hf,
    qwen_moe_fields,
    qwen_moe_to_hf,
)
from shardwork.models.hf.shared_fields import shared_fields_from_hf, shared_fields_to_hf
from shardwork.models.layer_options import non_default_layer_options

__all__ = ["DEEPSEEK_V3", "MIXTRAL", "MOE_ADAPTERS", "MOE_MODEL_TYPES", "QWEN2_MOE", "QWEN3_MOE"]


def _moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """``GPTConfig`` fields every MoE family reads the same way (after the shared checks)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf.get('hidden_act')!r} is not supported; valid: 'silu'")
    if hf.get("use_sliding_window"):
        raise ValueError("sliding_window is not supported; valid: None")
    return shared_fields_from_hf(hf)


def _moe_to_hf(config: GPTConfig) -> dict[str, Any]:
    return shared_fields_to_hf(config) | {"num_experts_per_tok": config.moe.router.top_k}


def _mixtral_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    common = _moe_fields(hf)
    if hf.get("sliding_window"):  # Mixtral spells it without use_sliding_window
        raise ValueError("sliding_window is not supported; valid: None")
    return common | mixtral_fields(hf)


def _qwen_moe_claim(config: GPTConfig) -> bool:
    """Qwen2-MoE: an MoE model with QKV bias, a shared expert or full-softmax weights."""
    m = config.moe
    return (
        config.add_qkv_bias or m.shared_expert_ffn_hidden_size is not None or m.router.pre_softmax
    )


def _plain_layers(config: GPTConfig) -> bool:
    """No hybrid-family layer option: these families' layers have none."""
    return not non_default_layer_options(config)


def _plain_moe(config: GPTConfig) -> bool:
    return config.moe is not None and config.mla is None and _plain_layers(config)


def _expert_rules(moe: str, names: tuple[str, str, str], shared: str) -> tuple:
    """Router, per-expert, expert-bias and shared-expert rules of one MoE layer."""
    return (
        (r"mlp\.router\.weight", f"{moe}.gate.weight"),
        (r"mlp\.router\.expert_bias", "mlp.gate.e_score_correction_bias"),
        (r"mlp\.experts\.linear_fc1\.weight\.(\d+)\.gate", rf"{moe}.experts.\1.{names[0]}.weight"),
        (r"mlp\.experts\.linear_fc1\.weight\.(\d+)\.up", rf"{moe}.experts.\1.{names[1]}.weight"),
        (r"mlp\.experts\.linear_fc2\.weight\.(\d+)", rf"{moe}.experts.\1.{names[2]}.weight"),
        (r"mlp\.shared_experts\.fc1\.weight\.(gate|up)", rf"mlp.{shared}.\1_proj.weight"),
        (r"mlp\.shared_experts\.fc2\.weight", f"mlp.{shared}.down_proj.weight"),
        (r"mlp\.shared_experts_gate\.weight", "mlp.shared_expert_gate.weight"),
    )


_PROJ = ("gate_proj", "up_proj", "down_proj")
_MLA_RULES = (
    (r"self_attention\.linear_q_down_proj\.weight", "self_attn.q_a_proj.weight"),
    (r"self_attention\.q_layernorm\.weight", "self_attn.q_a_layernorm.weight"),
    (r"self_attention\.linear_q_up_proj\.weight", "self_attn.q_b_proj.weight"),
    (r"self_attention\.linear_q_proj\.weight", "self_attn.q_proj.weight"),
    (r"self_attention\.linear_kv_down_proj\.weight", "self_attn.kv_a_proj_with_mqa.weight"),
    (r"self_attention\.kv_layernorm\.weight", "self_attn.kv_a_layernorm.weight"),
    (r"self_attention\.linear_kv_up_proj\.weight", "self_attn.kv_b_proj.weight"),
)

MIXTRAL = HFAdapter(
    model_type="mixtral",
    architecture="MixtralForCausalLM",
    fields_from_hf=_mixtral_from_hf,
    fields_to_hf=lambda c: _moe_to_hf(c) | mixtral_to_hf(c),
    claims=lambda c: _plain_moe(c) and not c.qk_layernorm and not _qwen_moe_claim(c),
    layer_rules=_expert_rules("block_sparse_moe", ("w1", "w3", "w2"), "shared_experts"),
    weight_layout="experts",
)
QWEN2_MOE = HFAdapter(
    model_type="qwen2_moe",
    architecture="Qwen2MoeForCausalLM",
    fields_from_hf=lambda hf: _moe_fields(hf) | qwen_moe_fields(hf, qwen2=True),
    fields_to_hf=lambda c: _moe_to_hf(c) | qwen_moe_to_hf(c, qwen2=True),
    claims=lambda c: _plain_moe(c) and not c.qk_layernorm and _qwen_moe_claim(c),
    layer_rules=_expert_rules("mlp", _PROJ, "shared_expert"),
    weight_layout="experts",
)
QWEN3_MOE = HFAdapter(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    fields_from_hf=lambda hf: _moe_fields(hf) | qwen_moe_fields(hf, qwen2=False),
    fields_to_hf=lambda c: _moe_to_hf(c) | qwen_moe_to_hf(c, qwen2=False),
    claims=lambda c: _plain_moe(c) and c.qk_layernorm,
    layer_rules=_expert_rules("mlp", _PROJ, "shared_experts"),
    weight_layout="experts",
)
DEEPSEEK_V3 = HFAdapter(
    model_type="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    fields_from_hf=lambda hf: _moe_fields(hf) | deepseek_fields(hf),
    fields_to_hf=lambda c: _moe_to_hf(c) | deepseek_to_hf(c),
    claims=lambda c: c.mla is not None and _plain_layers(c),
    layer_rules=_expert_rules("mlp", _PROJ, "shared_experts") + _MLA_RULES,
    weight_layout="experts",
    mtp_copies=True,
)
MOE_ADAPTERS = (MIXTRAL, QWEN2_MOE, QWEN3_MOE, DEEPSEEK_V3)
MOE_MODEL_TYPES = tuple(a.model_type for a in MOE_ADAPTERS)
