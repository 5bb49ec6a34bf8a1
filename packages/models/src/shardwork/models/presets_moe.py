"""MoE presets with the real families' shapes (Mixtral, Qwen-MoE, DeepSeek) and tiny CPU twins.

Each preset is a table row (``_SHAPES``, tiny twins in ``_TINY_SHAPES``; family fields shared
by dict union) made into a function returning a :class:`GPTConfig` with ``moe`` (and ``mla`` /
``mtp`` for DeepSeek); keyword overrides go to the GPTConfig. They are registered in ``shardwork.models.PRESETS``.
``PUBLISHED_MOE_PARAMS`` holds the published (total, active) counts the calculator is
checked against (model cards; rounded, so compared with a tolerance).

Tiny twins keep each family's features (routing function, normalisation, group limits,
shared experts and their gate, dense-first layers, MLA with and without a query latent,
YaRN, MTP) at sizes that run in milliseconds on a CPU, with 8 experts so ep = 2, 4 or 8 work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardwork.fused_kernels import YarnRopeScaling
from shardwork.models.config import GPTConfig
from shardwork.models.mla_config import MLAConfig
from shardwork.models.moe.config import MoEConfig
from shardwork.models.mtp_config import MTPConfig
from shardwork.models.preset_table import table_preset

__all__ = ["MOE_PRESETS", "PUBLISHED_MOE_PARAMS"]


def _deepseek_yarn(mscale: float) -> YarnRopeScaling:
    return YarnRopeScaling(
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=mscale,
        mscale_all_dim=mscale,
    )


_QWEN = dict(rope_theta=1e6, max_position_embeddings=32768, norm_epsilon=1e-6)
_DEEPSEEK = dict(
    head_dim=192, max_position_embeddings=163840, rope_theta=10000.0, norm_epsilon=1e-6
)

#: ``GPTConfig`` fields of each MoE preset with the real family's shapes.
_SHAPES: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": dict(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        vocab_size=32000,
        max_position_embeddings=32768,
        rope_theta=1e6,
        norm_epsilon=1e-5,
        moe=MoEConfig(num_experts=8, top_k=2, ffn_hidden_size=14336),
    ),
    "qwen3-30b-a3b": _QWEN
    | dict(
        num_layers=48,
        hidden_size=2048,
        num_attention_heads=32,
        num_query_groups=4,
        head_dim=128,
        ffn_hidden_size=6144,
        vocab_size=151936,
        qk_layernorm=True,
        max_position_embeddings=40960,
        moe=MoEConfig(num_experts=128, top_k=8, ffn_hidden_size=768),
    ),
    "qwen2-57b-a14b": _QWEN
    | dict(
        num_layers=28,
        hidden_size=3584,
        num_attention_heads=28,
        num_query_groups=4,
        ffn_hidden_size=18944,
        vocab_size=151936,
        add_qkv_bias=True,
        moe=MoEConfig(
            num_experts=64,
            top_k=8,
            ffn_hidden_size=2560,
            pre_softmax=True,
            shared_expert_ffn_hidden_size=20480,
            shared_expert_gate=True,
        ),
    ),
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
            num_experts=256,
            top_k=8,
            ffn_hidden_size=2048,
            score_function="sigmoid",
            top_k_scaling_factor=2.5,
            num_groups=8,
            group_top_k=4,
            enable_expert_bias=True,
            load_balancing_type="seq_aux_loss",
            aux_loss_coeff=1e-4,
            router_dtype="fp32",
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
            num_experts=64,
            top_k=6,
            ffn_hidden_size=1408,
            pre_softmax=True,
            shared_expert_ffn_hidden_size=2816,
            first_k_dense_replace=1,
        ),
    ),
}

_TINY = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    ffn_hidden_size=96,
    vocab_size=250,
    make_vocab_size_divisible_by=16,
    max_position_embeddings=256,
    init_method_std=0.05,
)


def _tiny_moe(**moe: Any) -> MoEConfig:
    return MoEConfig(**(dict(num_experts=8, top_k=2, ffn_hidden_size=32) | moe))


#: Tiny twins: (docstring, fields over ``_TINY``), keyed by the big preset's name.
_TINY_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral-8x7b": (
        "Tiny twin of Mixtral: GQA, softmax top-2 renormalised, every layer MoE.",
        dict(num_query_groups=2, rope_theta=1e6, moe=_tiny_moe()),
    ),
    "qwen3-30b-a3b": (
        "Tiny twin of Qwen3-30B-A3B: QK-norm, GQA, top-4 of 8 renormalised.",
        dict(
            num_query_groups=2,
            head_dim=16,
            qk_layernorm=True,
            rope_theta=1e6,
            norm_epsilon=1e-6,
            moe=_tiny_moe(top_k=4),
        ),
    ),
    "qwen2-57b-a14b": (
        "Tiny twin of Qwen2-MoE: QKV bias, softmax without renormalising, gated shared expert.",
        dict(
            num_query_groups=2,
            add_qkv_bias=True,
            rope_theta=1e6,
            norm_epsilon=1e-6,
            moe=_tiny_moe(
                top_k=4,
                pre_softmax=True,
                shared_expert_ffn_hidden_size=48,
                shared_expert_gate=True,
            ),
        ),
    ),
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
            moe=_tiny_moe(
                top_k=4,
                score_function="sigmoid",
                top_k_scaling_factor=2.5,
                num_groups=4,
                group_top_k=2,
                enable_expert_bias=True,
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
            moe=_tiny_moe(
                top_k=2, pre_softmax=True, shared_expert_ffn_hidden_size=64, first_k_dense_replace=1
            ),
        ),
    ),
}

MOE_PRESETS: dict[str, Callable[..., GPTConfig]] = {
    name: table_preset(name, fields) for name, fields in _SHAPES.items()
}
MOE_PRESETS |= {
    f"tiny-{name}": table_preset(f"tiny-{name}", _TINY | fields, doc)
    for name, (doc, fields) in _TINY_SHAPES.items()
}

#: Published (total, active) parameter counts; DeepSeek-V3's 671B excludes its 14B MTP module.
PUBLISHED_MOE_PARAMS: dict[str, tuple[float, float]] = {
    "mixtral-8x7b": (46.7e9, 12.9e9),
    "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "qwen2-57b-a14b": (57.4e9, 14.2e9),
    "deepseek-v3": (671e9, 37e9),
    "deepseek-v2-lite": (15.7e9, 2.4e9),
}
