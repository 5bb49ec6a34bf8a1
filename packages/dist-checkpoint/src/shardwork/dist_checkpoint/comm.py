"""The few collectives checkpointing needs, usable without torch.distributed initialised.

``group=None`` means the default (world) group when torch.distributed is initialised and "a
single process" when it is not; every helper then degrades to the local value.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["GroupInfo", "all_gather_object", "barrier", "broadcast_object", "resolve_group"]


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
