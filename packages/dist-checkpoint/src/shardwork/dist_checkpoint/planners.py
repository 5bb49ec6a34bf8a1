"""DCP planners that take shardwork's precomputed plans instead of a state dict.

- `PlannedSavePlanner`: each rank's local plan is exactly the write items chosen by
  `plan.build_global_plan` (deduplicated, load-balanced), so the coordinator only builds DCP's
  metadata from them (`create_default_global_save_plan`) without further dedup.
  ``planner_data`` maps every key to itself so DCP tools that rebuild a state dict from the
  metadata see flat keys.
- `PlannedLoadPlanner`: each rank asks for the rectangles of its template pieces
  (`create_read_items_for_chunk_list` intersects them with the saved chunks: this is the
  resharding), reads tensors straight into views of the template's tensors and decodes
  objects into a result dict with an allow-list (`decode.decode_object`: no code runs).
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)

from shardwork.dist_checkpoint.decode import decode_object

__all__ = ["PlannedLoadPlanner", "PlannedSavePlanner"]


def _narrow(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        if offset != 0 or length != tensor.shape[dim]:
            tensor = tensor.narrow(dim, offset, length)
    return tensor


def _index_key(index: MetadataIndex) -> tuple[str, tuple[int, ...] | None]:
    return index.fqn, None if index.offset is None else tuple(index.offset)


class PlannedSavePlanner(SavePlanner):
    """Save planner over precomputed write items.

    Args:
        items: this rank's write items.
        data: ``(fqn, offsets or None) -> tensor | bytes | object``; ``bytes`` are written as
            they are (already serialised), other non-tensors through ``torch.save``.
    """

    def __init__(self, items: list[WriteItem], data: dict[tuple[str, Any], Any]) -> None:
        self.items = items
        self.data = data

    def set_up_planner(
        self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        return SavePlan(self.items)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = create_default_global_save_plan(all_plans)
        fqns = metadata.state_dict_metadata.keys()
        metadata.planner_data = {fqn: (fqn,) for fqn in fqns}
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        value = self.data[_index_key(write_item.index)]
        if write_item.type != WriteItemType.BYTE_IO:
            return value
        if isinstance(value, bytes):
            return io.BytesIO(value)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        return buffer


class PlannedLoadPlanner(LoadPlanner):
    """Load planner over precomputed read items.

    Args:
        items: this rank's read items (tensor reads name their destination chunk by
            ``dest_index.index`` into ``views[fqn]``).
        views: ``fqn -> [tensor view of each requested rectangle]``.
    """

    def __init__(self, items: list[ReadItem], views: dict[str, list[torch.Tensor]]) -> None:
        self.items = items
        self.views = views
        self.objects: dict[str, Any] = {}

    def set_up_planner(
        self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan(self.items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        self.objects[fqn] = decode_object(value, name=f"object {fqn!r}")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        index = read_item.dest_index
        view = self.views[index.fqn][index.index]
        return _narrow(view, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Nothing to do: `resolve_tensor` returned a view of the destination itself."""
