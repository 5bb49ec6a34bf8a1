"""Which rows of a parameter this rank holds when data parallelism shards it (FSDP).

torch's FSDP (``fully_shard``) turns a parameter into a DTensor sharded on dim 0 over the
data-parallel group: rank ``r`` of ``W`` holds rows ``[r·c, min((r+1)·c, n))`` of the ``n``
rows of the tensor it replaced, ``c = ceil(n / W)`` (``torch.chunk``'s split; trailing ranks
may hold none). The unsharded tensor is the TP-local parameter, whose place in the global
tensor ``ParamMeta`` describes; :func:`row_shard` gives the rows and this rank's local view,
so checkpoints and optimizers can place the local piece in global coordinates without
gathering it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Shard

__all__ = ["RowShard", "row_shard"]


@dataclass(frozen=True)
class RowShard:
    """Rows ``[start, stop)`` (along dim 0) of the unsharded parameter, held as ``local``."""

    start: int
    stop: int
    local: torch.Tensor
    """This rank's rows: the DTensor's local tensor (same storage; writes reach the parameter)."""
    num_rows: int
    """Rows of the unsharded parameter (its dim 0)."""


def row_shard(param: torch.Tensor) -> RowShard | None:
    """This rank's rows of an FSDP-sharded parameter; None for a plain tensor.

    Raises ValueError for a DTensor that is not sharded on dim 0 over a 1-D mesh (HSDP or
    tensor-parallel DTensors are not a layout shardwork produces)."""
    if not isinstance(param, DTensor):
        return None
    placements = tuple(param.placements)
    if len(placements) != 1 or placements[0] != Shard(0):
        raise ValueError(
            f"row_shard: a DTensor parameter of shape {tuple(param.shape)} with placements "
            f"{placements}; valid: (Shard(dim=0),) over a 1-D mesh (torch's fully_shard)"
        )
    mesh = param.device_mesh
    rows = param.shape[0]
    chunk = math.ceil(rows / mesh.size())
    start = min(mesh.get_local_rank() * chunk, rows)
    stop = min(start + chunk, rows)
    # to_local() outside autograd returns a view of the local shard, not a graph node.
    with torch.no_grad():
        local = param.to_local()
    assert local.shape[0] == stop - start, (tuple(local.shape), start, stop)
    return RowShard(start, stop, local, rows)
