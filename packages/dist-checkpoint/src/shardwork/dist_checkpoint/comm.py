"""The few collectives checkpointing needs, usable without torch.distributed initialised.

``group=None`` means the default (world) group when torch.distributed is initialised and "a
single process" when it is not; every helper then degrades to the local value.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = [
    "GroupInfo",
    "all_gather_object",
    "barrier",
    "broadcast_object",
    "gather_object",
    "resolve_group",
    "scatter_object",
]


class GroupInfo:
    """A process group (or none) with this process's rank and the group's size."""

    def __init__(self, pg: Any, rank: int, size: int) -> None:
        self.pg = pg
        self.rank = rank
        self.size = size

    @property
    def distributed(self) -> bool:
        return self.pg is not None


def resolve_group(group: Any) -> GroupInfo:
    """`GroupInfo` for ``group`` (None -> world, or a single process without distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError(
                f"group={group!r} was given but torch.distributed is not initialised; "
                f"valid: group=None for a single process"
            )
        return GroupInfo(None, 0, 1)
    pg = group if group is not None else dist.group.WORLD
    return GroupInfo(pg, dist.get_rank(pg), dist.get_world_size(pg))


def all_gather_object(obj: Any, g: GroupInfo) -> list[Any]:
    if not g.distributed:
        return [obj]
    out: list[Any] = [None] * g.size
    dist.all_gather_object(out, obj, group=g.pg)
    return out


def gather_object(obj: Any, g: GroupInfo) -> list[Any] | None:
    """Every rank's ``obj`` in group-rank order on group rank 0; None on the other ranks."""
    if not g.distributed:
        return [obj]
    out: list[Any] | None = [None] * g.size if g.rank == 0 else None
    dist.gather_object(obj, out, dst=dist.get_global_rank(g.pg, 0), group=g.pg)
    return out


def scatter_object(objs: list[Any] | None, g: GroupInfo) -> Any:
    """Group rank r's item of group rank 0's ``objs`` (one per rank; None on other ranks)."""
    if not g.distributed:
        assert objs is not None
        return objs[0]
    box: list[Any] = [None]
    dist.scatter_object_list(box, objs, src=dist.get_global_rank(g.pg, 0), group=g.pg)
    return box[0]


def broadcast_object(obj: Any, g: GroupInfo) -> Any:
    """Group rank 0's ``obj`` on every rank."""
    if not g.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(g.pg, 0), group=g.pg)
    return box[0]


def barrier(g: GroupInfo) -> None:
    if g.distributed:
        dist.barrier(group=g.pg)
