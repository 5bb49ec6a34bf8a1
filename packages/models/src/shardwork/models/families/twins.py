"""Tiny CPU twins of the families' presets: the same features at sizes that run in milliseconds.

- :func:`dense_twin`: a dense preset's twin, copying its features (GQA, tied embeddings, QKV
  bias, QK-norm, rope theta and Llama-3 scaling with a short original context, norm epsilon)
  onto :data:`DENSE_TINY`.
- :data:`MOE_TINY` / :func:`tiny_moe`: the base fields and expert settings of the MoE twins
  (8 experts, so ep = 2, 4 or 8 work), which each MoE family extends with its features.

Vocabularies are *not* multiples of ``make_vocab_size_divisible_by`` so padding is exercised.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardwork.fused_kernels import Llama3RopeScaling
from shardwork.models.config import GPTConfig
from shardwork.models.moe.config import MoEConfig
from shardwork.moe_router import RouterConfig

__all__ = ["DENSE_TINY", "MOE_TINY", "dense_twin", "tiny_moe"]

DENSE_TINY = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    ffn_hidden_size=96,
    vocab_size=250,
    make_vocab_size_divisible_by=16,
    max_position_embeddings=256,
)

MOE_TINY = DENSE_TINY | dict(init_method_std=0.05)


def dense_twin(big: Callable[..., GPTConfig], **extra: Any) -> Callable[..., GPTConfig]:
    """The twin preset of ``big`` (keyword overrides go to the GPTConfig)."""

    def make(**kw: Any) -> GPTConfig:
        ref = big()
        feat = dict(
            num_query_groups=2 if ref.kv_heads < ref.num_attention_heads else None,
            tie_word_embeddings=ref.tie_word_embeddings,
            add_qkv_bias=ref.add_qkv_bias,
            qk_layernorm=ref.qk_layernorm,
            rope_theta=ref.rope_theta,
            rope_scaling=None
            if ref.rope_scaling is None
            else Llama3RopeScaling(
                factor=ref.rope_scaling.factor,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
            norm_epsilon=ref.norm_epsilon,
        )
        return GPTConfig(**(DENSE_TINY | feat | extra | kw))

    make.__doc__ = f"Tiny CPU twin of {big.__name__} (same features, toy sizes)."
    return make


def tiny_moe(*, router: dict[str, Any] | None = None, **moe: Any) -> MoEConfig:
    """A twin's ``MoEConfig``: 8 experts of width 32, top-2, with ``router`` overrides of its
    :class:`RouterConfig` and ``moe`` overrides of the other fields.

    The router reads :data:`MOE_TINY`'s hidden size and starts like the twin's other weights
    (``init_std`` = its ``init_method_std``); pass ``router=dict(hidden_size=...)`` with a
    twin of another width.
    """
    base = dict(
        num_experts=8,
        hidden_size=MOE_TINY["hidden_size"],
        top_k=2,
        init_std=MOE_TINY["init_method_std"],
    )
    return MoEConfig(
        router=RouterConfig(**(base | (router or {}))), **(dict(ffn_hidden_size=32) | moe)
    )
