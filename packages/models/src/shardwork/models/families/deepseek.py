"""The DeepSeek family (DeepSeek-V2-Lite, DeepSeek-V3): presets and what they are built from.

- Spec (:func:`~shardwork.models.spec.spec_for`): every layer's mixer is ``"mla"`` (multi-head
  latent attention; rotary on ``qk_rope_head_dim`` channels, neighbouring pairs rotated);
  the first ``first_k_dense_replace`` layers have a ``"dense"`` MLP, the others ``"moe"``
  (V3: 3 dense then 58 MoE; V2-Lite: 1 dense then 26 MoE). V3 adds one MTP depth, an
  ``("mla", "moe")`` layer numbered ``num_layers``. V3 routes with a group-limited sigmoid and
  an aux-loss-free expert bias; V2-Lite with softmax top-6.
- Hugging Face: ``model_type`` ``"deepseek_v3"`` (both): adapter
  :data:`shardwork.models.hf.moe_adapters.DEEPSEEK_V3`.
"""

from __future__ import annotations

from typing import Any

from shardwork.fused_kernels import YarnRopeScaling
from shardwork.models.families.twins import MOE_TINY, tiny_moe
from shardwork.models.mla_config import MLAConfig
from shardwork.models.moe.config import MoEConfig
from shardwork.models.mtp_config import MTPConfig
from shardwork.models.preset_table import table_preset
from shardwork.moe_router import RouterConfig

__all__ = ["HF_MODEL_TYPES", "PRESETS", "PUBLISHED_PARAMS", "TINY_PRESETS"]

HF_MODEL_TYPES = ("deepseek_v3",)


def _deepseek_yarn(mscale: float) -> YarnRopeScaling:
    # The rope_scaling of the published config.json files: YaRN factor 40 over a 4096-token
    # original context; mscale = mscale_all_dim (V3: 1.0, V2-Lite: 0.707).
    return YarnRopeScaling(
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=mscale,
        mscale_all_dim=mscale,
    )


_DEEPSEEK = dict(
    head_dim=192, max_position_embeddings=163840, rope_theta=10000.0, norm_epsilon=1e-6
)

#: ``GPTConfig`` fields of each preset.
_SHAPES: dict[str, dict[str, Any]] = {
    "deepseek-v3": _DEEPSEEK
    | dict(
        num_layers=61,
        hidden_size=7168,
        num_attention_heads=128,
        ffn_hidden_size=18432,
        vocab_size=129280,
        rope_scaling=_deepseek_yarn(1.0),
        mla=MLAConfig(
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
        moe=MoEConfig(
            router=RouterConfig(
                num_experts=256,
                hidden_size=7168,
                top_k=8,
                score_function="sigmoid",
                top_k_scaling_factor=2.5,
                num_groups=8,
                group_top_k=4,
                enable_expert_bias=True,
                load_balancing_type="seq_aux_loss",
                aux_loss_coeff=1e-4,
                router_dtype="fp32",
            ),
            ffn_hidden_size=2048,
            shared_expert_ffn_hidden_size=2048,
            first_k_dense_replace=3,
        ),
        mtp=MTPConfig(num_layers=1, loss_coeff=0.1),
    ),
    "deepseek-v2-lite": _DEEPSEEK
    | dict(
        num_layers=27,
        hidden_size=2048,
        num_attention_heads=16,
        ffn_hidden_size=10944,
        vocab_size=102400,
        rope_scaling=_deepseek_yarn(0.707),
        mla=MLAConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        moe=MoEConfig(
            router=RouterConfig(num_experts=64, hidden_size=2048, top_k=6, pre_softmax=True),
            ffn_hidden_size=1408,
            shared_expert_ffn_hidden_size=2816,
            first_k_dense_replace=1,
        ),
    ),
}

#: Tiny twins: (docstring, fields over ``MOE_TINY``), keyed by the big preset's name.
_TINY_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "deepseek-v3": (
        "Tiny twin of DeepSeek-V3: MLA with query latent, YaRN, sigmoid group-limited routing "
        "with expert bias and scaling, a shared expert, one dense-first layer, one MTP depth.",
        dict(
            num_layers=3,
            head_dim=24,
            rope_scaling=YarnRopeScaling(
                factor=4.0,
                original_max_position_embeddings=64,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
            norm_epsilon=1e-6,
            mla=MLAConfig(
                q_lora_rank=24,
                kv_lora_rank=16,
                qk_nope_head_dim=16,
                qk_rope_head_dim=8,
                v_head_dim=16,
            ),
            moe=tiny_moe(
                router=dict(
                    top_k=4,
                    score_function="sigmoid",
                    top_k_scaling_factor=2.5,
                    num_groups=4,
                    group_top_k=2,
                    enable_expert_bias=True,
                ),
                shared_expert_ffn_hidden_size=32,
                first_k_dense_replace=1,
            ),
            mtp=MTPConfig(num_layers=1, loss_coeff=0.3),
        ),
    ),
    "deepseek-v2-lite": (
        "Tiny twin of DeepSeek-V2-Lite: MLA without query latent, softmax top-k, two shared "
        "experts' width, one dense-first layer.",
        dict(
            num_layers=3,
            head_dim=24,
            norm_epsilon=1e-6,
            mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
            moe=tiny_moe(
                router=dict(top_k=2, pre_softmax=True),
                shared_expert_ffn_hidden_size=64,
                first_k_dense_replace=1,
            ),
        ),
    ),
}

PRESETS = {name: table_preset(name, fields) for name, fields in _SHAPES.items()}
"""Presets with the published shapes."""
TINY_PRESETS = {
    f"tiny-{name}": table_preset(f"tiny-{name}", MOE_TINY | fields, doc)
    for name, (doc, fields) in _TINY_SHAPES.items()
}
"""Their tiny CPU twins (``tiny-<name>``)."""

#: Published (total, active) parameter counts; V3's 671B excludes its 14B MTP module.
PUBLISHED_PARAMS: dict[str, tuple[float, float]] = {
    "deepseek-v3": (671e9, 37e9),
    "deepseek-v2-lite": (15.7e9, 2.4e9),
}
