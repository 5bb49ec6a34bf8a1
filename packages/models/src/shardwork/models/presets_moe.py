"""MoE presets with the real families' shapes (Mixtral, Qwen-MoE, DeepSeek) and tiny CPU twins.

Each preset returns a :class:`GPTConfig` with ``moe`` (and ``mla`` / ``mtp`` for DeepSeek);
keyword overrides go to the GPTConfig. They are registered in ``shardwork.models.PRESETS``.
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
from shardwork.models.mla import MLAConfig
from shardwork.models.moe.config import MoEConfig
from shardwork.models.mtp import MTPConfig

__all__ = ["MOE_PRESETS", "PUBLISHED_MOE_PARAMS"]


def _build(base: dict[str, Any], kw: dict[str, Any]) -> GPTConfig:
    return GPTConfig(**(base | kw))


def mixtral_8x7b(**kw: Any) -> GPTConfig:
    base = dict(
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
    )
    return _build(base, kw)


def qwen3_30b_a3b(**kw: Any) -> GPTConfig:
    base = dict(
        num_layers=48,
        hidden_size=2048,
        num_attention_heads=32,
        num_query_groups=4,
        head_dim=128,
        ffn_hidden_size=6144,
        vocab_size=151936,
        qk_layernorm=True,
        max_position_embeddings=40960,
        rope_theta=1e6,
        norm_epsilon=1e-6,
        moe=MoEConfig(num_experts=128, top_k=8, ffn_hidden_size=768),
    )
    return _build(base, kw)


def qwen2_57b_a14b(**kw: Any) -> GPTConfig:
    base = dict(
        num_layers=28,
        hidden_size=3584,
        num_attention_heads=28,
        num_query_groups=4,
        ffn_hidden_size=18944,
        vocab_size=151936,
        add_qkv_bias=True,
        max_position_embeddings=32768,
        rope_theta=1e6,
        norm_epsilon=1e-6,
        moe=MoEConfig(
            num_experts=64,
            top_k=8,
            ffn_hidden_size=2560,
            pre_softmax=True,
            shared_expert_ffn_hidden_size=20480,
            shared_expert_gate=True,
        ),
    )
    return _build(base, kw)


def _deepseek_yarn(mscale: float) -> YarnRopeScaling:
    return YarnRopeScaling(
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=mscale,
        mscale_all_dim=mscale,
    )


def deepseek_v3(**kw: Any) -> GPTConfig:
    base = dict(
        num_layers=61,
        hidden_size=7168,
        num_attention_heads=128,
        head_dim=192,
        ffn_hidden_size=18432,
        vocab_size=129280,
        max_position_embeddings=163840,
        rope_theta=10000.0,
        rope_scaling=_deepseek_yarn(1.0),
        norm_epsilon=1e-6,
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
    )
    return _build(base, kw)


def deepseek_v2_lite(**kw: Any) -> GPTConfig:
    base = dict(
        num_layers=27,
        hidden_size=2048,
        num_attention_heads=16,
        head_dim=192,
        ffn_hidden_size=10944,
        vocab_size=102400,
        max_position_embeddings=163840,
        rope_theta=10000.0,
        rope_scaling=_deepseek_yarn(0.707),
        norm_epsilon=1e-6,
        mla=MLAConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        moe=MoEConfig(
            num_experts=64,
            top_k=6,
            ffn_hidden_size=1408,
            pre_softmax=True,
            shared_expert_ffn_hidden_size=2816,
            first_k_dense_replace=1,
        ),
    )
    return _build(base, kw)


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


def tiny_mixtral(**kw: Any) -> GPTConfig:
    """Tiny twin of Mixtral: GQA, softmax top-2 renormalised, every layer MoE."""
    return _build(_TINY | dict(num_query_groups=2, rope_theta=1e6, moe=_tiny_moe()), kw)


def tiny_qwen3_moe(**kw: Any) -> GPTConfig:
    """Tiny twin of Qwen3-30B-A3B: QK-norm, GQA, top-4 of 8 renormalised."""
    return _build(
        _TINY
        | dict(
            num_query_groups=2,
            head_dim=16,
            qk_layernorm=True,
            rope_theta=1e6,
            norm_epsilon=1e-6,
            moe=_tiny_moe(top_k=4),
        ),
        kw,
    )


def tiny_qwen2_moe(**kw: Any) -> GPTConfig:
    """Tiny twin of Qwen2-MoE: QKV bias, softmax without renormalising, gated shared expert."""
    return _build(
        _TINY
        | dict(
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
        kw,
    )


def tiny_deepseek_v3(**kw: Any) -> GPTConfig:
    """Tiny twin of DeepSeek-V3: MLA with query latent, YaRN, sigmoid group-limited routing
    with expert bias and scaling, a shared expert, one dense-first layer, one MTP depth."""
    return _build(
        _TINY
        | dict(
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
        kw,
    )


def tiny_deepseek_v2_lite(**kw: Any) -> GPTConfig:
    """Tiny twin of DeepSeek-V2-Lite: MLA without query latent, softmax top-k, two shared
    experts' width, one dense-first layer."""
    return _build(
        _TINY
        | dict(
            num_layers=3,
            head_dim=24,
            norm_epsilon=1e-6,
            mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
            moe=_tiny_moe(
                top_k=2, pre_softmax=True, shared_expert_ffn_hidden_size=64, first_k_dense_replace=1
            ),
        ),
        kw,
    )


MOE_PRESETS: dict[str, Callable[..., GPTConfig]] = {
    "mixtral-8x7b": mixtral_8x7b,
    "qwen3-30b-a3b": qwen3_30b_a3b,
    "qwen2-57b-a14b": qwen2_57b_a14b,
    "deepseek-v3": deepseek_v3,
    "deepseek-v2-lite": deepseek_v2_lite,
    "tiny-mixtral-8x7b": tiny_mixtral,
    "tiny-qwen3-30b-a3b": tiny_qwen3_moe,
    "tiny-qwen2-57b-a14b": tiny_qwen2_moe,
    "tiny-deepseek-v3": tiny_deepseek_v3,
    "tiny-deepseek-v2-lite": tiny_deepseek_v2_lite,
}

#: Published (total, active) parameter counts; DeepSeek-V3's 671B excludes its 14B MTP module.
PUBLISHED_MOE_PARAMS: dict[str, tuple[float, float]] = {
    "mixtral-8x7b": (46.7e9, 12.9e9),
    "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "qwen2-57b-a14b": (57.4e9, 14.2e9),
    "deepseek-v3": (671e9, 37e9),
    "deepseek-v2-lite": (15.7e9, 2.4e9),
}
