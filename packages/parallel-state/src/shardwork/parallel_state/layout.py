"""``RankLayout``: which global ranks form each process group, computed without processes.

Ranks are laid on a grid whose axes follow ``config.order`` (first axis
fastest-varying). A group over a set of axes is the set of ranks that differ
only in those axes. Two grids share the same ranks:

- dense:  tp, cp, dp, pp   (ep has size 1 here)
- expert: etp, ep, edp, pp (cp has size 1 here; etp takes tp's place)

Both must give the same pipeline groups, since a stage holds both kinds of
layer. Groups are listed in the same order as Megatron-Core's
``RankGenerator`` lists them, so the two frameworks agree rank for rank.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from shardwork.parallel_state.config import ParallelConfig

#: Group names built from the dense grid and the axes each one spans.
DENSE_GROUPS: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "cp": ("cp",),
    "dp": ("dp",),
    "pp": ("pp",),
    "dp_cp": ("dp", "cp"),
    "tp_cp": ("tp", "cp"),
    "tp_dp": ("tp", "dp"),
    "tp_dp_cp": ("tp", "dp", "cp"),
    "mp": ("tp", "pp"),
}
#: Group names built from the expert grid (its "tp" axis is etp, its "dp" axis is edp).
EXPERT_GROUPS: dict[str, tuple[str, ...]] = {
    "ep": ("ep",),
    "etp": ("tp",),
    "edp": ("dp",),
    "etp_ep": ("tp", "ep"),
    "expert_mp": ("tp", "ep", "pp"),
}
#: Every group name a layout provides, in creation order.
GROUP_NAMES: tuple[str, ...] = (*DENSE_GROUPS, *EXPERT_GROUPS, "embedding")


def _masked_groups(
    sizes: dict[str, int], order: list[str], axes: tuple[str, ...]
) -> list[list[int]]:
    """Groups of ranks that differ only along ``axes`` on the grid ``sizes`` laid out in
    ``order`` (first axis fastest). Groups are listed with the outside axes' first one
    varying fastest, members with the inside axes' first one fastest (Megatron-Core's order).

    One array op over the whole grid: ``ranks`` has one dim per axis, the last axis of
    ``order`` first, so C order enumerates the first axis fastest; moving the outside axes to
    the front (each group of axes reversed, for the same reason) and flattening each part
    lists the groups as rows.
    """
    # Dims in reverse order: the last axis of ``order`` is dim 0, so C order varies the first axis
    # fastest.
    ranks = np.arange(math.prod(sizes[n] for n in order)).reshape(
        [sizes[n] for n in reversed(order)]
    )
    dim = {name: len(order) - 1 - i for i, name in enumerate(order)}
    inside = [name for name in order if name in axes]
    outside = [name for name in order if name not in axes]
    permuted = ranks.transpose(
        [dim[n] for n in reversed(outside)] + [dim[n] for n in reversed(inside)]
    )
    group_size = math.prod(sizes[n] for n in inside)
    # One row per group: the outside axes enumerate the groups, the inside axes their members.
    return permuted.reshape(-1, group_size).tolist()


@dataclass(frozen=True)
class RankLayout:
    """Every group's member ranks for a resolved :class:`ParallelConfig`."""

    config: ParallelConfig
    groups: dict[str, list[list[int]]] = field(repr=False)

    @classmethod
    def build(cls, config: ParallelConfig, world_size: int) -> RankLayout:
        """Resolve ``config`` for ``world_size`` and compute every group (ValueError if impossible)."""
        config = config.resolve(world_size)
        order = config.full_order
        # ep is 1 on the dense grid and cp is 1 on the expert grid: both grids span the same ranks
        # (tp*cp*dp = etp*ep*edp per pipeline stage).
        dense = {"tp": config.tp, "cp": config.cp, "ep": 1, "dp": config.dp, "pp": config.pp}
        expert = {"tp": config.etp, "cp": 1, "ep": config.ep, "dp": config.edp, "pp": config.pp}
        groups = {name: _masked_groups(dense, order, axes) for name, axes in DENSE_GROUPS.items()}
        groups |= {
            name: _masked_groups(expert, order, axes) for name, axes in EXPERT_GROUPS.items()
        }
        expert_pp = _masked_groups(expert, order, ("pp",))
        # Compared as sets: the expert grid may list the same pipeline groups in another order.
        if sorted(map(tuple, expert_pp)) != sorted(map(tuple, groups["pp"])):
            raise ValueError(
                f"ParallelConfig.order={config.order!r} puts pipeline stages on different ranks for "
                f"dense and expert layers with tp={config.tp}, cp={config.cp}, etp={config.etp}, "
                f"ep={config.ep}: use an order where pp is outside the other axes (e.g. 'tp-cp-ep-dp-pp')"
            )
        # First and last stage of each pipeline (tied input embedding and output layer); a set, so
        # pp = 1 gives a one-rank group.
        groups["embedding"] = [sorted({pp_group[0], pp_group[-1]}) for pp_group in groups["pp"]]
        return cls(config=config, groups=groups)

    @property
    def world_size(self) -> int:
        return self.config.world_size

    def group_of(self, name: str, rank: int) -> list[int]:
        """Member ranks of group ``name`` that contains ``rank``."""
        for members in self.groups[name]:
            if rank in members:
                return members
        raise ValueError(
            f"rank={rank} is not in any {name!r} group of a world of {self.world_size}"
        )

    def coordinate(self, name: str, rank: int) -> int:
        """``rank``'s index inside its group ``name`` (its tp rank, pp stage, ...)."""
        return self.group_of(name, rank).index(rank)

    def size(self, name: str) -> int:
        return len(self.groups[name][0])

    def check(self) -> None:
        """Assert the layout's invariants: every rank in exactly one group per name, equal sizes."""
        for name, groups in self.groups.items():
            members = sorted(itertools.chain.from_iterable(groups))
            if name == "embedding":
                assert set(members) <= set(range(self.world_size)), name
                continue
            assert members == list(range(self.world_size)), name
            assert len({len(g) for g in groups}) == 1, name
            assert math.prod([len(groups), len(groups[0])]) == self.world_size, name
