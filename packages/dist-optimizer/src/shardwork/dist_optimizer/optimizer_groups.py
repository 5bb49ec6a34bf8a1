"""Which groups an optimizer part reduces over: one resolution shared by the ZeRO and the
layer-wise optimizers.

- the data-parallel group comes from the DDP chunks (edp for the expert part, dp×cp otherwise)
  and must agree with ``process_groups`` when it is given;
- tp group, grad-norm groups and pipeline rank default from ``process_groups``;
- ``collision_axes``: parallel axes whose ranks hold different parameters under possibly equal
  local names (pp, and ep for experts), so saving needs ``param_rects`` with global keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


def group_ranks(group: Any) -> tuple[int, ...]:
    """Global ranks of ``group`` (``(this rank,)`` or ``(0,)`` for None)."""
    if group is None:
        return (dist.get_rank(),) if dist.is_initialized() else (0,)
    return tuple(dist.get_process_group_ranks(group))


@dataclass(frozen=True)
class OptimizerGroups:
    dp_group: Any
    tp_group: Any
    stats_groups: tuple
    pp_rank: int
    collision_axes: dict[str, int]


def resolve_optimizer_groups(
    models, *, expert: bool, process_groups, tp_group, stats_groups, pp_rank
) -> OptimizerGroups:
    """Resolve and check the groups of one optimizer part (ValueError on a mismatch)."""
    groups = [m.expert_dp_group if expert else m.dp_group for m in models]
    dp_group = groups[0]
    if any(group_ranks(g) != group_ranks(dp_group) for g in groups):
        raise ValueError("model chunks reduce over different data-parallel groups; valid: one")
    collision_axes: dict[str, int] = {}
    if process_groups is not None:
        name = "edp" if expert else "dp_cp"
        expected = group_ranks(process_groups.group(name))
        if expected != group_ranks(dp_group):
            raise ValueError(
                f"mismatched groups: the model's {'expert ' if expert else ''}data-parallel "
                f"group has ranks {group_ranks(dp_group)} but process_groups "
                f"{name!r} has {expected}; valid: build the DDP model from the same groups"
            )
        if tp_group is None:
            tp_group = process_groups.group("etp" if expert else "tp")
        if stats_groups is None:
            stats_groups = (dp_group, process_groups.group("expert_mp" if expert else "mp"))
        if pp_rank is None:
            pp_rank = process_groups.rank("pp")
        collision_axes = {
            a: process_groups.size(a)
            for a in (("pp", "ep") if expert else ("pp",))
            if process_groups.size(a) > 1
        }
    return OptimizerGroups(
        dp_group=dp_group,
        tp_group=tp_group,
        stats_groups=tuple(stats_groups if stats_groups is not None else (dp_group, tp_group)),
        pp_rank=pp_rank or 0,
        collision_axes=collision_axes,
    )
