"""Family-specific ``GPTConfig`` <-> ``config.json`` fields of the Hugging Face MoE families,
used by their adapters in :mod:`shardwork.models.hf.moe_adapters` (which documents the
semantics): Mixtral, Qwen2-MoE / Qwen3-MoE (one function each, ``qwen2`` picks the variant)
and DeepSeek-V3 (MLA); also the MoE blocks of Nemotron-H (:mod:`shardwork.models.hf.nemotron_h`),
which route like DeepSeek-V3.
"""

from __future__ import annotations

from typing import Any

from shardwork.models.config import GPTConfig
from shardwork.models.mla_config import MLAConfig
from shardwork.models.moe.config import MoEConfig
from shardwork.moe_router import RouterConfig, group_score_top_n_for_hf

__all__ = [
    "deepseek_fields",
    "deepseek_to_hf",
    "mixtral_fields",
    "mixtral_to_hf",
    "nemotron_h_moe_fields",
    "nemotron_h_moe_to_hf",
    "qwen_moe_fields",
    "qwen_moe_to_hf",
]


def _qwen_pattern(hf: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense = set(hf.get("mlp_only_layers") or ())
    return tuple(int(i not in dense and (i + 1) % step == 0) for i in range(num_layers))


def _router(hf: dict[str, Any], **routing: Any) -> RouterConfig:
    """The family's routing options on the model's hidden size, the gating weight initialised
    like the model's (``initializer_range``, as ``shared_fields`` reads it)."""
    return RouterConfig(
        hidden_size=int(hf["hidden_size"]),
        init_std=float(hf.get("initializer_range", 0.02)),
        **routing,
    )


def _group_score_top_n(hf: dict[str, Any]) -> int | None:
    """The group-score rule of a group-limited HF config (transformers' DeepSeek-V3 scores a
    group by its top-2 experts), as ``RouterConfig.group_score_top_n``: None where it equals
    the default ``top_k // group_top_k`` (so such configs compare equal to the presets)."""
    rule = group_score_top_n_for_hf(hf)
    default = int(hf["num_experts_per_tok"]) // int(hf["topk_group"])
    return None if rule is None or rule == default else rule


def mixtral_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Mixtral's attention and MoE fields (top-k softmax renormalised, no shared expert)."""
    heads = int(hf["num_attention_heads"])
    return dict(
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        head_dim=hf.get("head_dim") or None,
        ffn_hidden_size=int(hf["intermediate_size"]),
        moe=MoEConfig(
            router=_router(
                hf,
                num_experts=int(hf["num_local_experts"]),
                top_k=int(hf["num_experts_per_tok"]),
            ),
            ffn_hidden_size=int(hf["intermediate_size"]),
        ),
    )


def qwen_moe_fields(hf: dict[str, Any], *, qwen2: bool) -> dict[str, Any]:
    """Qwen2-MoE (``qwen2``) / Qwen3-MoE attention and MoE fields (shared expert and its gate
    for Qwen2-MoE, QK-norm for Qwen3-MoE)."""
    heads, layers = int(hf["num_attention_heads"]), int(hf["num_hidden_layers"])
    shared = hf.get("shared_expert_intermediate_size") if qwen2 else None
    fields = dict(
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        head_dim=hf.get("head_dim") or None,
        ffn_hidden_size=int(hf["intermediate_size"]),
        qk_layernorm=not qwen2,
        add_qkv_bias=bool(hf.get("qkv_bias", True)) if qwen2 else False,
        moe=MoEConfig(
            router=_router(
                hf,
                num_experts=int(hf.get("num_experts") or hf["num_local_experts"]),
                top_k=int(hf["num_experts_per_tok"]),
                pre_softmax=not hf.get("norm_topk_prob", False),
            ),
            ffn_hidden_size=int(hf["moe_intermediate_size"]),
            shared_expert_ffn_hidden_size=int(shared) if shared else None,
            shared_expert_gate=bool(shared),
            layer_freq=_qwen_pattern(hf, layers),
        ),
    )
    if not qwen2 and hf.get("attention_bias"):
        raise ValueError("attention_bias=True with model_type='qwen3_moe' is not supported")
    return fields


def deepseek_fields(hf: dict[str, Any]) -> dict[str, Any]:
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
            router=_router(
                hf,
                num_experts=int(hf["n_routed_experts"]),
                top_k=int(hf["num_experts_per_tok"]),
                score_function="sigmoid",
                top_k_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                num_groups=int(n_group) if grouped else None,
                group_top_k=int(topk_group) if grouped else None,
                group_score_top_n=_group_score_top_n(hf) if grouped else None,
                enable_expert_bias=True,
            ),
            ffn_hidden_size=int(hf["moe_intermediate_size"]),
            shared_expert_ffn_hidden_size=int(shared) * int(hf["moe_intermediate_size"])
            if shared
            else None,
            first_k_dense_replace=int(hf.get("first_k_dense_replace") or 0),
        ),
    )
    return fields


def _check_top2_groups(r: RouterConfig, family: str) -> None:
    """ValueError unless group-limited routing scores a group by its top 2 experts, the rule
    of transformers' DeepSeek-V3-style routers."""
    if r.num_groups is None or r.num_groups <= 1:
        return
    rule = r.group_score_top_n or r.top_k // r.group_top_k
    if rule != 2:
        raise ValueError(
            f"group-limited routing scores a group by its top {rule} experts (top_k="
            f"{r.top_k}, group_top_k={r.group_top_k}, group_score_top_n="
            f"{r.group_score_top_n}); {family} in transformers scores it by its top 2: "
            "valid: group_score_top_n=2 (or top_k // group_top_k = 2)"
        )


