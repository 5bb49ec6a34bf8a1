"""Scores, top-k selection and capacity: the pure tensor functions behind :class:`TopKRouter`.

Legend: T tokens, E experts, K = top_k, G groups.

- ``topk_routing``: the plain-autograd formula of the routing (the router runs the same math
  through ``routing_fn.route_topk``'s hand-written backward; tests compare the two):
  logits_TE -> (probs_TE, routing_map_TE) for softmax (pre- or post-top-k),
  sigmoid and sqrtsoftplus scores, with group-limited selection, expert bias (selection only)
  and a scaling factor. Scores are computed in fp32, or fp64 when the logits are fp64
  (Megatron-Core computes its softmax in fp32 even for fp64 logits), and cast back to the
  logits' dtype.
- ``aux_loss_scores``: the dense scores and plain top-k map that load-balancing losses use
  (plain-autograd reference of ``routing_fn.aux_score_sums`` and ``AuxLossGradient``).
- ``sinkhorn``: Sinkhorn-Knopp balancing of exp(logits).
- ``drop_to_capacity``: token dropping by probability or by position, optional padding.
- No Python loop over tokens or experts anywhere: everything is a handful of batched ops.
- The public functions check their arguments first with the rules :class:`RouterConfig`
  uses (:mod:`.checks`; shapes and Python values only, no host sync); the router's own
  forward calls the unchecked internals, its config having been checked once.
"""

from __future__ import annotations

import math

import torch

from shardwork.moe_router.checks import (
    check_bool,
    check_capacity_factor,
    check_groups,
    check_tensor,
    check_top_k,
    is_finite_number,
    is_int,
)
from shardwork.moe_router.config import DROP_POLICIES, SCORE_FUNCTIONS


def score_dtype(logits: torch.Tensor) -> torch.dtype:
    """fp64 logits keep fp64 scores; anything else is scored in fp32."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


NORM_EPS = 1e-20
"""Added to the sum of the K selected scores (and to the row sums the load-balancing losses
divide by) before normalising, as Megatron-Core does; shared by the top-k and dense paths."""


def activate(logits_TE: torch.Tensor, score_function: str) -> torch.Tensor:
    """The elementwise score function (sigmoid or sqrtsoftplus) of the logits, in the score
    dtype (:func:`score_dtype`); softmax is not elementwise and is handled by the callers."""
    x = logits_TE.to(score_dtype(logits_TE))
    if score_function == "sigmoid":
        return torch.sigmoid(x)
    if score_function == "sqrtsoftplus":
        return torch.nn.functional.softplus(x).sqrt()
    raise ValueError(f"score_function={score_function!r} is not an elementwise score function")


def activation_grad(
    grad: torch.Tensor, scores: torch.Tensor, logits: torch.Tensor, score_function: str
) -> torch.Tensor:
    """d(loss)/d(logits) from d(loss)/d(scores) for an elementwise score function."""
    if score_function == "sigmoid":
        return torch.ops.aten.sigmoid_backward(grad, scores)
    # sqrtsoftplus: s = sqrt(softplus(x)); autograd's SqrtBackward then SoftplusBackward.
    # d sqrt(u) = g / (2 sqrt(u)); beta=1, threshold=20 are F.softplus's defaults.
    return torch.ops.aten.softplus_backward(grad / (2 * scores), logits.to(scores.dtype), 1, 20)


_SAME_WIDTH_INT = {torch.float32: torch.int32, torch.float64: torch.int64}


def topk_indices_nonnegative(scores_TE: torch.Tensor, k: int) -> torch.Tensor:
    """``torch.topk(scores_TE, k, dim=1).indices`` for scores >= 0 (softmax, sigmoid,
    sqrtsoftplus), computed faster on CPU.

    Non-negative IEEE floats order exactly like their bit patterns read as signed integers of
    the same width, and equal floats have equal bits, so ``topk`` over that integer view picks
    the same entries in the same order (ties included: the same selection algorithm sees the
    same comparisons). On CPU it is ~13 % faster than over floats ([4096, 256], k = 8: 8.4 vs
    9.8 ms, 1 thread). NaN scores (a diverged router) may rank differently.
    """
    view_dtype = _SAME_WIDTH_INT.get(scores_TE.dtype)
    if view_dtype is None or scores_TE.device.type != "cpu":
        return torch.topk(scores_TE, k=k, dim=1)[1]
    return torch.topk(scores_TE.view(view_dtype), k=k, dim=1)[1]


def top2_values(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(largest, second largest) of the last dim by a max/min tournament on contiguous halves.

    Elementwise ops only (``torch.topk`` and index-returning ``max`` cost microseconds per
    row on CPU). Exact, ties included: equal maxima give second == largest, as topk does.
    """
    n = x.shape[-1]
    # The tournament needs a power-of-two width; topk elsewhere (and off CPU).
    if n < 2 or n & (n - 1) or x.device.type != "cpu":
        v = torch.topk(x, 2, dim=-1)[0]
        return v[..., 0], v[..., 1]
    h = n // 2
    # Pair the two halves: m1 = pairwise maxima, m2 = pairwise minima.
    m1 = torch.maximum(x[..., :h], x[..., h:])
    m2 = torch.minimum(x[..., :h], x[..., h:])
    while m1.shape[-1] > 1:
        h = m1.shape[-1] // 2
        a1, b1, a2, b2 = m1[..., :h], m1[..., h:], m2[..., :h], m2[..., h:]
        # The runner-up of two pairs is the larger of (smaller maximum, larger runner-up).
        m2 = torch.maximum(torch.minimum(a1, b1), torch.maximum(a2, b2))
        m1 = torch.maximum(a1, b1)
    return m1[..., 0], m2[..., 0]


