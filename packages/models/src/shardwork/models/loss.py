"""Losses as (sum, token count), and their reduction over data × context parallel ranks.

- :func:`token_loss`: vocab-parallel cross entropy (``shardwork.fused_kernels.cross_entropy``
  over the TP group) of ``[s, b, V/tp]`` logits against ``[b, s]`` labels, returning the sum
  over this rank's counted tokens and their number. The logits are ``LMHead.forward``'s,
  already soft-capped when ``final_logit_softcapping`` is set (the one place it applies); a
  fused linear cross-entropy that skips ``LMHead.forward`` must apply
  ``LMHead.final_logit_softcapping`` itself or fall back to this path. Tokens with label -100 or loss_mask 0
  are not counted.
- :func:`loss_for_backward`: ``loss_sum / N_global`` where ``N_global`` is the token count
  all-reduced (no gradient) over ``group`` (dp×cp). Backpropagating it on every rank and
  *summing* gradients over dp×cp gives exactly the gradient of the global mean, whatever the
  token count of each rank.
- :func:`reduce_loss`: the global mean for logging (sum and count all-reduced, then divided).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwork.fused_kernels import cross_entropy
from shardwork.parallel_state import group_size

__all__ = ["loss_for_backward", "reduce_loss", "token_loss"]


def token_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    loss_mask: torch.Tensor | None = None,
    tp_group=None,
    ignore_index: int = -100,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, num_tokens)`` of ``logits [s, b, V_local]`` vs ``labels [b, s]``.

    ``loss_sum`` is a 0-d float tensor (float32, or float64 for float64 logits) with gradient;
    ``num_tokens`` a 0-d int64 tensor.
    """
    s, b = logits.shape[0], logits.shape[1]
    if tuple(labels.shape) != (b, s):
        raise ValueError(
            f"labels.shape={tuple(labels.shape)} must be [b, s] = {(b, s)} to match the logits"
        )
    # [b, s] -> [s, b] -> [s*b]: the same token order as the sequence-first logits flattened below.
    lab = labels.transpose(0, 1).reshape(-1)
    # bf16/fp16 logits go in as they are: the op computes in fp32 per row chunk without a
    # full-vocab fp32 copy, and its per-token losses come back in fp32.
    # [s, b, V/tp] -> [s*b, V/tp].
    flat = logits.reshape(s * b, logits.shape[-1])
    losses = cross_entropy(
        flat, lab, tp_group=tp_group, ignore_index=ignore_index, reduction="none", backend=backend
    )
    counted = lab != ignore_index
    if loss_mask is not None:
        if tuple(loss_mask.shape) != (b, s):
            raise ValueError(f"loss_mask.shape={tuple(loss_mask.shape)} must be [b, s] = {(b, s)}")
        m = loss_mask.transpose(0, 1).reshape(-1)
        counted = counted & (m != 0)
        losses = losses * m.to(losses.dtype)
    return losses.sum(), counted.sum()


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    # Detached clone: the count/sum is a constant for backward and the caller's tensor is not
    # overwritten by the in-place all-reduce.
    x = x.detach().clone()
    if group_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


def loss_for_backward(loss_sum: torch.Tensor, num_tokens: torch.Tensor, group) -> torch.Tensor:
    """``loss_sum / (num_tokens summed over group)``: backprop this, then sum grads over group."""
    total = _all_reduce(num_tokens, group)
    # Divide by the global count, not the local one: ranks with fewer tokens then weigh each token
    # the same, and summing gradients over dp×cp gives the global per-token mean exactly.
    return loss_sum / total.to(loss_sum.dtype)


def reduce_loss(loss_sum: torch.Tensor, num_tokens: torch.Tensor, group) -> torch.Tensor:
    """The global mean loss over ``group`` (no gradient), for logging."""
    total = _all_reduce(num_tokens, group).to(loss_sum.dtype)
    return _all_reduce(loss_sum, group) / total
