"""Hand-written autograd for the routing math after the gate GEMM (the default path).

Legend: T tokens, E experts, K = top_k, S sequence, B batch (T = S*B, row-major [S, B]).

- ``TopKProbs``: logits + the chosen top-K indices -> dense probs [T, E]. Forward gathers the
  K scores per token and normalises/scales them; backward touches only those K entries per
  token (a gather, a few [T, K] ops and one scatter), except pre-softmax whose softmax
  Jacobian is dense. The [T, K] formulas are the ones autograd runs on Megatron-Core's
  graph (division backward as ``-g * ((a / b) / b)``, ``sigmoid_backward``,
  ``softplus_backward``, ``_softmax_backward_data``), so results agree to fp32 rounding.
- ``aux_score_sums``: the load-balancing losses' statistic, per-sequence column sums of the
  normalised dense scores (softmax, or activation / row sum), padding tokens left out [B, E].
- ``AuxLossGradient``: every Switch-style loss is linear in that statistic, so its gradient
  w.r.t. the sums is fixed in forward; one node passes the probs through and, in backward,
  adds the losses' gradient (times the aux-loss scale) to the logits' gradient.
- Dense scores are computed once (no grad) by the caller and shared by selection, the probs
  and the aux statistic; nothing here builds an autograd graph of its own.
"""

from __future__ import annotations

import torch

from shardwork.moe_router.routing_dense import dense_route, use_dense
from shardwork.moe_router.scoring import (
    NORM_EPS,
    activate,
    activation_grad,
    score_dtype,
    select_topk,
)

# Bound per module (not read through scoring) so a test can plant another eps in each path.
_NORM_EPS = NORM_EPS


class TopKProbs(torch.autograd.Function):
    """probs_TE = scatter(top_TK, f(scores at top_TK)); see the module docstring.

    ``mode``: ``softmax_post`` (softmax over the K selected logits), ``softmax_pre`` (``scores``
    is the dense softmax; probs are its K selected values) or ``sigmoid`` / ``sqrtsoftplus``
    (``scores`` is the dense activation; probs = s_K / (sum_K s + 1e-20) when K > 1).
    ``scaling``: factor applied last (None or 0: none). ``top_logits_TK``: optional, the
    logits at ``top_TK`` when the selection already returned them (saves a gather).
    """

    @staticmethod
    def forward(ctx, logits_TE, scores_TE, top_TK, mode: str, scaling, top_logits_TK=None):
        dtype = scores_TE.dtype if scores_TE is not None else score_dtype(logits_TE)
        ctx.mode, ctx.scaling, ctx.out_dtype = mode, scaling, logits_TE.dtype
        ctx.shape = logits_TE.shape
        if mode == "softmax_post":
            if top_logits_TK is None:
                top_logits_TK = logits_TE.gather(1, top_TK)
            # Post-softmax (Megatron-Core's default): softmax over only the K selected logits.
            probs_TK = torch.softmax(top_logits_TK, dim=-1, dtype=dtype)
            ctx.save_for_backward(top_TK, probs_TK)
        elif mode == "softmax_pre":
            probs_TK = scores_TE.gather(1, top_TK)
            ctx.save_for_backward(top_TK, scores_TE)
        else:
            s_TK = scores_TE.gather(1, top_TK)
            logits_TK = logits_TE.gather(1, top_TK) if mode == "sqrtsoftplus" else None
            if top_TK.shape[1] > 1:
                # The +1e-20 (Megatron-Core's value) keeps a row whose K scores all underflow to 0
                # from 0/0.
                denom_T1 = s_TK.sum(dim=-1, keepdim=True) + _NORM_EPS
                probs_TK = s_TK / denom_T1
            else:
                denom_T1, probs_TK = None, s_TK
            ctx.save_for_backward(top_TK, s_TK, denom_T1, logits_TK)
        if scaling:
            probs_TK = probs_TK * scaling
        # Scores are computed in score_dtype (fp32 for low-precision logits); probs return in the
        # logits' dtype.
        probs_TK = probs_TK.to(logits_TE.dtype)
        # [T, K] -> dense [T, E], zero at the experts not selected.
        return torch.zeros_like(logits_TE).scatter_(1, top_TK, probs_TK)

    @staticmethod
    def backward(ctx, grad_TE):
        mode, scaling = ctx.mode, ctx.scaling
        # saved_tensors is read once: under non-reentrant checkpointing a second read raises.
        saved = ctx.saved_tensors
        top_TK = saved[0]
        work = saved[1].dtype
        # Only the K selected entries of the output depend on the logits; the rest are constant
        # zeros.
        g_TK = grad_TE.gather(1, top_TK).to(work)
        if scaling:
            g_TK = g_TK * scaling
        if mode == "softmax_post":
            probs_TK = saved[1]
            g_TK = torch._softmax_backward_data(g_TK, probs_TK, -1, probs_TK.dtype)
        elif mode == "softmax_pre":
            scores_TE = saved[1]
            # The softmax Jacobian couples all E entries, so the K gradients are spread to [T, E]
            # first.
            dense = torch.zeros_like(scores_TE).scatter_(1, top_TK, g_TK)
            grad = torch._softmax_backward_data(dense, scores_TE, -1, scores_TE.dtype)
            return grad.to(ctx.out_dtype), None, None, None, None, None
        else:
            _, s_TK, denom_T1, logits_TK = saved
            if denom_T1 is not None:  # q = a / b: grad_a = g / b, grad_b = -g * ((a / b) / b)
                g_b = (-g_TK * ((s_TK / denom_T1) / denom_T1)).sum(dim=-1, keepdim=True)
                g_TK = g_TK / denom_T1 + g_b
            g_TK = activation_grad(g_TK, s_TK, logits_TK, mode)
        grad = torch.zeros(ctx.shape, dtype=ctx.out_dtype, device=grad_TE.device)
        return grad.scatter_(1, top_TK, g_TK.to(ctx.out_dtype)), None, None, None, None, None


