"""MoE router scores + top-k (+ group-limited top-k, + expert-bias selection) + aux-loss statistics.

Semantics follow Megatron-Core 0.19's ``topk_routing_with_score_function`` and
``compute_routing_scores_for_aux_loss`` (re-derived here; this package never
imports moe-router or Megatron):

- ``softmax``, ``pre_softmax=False``: top-k of the raw logits, then softmax over the k
  selected logits (probs sum to 1). ``pre_softmax=True``: softmax over all experts,
  then top-k of the probabilities (not renormalised unless ``normalize=True``).
- ``sigmoid`` / ``sqrtsoftplus`` (``sqrt(softplus(x))``): top-k of ``score(logits)
  (+ expert_bias)``; probs are the selected scores (the bias only steers selection),
  divided by their sum (+1e-20) when ``topk > 1``.
- Group-limited: experts form ``num_groups`` equal groups; each group scores the sum of
  its top ``topk // group_topk`` selection scores; only the ``group_topk`` best groups
  stay eligible.
- ``scaling_factor`` multiplies the probs last; probs come back in ``logits.dtype``.
- Aux-loss statistics: ``scores_for_aux`` = softmax of all logits (softmax), or sigmoid /
  sqrtsoftplus scores divided by their row sum, float32 (float64 for float64 logits,
  where Megatron would compute in float32) and differentiable;
  ``tokens_per_expert`` counts, per expert, the tokens whose plain top-k of
  ``scores_for_aux`` (no groups, no bias) contains it — what Megatron's aux losses
  use. The counts of the actual routing are ``routing_map.sum(0)``.

Tensor names: N tokens, E experts.
"""

from __future__ import annotations

import torch

from shardwork.fused_kernels import te_ops
from shardwork.fused_kernels._checks import (
    acc_dtype,
    check_float,
    check_int,
    check_positive,
    check_same_device,
)
from shardwork.fused_kernels.backend import resolve_backend
from shardwork.fused_kernels.router_output import RouterTopK, default_normalize

__all__ = ["RouterTopK", "router_topk", "router_topk_reference"]

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")


