"""Generated cases of the router conformance kit (:mod:`shardwork.moe_router.conformance`).

Each :class:`ConformanceCase` exercises one routing option (its ``option`` label) on random
inputs drawn from a seed: a router configuration (:class:`RouterConfig`, whose fields map to
Megatron-Core's ``moe_*`` flags, docs/moe-router.md), hidden states [S, B, H], a gating weight
[E, H], an expert bias where the option uses one, and an upstream gradient for the probs.

- Scores and selection: softmax after / before top-k (top-1 and top-2), sigmoid,
  sqrtsoftplus, top-4 with a scaling factor, expert bias, group-limited routing with the
  default group score and with ``group_score_top_n``.
- Capacity: dropping by probability and by position, padding to capacity.
- Each loss alone (aux, seq-aux, global-aux, z-loss) with coefficient 1 and a *zero* upstream
  gradient, so the input and weight gradients are exactly the loss's gradient.

Weights are drawn at std 1/√H so the logits are O(1) and routing is decisive (no near-ties
that rounding could flip); sizes are small (T = 32 tokens) so a case runs in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwork.moe_router.config import RouterConfig


@dataclass(frozen=True)
class ConformanceCase:
    """One generated input for the router under test (see module docstring)."""

    name: str
    """Short identifier, e.g. ``"softmax_post_top2"``."""
    option: str
    """The routing option this case checks, as reported (``"score_function=sigmoid"``)."""
    config: RouterConfig
    """The options to configure the router with (aux-loss scale 1: gradients are unscaled)."""
    hidden: torch.Tensor
    """[S, B, H] fp32 router input; the kit hands a leaf that requires grad."""
    weight: torch.Tensor
    """[E, H] fp32 gating weight to load into the router (no gating bias)."""
    expert_bias: torch.Tensor | None
    """[E] fp32 selection-only bias (``enable_expert_bias``), else None."""
    grad_probs: torch.Tensor
    """[T, E] upstream gradient of the probs (T = S·B in [S, B] row-major order)."""


BASE = dict(num_experts=8, hidden_size=16, top_k=2, load_balancing_type="none")
DEEP = dict(num_experts=16, top_k=4, score_function="sigmoid")
# (name, option label, config fields over BASE, zero upstream gradient: a loss case)
CASE_TABLE: tuple[tuple[str, str, dict, bool], ...] = (
    ("softmax_post_top2", "score_function=softmax, pre_softmax=False", {}, False),
    ("softmax_pre_top2", "score_function=softmax, pre_softmax=True", {"pre_softmax": True}, False),
    (
        "softmax_pre_top1",
        "top_k=1 (pre_softmax=True)",
        {"pre_softmax": True, "top_k": 1},
        False,
    ),
    ("sigmoid_top2", "score_function=sigmoid", {"score_function": "sigmoid"}, False),
    (
        "sqrtsoftplus_top2",
        "score_function=sqrtsoftplus",
        {"score_function": "sqrtsoftplus"},
        False,
    ),
    ("sigmoid_top4_scaled", "top_k_scaling_factor", {**DEEP, "top_k_scaling_factor": 2.5}, False),
    (
        "expert_bias",
        "enable_expert_bias (selection only)",
        {**DEEP, "enable_expert_bias": True},
        False,
    ),
    (
        "group_limited",
        "num_groups / group_top_k",
        {**DEEP, "num_groups": 4, "group_top_k": 2},
        False,
    ),
    (
        "group_score_top_n",
        "group_score_top_n=2",
        {**DEEP, "top_k": 6, "num_groups": 4, "group_top_k": 2, "group_score_top_n": 2},
        False,
    ),
    (
        "capacity_probs",
        "capacity_factor, token_drop_policy=probs",
        {"capacity_factor": 1.1},
        False,
    ),
    (
        "capacity_position",
        "capacity_factor, token_drop_policy=position",
        {"capacity_factor": 1.1, "token_drop_policy": "position"},
        False,
    ),
    (
        # position policy: which zero-probability tokens pad a column is then defined (the
        # earliest unrouted ones); under the probs policy it is a tie among zeros
        "capacity_pad",
        "pad_to_capacity",
        {"capacity_factor": 1.1, "token_drop_policy": "position", "pad_to_capacity": True},
        False,
    ),
    (
        "aux_loss",
        "load_balancing_type=aux_loss",
        {"load_balancing_type": "aux_loss", "aux_loss_coeff": 1.0},
        True,
    ),
    (
        "seq_aux_loss",
        "load_balancing_type=seq_aux_loss",
        {"load_balancing_type": "seq_aux_loss", "aux_loss_coeff": 1.0, "score_function": "sigmoid"},
        True,
    ),
    (
        "global_aux_loss",
        "load_balancing_type=global_aux_loss",
        {"load_balancing_type": "global_aux_loss", "aux_loss_coeff": 1.0},
        True,
    ),
    ("z_loss", "z_loss_coeff", {"z_loss_coeff": 1.0}, True),
)
CASE_NAMES = tuple(row[0] for row in CASE_TABLE)


def generate_cases(
    *, seed: int = 0, names: tuple[str, ...] | None = None, seq_len: int = 8, batch: int = 4
) -> list[ConformanceCase]:
    """The conformance cases (all, or those in ``names``), drawn from ``seed``.

    ``seq_len · batch`` tokens per case; the default 32 keeps capacities fractional
    (C = ⌈T·K/E·1.1⌉) so a floor-for-ceil mistake shows.
    """
    unknown = set(names or ()) - set(CASE_NAMES)
    if unknown:
        raise ValueError(f"names={sorted(unknown)} are not cases: choose from {CASE_NAMES}")
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for name, option, fields, loss_only in CASE_TABLE:
        config = RouterConfig(**{**BASE, **fields})
        num_experts, hidden_size = config.num_experts, config.hidden_size
        # drawn for every case, kept or not, so a case's inputs do not depend on ``names``
        weight = torch.randn(num_experts, hidden_size, generator=gen) / hidden_size**0.5
        hidden = torch.randn(seq_len, batch, hidden_size, generator=gen)
        bias = torch.randn(num_experts, generator=gen) * 0.1
        grad = torch.randn(seq_len * batch, num_experts, generator=gen)
        if names is not None and name not in names:
            continue
        cases.append(
            ConformanceCase(
                name=name,
                option=option,
                config=config,
                hidden=hidden,
                weight=weight,
                expert_bias=bias if config.enable_expert_bias else None,
                grad_probs=torch.zeros_like(grad) if loss_only else grad,
            )
        )
    return cases
