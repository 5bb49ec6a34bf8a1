"""Which transformers router modules the integration replaces, and the :class:`RouterConfig`
that reproduces each one's routing.

transformers 5 gives every MoE block a router module (``mlp.gate``, gpt-oss ``mlp.router``)
that returns ``(router_logits, top_k_weights, top_k_index)``; the routing fields are read off
that module (its ``top_k``, ``norm_topk_prob``, group sizes, scaling factor, weight shape), so
they are the ones the model actually runs with. Per class (read from transformers 5.x):

=========================  ==========================================================
router class               shardwork routing
=========================  ==========================================================
``MixtralTopKRouter``      softmax, top-k renormalised = softmax over the top-k logits
                           (``pre_softmax=False``)
``Qwen2MoeTopKRouter``,    softmax over all experts, top-k; renormalised only with
``Qwen3MoeTopKRouter``,    ``norm_topk_prob`` (``pre_softmax = not norm_topk_prob``)
``OlmoeTopKRouter``
``DeepseekV3TopkRouter``   fp32 sigmoid scores, ``e_score_correction_bias`` as the expert
                           bias, groups ranked by their top-2 sum
                           (:func:`group_score_top_n_for_hf`), top-k normalised and scaled
                           by ``routed_scaling_factor``
``GptOssTopKRouter``       softmax over the top-k logits, gating bias (``add_bias``)
=========================  ==========================================================

Only the load-balancing options (:data:`BALANCING_OPTIONS`) may be set on top: the others
would change which experts the model's weights were trained to use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from shardwork.moe_router.config import RouterConfig
from shardwork.moe_router.hf_config import group_score_top_n_for_hf

BALANCING_OPTIONS = (
    "load_balancing_type",
    "aux_loss_coeff",
    "z_loss_coeff",
    "capacity_factor",
    "token_drop_policy",
    "expert_bias_update_rate",
    "input_jitter_eps",
    "check_finite",
)
"""``RouterConfig`` fields :func:`config_for_router` accepts as options."""

GATE_ATTRIBUTES = ("gate", "router")
"""Names under which a transformers MoE block holds its router module."""


def _renormalised_softmax(gate: torch.nn.Module, hf_config: Mapping) -> dict:
    # softmax(all)[top-k] / its sum == softmax(top-k logits): Megatron's post-softmax.
    return {"score_function": "softmax", "pre_softmax": False}


def _softmax_then_topk(gate: torch.nn.Module, hf_config: Mapping) -> dict:
    return {"score_function": "softmax", "pre_softmax": not bool(gate.norm_topk_prob)}


def _softmax_of_top_logits(gate: torch.nn.Module, hf_config: Mapping) -> dict:
    return {"score_function": "softmax", "pre_softmax": False, "add_bias": gate.bias is not None}


def _grouped_sigmoid(gate: torch.nn.Module, hf_config: Mapping) -> dict:
    model_type = hf_config.get("model_type")
    if not gate.norm_topk_prob or gate.top_k == 1:
        # shardwork divides the selected sigmoid scores by their sum exactly when top_k > 1.
        raise ValueError(
            f"{model_type} router with norm_topk_prob={gate.norm_topk_prob!r} and "
            f"num_experts_per_tok={gate.top_k} is not supported: shardwork normalises the "
            "selected sigmoid scores exactly when top_k > 1 (norm_topk_prob=True, top_k >= 2)"
        )
    fields = {
        "score_function": "sigmoid",
        "top_k_scaling_factor": float(gate.routed_scaling_factor),
        "enable_expert_bias": True,
        "router_dtype": "fp32",  # the HF router casts hidden states and weight to fp32
    }
    num_groups = gate.num_group
    if num_groups is not None and num_groups > 1:
        fields |= {
            "num_groups": int(num_groups),
            "group_top_k": int(gate.topk_group),
            "group_score_top_n": group_score_top_n_for_hf(hf_config),
        }
    return fields


ROUTING_RULES: dict[str, Callable[[torch.nn.Module, Mapping], dict]] = {
    "MixtralTopKRouter": _renormalised_softmax,
    "Qwen2MoeTopKRouter": _softmax_then_topk,
    "Qwen3MoeTopKRouter": _softmax_then_topk,
    "OlmoeTopKRouter": _softmax_then_topk,
    "DeepseekV3TopkRouter": _grouped_sigmoid,
    "GptOssTopKRouter": _softmax_of_top_logits,
}
"""transformers router class name -> the routing fields (besides sizes) reproducing it."""


def is_hf_router(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a transformers router this integration knows how to replace."""
    return type(module).__name__ in ROUTING_RULES


def config_for_router(gate: torch.nn.Module, hf_config: Mapping, **options) -> RouterConfig:
    """The :class:`RouterConfig` that routes as the transformers router ``gate`` does, plus
    ``options`` (only :data:`BALANCING_OPTIONS`). ``hf_config`` is the model's
    ``config.to_dict()`` (its ``model_type`` and group fields)."""
    rule = ROUTING_RULES.get(type(gate).__name__)
    if rule is None:
        raise ValueError(
            f"router class {type(gate).__name__!r} is not supported: known classes are "
            f"{tuple(ROUTING_RULES)}"
        )
    for name in options:
        if name not in BALANCING_OPTIONS:
            raise ValueError(
                f"router option {name}={options[name]!r} is invalid: the routing itself comes from "
                f"the model's router ({type(gate).__name__}); options you may set are "
                f"{BALANCING_OPTIONS}"
            )
    num_experts, hidden_size = gate.weight.shape
    return RouterConfig(
        num_experts=int(num_experts),
        hidden_size=int(hidden_size),
        top_k=int(gate.top_k),
        **rule(gate, hf_config),
        **options,
    )
