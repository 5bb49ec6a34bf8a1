"""What every router top-k backend returns (:class:`RouterTopK`) and the renormalisation rule
they share (:func:`default_normalize`).

Its own module so that the dispatcher (:mod:`~shardwork.fused_kernels.router`) and the
backends it dispatches to (``triton_router``, ``te_ops``) depend on it, not on each other.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["RouterTopK", "default_normalize"]


class RouterTopK(NamedTuple):
    """Outputs of :func:`router_topk`."""

    probs: torch.Tensor
    """[N, E] routing probabilities in ``logits.dtype``, zero off the selected experts."""
    routing_map: torch.Tensor
    """[N, E] bool, True where a token is routed to an expert."""
    scores_for_aux: torch.Tensor
    """[N, E] float32 scores the load-balancing losses use (differentiable)."""
    tokens_per_expert: torch.Tensor
    """[E] int64 aux-loss token counts (plain top-k of ``scores_for_aux``)."""


def default_normalize(score_function: str, topk: int) -> bool:
    """Megatron-Core's rule for ``normalize=None``: renormalise the selected probs of
    sigmoid / sqrtsoftplus scores when more than one expert is chosen (softmax top-k probs
    already sum to one, or are pre-softmax values the caller asked to keep)."""
    return score_function != "softmax" and topk > 1
