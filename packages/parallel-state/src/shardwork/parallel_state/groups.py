"""``ProcessGroups``: every communicator a rank needs, created once and passed explicitly.

- ``init_process_groups`` builds the :class:`RankLayout`, then each rank creates the
  communicators of the groups it belongs to (one per name), in name order, with local
  synchronisation: its work does not grow with the number of groups it is not in.
  Two names with the same members (say ep and dp) still get separate
  communicators, as in Megatron-Core: collectives issued on one (an overlapped
  gradient all-reduce) must never queue behind or interleave with another's (an
  expert all-to-all in backward).
- It works inside an existing default group, or initialises one itself (a
  given ``Store`` or torchrun's rendezvous; ``rank=``/``world_size=`` or the
  ``RANK``/``WORLD_SIZE`` environment variables), and can place the layout
  on a subset of the world's ranks (``ranks=``), so one pool of processes can
  host layouts of several sizes.
- ``gloo_twins=True`` adds gloo copies of the dp, dp_cp and edp groups for
  CPU-side collectives next to NCCL groups; on a world that is gloo on every
  device (``"gloo"``, ``"cpu:gloo"``) they are the same objects.
- A ``None`` group means "not distributed"; :func:`group_size` and
  :func:`group_rank` accept it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from types import MappingProxyType
from typing import Any

import torch
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

    def _not_member(self, name: str) -> str | None:
        """Why this rank has no group ``name`` (unknown name, or not a member), else None."""
        if name not in GROUP_NAMES:
            return f"unknown group name {name!r}; valid names: {', '.join(GROUP_NAMES)}"
        if name not in self.members:
            return (
                f"global rank {self.global_rank} belongs to no {name!r} group (the embedding "
                "group holds only the first and last pipeline stages)"
            )
        return None

    def _members_of(self, name: str) -> tuple[int, ...]:
        if (why := self._not_member(name)) is not None:
            raise ValueError(why)
        return self.members[name]

    def group(self, name: str) -> ProcessGroup | None:
        self._members_of(name)
        return self.handles[name]

    def gloo_group(self, name: str) -> ProcessGroup | None:
        """The gloo twin of ``name`` (dp, dp_cp or edp) for CPU-side collectives."""
        if name not in self.gloo:
            raise ValueError(
                f"no gloo twin for {name!r}; twins exist for {', '.join(_GLOO_TWINNED)}"
            )
        return self.gloo[name]

    def size(self, name: str) -> int:
        return len(self._members_of(name))

    def rank(self, name: str) -> int:
        """This rank's index in group ``name`` (e.g. its pipeline stage for "pp")."""
        return self._members_of(name).index(self.global_rank)

    def __getattr__(self, name: str) -> ProcessGroup | None:
        # Read through __dict__: ``self.handles`` on an instance without it (mid-unpickling or copy)
        # would re-enter __getattr__ without end.
        handles = self.__dict__.get("handles")
        if handles is not None and name in handles:
            return handles[name]
        if handles is not None and name in GROUP_NAMES:
            raise AttributeError(self._not_member(name))
        raise AttributeError(name)

    @property
    def is_first_pp_stage(self) -> bool:
        return self.rank("pp") == 0

    @property
    def is_last_pp_stage(self) -> bool:
        return self.rank("pp") == self.size("pp") - 1


def _known(argument: str, value: int | None, env: str) -> int:
    """``value`` if given, else the integer in environment variable ``env``; ValueError if neither."""
    if value is not None:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"init_process_groups: {argument}={value!r} must be an int")
        return value
    text = os.environ.get(env)
    if text is None:
        raise ValueError(
            f"init_process_groups: {argument} is unknown: torch.distributed is not initialised, so "
            f"pass {argument}= or set the {env} environment variable (torchrun sets it)"
        )
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"init_process_groups: environment variable {env}={text!r} must be an integer ({argument})"
        ) from None