def nemotron_h_moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Nemotron-H's ``moe`` blocks: squared-ReLU experts and shared expert, sigmoid scores
    selected on ``score + e_score_correction_bias`` (optionally group-limited), renormalised
    (``norm_topk_prob``) and scaled by ``routed_scaling_factor``; logits in fp32 as
    transformers computes them. The shared expert is one MLP of
    ``moe_shared_expert_intermediate_size`` (transformers' width, falling back to
    ``intermediate_size``; ``n_shared_experts`` does not change it)."""
    if hf.get("moe_latent_size") is not None:
        raise ValueError(
            f"moe_latent_size={hf['moe_latent_size']!r} is not supported for nemotron_h (the "
            "experts' latent projections fc1/fc2_latent_proj); valid: None"
        )
    top_k, norm = int(hf["num_experts_per_tok"]), bool(hf.get("norm_topk_prob", True))
    # moe-router's sigmoid weights are s / sum(s) over the top k for k > 1 and s for k = 1.
    if norm != (top_k > 1):
        raise ValueError(
            f"norm_topk_prob={norm} with num_experts_per_tok={top_k} is not supported for "
            "nemotron_h: valid: norm_topk_prob=True with num_experts_per_tok > 1, or False "
            "with num_experts_per_tok=1"
        )
    n_group, topk_group = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    grouped = n_group > 1
    shared = hf.get("moe_shared_expert_intermediate_size") or hf["intermediate_size"]
    return dict(
        moe=MoEConfig(
            router=_router(
                hf,
                num_experts=int(hf["n_routed_experts"]),
                top_k=top_k,
                score_function="sigmoid",
                top_k_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                num_groups=n_group if grouped else None,
                group_top_k=topk_group if grouped else None,
                group_score_top_n=_group_score_top_n(hf) if grouped else None,
                enable_expert_bias=True,
                router_dtype="fp32",
            ),
            ffn_hidden_size=int(hf["moe_intermediate_size"]),
            shared_expert_ffn_hidden_size=int(shared),
        )
    )


def nemotron_h_moe_to_hf(config: GPTConfig) -> dict[str, Any]:
    """Nemotron-H's MoE fields of ``config.json``; ValueError for routing it cannot express."""
    m = config.moe
    r = m.router
    for ok, what in (
        (r.score_function == "sigmoid", f"score_function={r.score_function!r}; valid: 'sigmoid'"),
        (r.enable_expert_bias, "enable_expert_bias=False; valid: True"),
        (m.shared_expert_ffn_hidden_size is not None, "no shared expert; valid: one"),
        (not m.shared_expert_gate, "shared_expert_gate=True; valid: False"),
    ):
        if not ok:
            raise ValueError(f"GPTConfig.moe has {what} (Nemotron-H's MoE blocks)")
    _check_top2_groups(r, "Nemotron-H")
    return {
        "n_routed_experts": r.num_experts,
        "num_experts_per_tok": r.top_k,
        "moe_intermediate_size": m.ffn_hidden_size,
        "moe_shared_expert_intermediate_size": m.shared_expert_ffn_hidden_size,
        "n_shared_experts": 1,
        "moe_latent_size": None,
        "n_group": r.num_groups or 1,
        "topk_group": r.group_top_k or 1,
        "norm_topk_prob": r.top_k > 1,
        "routed_scaling_factor": r.top_k_scaling_factor or 1.0,
    }


def mixtral_to_hf(config: GPTConfig) -> dict[str, Any]:
    """Mixtral's expert fields of ``config.json``."""
    return {
        "num_local_experts": config.moe.router.num_experts,
        "intermediate_size": config.moe.ffn_hidden_size,
        "head_dim": config.kv_channels,
        "sliding_window": None,
    }


def qwen_moe_to_hf(config: GPTConfig, *, qwen2: bool) -> dict[str, Any]:
    """Qwen2-MoE (``qwen2``) / Qwen3-MoE expert and layer-placement fields of ``config.json``."""
    m = config.moe
    r = m.router
    pattern = [int(m.is_moe_layer(i)) for i in range(config.num_layers)]
    out = {
        "num_experts": r.num_experts,
        "moe_intermediate_size": m.ffn_hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "norm_topk_prob": not r.pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, v in enumerate(pattern) if not v],
        "head_dim": config.kv_channels,
        "use_sliding_window": False,
    }
    if qwen2:
        out["shared_expert_intermediate_size"] = m.shared_expert_ffn_hidden_size or 0
        out["qkv_bias"] = config.add_qkv_bias
    return out


def deepseek_to_hf(config: GPTConfig) -> dict[str, Any]:
    """DeepSeek-V3's MLA, routing and MTP fields of ``config.json``."""
    m, mla = config.moe, config.mla
    r = m.router
    shared = m.shared_expert_ffn_hidden_size or 0
    _check_top2_groups(r, "DeepSeek-V3")
    if shared % m.ffn_hidden_size:
        raise ValueError(
            f"shared_expert_ffn_hidden_size={shared} is not a multiple of the expert width "
            f"{m.ffn_hidden_size}: DeepSeek-V3 counts shared experts (n_shared_experts)"
        )
    return {
        "n_routed_experts": r.num_experts,
        "moe_intermediate_size": m.ffn_hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "n_shared_experts": shared // m.ffn_hidden_size,
        "routed_scaling_factor": r.top_k_scaling_factor or 1.0,
        "n_group": r.num_groups or 1,
        "topk_group": r.group_top_k or 1,
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