def normalised_scores(
    scores_TE: torch.Tensor, score_function: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(n_TE, denom_T1): the load-balancing losses' per-token scores, summing to 1 per token.

    Softmax scores are already normalised (denom None); an elementwise activation s is divided
    by its row sum: n = s / (sum_j s_j + 1e-20).
    """
    if score_function == "softmax":
        return scores_TE, None
    denom_T1 = scores_TE.sum(dim=-1, keepdim=True) + _NORM_EPS
    return scores_TE / denom_T1, denom_T1


def aux_score_sums(norm_TE: torch.Tensor, batch: int, valid_T: torch.Tensor | None) -> torch.Tensor:
    """sums_BE[b, i] = sum over valid tokens t of sequence b of n(t, i) (no autograd).

    ``norm_TE``: :func:`normalised_scores`. The statistic every Switch-style loss is linear
    in; ``valid_T`` (bool, False for padding) or None. Token t = s * batch + b (row-major
    [S, B]).
    """
    T, E = norm_TE.shape
    masked = norm_TE if valid_T is None else norm_TE * valid_T.unsqueeze(-1)
    return masked.view(T // batch, batch, E).sum(dim=0)


class AuxLossGradient(torch.autograd.Function):
    """Returns ``probs_TE`` unchanged; backward adds every load-balancing loss's gradient to
    the logits' gradient in one node.

    Each Switch-style loss (aux, seq aux, global aux) is linear in ``aux_score_sums``'s
    sums_BE with a coefficient fixed in forward (token counts, coefficient, token totals), so
    d(sum of losses)/d(sums_BE) = ``dloss_BE`` ([B, E] or [1, E]) is known before backward.
    Backward multiplies it by ``scale.value`` (read then, as ``attach_aux_loss`` does) and
    applies the normalisation and activation Jacobians in a handful of dense [T, E] passes,
    broadcasting over the sequence axis without an expanded copy. This replaces a chain of
    ~6 autograd nodes per loss (scaler, constant, sum, product with the counts, select,
    sums) with one.

    Args (forward): ``probs_TE`` (passed through), ``logits_TE`` (receives the gradient),
    ``scores_TE`` (softmax, or the elementwise activation, of the logits; no grad),
    ``normalised`` (:func:`normalised_scores` of them: ``(norm_TE, denom_T1)``, computed once
    by the caller, which also needs them for the loss values), ``dloss_BE``,
    ``score_function``, ``batch`` B (T = S*B), ``valid_T`` (bool or None) and ``scale`` (an
    ``AuxLossScale`` or None for 1).
    """

    @staticmethod
    def forward(
        ctx,
        probs_TE,
        logits_TE,
        scores_TE,
        normalised,
        dloss_BE,
        score_function: str,
        batch,
        valid_T,
        scale,
    ):
        ctx.score_function, ctx.batch, ctx.scale = score_function, batch, scale
        ctx.out_dtype = logits_TE.dtype
        norm_TE, denom_T1 = normalised
        logits_saved = logits_TE if score_function == "sqrtsoftplus" else None
        ctx.save_for_backward(scores_TE, norm_TE, denom_T1, dloss_BE, valid_T, logits_saved)
        return probs_TE.view_as(probs_TE)

    @staticmethod
    def backward(ctx, grad_probs_TE):
        scores_TE, norm_TE, denom_T1, dloss_BE, valid_T, logits_TE = ctx.saved_tensors
        T, E = norm_TE.shape
        B = ctx.batch
        scale = ctx.scale.value if ctx.scale is not None else torch.ones(())
        g_BE = dloss_BE.to(norm_TE.dtype) * scale.to(device=norm_TE.device, dtype=norm_TE.dtype)
        g_SBE = g_BE.view(1, -1, E)  # broadcast over the sequence axis (and B when [1, E])
        if valid_T is not None:
            g_SBE = g_SBE * valid_T.view(T // B, B, 1)
        norm = norm_TE.view(T // B, B, E)
        # One [T, E] buffer serves every dense step (fewer allocations and memory passes).
        buf = torch.mul(norm, g_SBE)
        dot = buf.sum(dim=-1, keepdim=True)
        # buf = g - sum_j g_j n_j: the common factor of the softmax and the s / D Jacobians.
        buf = torch.sub(g_SBE, dot, out=buf)
        if ctx.score_function == "softmax":
            grad = buf.mul_(norm).view(T, E)  # softmax: grad_logits = n * (g - sum_j g_j n_j)
        else:  # n = s / D: grad_s = (g - sum_j g_j n_j) / D
            g_s = buf.mul_((1 / denom_T1).view(T // B, B, 1)).view(T, E)
            if ctx.score_function == "sigmoid":
                # grad_input=g_s writes g * s * (1 - s) into g_s's storage (no new [T, E]
                # allocation).
                grad = torch.ops.aten.sigmoid_backward.grad_input(g_s, scores_TE, grad_input=g_s)
            else:
                grad = activation_grad(g_s, scores_TE, logits_TE, ctx.score_function)
        return grad_probs_TE, grad.to(ctx.out_dtype), None, None, None, None, None, None, None


def route_topk(
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
    replay_top_TK: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Same contract and results as :func:`scoring.topk_routing` (its plain-autograd twin).

    Returns (probs_TE, routing_map_TE, top_TK, scores_TE): the dense scores (softmax for
    pre-softmax, the activation for sigmoid/sqrtsoftplus, None for post-softmax) are computed
    once without autograd and can be handed to :class:`AuxLossGradient`. Few experts and K <= 2
    on CPU (not post-softmax) take the dense path (``routing_dense``): ``top_TK = None``.

    ``replay_top_TK`` (router replay): use these K experts per token instead of selecting;
    the probs are computed from the current logits at those experts, as after a selection.
    """
    dtype = score_dtype(logits_TE)

    def select(ranked_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if replay_top_TK is not None:
            return ranked_TE.gather(1, replay_top_TK), replay_top_TK
        return select_topk(ranked_TE, top_k, num_groups, group_top_k, group_score_top_n)

    if replay_top_TK is None and use_dense(
        logits_TE, top_k, group_top_k, post_softmax=score_function == "softmax" and not pre_softmax
    ):
        dense = dense_route(
            logits_TE,
            top_k,
            score_function=score_function,
            pre_softmax=pre_softmax,
            scaling_factor=scaling_factor,
            expert_bias=expert_bias,
            dtype=dtype,
        )
        if dense is not None:
            probs_TE, routing_map_TE, scores_TE = dense
            return probs_TE, routing_map_TE, None, scores_TE
    scores_TE = top_logits_TK = None
    # Selection is not differentiable; TopKProbs supplies the gradient of the chosen probs.
    with torch.no_grad():
        if score_function == "softmax":
            if pre_softmax:
                scores_TE = torch.softmax(logits_TE, dim=-1, dtype=dtype)
                top_TK = select(scores_TE)[1]
            else:
                top_logits_TK, top_TK = select(logits_TE)
            mode = "softmax_pre" if pre_softmax else "softmax_post"
        else:
            scores_TE = activate(logits_TE, score_function)
            # The bias (aux-loss-free balancing, DeepSeek-V3 section 2.1.2) only changes which
            # experts are picked; the probs come from the unbiased scores.
            ranked = scores_TE if expert_bias is None else scores_TE + expert_bias.to(dtype)
            top_TK = select(ranked)[1]
            mode = score_function
    probs_TE = TopKProbs.apply(logits_TE, scores_TE, top_TK, mode, scaling_factor, top_logits_TK)
    routing_map_TE = torch.zeros(
        logits_TE.shape, dtype=torch.bool, device=logits_TE.device
    ).scatter_(1, top_TK, torch.ones(top_TK.shape, dtype=torch.bool, device=top_TK.device))
    return probs_TE, routing_map_TE, top_TK, scores_TE
