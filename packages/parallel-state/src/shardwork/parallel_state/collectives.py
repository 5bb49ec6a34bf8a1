"""Differentiable collectives for tensor-, sequence-, context- and expert-parallel layers.

Each function is an autograd op whose backward is the adjoint collective:

=============================  ===========================  ==========================
function                       forward                      backward
=============================  ===========================  ==========================
copy_to_tp_region              identity                     all-reduce
reduce_from_tp_region          all-reduce                   identity
scatter_to_tp_region           keep own slice of last dim   all-gather last dim
gather_from_tp_region          all-gather last dim          keep own slice
scatter_to_sequence_region     keep own slice of ``dim``    all-gather ``dim``
gather_from_sequence_region    all-gather ``dim``           reduce-scatter (or slice)
reduce_scatter_to_sequence_    reduce-scatter ``dim``       all-gather ``dim``
all_to_all                     all-to-all (uneven splits)   reverse all-to-all
=============================  ===========================  ==========================

``group=None`` (not distributed) makes every function the identity.
Tensors along the gathered/scattered dim are split into equal, contiguous
chunks in group-rank order; sizes must divide evenly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from shardwork.parallel_state.groups import group_rank, group_size


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    # A copy: all_reduce works in place and the caller's tensor must stay unchanged.
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = group_size(group)
    if x.shape[dim] % size != 0:
        raise ValueError(
            f"dim {dim} of size {x.shape[dim]} cannot be split evenly over {size} ranks"
        )
    return x.chunk(size, dim=dim)[group_rank(group)].contiguous()


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = group_size(group)
    # all_gather_into_tensor concatenates along dim 0: move ``dim`` to the front and back.
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((size * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, moved, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = group_size(group)
    if x.shape[dim] % size != 0:
        raise ValueError(
            f"dim {dim} of size {x.shape[dim]} cannot be reduce-scattered over {size} ranks"
        )
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // size, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, moved, group=group)
    return out.movedim(0, dim).contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        # Megatron-LM's operator f (Shoeybi et al., 2019, section 3): every rank uses the full
        # input, so the input's gradient is the sum of the ranks' partial gradients.
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        # Megatron-LM's operator g: the output is replicated, so its gradient is already complete.
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, grad_is_partial):
        ctx.dim, ctx.group, ctx.grad_is_partial = dim, group, grad_is_partial
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        # The output gradient is a partial sum on each rank: sum over ranks, keep this rank's chunk.
        if ctx.grad_is_partial:
            return _reduce_scatter(grad, ctx.dim, ctx.group), None, None, None
        # The output gradient is replicated: each rank's chunk is already final.
        return _split(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


def _all_to_all(x, output_splits, input_splits, group):
    x = x.contiguous()
    if output_splits is None:
        # No splits given: equal splits, the output has the input's shape.
        out = torch.empty_like(x)
    else:
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(
        out,
        x,
        output_split_sizes=None if output_splits is None else list(output_splits),
        input_split_sizes=None if input_splits is None else list(input_splits),
        group=group,
    )
    return out


def copy_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over ``group`` (input of a column-parallel layer)."""
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (sum) over ``group``; identity gradient (output of a row-parallel layer)."""
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's chunk of the last dim; the gradient is all-gathered."""
    return x if group_size(group) == 1 else _ScatterToRegion.apply(x, x.dim() - 1, group)


def gather_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather the last dim; the gradient keeps this rank's chunk."""
    return x if group_size(group) == 1 else _GatherFromRegion.apply(x, x.dim() - 1, group, False)


def scatter_to_sequence_region(x: torch.Tensor, group, *, dim: int = 0) -> torch.Tensor:
    """Keep this rank's chunk of the sequence dim ``dim``; the gradient is all-gathered."""
    return x if group_size(group) == 1 else _ScatterToRegion.apply(x, dim, group)


def gather_from_sequence_region(
    x: torch.Tensor, group, *, dim: int = 0, grad_is_partial: bool = True
) -> torch.Tensor:
    """All-gather along the sequence dim ``dim``.

    ``grad_is_partial=True`` (the input of a column-parallel layer under
    sequence parallelism): each rank's output gradient is a partial sum, so the
    backward reduce-scatters it. ``False``: the gradient is replicated and the
    backward keeps this rank's chunk.
    """
    if group_size(group) == 1:
        return x
    return _GatherFromRegion.apply(x, dim, group, grad_is_partial)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group, *, dim: int = 0) -> torch.Tensor:
    """Sum over ``group`` and keep this rank's chunk of ``dim``; the gradient is all-gathered."""
    return x if group_size(group) == 1 else _ReduceScatterToRegion.apply(x, dim, group)


def all_to_all(
    x: torch.Tensor,
    group,
    *,
    output_splits: Sequence[int] | None = None,
    input_splits: Sequence[int] | None = None,
) -> torch.Tensor:
    """All-to-all along dim 0 with optional uneven splits (rows sent to / received from each rank).

    The backward runs the reverse exchange (splits swapped).
    """
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, output_splits, input_splits, group)