def _world_to_initialise(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """This process's global rank and the world size, for initialising torch.distributed here."""
    world_size = _known("world_size", world_size, "WORLD_SIZE")
    rank = _known("rank", rank, "RANK")
    if world_size < 1:
        raise ValueError(f"init_process_groups: world_size={world_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"init_process_groups: rank={rank} must be in [0, {world_size}) for world_size={world_size}"
        )
    return rank, world_size


def _check_live_world(rank: int | None, world_size: int | None) -> int:
    """The initialised world's size; ``rank``/``world_size``, when given, must agree with it."""
    live = {"rank": dist.get_rank(), "world_size": dist.get_world_size()}
    for argument, value in (("rank", rank), ("world_size", world_size)):
        if value is not None and value != live[argument]:
            raise ValueError(
                f"init_process_groups: {argument}={value} disagrees with the initialised "
                f"torch.distributed world ({argument}={live[argument]}); omit it or pass {live[argument]}"
            )
    return live["world_size"]


def _world_is_gloo_only(world_backend: str) -> bool:
    """Whether every device of a world with backend ``world_backend`` already uses gloo.

    ``"gloo"`` and ``"cpu:gloo"`` are; ``"nccl"`` and ``"cpu:gloo,cuda:nccl"`` are not. Only
    then can the world's own groups serve as the gloo twins.
    """
    return {part.rsplit(":", 1)[-1].strip() for part in world_backend.split(",")} == {"gloo"}


def _create_groups(
    layout: RankLayout,
    names: Sequence[str],
    global_ranks: Sequence[int],
    me: int,
    *,
    backend: str | None,
    timeout: timedelta | None,
) -> dict[str, ProcessGroup]:
    """Create this rank's communicator of each name in ``names``; return them by name.

    Layout rank ``i`` is global rank ``global_ranks[i]``; ``me`` is this process's global rank.
    ``backend=None`` gives the world's backend. Each rank creates only the groups it is a
    member of, with local synchronisation (only the members meet in the creation barrier):
    per-rank work is one ``new_group`` per name, whatever the world size, where creating
    every group on every rank costs each rank one call per group of the whole layout (about
    190,000 at 100k ranks) and a world-wide barrier in each.
    """
    local_me = list(global_ranks).index(me)
    mine: dict[str, ProcessGroup] = {}
    # Members create their groups in the same order (``names``' order), which keeps torch's per-rank
    # group counter, and so the hashed group names, equal across each group's members.
    for name in names:
        members = next((g for g in layout.groups[name] if local_me in g), None)
        if members is None:  # a middle pipeline stage has no 'embedding' group
            continue
        mine[name] = dist.new_group(
            [global_ranks[r] for r in members],
            timeout=timeout,
            backend=backend,
            use_local_synchronization=True,
        )
    return mine


def init_process_groups(
    config: ParallelConfig,
    *,
    backend: str | None = None,
    timeout: timedelta | None = None,
    store: dist.Store | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    ranks: Sequence[int] | None = None,
    gloo_twins: bool = False,
) -> ProcessGroups:
    """Create every group of ``config`` and return this rank's :class:`ProcessGroups`.

    If torch.distributed is not initialised yet, it is initialised here with
    ``backend`` (default: nccl when CUDA is available, else gloo), ``timeout``,
    ``store`` (default: torchrun's ``MASTER_ADDR``/``MASTER_PORT`` rendezvous),
    and this process's global ``rank`` and the ``world_size`` (default: the
    ``RANK`` and ``WORLD_SIZE`` environment variables; a ValueError names the
    one that is missing). If it is initialised, ``rank``/``world_size`` may be
    omitted and must match it if given. ``ranks`` places the layout on those
    global ranks (default: the whole world); only those ranks call this
    function. Everything is validated before anything is created.
    """
    initialise = not dist.is_initialized()
    if initialise:
        me, world = _world_to_initialise(rank, world_size)
    else:
        me, world = dist.get_rank(), _check_live_world(rank, world_size)
    if ranks is None:
        global_ranks = list(range(world))
    else:
        global_ranks = list(ranks)
        if len(set(global_ranks)) != len(global_ranks) or not global_ranks:
            raise ValueError(f"ranks={ranks} must be a non-empty list of distinct global ranks")
        outside = [r for r in global_ranks if not isinstance(r, int) or not 0 <= r < world]
        if outside:
            raise ValueError(f"ranks={ranks}: {outside} are not global ranks of a world of {world}")
        if me not in global_ranks:
            raise ValueError(
                f"global rank {me} called init_process_groups but is not in ranks={global_ranks}"
            )
    layout = RankLayout.build(config, len(global_ranks))  # raises before anything exists

    if initialise:
        if backend is None:
            # NCCL needs CUDA; without it gloo is the backend that works on CPU.
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        kwargs: dict[str, Any] = {"backend": backend, "rank": me, "world_size": world}
        if timeout is not None:
            kwargs["timeout"] = timeout
        if store is not None:
            kwargs["store"] = store
        dist.init_process_group(**kwargs)

    # backend=None: every group uses the world's backend.
    handles = _create_groups(layout, GROUP_NAMES, global_ranks, me, backend=None, timeout=timeout)
    if not gloo_twins:
        gloo = dict.fromkeys(_GLOO_TWINNED)
    elif _world_is_gloo_only(dist.get_backend()):
        # A world that is gloo on every device: its groups already are the gloo twins.
        gloo = {name: handles[name] for name in _GLOO_TWINNED}
    else:
        gloo = _create_groups(
            layout, _GLOO_TWINNED, global_ranks, me, backend="gloo", timeout=timeout
        )
    local_me = global_ranks.index(me)
    # A rank in no group of a name (a middle pipeline stage and 'embedding') has no entry.
    members_by_name = {
        name: tuple(global_ranks[r] for r in group)
        for name in GROUP_NAMES
        for group in layout.groups[name]
        if local_me in group
    }
    return ProcessGroups(
        config=layout.config,
        global_rank=me,
        members=MappingProxyType(members_by_name),
        handles=MappingProxyType(handles),
        gloo=MappingProxyType(gloo),
    )