def _group_limited_topk(scores_NE, topk, num_groups, group_topk):
    n, e = scores_NE.shape
    # [N, E] -> [N, G, E/G]: the experts of one group are contiguous.
    per_group = scores_NE.view(n, num_groups, e // num_groups)
    group_scores = per_group.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    group_idx = group_scores.topk(group_topk, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, group_idx, True)
    # Each kept group's flag repeated over its E/G experts: [N, G] -> [N, E].
    expert_mask = group_mask.repeat_interleave(e // num_groups, dim=1)
    masked = scores_NE.masked_fill(~expert_mask, float("-inf"))
    return masked.topk(topk, dim=-1)


def _elementwise_scores(
    logits: torch.Tensor, score_function: str, dtype: torch.dtype
) -> torch.Tensor:
    x = logits.to(dtype)
    if score_function == "sigmoid":
        return torch.sigmoid(x)
    return torch.nn.functional.softplus(x).sqrt()


def router_topk_reference(
    logits: torch.Tensor,
    *,
    topk: int,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    expert_bias: torch.Tensor | None = None,
    scaling_factor: float | None = None,
    normalize: bool | None = None,
) -> RouterTopK:
    """Plain-torch router top-k (the oracle for the other backends); differentiable by autograd."""
    if normalize is None:
        normalize = default_normalize(score_function, topk)
    cd = acc_dtype(logits)

    def select(scores_NE):
        if group_topk:
            return _group_limited_topk(scores_NE, topk, num_groups, group_topk)
        return scores_NE.topk(topk, dim=-1)

    if score_function == "softmax":
        if pre_softmax:
            probs, idx = select(torch.softmax(logits, dim=-1, dtype=cd))
        else:
            top_logits, idx = select(logits)
            probs = torch.softmax(top_logits, dim=-1, dtype=cd)
        if normalize and pre_softmax:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        scores = _elementwise_scores(logits, score_function, cd)
        if expert_bias is not None:
            idx = select(scores + expert_bias.to(cd)).indices
            probs = scores.gather(1, idx)
        else:
            probs, idx = select(scores)
        if normalize:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.to(logits.dtype)
    dense = torch.zeros_like(logits).scatter(1, idx, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
    if score_function == "softmax":
        aux = torch.softmax(logits, dim=-1, dtype=cd)
    else:
        aux = _elementwise_scores(logits, score_function, cd)
        aux = aux / (aux.sum(dim=-1, keepdim=True) + 1e-20)
    aux_idx = aux.detach().topk(topk, dim=-1).indices
    counts = torch.zeros(logits.shape[1], dtype=torch.int64, device=logits.device)
    counts.index_add_(0, aux_idx.reshape(-1), torch.ones_like(aux_idx.reshape(-1)))
    return RouterTopK(dense, routing_map, aux, counts)


def _validate(logits, topk, score_function, num_groups, group_topk, expert_bias, scaling_factor):
    check_float("logits", logits)
    if logits.dim() != 2:
        raise ValueError(
            f"logits.shape={tuple(logits.shape)} must be 2-D [num_tokens, num_experts]"
        )
    e = logits.shape[1]
    check_int("topk", topk)
    if not 1 <= topk <= e:
        raise ValueError(f"topk={topk!r} must be an int in [1, num_experts={e}]")
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"score_function={score_function!r}; valid: {', '.join(SCORE_FUNCTIONS)}")
    if (num_groups is None) != (group_topk is None):
        raise ValueError(
            f"num_groups={num_groups} and group_topk={group_topk} must be given together (or neither)"
        )
    if group_topk is not None:
        check_int("num_groups", num_groups)
        check_int("group_topk", group_topk)
        if num_groups <= 0 or e % num_groups:
            raise ValueError(f"num_groups={num_groups} must be > 0 and divide num_experts={e}")
        if not 1 <= group_topk <= num_groups:
            raise ValueError(f"group_topk={group_topk} must be in [1, num_groups={num_groups}]")
        if topk < group_topk or topk > group_topk * (e // num_groups):
            raise ValueError(
                f"topk={topk} must be in [group_topk={group_topk}, group_topk * experts per group "
                f"= {group_topk * (e // num_groups)}]"
            )
    if expert_bias is not None:
        if score_function == "softmax":
            raise ValueError(
                "expert_bias is used with score_function='sigmoid' or 'sqrtsoftplus' only "
                "(Megatron-Core semantics), "
                f"got score_function={score_function!r}"
            )
        if tuple(expert_bias.shape) != (e,):
            raise ValueError(f"expert_bias.shape={tuple(expert_bias.shape)} must be ({e},)")
        check_same_device(logits=logits, expert_bias=expert_bias)
    if scaling_factor is not None:
        check_positive("scaling_factor", scaling_factor)


def router_topk(
    logits: torch.Tensor,
    *,
    topk: int,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    expert_bias: torch.Tensor | None = None,
    scaling_factor: float | None = None,
    normalize: bool | None = None,
    backend: str | None = None,
) -> RouterTopK:
    """Route ``logits [N, E]``: returns :class:`RouterTopK` (probs, routing_map, scores_for_aux, tokens_per_expert).

    ``normalize=None`` keeps Megatron's rule (renormalise sigmoid/sqrtsoftplus top-k probs when
    ``topk > 1``); True/False force renormalisation of the selected probs on or off
    (``True`` with pre-softmax gives HF ``norm_topk_prob``).
    """
    _validate(logits, topk, score_function, num_groups, group_topk, expert_bias, scaling_factor)
    kwargs = dict(
        topk=topk,
        score_function=score_function,
        pre_softmax=pre_softmax,
        num_groups=num_groups,
        group_topk=group_topk,
        expert_bias=expert_bias,
        scaling_factor=scaling_factor,
        normalize=normalize,
    )
    chosen = resolve_backend("router_topk", backend, logits.device, dtype=logits.dtype)
    if chosen == "triton":
        from shardwork.fused_kernels import triton_router

        if normalize is None:
            kwargs["normalize"] = default_normalize(score_function, topk)
        return triton_router.router_topk(logits, **kwargs)
    if chosen == "te":
        return te_ops.router_topk(logits, **kwargs)
    return router_topk_reference(logits, **kwargs)
