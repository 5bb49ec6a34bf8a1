"""Differentiable collectives over dim 0 used by the token dispatchers (torch.distributed only).

Each function is an autograd op whose backward is the adjoint collective. ``group=None`` or a
group of one rank makes every function the identity. Sizes are per-rank row counts in
group-rank order; uneven gathers and reduce-scatters go through ``all_to_all_single``.

=======================  ===============================  ================================
function                 forward                          backward
=======================  ===============================  ================================
all_gather_rows          concat every rank's rows         sum over ranks, keep own rows
reduce_scatter_rows      sum over ranks, keep own rows    concat every rank's rows
all_to_all_rows          send row blocks to each rank     the reverse exchange
split_rows               keep own equal chunk             concat every rank's chunk
gather_rows_replicated   concat every rank's rows         keep own rows (no sum)
=======================  ===============================  ================================

``split_rows`` / ``gather_rows_replicated`` serve a group over which the activations are
replicated (dense TP without sequence parallelism): every rank computes the same downstream
loss, so the gradient of the gathered tensor is already complete on each rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def group_size(group) -> int:
    """Ranks in ``group`` (1 for None)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This process's rank in ``group`` (0 for None)."""
    return 0 if group is None else dist.get_rank(group)


def _a2a(x: torch.Tensor, out_sizes: Sequence[int], in_sizes: Sequence[int], group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_sizes), *x.shape[1:]))
    dist.all_to_all_single(
        out, x, output_split_sizes=list(out_sizes), input_split_sizes=list(in_sizes), group=group
    )
    return out


def _gather(x: torch.Tensor, sizes: Sequence[int], group) -> torch.Tensor:
    world = len(sizes)
    if len(set(sizes)) == 1:
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out
    # Uneven all-gather as an all-to-all: every rank sends its whole block to every rank.
    return _a2a(x.repeat(world, *([1] * (x.dim() - 1))), sizes, [x.shape[0]] * world, group)


def _reduce_scatter(x: torch.Tensor, sizes: Sequence[int], group) -> torch.Tensor:
    world, me = len(sizes), group_rank(group)
    if len(set(sizes)) == 1:
        out = x.new_empty((sizes[me], *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
        return out
    # Uneven reduce-scatter: receive every rank's copy of this rank's block, [world, n_me, ...], and
    # sum them here.
    parts = _a2a(x, [sizes[me]] * world, sizes, group)
    return parts.view(world, sizes[me], *x.shape[1:]).sum(dim=0)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _gather(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        # Every rank used the gathered rows, so each row's gradient is the sum over ranks.
        return _reduce_scatter(grad, ctx.sizes, ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _reduce_scatter(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.sizes, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_sizes, in_sizes, group):
        ctx.out_sizes, ctx.in_sizes, ctx.group = out_sizes, in_sizes, group
        return _a2a(x, out_sizes, in_sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _a2a(grad, ctx.in_sizes, ctx.out_sizes, ctx.group), None, None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.chunk(group_size(group), dim=0)[group_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        # Each chunk was used only by its own rank: the gradient is the concatenation, no sum.
        return _gather(grad, [grad.shape[0]] * group_size(ctx.group), ctx.group), None


class _GatherReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, [x.shape[0]] * group_size(group), group)

    @staticmethod
    def backward(ctx, grad):
        # The loss downstream is replicated: every rank already holds the full gradient, so no sum.
        return grad.chunk(group_size(ctx.group), dim=0)[group_rank(ctx.group)].contiguous(), None


def gather_sizes(n: int, group, device=None) -> list[int]:
    """Every rank's row count ``n`` (one small all-gather; host sync)."""
    if group_size(group) == 1:
        return [n]
    t = torch.tensor([n], dtype=torch.int64, device=device)
    out = torch.empty(group_size(group), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(out, t, group=group)
    return out.tolist()


def all_gather_rows(x: torch.Tensor, group, sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Concatenate every rank's rows (``sizes``: rows per rank, equal when None)."""
    if group_size(group) == 1:
        return x
    sizes = list(sizes) if sizes is not None else [x.shape[0]] * group_size(group)
    return _AllGather.apply(x, sizes, group)


def reduce_scatter_rows(x: torch.Tensor, group, sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Sum over ranks and keep this rank's block of rows (``sizes``: rows per rank)."""
    if group_size(group) == 1:
        return x
    world = group_size(group)
    if sizes is None:
        if x.shape[0] % world:
            raise ValueError(
                f"{x.shape[0]} rows cannot be reduce-scattered evenly over {world} ranks"
            )
        sizes = [x.shape[0] // world] * world
    return _ReduceScatter.apply(x, list(sizes), group)


def all_to_all_rows(
    x: torch.Tensor, group, *, output_sizes: Sequence[int], input_sizes: Sequence[int]
) -> torch.Tensor:
    """Send ``input_sizes[j]`` consecutive rows to rank j; receive ``output_sizes[j]`` from it."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(output_sizes), list(input_sizes), group)


def split_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's equal chunk of rows of a replicated tensor."""
    if group_size(group) == 1:
        return x
    if x.shape[0] % group_size(group):
        raise ValueError(
            f"{x.shape[0]} tokens cannot be split evenly over the {group_size(group)} ranks of tp_group"
        )
    return _Split.apply(x, group)


def gather_rows_replicated(x: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`split_rows`: concat every rank's chunk; gradient keeps own chunk."""
    if group_size(group) == 1:
        return x
    return _GatherReplicated.apply(x, group)
