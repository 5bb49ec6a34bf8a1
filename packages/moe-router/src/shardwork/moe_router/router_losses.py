"""A router's losses applied to one routing result, outside :meth:`TopKRouter.route`.

Legend: S sequence, B batch, T = S*B tokens, E experts, K top_k.

- :class:`LossSite`: where one call's losses go (config, groups, tracker, loss scale, the
  global aux loss's running counts). The router builds it per call from its attributes,
  because callers swap some of them between calls (the models package replaces the tracker
  and the running counts around an activation recompute).
- :func:`apply_z_loss`: the z-loss, attached to the logits (:func:`attach_aux_loss`).
- :func:`apply_load_balancing`: the aux, seq-aux and global-aux losses. Each is
  L = c * sum(sums * tpe) with sums = ``aux_score_sums`` of the normalised scores, so its
  gradient w.r.t. the sums is fixed in forward: every loss contributes dL/dsums ([1, E] or
  [B, E]) and one ``AuxLossGradient`` node on the probs injects them all. The sums
  themselves are computed only when a tracker logs the loss values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardwork.moe_router.aux_loss import (
    AuxLossScale,
    attach_aux_loss,
    switch_aux_loss_from_sums,
    switch_loss_factor,
    z_loss,
)
from shardwork.moe_router.comm import group_size
from shardwork.moe_router.config import RouterConfig
from shardwork.moe_router.counts import index_counts
from shardwork.moe_router.routing_dense import dense_softmax, dense_threshold_map, use_dense
from shardwork.moe_router.routing_fn import AuxLossGradient, aux_score_sums, normalised_scores
from shardwork.moe_router.scoring import activate, score_dtype, topk_indices_nonnegative
from shardwork.moe_router.tracker import AuxLossTracker

__all__ = ["LossSite", "apply_load_balancing", "apply_z_loss"]


@dataclass(frozen=True)
class LossSite:
    """Where one routing call's losses go; see the module docstring."""

    config: RouterConfig
    tp_cp_group: Any
    tp_dp_cp_group: Any
    tracker: AuxLossTracker | None
    layer_index: int | None
    loss_scale: AuxLossScale | None
    global_tokens_per_expert: torch.Tensor | None  # updated in place by the global aux loss
    global_aux_steps: torch.Tensor | None

    def attach(self, x: torch.Tensor, loss: torch.Tensor, num_tokens) -> torch.Tensor:
        """``x`` unchanged, with ``loss`` joining the objective (per token when configured)."""
        if self.config.calculate_per_token_loss:
            loss = loss * num_tokens * group_size(self.tp_cp_group)
        return attach_aux_loss(x, loss, self.loss_scale)

    def record(self, name: str, loss: torch.Tensor, coeff: float) -> None:
        """Log ``loss`` without its coefficient to the tracker, if any."""
        if self.tracker is not None:  # the division only when someone logs it
            self.tracker.record_loss(name, self.layer_index, loss / coeff)

    def per_token(self, factor, num_tokens):
        """``factor`` times num_tokens * |TP×CP| with ``calculate_per_token_loss`` (the loss is
        then summed per token; the trainer divides by the global token count)."""
        if self.config.calculate_per_token_loss:
            return factor * num_tokens * group_size(self.tp_cp_group)
        return factor


def apply_z_loss(site: LossSite, logits_TE: torch.Tensor, padding_mask) -> torch.Tensor:
    """The logits with the z-loss attached (unchanged without ``z_loss_coeff``)."""
    coeff = site.config.z_loss_coeff
    if coeff is None:
        return logits_TE
    # Megatron-Core divides the z-loss coefficient by the TP x CP size the same way.
    coeff = coeff / group_size(site.tp_cp_group)
    loss = z_loss(logits_TE, coeff, padding_mask)
    n = logits_TE.shape[0] if padding_mask is None else (~padding_mask).sum()
    logits_TE = site.attach(logits_TE, loss, n)
    if coeff > 0:
        site.record("z_loss", loss, coeff)
    return logits_TE


def apply_load_balancing(
    site: LossSite,
    probs_TE: torch.Tensor,
    logits_TE: torch.Tensor,
    *,
    seq_len: int,
    batch: int,
    padding_mask: torch.Tensor | None,
    plain_top_TK: torch.Tensor | None,
    scores_TE: torch.Tensor | None,
) -> torch.Tensor:
    """``probs_TE`` with the configured load-balancing losses' gradient attached.

    ``plain_top_TK``: the routing's own plain top-K of the scores (no groups, no expert bias)
    when it has one, as K indices per token or a bool map; ``scores_TE``: its dense scores
    (None for post-softmax, fused or sinkhorn routing: computed here without grad).
    """
    fn = site.config.score_function
    if scores_TE is None:
        with torch.no_grad():
            if fn == "softmax":
                scores_TE = dense_softmax(logits_TE, score_dtype(logits_TE))
            else:
                scores_TE = activate(logits_TE, fn)
    valid = None if padding_mask is None else ~padding_mask
    counts_BE = _sequence_counts(site.config, scores_TE, plain_top_TK, seq_len, batch, valid)
    normalised = normalised_scores(scores_TE, fn)
    sums_BE = None
    if site.tracker is not None:
        sums_BE = aux_score_sums(normalised[0], batch, valid)
    terms = _loss_terms(
        site,
        counts_BE,
        sums_BE,
        num_tokens=logits_TE.shape[0],
        seq_len=seq_len,
        padded=padding_mask is not None,
        dtype=scores_TE.dtype,
    )
    if not terms or not logits_TE.requires_grad:
        return probs_TE
    dloss_BE = terms[0]
    for term in terms[1:]:
        dloss_BE = dloss_BE + term
    return AuxLossGradient.apply(
        probs_TE, logits_TE, scores_TE, normalised, dloss_BE, fn, batch, valid, site.loss_scale
    )


