"""Per-microbatch losses returned by the schedules, and their reduction to the true mean.

- A forward step's ``loss_fn(output)`` returns ``(loss_sum, num_tokens, logs)``: the loss
  summed over the microbatch's tokens, how many tokens that is, and a dict to log.
- Schedules return one :class:`MicrobatchLoss` per microbatch on the last pipeline stage
  and an empty list elsewhere.
- :func:`reduce_loss` gives every rank the global mean ``Σ loss_sum / Σ num_tokens`` over
  microbatches, pipeline stages (only the last one holds losses) and data × context
  parallel ranks: the sums are reduced before dividing, so ranks with unequal token
  counts still give the true per-token mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class MicrobatchLoss:
    """The loss of one microbatch, detached (for logging and reduction)."""

    loss_sum: torch.Tensor
    """Loss summed over the microbatch's tokens (0-dim)."""
    num_tokens: torch.Tensor
    """Number of tokens in that sum (0-dim)."""
    logs: dict[str, Any] = field(default_factory=dict)
    """Whatever the loss function returned for logging."""


def loss_totals(
    losses: Sequence[MicrobatchLoss], *, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Σ loss_sum, Σ num_tokens)`` of this rank's microbatches as float64 0-dim tensors.

    Zeros on ranks without losses (not the last pipeline stage); ``device`` places them
    (default: the losses' device, else CUDA's current device if available, else CPU).
    """
    if device is None:
        if losses:
            device = losses[0].loss_sum.device
        elif torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
    # float64 sums: token counts stay exact and many micro-batches' losses add without fp32 drift.
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for item in losses:
        total[0] += item.loss_sum.detach().to(total)
        total[1] += torch.as_tensor(item.num_tokens).to(total)
    return total[0], total[1]


def reduce_loss(
    losses: Sequence[MicrobatchLoss],
    *,
    pp_group=None,
    dp_cp_group=None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global ``(mean, loss_sum, num_tokens)`` on every rank that calls it.

    Sums over the pipeline group (only the last stage contributes) and the data × context
    parallel group, then divides. Every rank of both groups must call it.
    """
    loss_sum, num_tokens = loss_totals(losses, device=device)
    total = torch.stack([loss_sum, num_tokens])
    for group in (pp_group, dp_cp_group):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
    # Divide after the reductions: a mean of per-rank means would weigh ranks with fewer tokens up.
    return total[0] / total[1], total[0], total[1]
