"""Quantile balancing: balance experts with a per-expert offset found by a quantile, no loss.

Semantics of Megatron-Core 0.19.2's ``moe_router_load_balancing_type="quantile_balancing"``
(legend: T tokens, E experts, K top_k, l(x, i) the fp32 gating logit, β the per-expert
offset ``qb_beta``; C = T·K/E, the token count each expert would get under perfect balance):

- **Selection** (every forward): each token takes the K experts with the largest l(x, i) − β_i.
  The probabilities are then the score function's own at those experts (softmax over the K
  selected logits, pre-softmax scores, or sigmoid / sqrtsoftplus normalised over the K), so
  the gating weight gets the usual gradient; β never reaches the probabilities.
- **Quantile** (training forwards with autograd on): with a(x) the (K+1)-th largest
  l(x, ·) − β — the level token x would have to clear to gain one more expert — the expert's
  quantile q_i is the (C+1)-th largest of l(x, i) − a(x) over the micro-batch's tokens. Using
  q as the next β would, with the token levels a held fixed, leave exactly C tokens above the
  level of each expert: one step of coordinate descent on the dual of the balanced assignment
  problem (tokens' levels a, experts' prices β). T·K must be divisible by E. When the tokens of
  a micro-batch are split over several ranks (sequence-parallel TP × CP), the T×E matrix
  l − a is gathered over them so the quantile sees every token.
- **Accumulation**: each such forward adds q to ``qb_beta_accum`` and 1 to ``qb_beta_count``.
- **Step update** (:func:`update_quantile_balancing`, once per optimizer step, after
  backward): the mean q over the step's micro-batches is averaged over the given group (the
  data-parallel ranks, which saw other micro-batches), blended as
  β ← ema·β + (1 − ema)·mean(q), centred to zero mean over experts, and the accumulators reset.

Selection and quantile are computed without autograd in fp32 whatever the router dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwork.moe_router.comm import group_size


def quantile_balanced_topk(
    logits_TE: torch.Tensor,
    top_k: int,
    beta_E: torch.Tensor,
    *,
    want_quantile: bool,
    token_group=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(top_TK, quantile_E)``: the K experts of each local token, and (``want_quantile``) the
    expert quantiles q over the tokens of every rank of ``token_group`` (see module docstring).

    Every rank of ``token_group`` must call this with ``want_quantile`` alike (a collective).
    Raises ValueError when the gathered token count times K is not a multiple of E.
    """
    with torch.no_grad():
        logits_TE = logits_TE.detach().float()
        num_experts = logits_TE.shape[1]
        # K + 1 largest: the first K are the choice, the last is the token's level a(x).
        shifted_TK1, ranked_TK1 = (logits_TE - beta_E).topk(top_k + 1, dim=1)
        top_TK = ranked_TK1[:, :top_k]
        if not want_quantile:
            return top_TK, None
        margin_TE = logits_TE - shifted_TK1[:, top_k:]
        ranks = group_size(token_group)
        if ranks > 1:
            gathered = margin_TE.new_empty((ranks * margin_TE.shape[0], num_experts))
            dist.all_gather_into_tensor(gathered, margin_TE.contiguous(), group=token_group)
            margin_TE = gathered
        num_tokens = margin_TE.shape[0]
        if (num_tokens * top_k) % num_experts != 0:
            raise ValueError(
                f"quantile balancing needs tokens × top_k divisible by num_experts: {num_tokens} "
                f"tokens (over {ranks} rank(s) of the token group) × top_k={top_k} = "
                f"{num_tokens * top_k} is not a multiple of num_experts={num_experts}; change the "
                "micro-batch size or sequence length"
            )
        balanced = num_tokens * top_k // num_experts
        quantile_E = margin_TE.topk(balanced + 1, dim=0).values[-1]
        return top_TK, quantile_E


@torch.no_grad()
def update_quantile_balancing(routers, *, group=None) -> None:
    """Quantile-balancing step, once per optimizer step after backward (see module docstring).

    For every router with a ``qb_beta`` buffer, in training mode: average its accumulated
    quantiles over the step's micro-batches (0 when it routed none) and then over ``group``
    (the data-parallel × context-parallel ranks: the ranks that saw other micro-batches), blend
    with ``RouterConfig.quantile_balancing_ema``, centre, write ``qb_beta`` and reset the
    accumulators. All routers travel in one all-reduce; every rank of ``group`` must call this
    with the same routers.
    """
    active = [r for r in routers if getattr(r, "qb_beta", None) is not None and r.training]
    if not active:
        return
    means = torch.stack(
        [r.qb_beta_accum / r.qb_beta_count.clamp(min=1).to(r.qb_beta_accum.dtype) for r in active]
    )
    ranks = group_size(group)
    if ranks > 1:
        dist.all_reduce(means, group=group)
        means /= ranks
    for r, mean_E in zip(active, means):
        ema = r.config.quantile_balancing_ema
        blended = ema * r.qb_beta + (1.0 - ema) * mean_E
        r.qb_beta.copy_(blended - blended.mean())
        r.qb_beta_accum.zero_()
        r.qb_beta_count.zero_()
