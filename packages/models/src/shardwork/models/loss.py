"""Losses as (sum, token count), and their reduction over data × context parallel ranks.

- :func:`token_loss`: vocab-parallel cross entropy (``shardwork.fused_kernels.cross_entropy``
  over the TP group) of ``[s, b, V/tp]`` logits against ``[b, s]`` labels, returning the sum
  over this rank's counted tokens and their number. The logits are ``LMHead.forward``'s,
  already soft-capped when ``final_logit_softcapping`` is set (the one place it applies to
  logits). Tokens with label -100 or loss_mask 0 are not counted.
- :func:`linear_token_loss`: the same ``(loss_sum, num_tokens)`` from the head's *input*
  ``[s, b, h]`` and weight through ``shardwork.fused_kernels.linear_cross_entropy``: the
  logits are never materialised; the soft-cap and the vocabulary padding are passed to the
  op (``LMHead.token_loss`` calls it with the head's own settings).
- :func:`loss_for_backward`: ``loss_sum / N_global`` where ``N_global`` is the token count
  all-reduced (no gradient) over ``group`` (dp×cp). Backpropagating it on every rank and
  *summing* gradients over dp×cp gives exactly the gradient of the global mean, whatever the
  token count of each rank.
- :func:`reduce_loss`: the global mean for logging (sum and count all-reduced, then divided).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwork.fused_kernels import cross_entropy, linear_cross_entropy
from shardwork.parallel_state import group_size

__all__ = ["linear_token_loss", "loss_for_backward", "reduce_loss", "token_loss"]


def _flat_targets(labels, loss_mask, s: int, b: int):
    """``labels [b, s]`` and ``loss_mask [b, s]`` in the ``[s*b]`` order of flattened
    sequence-first activations (mask None when not given)."""
    if tuple(labels.shape) != (b, s):
        raise ValueError(
            f"labels.shape={tuple(labels.shape)} must be [b, s] = {(b, s)} to match the logits"
        )
    # [b, s] -> [s, b] -> [s*b]: the token order of the sequence-first activations flattened.
    lab = labels.transpose(0, 1).reshape(-1)
    if loss_mask is None:
        return lab, None
    if tuple(loss_mask.shape) != (b, s):
        raise ValueError(f"loss_mask.shape={tuple(loss_mask.shape)} must be [b, s] = {(b, s)}")
    return lab, loss_mask.transpose(0, 1).reshape(-1)


def _weight_dtype(hidden: torch.Tensor) -> torch.dtype:
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def token_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    loss_mask: torch.Tensor | None = None,
    tp_group=None,
    ignore_index: int = -100,
    inplace_backward: bool = False,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, num_tokens)`` of ``logits [s, b, V_local]`` vs ``labels [b, s]``.

    ``loss_sum`` is a 0-d float tensor (float32, or float64 for float64 logits) with gradient;
    ``num_tokens`` a 0-d int64 tensor. ``inplace_backward=True`` lets the loss write the logits'
    gradient over the logits (for logits nothing else reads, as in the model's training path).
    """
    s, b = logits.shape[0], logits.shape[1]
    lab, mask = _flat_targets(labels, loss_mask, s, b)
    # bf16/fp16 logits go in as they are: the op computes in fp32 per row block without a
    # full-vocab fp32 copy, and its per-token losses come back in fp32.
    # [s, b, V/tp] -> [s*b, V/tp].
    flat = logits.reshape(s * b, logits.shape[-1])
    losses = cross_entropy(
        flat,
        lab,
        tp_group=tp_group,
        ignore_index=ignore_index,
        reduction="none",
        inplace_backward=inplace_backward,
        backend=backend,
    )
    counted = lab != ignore_index
    if mask is not None:
        counted = counted & (mask != 0)
        losses = losses * mask.to(losses.dtype)
    return losses.sum(), counted.sum()


def linear_token_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_size: int,
    loss_mask: torch.Tensor | None = None,
    tp_group=None,
    softcap: float | None = None,
    ignore_index: int = -100,
    grad_in_forward: bool = True,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, num_tokens)`` as :func:`token_loss` gives for the logits
    ``softcap(hidden · weightᵀ)``, computed without them.

    ``hidden [s, b, h]``: the head's input inside the TP region (the same on every TP rank; its
    gradient is this rank's partial, summed by the caller's region function); ``weight
    [V_pad/tp, h]`` in ``hidden``'s dtype; ``vocab_size`` the real vocabulary (rows past it are
    padding: no logit, zero gradient).
    """
    s, b = hidden.shape[0], hidden.shape[1]
    lab, mask = _flat_targets(labels, loss_mask, s, b)
    loss_sum = linear_cross_entropy(
        hidden.reshape(s * b, hidden.shape[-1]),
        weight,
        lab,
        # The mask as constant per-token weights (bool/int masks become 0/1 floats).
        token_weights=None if mask is None else mask.to(_weight_dtype(hidden)),
        tp_group=tp_group,
        vocab_size=vocab_size,
        ignore_index=ignore_index,
        softcap=softcap,
        reduction="sum",
        grad_in_forward=grad_in_forward,
        backend=backend,
    )
    counted = lab != ignore_index
    if mask is not None:
        counted = counted & (mask != 0)
    return loss_sum, counted.sum()


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
