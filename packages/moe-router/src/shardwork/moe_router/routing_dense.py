"""Dense routing for few experts (E <= 32) and K <= 2: no top-k call, no gather/scatter.

Legend: T tokens, E experts, K = top_k.

With a handful of experts every [T, E] op is tiny and per-op overhead dominates; on CPU
``torch.topk``, ``gather`` and ``scatter`` cost far more per row than an elementwise op. Here
the K-th largest ranked score per token is found with max/min only (``scoring.top2_values``),
the routing map is ``ranked >= threshold`` and every formula runs on [T, E] with zeros off the
map, which gives the same floats as the [T, K] formulas (sums over the extra zeros are exact).
A token whose ranked scores tie at the threshold would select more than K experts; then
:func:`dense_threshold_map` returns None and the caller uses the top-k path.

- ``DenseTopKProbs``: the autograd function (same results as ``routing_fn.TopKProbs``) for
  pre-softmax, sigmoid and sqrtsoftplus. Post-softmax stays on the top-k path (one ``topk``
  call returns indices and logits; its K-wide softmax keeps Megatron-Core's floats).
- ``dense_softmax``: the aux losses' dense softmax without torch's softmax kernel over a
  short last dim, slow on CPU for many rows.
"""

from __future__ import annotations

import torch

from shardwork.moe_router.scoring import NORM_EPS, activate, activation_grad, top2_values

# Bound per module (not read through scoring) so a test can plant another eps in each path.
_NORM_EPS = NORM_EPS

MAX_DENSE_EXPERTS = 32


def dense_threshold_map(ranked_TE: torch.Tensor, top_k: int) -> torch.Tensor | None:
    """Bool map of each row's ``top_k`` largest entries, or None when ties make it ambiguous."""
    if top_k == 1:
        threshold_T = ranked_TE.amax(dim=-1)
    else:
        threshold_T = top2_values(ranked_TE)[1]
    map_TE = ranked_TE >= threshold_T.unsqueeze(-1)
    if not bool((map_TE.sum(dim=-1) == top_k).all()):
        return None
    return map_TE


def use_dense(
    logits_TE: torch.Tensor, top_k: int, group_top_k, *, post_softmax: bool = False
) -> bool:
    """Whether the dense path applies: CPU, E <= 32 and a power of two, K <= 2, no groups,
    and not post-softmax (whose K-wide softmax after one ``topk`` call, which also returns the
    selected logits, is as cheap and keeps Megatron-Core's floats)."""
    E = logits_TE.shape[-1]
    return (
        not post_softmax
        and logits_TE.device.type == "cpu"
        and E <= MAX_DENSE_EXPERTS
        and E & (E - 1) == 0
        and top_k <= 2
        and not group_top_k
    )


def dense_softmax(logits_TE: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Softmax over E, without autograd use in mind (the aux losses' scores).

    torch's CPU softmax over a short last dim (E <= 32) is slow for many rows; there it is
    computed as exp(x - rowmax) * (1 / rowsum), the formula of torch's kernel (equal up to
    the exp implementation's last bit).
    """
    E = logits_TE.shape[-1]
    if logits_TE.device.type != "cpu" or E > MAX_DENSE_EXPERTS:
        return torch.softmax(logits_TE, dim=-1, dtype=dtype)
    x = logits_TE.to(dtype)
    exp_TE = torch.exp(x - x.amax(dim=-1, keepdim=True))
    return exp_TE * (1 / exp_TE.sum(dim=-1, keepdim=True))


class DenseTopKProbs(torch.autograd.Function):
    """probs_TE from the routing map with dense [T, E] formulas.

    Modes ``softmax_pre`` (``scores_TE`` is the dense softmax), ``sigmoid`` and
    ``sqrtsoftplus`` (``scores_TE`` is the dense activation); post-softmax uses
    ``routing_fn.TopKProbs`` on indices read off the map.
    """

    @staticmethod
    def forward(ctx, logits_TE, map_TE, mode: str, scaling, top_k: int, scores_TE):
        ctx.mode, ctx.scaling, ctx.out_dtype = mode, scaling, logits_TE.dtype
        if mode == "softmax_pre":
            probs = scores_TE * map_TE
            ctx.save_for_backward(map_TE, scores_TE)
        else:
            sel = scores_TE * map_TE
            denom_T1 = sel.sum(dim=-1, keepdim=True) + _NORM_EPS if top_k > 1 else None
            probs = sel / denom_T1 if top_k > 1 else sel
            logits = logits_TE if mode == "sqrtsoftplus" else None
            ctx.save_for_backward(map_TE, scores_TE, sel, denom_T1, logits)
        if scaling:
            probs = probs * scaling
        return probs.to(logits_TE.dtype)

    @staticmethod
    def backward(ctx, grad_TE):
        # saved_tensors is read once: under non-reentrant checkpointing a second read raises.
        saved = ctx.saved_tensors
        map_TE, work = saved[0], saved[1]
        g = grad_TE.to(work.dtype)
        if ctx.scaling:
            g = g * ctx.scaling
        if ctx.mode == "softmax_pre":
            grad = torch._softmax_backward_data(g * map_TE, work, -1, work.dtype)
        else:
            _, scores_TE, sel, denom_T1, logits = saved
            g = g * map_TE
            if denom_T1 is not None:  # q = a / b: grad_a = g / b, grad_b = -g * ((a / b) / b)
                g_b = (-g * ((sel / denom_T1) / denom_T1)).sum(dim=-1, keepdim=True)
                g = (g / denom_T1 + g_b) * map_TE
            grad = activation_grad(g, scores_TE, logits, ctx.mode)
        return grad.to(ctx.out_dtype), None, None, None, None, None


def dense_route(
    logits_TE: torch.Tensor,
    top_k: int,
    *,
    score_function: str,
    pre_softmax: bool,
    scaling_factor: float | None,
    expert_bias: torch.Tensor | None,
    dtype: torch.dtype,
):
    """(probs_TE, map_TE, dense scores_TE) or None when ties need the top-k path.

    The dense scores returned are the softmax (both softmax modes) or the activation.
    """
    with torch.no_grad():
        if score_function == "softmax":
            # torch's kernel itself: the probs must match Megatron-Core's to the last bit
            scores_TE = torch.softmax(logits_TE, dim=-1, dtype=dtype)
            ranked, mode = scores_TE, "softmax_pre"
        else:
            scores_TE = activate(logits_TE, score_function)
            ranked = scores_TE if expert_bias is None else scores_TE + expert_bias.to(dtype)
            mode = score_function
        map_TE = dense_threshold_map(ranked, top_k)
    if map_TE is None:
        return None
    probs_TE = DenseTopKProbs.apply(logits_TE, map_TE, mode, scaling_factor, top_k, scores_TE)
    return probs_TE, map_TE, scores_TE
