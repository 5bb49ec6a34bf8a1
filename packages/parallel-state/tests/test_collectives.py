"""Each differentiable collective: forward and backward against a single-process computation.

Every rank builds the same full random tensors from a shared seed, runs the
collective on its piece, and compares output and input gradient with what the
single-process formula gives for that rank.
"""

import pytest
import torch
import torch.distributed as dist

from shardwork.parallel_state import (
    all_to_all,
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tp_region,
)
from shardwork.parallel_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank


def _per_rank(seed, world, shape):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(world)]


def _check(name):
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    inputs = _per_rank(1, world, (4 * world, 3, 2 * world))  # each rank's own input
    grads = _per_rank(
        2, world, (4 * world, 3, 2 * world)
    )  # each rank's upstream gradient, full shape
    x = inputs[rank].clone().requires_grad_(True)

    if name == "copy_to_tp":
        out = copy_to_tp_region(x, group)
        expected_out = inputs[rank]
        upstream = grads[rank]
        expected_grad = sum(grads)
    elif name == "reduce_from_tp":
        out = reduce_from_tp_region(x, group)
        expected_out = sum(inputs)
        upstream = grads[rank]
        expected_grad = grads[rank]
    elif name == "scatter_to_tp":
        out = scatter_to_tp_region(x, group)
        expected_out = inputs[rank].chunk(world, dim=-1)[rank]
        upstream = [g.chunk(world, dim=-1)[r] for r, g in enumerate(grads)]
        expected_grad = torch.cat(upstream, dim=-1)
        upstream = upstream[rank]
    elif name == "gather_from_tp":
        out = gather_from_tp_region(x, group)
        expected_out = torch.cat(inputs, dim=-1)
        upstream = grads[0].repeat(1, 1, world)  # replicated gradient, as after a TP-replicated op
        expected_grad = upstream.chunk(world, dim=-1)[rank]
    elif name == "scatter_to_sequence":
        out = scatter_to_sequence_region(x, group, dim=1 if world == 3 else 0)
        dim = 1 if world == 3 else 0
        expected_out = inputs[rank].chunk(world, dim=dim)[rank]
        upstream_all = [g.chunk(world, dim=dim)[r] for r, g in enumerate(grads)]
        expected_grad = torch.cat(upstream_all, dim=dim)
        upstream = upstream_all[rank]
    elif name == "gather_from_sequence_partial":
        out = gather_from_sequence_region(x, group, dim=0, grad_is_partial=True)
        expected_out = torch.cat(inputs, dim=0)
        # Each rank's gradient of the gathered tensor is a partial sum over ranks.
        upstream = torch.cat([grads[rank]] * world, dim=0)
        expected_grad = sum(grads)
    elif name == "gather_from_sequence_replicated":
        out = gather_from_sequence_region(x, group, dim=2, grad_is_partial=False)
        expected_out = torch.cat(inputs, dim=2)
        upstream = torch.cat([grads[0]] * world, dim=2)
        expected_grad = upstream.chunk(world, dim=2)[rank]
    elif name == "reduce_scatter_to_sequence":
        out = reduce_scatter_to_sequence_region(x, group, dim=0)
        expected_out = sum(inputs).chunk(world, dim=0)[rank]
        upstream_all = [g.chunk(world, dim=0)[r] for r, g in enumerate(grads)]
        expected_grad = torch.cat(upstream_all, dim=0)
        upstream = upstream_all[rank]
    elif name == "all_to_all_uneven":
        # Rank r sends (r + dst + 1) rows to rank dst.
        send = [rank + dst + 1 for dst in range(world)]
        recv = [src + rank + 1 for src in range(world)]
        g = torch.Generator().manual_seed(3)
        rows = [
            torch.randn(sum(src + d + 1 for d in range(world)), 5, generator=g, dtype=torch.float64)
            for src in range(world)
        ]
        x = rows[rank].clone().requires_grad_(True)
        out = all_to_all(x, group, output_splits=recv, input_splits=send)
        pieces = [
            rows[src].split([src + d + 1 for d in range(world)])[rank] for src in range(world)
        ]
        expected_out = torch.cat(pieces)
        out_grads = _per_rank(4, world, (1, 5))
        upstream_rows = [
            out_grads[r].expand(sum(s + r + 1 for s in range(world)), 5) * (r + 1)
            for r in range(world)
        ]
        upstream = upstream_rows[rank]
        back = [
            upstream_rows[dst].split([s + dst + 1 for s in range(world)])[rank]
            for dst in range(world)
        ]
        expected_grad = torch.cat(back)
    else:
        raise AssertionError(name)
    out.backward(upstream)
    torch.testing.assert_close(out, expected_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, expected_grad, rtol=1e-12, atol=1e-12)
    return True


NAMES = [
    "copy_to_tp",
    "reduce_from_tp",
    "scatter_to_tp",
    "gather_from_tp",
    "scatter_to_sequence",
    "gather_from_sequence_partial",
    "gather_from_sequence_replicated",
    "reduce_scatter_to_sequence",
    "all_to_all_uneven",
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("world", [2, 3])
def test_collective_forward_and_backward(name, world):
    assert run_on_ranks(_check, world_size=world, args=(name,)) == [True] * world


def _identity_without_group():
    x = torch.randn(4, 6, requires_grad=True)
    outs = [
        copy_to_tp_region(x, None),
        reduce_from_tp_region(x, None),
        scatter_to_tp_region(x, None),
        gather_from_tp_region(x, None),
        gather_from_sequence_region(x, None),
        reduce_scatter_to_sequence_region(x, None),
        all_to_all(x, None),
    ]
    return all(o is x for o in outs)


def test_no_group_means_identity():
    assert _identity_without_group()
