"""What ``shardwork.json`` records about the parallel layout a checkpoint was saved at.

Always, from the save's process group: ``world_size`` (ranks that saved together) and
``group_ranks`` (their global ranks, in group order). The *parallel* layout (TP/PP/EP/DP
sizes) is known only to the caller, who passes ``layout=`` as

- a mapping of JSON values (recorded as given), or
- any object carrying the parallel sizes, read by attribute (duck-typed, so this package
  does not import parallel-state): a ``ProcessGroups`` bundle (sizes from its ``config``) or
  a ``ParallelConfig`` itself; the attributes ``tp, pp, vpp, cp, ep, etp, dp, order`` that
  exist are recorded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from shardwork.dist_checkpoint.comm import GroupInfo

__all__ = ["LAYOUT_FIELDS", "describe_layout", "group_ranks"]

#: Attributes read from a layout object (a ProcessGroups' config or a ParallelConfig).
LAYOUT_FIELDS = ("tp", "pp", "vpp", "cp", "ep", "etp", "dp", "order")


def _fields_of(obj: Any) -> dict[str, Any] | None:
    found = {name: getattr(obj, name) for name in LAYOUT_FIELDS if hasattr(obj, name)}
    return found or None


def describe_layout(layout: Any) -> dict[str, Any] | None:
    """The JSON-able record of ``layout`` (see module docstring); ValueError if it is none of
    the accepted forms or holds values JSON cannot represent."""
    if layout is None:
        return None
    if isinstance(layout, Mapping):
        record = {str(k): v for k, v in layout.items()}
    else:
        record = _fields_of(getattr(layout, "config", None)) or _fields_of(layout)
        if record is None:
            raise ValueError(
                f"layout={layout!r} is not valid; valid: None, a mapping of JSON values, or an "
                f"object with the parallel sizes as attributes (a ProcessGroups bundle via its "
                f".config, or a ParallelConfig: {', '.join(LAYOUT_FIELDS)})"
            )
    try:
        json.dumps(record)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"layout={layout!r} is not valid: {exc}; valid: values JSON can represent "
            f"(numbers, strings, booleans, None, lists, dicts)"
        ) from None
    return record


def group_ranks(g: GroupInfo) -> list[int]:
    """Global ranks of the save's group in group order ([0] without torch.distributed)."""
    if not g.distributed:
        return [0]
    return list(dist.get_process_group_ranks(g.pg))
