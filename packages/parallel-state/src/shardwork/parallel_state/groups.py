"""``ProcessGroups``: every communicator a rank needs, created once and passed explicitly.

- ``init_process_groups`` builds the :class:`RankLayout`, then creates one
  communicator per group name and member list, in the same order on every rank.
  Two names with the same members (say ep and dp) still get separate
  communicators, as in Megatron-Core: collectives issued on one (an overlapped
  gradient all-reduce) must never queue behind or interleave with another's (an
  expert all-to-all in backward).
- It works inside an existing default group, initialises one itself (from
  ``torchrun``'s environment or a given ``Store``), and can place the layout
  on a subset of the world's ranks (``ranks=``), so one pool of processes can
  host layouts of several sizes.
- ``gloo_twins=True`` adds gloo copies of the dp, dp_cp and edp groups for
  CPU-side collectives next to NCCL groups; on a gloo world they are the
  same objects.
- A ``None`` group means "not distributed"; :func:`group_size` and
  :func:`group_rank` accept it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from types import MappingProxyType
from typing import Any

import torch.distributed as dist

from shardwork.parallel_state.config import ParallelConfig
from shardwork.parallel_state.layout import GROUP_NAMES, RankLayout

ProcessGroup = Any  # torch.distributed.ProcessGroup, or None for "not distributed"

_GLOO_TWINNED = ("dp", "dp_cp", "edp")


def group_size(group: ProcessGroup | None) -> int:
    """Size of ``group``; 1 for ``None`` (not distributed)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank inside ``group``; 0 for ``None``."""
    return 0 if group is None else dist.get_rank(group)


@dataclass(frozen=True)
class ProcessGroups:
    """The groups of one rank, their members (global ranks) and this rank's position.

    Access a group by attribute (``groups.tp``) or name (``groups.group("tp")``);
    sizes and ranks by ``groups.size("tp")`` / ``groups.rank("tp")``.
    Names: tp, cp, dp, pp, dp_cp, tp_cp, tp_dp, tp_dp_cp, mp (tp×pp), ep, etp,
    edp, etp_ep, expert_mp (etp×ep×pp), embedding (first and last pp stage).
    """

    config: ParallelConfig
    global_rank: int
    members: MappingProxyType = field(repr=False)
    handles: MappingProxyType = field(repr=False)
    gloo: MappingProxyType = field(repr=False)

    @classmethod
    def single(cls) -> ProcessGroups:
        """One process, no torch.distributed: every group is ``None`` and every size 1."""
        config = ParallelConfig().resolve(1)
        members = MappingProxyType({name: (0,) for name in GROUP_NAMES})
        handles = MappingProxyType(dict.fromkeys(GROUP_NAMES))
        return cls(config, 0, members, handles, MappingProxyType(dict.fromkeys(_GLOO_TWINNED)))

    def group(self, name: str) -> ProcessGroup | None:
        if name not in self.handles:
            raise ValueError(f"unknown group name {name!r}; valid names: {', '.join(GROUP_NAMES)}")
        return self.handles[name]

    def gloo_group(self, name: str) -> ProcessGroup | None:
        """The gloo twin of ``name`` (dp, dp_cp or edp) for CPU-side collectives."""
        if name not in self.gloo:
            raise ValueError(
                f"no gloo twin for {name!r}; twins exist for {', '.join(_GLOO_TWINNED)}"
            )
        return self.gloo[name]

    def size(self, name: str) -> int:
        return len(self.members[name])

    def rank(self, name: str) -> int:
        """This rank's index in group ``name`` (e.g. its pipeline stage for "pp")."""
        return self.members[name].index(self.global_rank)

    def __getattr__(self, name: str) -> ProcessGroup | None:
        handles = self.__dict__.get("handles")
        if handles is not None and name in handles:
            return handles[name]
        raise AttributeError(name)

    @property
    def is_first_pp_stage(self) -> bool:
        return self.rank("pp") == 0

    @property
    def is_last_pp_stage(self) -> bool:
        return self.rank("pp") == self.size("pp") - 1


def init_process_groups(
    config: ParallelConfig,
    *,
    backend: str | None = None,
    timeout: timedelta | None = None,
    store: dist.Store | None = None,
    ranks: Sequence[int] | None = None,
    gloo_twins: bool = False,
) -> ProcessGroups:
    """Create every group of ``config`` and return this rank's :class:`ProcessGroups`.

    If torch.distributed is not initialised yet, it is initialised here with
    ``backend`` (default: nccl when CUDA is available, else gloo), ``timeout``
    and ``store`` (or torchrun's environment variables). ``ranks`` places the
    layout on those global ranks (default: the whole world); only those ranks
    call this function. The config is validated before anything is created.
    """
    if ranks is not None:
        ranks = list(ranks)
        if len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"ranks={ranks} must be a non-empty list of distinct global ranks")
        world_size = len(ranks)
    elif dist.is_initialized():
        world_size = dist.get_world_size()
    else:
        import os

        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    layout = RankLayout.build(config, world_size)  # raises before any group exists

    if not dist.is_initialized():
        if backend is None:
            import torch

            backend = "nccl" if torch.cuda.is_available() else "gloo"
        kwargs: dict[str, Any] = {"backend": backend}
        if timeout is not None:
            kwargs["timeout"] = timeout
        if store is not None:
            import os

            kwargs.update(store=store, rank=int(os.environ["RANK"]), world_size=world_size)
        dist.init_process_group(**kwargs)

    global_ranks = ranks if ranks is not None else list(range(dist.get_world_size()))
    if len(global_ranks) != layout.world_size:
        raise ValueError(
            f"layout needs {layout.world_size} ranks but {len(global_ranks)} are available"
        )
    me = dist.get_rank()
    if me not in global_ranks:
        raise ValueError(
            f"global rank {me} called init_process_groups but is not in ranks={global_ranks}"
        )
    local_me = global_ranks.index(me)
    world_backend = dist.get_backend()
    local = ranks is not None and len(global_ranks) != dist.get_world_size()

    created: dict[tuple[str, tuple[int, ...]], Any] = {}
    gloo_created: dict[tuple[str, tuple[int, ...]], Any] = {}

    def make(name: str, members: tuple[int, ...], use_backend: str | None, cache: dict) -> Any:
        if (name, members) not in cache:
            cache[(name, members)] = dist.new_group(
                list(members), timeout=timeout, backend=use_backend, use_local_synchronization=local
            )
        return cache[(name, members)]

    members_by_name: dict[str, tuple[int, ...]] = {}
    handles: dict[str, Any] = {}
    for name in GROUP_NAMES:
        for group in layout.groups[name]:
            mapped = tuple(global_ranks[r] for r in group)
            if local and local_me not in group:
                continue  # with local synchronisation only members create a group
            handle = make(name, mapped, None, created)
            if local_me in group:
                members_by_name[name] = mapped
                handles[name] = handle
    gloo: dict[str, Any] = {}
    for name in _GLOO_TWINNED:
        if not gloo_twins:
            gloo[name] = None
        elif world_backend == "gloo":
            gloo[name] = handles[name]
        else:
            for group in layout.groups[name]:
                mapped = tuple(global_ranks[r] for r in group)
                if local and local_me not in group:
                    continue
                handle = make(name, mapped, "gloo", gloo_created)
                if local_me in group:
                    gloo[name] = handle
    return ProcessGroups(
        config=layout.config,
        global_rank=me,
        members=MappingProxyType(members_by_name),
        handles=MappingProxyType(handles),
        gloo=MappingProxyType(gloo),
    )
