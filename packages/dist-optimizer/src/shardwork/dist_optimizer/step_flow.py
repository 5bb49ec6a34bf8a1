"""One optimizer step over one or more sharded parts, with global statistics.

A *part* is a :class:`~shardwork.dist_optimizer.distributed_optimizer.DistributedOptimizer`
or :class:`~shardwork.dist_optimizer.layerwise.LayerWiseDistributedOptimizer` (dense,
expert, ...). :func:`run_step` drives them through the same phases so a
:class:`~shardwork.dist_optimizer.chained.ChainedOptimizer` steps as one:

1. each part finishes its gradient reduction and fills its fp32 master gradients, divided
   by the loss scale;
2. each part sums, over its own rank's gradients, ``[non-finite pieces, Σg², zero count]``
   (the zero count only when asked for)
   (parameters replicated across TP counted on TP rank 0 only, the shared embedding on the
   first pipeline stage only) and all-reduces that one 3-vector over its ``stats_groups``,
   whose product spans every rank holding a piece of its parameters. A rank with no
   parameters contributes zeros but still joins, so no collective waits forever;
3. the loss scaler is updated; with any non-finite gradient the step is skipped everywhere;
4. the global norm is ``sqrt(Σ parts Σg²)``; with ``clip_grad > 0`` every gradient is
   multiplied by ``min(1, clip_grad / (norm + 1e-6))`` (``torch.nn.utils.clip_grad_norm_``'s rule);
5. each part steps its local optimizer, writes masters back to the model and starts
   gathering parameters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

__all__ = ["StepResult", "run_step"]


class StepResult(NamedTuple):
    """What :func:`run_step` returns (unpacks like Megatron's ``(ok, norm, zeros)``)."""

    update_successful: bool
    """False when the step was skipped for a non-finite gradient."""
    grad_norm: float | None
    """Global L2 norm of the (unscaled, unclipped) gradient; None when skipped."""
    num_zeros_in_grad: int | None
    """Zero gradient elements over all ranks (TP replicas once); None unless counted."""


class StepPart(Protocol):
    stats_groups: Sequence[Any]

    def prepare_grads(self, inv_scale: float) -> None: ...
    def local_grad_stats(self, count_zeros: bool = True) -> torch.Tensor: ...
    def scale_grads(self, factor: float) -> None: ...
    def step_local(self) -> None: ...
    def finish_step(self) -> None: ...


def reduce_stats(stats: torch.Tensor, groups: Sequence[Any]) -> torch.Tensor:
    """SUM-all-reduce ``stats`` over each group in turn (None groups are skipped).

    The tensor travels on the current CUDA device for NCCL groups, on the CPU otherwise.
    """
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            # NCCL only moves CUDA tensors; gloo groups take CPU tensors.
            if dist.get_backend(group) == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
            else:
                device = torch.device("cpu")
            moved = stats.to(device)
            dist.all_reduce(moved, group=group)
            stats = moved
    return stats.cpu()


def run_step(
    parts: Sequence[StepPart],
    *,
    clip_grad: float,
    loss_scaler: Any,
    skip_nonfinite: bool,
    count_zeros: bool,
) -> StepResult:
    """One step of every part; see the module docstring for the phases."""
    scale = 1.0 if loss_scaler is None else float(loss_scaler.scale)
    for part in parts:
        part.prepare_grads(1.0 / scale)
    # fp64: less rounding in the sum over ranks and parts, and zero counts stay exact past 2**24.
    totals = torch.zeros(3, dtype=torch.float64)
    for part in parts:
        local = part.local_grad_stats(count_zeros=count_zeros)
        stats = reduce_stats(local.to(torch.float64), part.stats_groups)
        totals += stats
    # totals are all-reduced, so every rank takes the same branch below (skip or step together);
    # ranks that disagreed would issue different collectives from here on.
    found = bool(totals[0] > 0)
    if loss_scaler is not None:
        loss_scaler.update(found)
    # With a loss scaler an overflow is expected (the scale just backed off): never step on it.
    if found and (skip_nonfinite or loss_scaler is not None):
        return StepResult(False, None, None)
    norm = math.sqrt(float(totals[1])) if math.isfinite(float(totals[1])) else float("nan")
    if clip_grad > 0:
        # +1e-6 as in torch.nn.utils.clip_grad_norm_ (also guards a zero norm).
        coef = clip_grad / (norm + 1e-6)
        if coef < 1.0:
            for part in parts:
                part.scale_grads(coef)
    for part in parts:
        part.step_local()
    for part in parts:
        part.finish_step()
    return StepResult(True, norm, int(totals[2]) if count_zeros else None)