def _sequence_counts(config: RouterConfig, scores_TE, plain_top_TK, seq_len, batch, valid):
    """Per-sequence token counts [B, E] of the map the losses count: a plain top-K of the
    scores, reused from the routing when it has one (K indices per token or a bool map)."""
    E, K = config.num_experts, config.top_k
    top_TK = plain_top_TK
    if top_TK is None and use_dense(scores_TE, K, None):
        top_TK = dense_threshold_map(scores_TE, K)
    if top_TK is None:
        top_TK = topk_indices_nonnegative(scores_TE, K)
    if top_TK.dtype == torch.bool:
        counted = top_TK if valid is None else top_TK & valid.unsqueeze(-1)
        return counted.view(seq_len, batch, E).sum(dim=0)
    return index_counts(top_TK, E, batch, valid).view(batch, E)


def _loss_terms(site: LossSite, counts_BE, sums_BE, *, num_tokens, seq_len, padded, dtype):
    """dL/dsums of each configured loss, [1, E] or [B, E] in ``dtype``."""
    cfg = site.config
    K, batch = cfg.top_k, counts_BE.shape[0]
    counts_E = None  # whole micro-batch counts, for the aux and global losses
    if cfg.aux_loss_coeff_for("aux_loss") > 0 or cfg.aux_loss_coeff_for("global_aux_loss") > 0:
        # Batch of one: the sequence row is already the micro-batch count (no sum needed).
        counts_E = counts_BE.sum(dim=0) if batch > 1 else counts_BE[0]
    whole = None if sums_BE is None else sums_BE.sum(dim=0)
    terms = []

    coeff = cfg.aux_loss_coeff_for("aux_loss")
    if coeff > 0:
        tpe, n_local, n_total = _counts(counts_E, num_tokens, site.tp_cp_group, K, padded)
        terms.append(
            _switch_term(site, "load_balancing_loss", coeff, tpe, n_local, n_total, whole, dtype)
        )

    coeff = cfg.aux_loss_coeff_for("seq_aux_loss")
    if coeff > 0:
        # Fold the batch into the expert axis: column b*E + i is expert i of sequence b.
        tpe, n_local, n_total = _counts(
            counts_BE.reshape(-1), seq_len, site.tp_cp_group, K * batch, padded
        )
        folded = None if sums_BE is None else sums_BE.reshape(-1)
        name = "seq_load_balancing_loss"
        terms.append(
            _switch_term(site, name, coeff, tpe, n_local, n_total, folded, dtype, batch=batch)
        )

    coeff = cfg.aux_loss_coeff_for("global_aux_loss")
    if coeff > 0:
        tpe, n_local, n_total = _counts(counts_E, num_tokens, site.tp_dp_cp_group, K, padded)
        with torch.no_grad():
            # Running token counts across calls; the loss uses their mean per call.
            site.global_tokens_per_expert.add_(tpe)  # the router's buffers, in place
            site.global_aux_steps.add_(1)
        mean_tpe = site.global_tokens_per_expert / site.global_aux_steps
        name = "global_load_balancing_loss"
        terms.append(_switch_term(site, name, coeff, mean_tpe, n_local, n_total, whole, dtype))
    return terms


def _counts(local_E, num_rows: int, group, divisor: int, padded: bool):
    """(reduced tokens_per_expert, local token count, total token count)."""
    total_E = local_E
    if group_size(group) > 1:
        # all_reduce works in place and local_E is still needed for the local token count.
        total_E = local_E.clone()
        # Every rank of the group reaches this all-reduce for the same losses and layers in the same
        # order (one config), so the collectives pair up.
        dist.all_reduce(total_E, group=group)
    if padded:
        # Each valid token is counted once per selected expert: count sum / K = valid tokens.
        return total_E, local_E.sum() / divisor, total_E.sum() / divisor
    return total_E, num_rows, num_rows * group_size(group)


def _switch_term(site, name, coeff, tpe, n_local, n_total, sums, dtype, *, batch: int = 1):
    """dL/dsums of one Switch-style loss L = c * sum(sums * tpe), shaped [batch, E] in
    ``dtype`` (the scores'; integer counts times a Python float would give fp32).
    ``batch`` > 1: the seq aux loss, a mean over the B sequences folded into the expert
    axis. Records L's value when the tracker's ``sums`` were computed."""
    E, K = site.config.num_experts, site.config.top_k
    formula = dict(num_experts=E, top_k=K, coeff=coeff, total_num_tokens=n_total)
    factor = switch_loss_factor(**formula) / batch
    dloss = tpe.to(dtype).view(batch, E)
    if sums is not None:
        loss = switch_aux_loss_from_sums(sums, tpe, **formula) / batch
        site.record(name, loss, coeff)
    return dloss * site.per_token(factor, n_local * batch)