def _top_sum(grouped_TGe: torch.Tensor, r: int) -> torch.Tensor:
    """Sum of the r largest entries of the last dim (exactly topk(r).sum, ties included)."""
    if r == 1:
        return grouped_TGe.amax(dim=-1)
    if r == 2:  # v1 + v2 in topk's order: the same float sum
        first, second = top2_values(grouped_TGe)
        return first + second
    return grouped_TGe.topk(r, dim=-1)[0].sum(dim=-1)


def group_limited_topk(
    scores_TE: torch.Tensor,
    top_k: int,
    *,
    num_groups: int,
    group_top_k: int,
    group_score_top_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k restricted to the ``group_top_k`` best of ``num_groups`` equal expert groups.

    A group's rank is the sum of its best ``group_score_top_n`` scores; None means
    ``top_k // group_top_k`` (Megatron-Core's device- and node-limited routing), while
    transformers' DeepSeek-V3 always sums the top 2. The final top-k runs on the kept groups
    only (gathered, not masked), which selects the same experts as masking the others to -inf.
    Returns (values_TK, indices_TK).

    Raises ValueError for arguments :class:`RouterConfig` refuses: ``num_groups`` not dividing
    E, ``group_top_k > num_groups``, a top-k the kept groups cannot fill, ...
    """
    owner = "group_limited_topk: "
    check_tensor(owner, "scores_TE", scores_TE, dims=2)
    num_experts = scores_TE.shape[1]
    check_top_k(owner, top_k, num_experts)
    if num_groups is None or group_top_k is None:
        raise ValueError(
            f"{owner}num_groups={num_groups!r} and group_top_k={group_top_k!r} are invalid: "
            "both must be integers >= 1"
        )
    check_groups(
        owner,
        num_experts=num_experts,
        top_k=top_k,
        num_groups=num_groups,
        group_top_k=group_top_k,
        group_score_top_n=group_score_top_n,
    )
    return _group_limited_topk(scores_TE, top_k, num_groups, group_top_k, group_score_top_n)


def _group_limited_topk(
    scores_TE: torch.Tensor,
    top_k: int,
    num_groups: int,
    group_top_k: int,
    group_score_top_n: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`group_limited_topk` without the argument checks (the router's path)."""
    num_tokens, num_experts = scores_TE.shape
    per_group = num_experts // num_groups
    # [T, E] -> [T, G, E/G]: experts of one group are contiguous.
    grouped_TGe = scores_TE.view(num_tokens, num_groups, per_group)
    n = top_k // group_top_k if group_score_top_n is None else group_score_top_n
    group_scores_TG = _top_sum(grouped_TGe, n)
    group_idx = torch.topk(group_scores_TG, k=group_top_k, dim=-1, sorted=False)[1]
    kept = torch.gather(grouped_TGe, 1, group_idx.unsqueeze(-1).expand(-1, -1, per_group))
    values, local = torch.topk(kept.reshape(num_tokens, group_top_k * per_group), k=top_k, dim=-1)
    # Position among the kept groups -> global expert: group id * (E/G) + offset in the group.
    indices = torch.gather(group_idx, 1, local // per_group) * per_group + local % per_group
    return values, indices


def select_topk(
    scores_TE: torch.Tensor,
    top_k: int,
    num_groups: int | None,
    group_top_k: int | None,
    group_score_top_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of each row's ``top_k`` largest scores, group-limited when
    ``group_top_k`` is set; the one selection the reference and the fast path share."""
    if group_top_k:
        return _group_limited_topk(scores_TE, top_k, num_groups, group_top_k, group_score_top_n)
    return torch.topk(scores_TE, k=top_k, dim=1)


def _check_topk_routing_args(
    logits_TE,
    top_k,
    *,
    score_function,
    pre_softmax,
    num_groups,
    group_top_k,
    group_score_top_n,
    scaling_factor,
    expert_bias,
) -> None:
    """ValueError / TypeError naming the first bad argument of :func:`topk_routing`."""
    owner = "topk_routing: "
    check_tensor(owner, "logits_TE", logits_TE, dims=2)
    if not logits_TE.is_floating_point():
        raise TypeError(
            f"{owner}logits_TE of dtype {logits_TE.dtype} is invalid: it must be floating point"
        )
    num_experts = logits_TE.shape[1]
    check_top_k(owner, top_k, num_experts)
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(
            f"{owner}score_function={score_function!r} is invalid: use one of {SCORE_FUNCTIONS}"
        )
    check_bool(owner, "pre_softmax", pre_softmax)
    check_groups(
        owner,
        num_experts=num_experts,
        top_k=top_k,
        num_groups=num_groups,
        group_top_k=group_top_k,
        group_score_top_n=group_score_top_n,
    )
    if scaling_factor is not None and (not is_finite_number(scaling_factor) or scaling_factor < 0):
        raise ValueError(
            f"{owner}scaling_factor={scaling_factor!r} is invalid: it must be None or a finite "
            "number >= 0"
        )
    if expert_bias is None:
        return
    check_tensor(owner, "expert_bias", expert_bias)
    if expert_bias.shape != (num_experts,):
        raise ValueError(
            f"{owner}expert_bias of shape {tuple(expert_bias.shape)} is invalid: it must be "
            f"[E] = ({num_experts},), one entry per expert of logits_TE"
        )
    if score_function == "softmax":
        raise ValueError(
            f"{owner}expert_bias is invalid with score_function='softmax': it steers "
            "sigmoid / sqrtsoftplus selection only; pass None or change the score function"
        )


def topk_routing(
    logits_TE: torch.Tensor,
    top_k: int,
    *,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    num_groups: int | None = None,
    group_top_k: int | None = None,
    group_score_top_n: int | None = None,
    scaling_factor: float | None = None,
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Select K experts per token and their combine weights.

    - softmax, pre_softmax: p = softmax(logits) over E, keep the top K values.
    - softmax, post: keep the top K logits, p = softmax over those K.
    - sigmoid / sqrtsoftplus: s = f(logits); select on s + expert_bias (bias never reaches the
      weights); p = s_k / (sum_k s_k + 1e-20) when K > 1, p = s when K = 1.
    - then p *= scaling_factor.

    Returns (probs_TE, routing_map_TE bool, top_indices_TK, scores_TE): probs are zero off the
    map and have the logits' dtype; scores_TE are the dense scores over all experts where they
    were computed (pre-softmax, sigmoid, sqrtsoftplus; None for post-softmax), reused by the
    aux losses.

    Arguments are checked first, with :class:`RouterConfig`'s rules: 2-D floating logits,
    ``1 <= top_k <= E``, valid groups, ``expert_bias`` of shape [E] and only with sigmoid /
    sqrtsoftplus scores (softmax would ignore it).
    """
    _check_topk_routing_args(
        logits_TE,
        top_k,
        score_function=score_function,
        pre_softmax=pre_softmax,
        num_groups=num_groups,
        group_top_k=group_top_k,
        group_score_top_n=group_score_top_n,
        scaling_factor=scaling_factor,
        expert_bias=expert_bias,
    )
    num_tokens = logits_TE.shape[0]
    dtype = score_dtype(logits_TE)
    scores_TE = None
    if score_function == "softmax":
        if pre_softmax:
            scores_TE = torch.softmax(logits_TE, dim=-1, dtype=dtype)
            probs_TK, top_TK = select_topk(
                scores_TE, top_k, num_groups, group_top_k, group_score_top_n
            )
        else:
            top_logits_TK, top_TK = select_topk(
                logits_TE, top_k, num_groups, group_top_k, group_score_top_n
            )
            probs_TK = torch.softmax(top_logits_TK, dim=-1, dtype=dtype)
    else:
        scores_TE = activate(logits_TE, score_function)
        if expert_bias is not None:
            # The bias only steers selection; the weights are gathered from the unbiased scores.
            _, top_TK = select_topk(
                scores_TE + expert_bias.to(dtype), top_k, num_groups, group_top_k, group_score_top_n
            )
            probs_TK = torch.gather(scores_TE, 1, top_TK)
        else:
            probs_TK, top_TK = select_topk(
                scores_TE, top_k, num_groups, group_top_k, group_score_top_n
            )
        if top_k > 1:
            # +1e-20 as Megatron-Core (NORM_EPS): no 0/0 when every selected score underflows.
            probs_TK = probs_TK / (probs_TK.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        probs_TK = probs_TK * scaling_factor
    probs_TK = probs_TK.to(logits_TE.dtype)
    probs_TE = torch.zeros_like(logits_TE).scatter(1, top_TK, probs_TK)
    routing_map_TE = torch.zeros(
        (num_tokens, logits_TE.shape[1]), dtype=torch.bool, device=logits_TE.device
    ).scatter_(1, top_TK, True)
    return probs_TE, routing_map_TE, top_TK, scores_TE


def aux_loss_scores(
    logits_TE: torch.Tensor,
    top_k: int,
    score_function: str,
    *,
    scores_TE: torch.Tensor | None = None,
    plain_top_TK: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense scores and plain top-k map used by the load-balancing losses.

    Softmax scores are softmax(logits); sigmoid/sqrtsoftplus scores are normalised to sum to 1
    per token. The map is the top-K of those scores, with no group limit and no expert bias
    (the losses measure the router's own preference). Returns (routing_map_TE, scores_TE).

    Reuse: ``scores_TE`` — the unnormalised dense scores the routing already computed (the
    same autograd node serves both); ``plain_top_TK`` — the routing's own top-K indices when
    that selection was a plain top-K of a monotone function of the logits (no groups, no
    bias), which picks the same experts.
    """
    if score_function == "softmax":
        if scores_TE is None:
            scores_TE = torch.softmax(logits_TE, dim=-1, dtype=score_dtype(logits_TE))
        ranked_TE = scores_TE
    else:
        ranked_TE = activate(logits_TE, score_function) if scores_TE is None else scores_TE
        scores_TE = ranked_TE / (ranked_TE.sum(dim=-1, keepdim=True) + 1e-20)
    top_TK = plain_top_TK if plain_top_TK is not None else torch.topk(ranked_TE, k=top_k, dim=1)[1]
    routing_map_TE = torch.zeros(
        logits_TE.shape, dtype=torch.bool, device=logits_TE.device
    ).scatter_(1, top_TK, True)
    return routing_map_TE, scores_TE


def sinkhorn(cost_TE: torch.Tensor, tol: float = 1e-4, max_iters: int = 1000) -> torch.Tensor:
    """Sinkhorn-Knopp: scale rows and columns of exp(cost) towards uniform marginals.

    Iterates d0 = 1/(T * (exp(C) d1)), d1 = 1/(E * (d0^T exp(C))) until the mean change of
    d1 is below ``tol`` or ``max_iters`` is reached (Megatron-Core has no cap and can spin for
    minutes on large logits); returns diag(d0) exp(C) diag(d1). Runs without autograd.
    ``cost_TE`` must be a 2-D floating tensor, ``tol`` a finite number >= 0 and ``max_iters``
    an integer >= 1 (checked first).
    """
    owner = "sinkhorn: "
    check_tensor(owner, "cost_TE", cost_TE, dims=2)
    if not cost_TE.is_floating_point():
        raise TypeError(
            f"{owner}cost_TE of dtype {cost_TE.dtype} is invalid: it must be floating point"
        )
    if not is_finite_number(tol) or tol < 0:
        raise ValueError(f"{owner}tol={tol!r} is invalid: it must be a finite number >= 0")
    if not is_int(max_iters) or max_iters < 1:
        raise ValueError(f"{owner}max_iters={max_iters!r} is invalid: it must be an integer >= 1")
    cost = torch.exp(cost_TE)
    d0 = torch.ones(cost.shape[0], device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.shape[1], device=cost.device, dtype=cost.dtype)
    # Guards the divisions when exp(cost) underflows a whole row or column (Megatron-Core: 1e-8).
    eps = 1e-8
    error = 1e9
    d1_old = d1
    iters = 0
    while error > tol and iters < max_iters:
        iters += 1
        d0 = (1 / d0.shape[0]) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.shape[0]) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def sinkhorn_routing(
    logits_TE: torch.Tensor, top_k: int, *, training: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sinkhorn routing (BASE layers): select on the balanced plan while training, weight by
    sigmoid (K = 1) or softmax (K > 1) of the logits. Returns (probs_TE, routing_map_TE)."""

    def activation(x: torch.Tensor) -> torch.Tensor:
        if top_k == 1:
            return torch.sigmoid(x)
        return torch.softmax(x, dim=-1, dtype=torch.float32).type_as(x)

    if training:
        with torch.no_grad():
            # Selection only (no grad); the weights below come from the logits with autograd.
            plan_TE = sinkhorn(logits_TE.to(torch.float32))
            top_TK = torch.topk(plan_TE, k=top_k, dim=1)[1]
        scores_TE = activation(logits_TE)
    else:
        scores_TE = activation(logits_TE)
        top_TK = torch.topk(scores_TE, k=top_k, dim=1)[1]
    routing_map_TE = torch.zeros(
        logits_TE.shape, dtype=torch.bool, device=logits_TE.device
    ).scatter_(1, top_TK, True)
    return scores_TE * routing_map_TE, routing_map_TE


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert: ceil(num_tokens * top_k / num_experts * capacity_factor).

    Checked first: ``num_tokens`` an integer >= 0, ``num_experts`` >= 1, ``1 <= top_k <=
    num_experts``, ``capacity_factor`` a finite number > 0 (ValueError naming the argument).
    """
    owner = "expert_capacity: "
    if not is_int(num_tokens) or num_tokens < 0:
        raise ValueError(f"{owner}num_tokens={num_tokens!r} is invalid: it must be an integer >= 0")
    if not is_int(num_experts) or num_experts < 1:
        raise ValueError(
            f"{owner}num_experts={num_experts!r} is invalid: it must be an integer >= 1"
        )
    check_top_k(owner, top_k, num_experts)
    check_capacity_factor(owner, capacity_factor)
    return _capacity(num_tokens, num_experts, top_k, capacity_factor)


def _capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """:func:`expert_capacity` without the argument checks."""
    return math.ceil((num_tokens * top_k / num_experts) * capacity_factor)


def _first_by_position(mask_TE: torch.Tensor, count: int | torch.Tensor) -> torch.Tensor:
    """Keep, per expert column, the first ``count`` True entries in token order."""
    return mask_TE & (torch.cumsum(mask_TE.to(torch.int32), dim=0) <= count)


def drop_to_capacity(
    probs_TE: torch.Tensor,
    routing_map_TE: torch.Tensor,
    *,
    top_k: int,
    capacity_factor: float,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Enforce expert capacity; returns (probs_TE, routing_map_TE) after dropping.

    ``probs``: an expert keeps its ``capacity`` highest-probability tokens (same top-k over the
    token axis as Megatron-Core, so results agree exactly). ``position``: it keeps its earliest
    routed tokens (Megatron-Core uses top-k over an integer map here, whose tie-breaking keeps
    an arbitrary subset; this keeps the first ones, as the policy's name says).
    With ``pad_to_capacity`` every expert column holds exactly ``capacity`` slots (zero
    probability where padded) when capacity <= T.

    Checked first: 2-D ``probs_TE``, a bool ``routing_map_TE`` of the same shape, ``1 <=
    top_k <= E``, ``capacity_factor`` a finite number > 0, a known ``drop_policy``.
    """
    _check_drop_args(probs_TE, routing_map_TE, top_k, capacity_factor, drop_policy, pad_to_capacity)
    num_tokens, num_experts = probs_TE.shape
    capacity = _capacity(num_tokens, num_experts, top_k, capacity_factor)
    if capacity > num_tokens:
        keep_TE = torch.ones_like(routing_map_TE)
    elif drop_policy == "probs":
        # topk over the token axis: each expert keeps its `capacity` highest-probability tokens.
        idx = torch.topk(probs_TE, k=capacity, dim=0, sorted=False)[1]
        keep_TE = torch.zeros_like(routing_map_TE).scatter_(0, idx, True)
    else:  # "position"
        keep_TE = _first_by_position(routing_map_TE, capacity)
        if pad_to_capacity:
            free_E = capacity - keep_TE.sum(dim=0)
            keep_TE = keep_TE | _first_by_position(~routing_map_TE, free_E)
    final_map_TE = keep_TE if pad_to_capacity else routing_map_TE & keep_TE
    return probs_TE * final_map_TE, final_map_TE


def _check_drop_args(
    probs_TE, routing_map_TE, top_k, capacity_factor, drop_policy, pad_to_capacity
) -> None:
    """ValueError / TypeError naming the first bad argument of :func:`drop_to_capacity`."""
    owner = "drop_to_capacity: "
    check_tensor(owner, "probs_TE", probs_TE, dims=2)
    check_tensor(owner, "routing_map_TE", routing_map_TE)
    if routing_map_TE.shape != probs_TE.shape:
        raise ValueError(
            f"{owner}routing_map_TE of shape {tuple(routing_map_TE.shape)} is invalid: it must "
            f"have probs_TE's shape {tuple(probs_TE.shape)}"
        )
    if routing_map_TE.dtype != torch.bool:
        raise TypeError(
            f"{owner}routing_map_TE of dtype {routing_map_TE.dtype} is invalid: it must be bool"
        )
    check_top_k(owner, top_k, probs_TE.shape[1])
    check_capacity_factor(owner, capacity_factor)
    if drop_policy not in DROP_POLICIES:
        raise ValueError(
            f"{owner}drop_policy={drop_policy!r} is invalid: use one of {DROP_POLICIES}"
        )
    check_bool(owner, "pad_to_capacity", pad_to_capacity)
