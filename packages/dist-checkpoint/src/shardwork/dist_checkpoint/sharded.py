"""Descriptions of what each rank holds: `ShardedTensor` and `ShardedObject`.

- A `ShardedTensor` is one rank's rectangular piece (``local_shape`` at ``global_offset``)
  of a global tensor named ``key``. With ``flattened_range=(start, stop)`` the rank holds only
  elements ``[start, stop)`` of the row-major flattening of that rectangle, as a 1-D tensor:
  the shape a ZeRO-style distributed optimizer keeps its fp32 master weights and moments in.
- ``replica_id == 0`` marks the primary copy; ``replica_id > 0`` marks the same elements held
  by another rank (data-parallel replicas). Replicas are written once.
- A `ShardedObject` is any picklable value (RNG state, scheduler, data position). Objects are
  not resharded: ``global_shape``/``global_offset`` index a grid of per-rank objects (for example
  one RNG state per (pp, tp) rank), and a load must ask for pieces of the grid it was saved with.
- A "sharded state dict" is a nested dict/list of these plus plain values (saved as-is on the
  first rank only, loaded back unchanged).

Every field is validated in ``__post_init__``; errors are ``ValueError`` naming the key, the
field, its value and what would be valid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["ShardedObject", "ShardedTensor"]


def _as_int_tuple(key: str, name: str, value: Any) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in value)
    except TypeError as exc:
        raise ValueError(
            f"{key!r}: {name}={value!r} is not a sequence of ints; "
            f"valid: a tuple of non-negative ints"
        ) from exc
    if any(v < 0 for v in out) or any(isinstance(v, bool) for v in value):
        raise ValueError(f"{key!r}: {name}={value!r} has a negative entry; valid: ints >= 0")
    return out


def _check_key(key: Any) -> None:
    if not isinstance(key, str) or not key:
        raise ValueError(f"key={key!r} is not valid; valid: a non-empty str")


def _check_replica_id(key: str, replica_id: Any) -> None:
    if isinstance(replica_id, bool) or not isinstance(replica_id, int) or replica_id < 0:
        raise ValueError(
            f"{key!r}: replica_id={replica_id!r} is not valid; valid: an int >= 0 "
            f"(0 = the primary copy)"
        )


@dataclass(frozen=True, eq=False)
class ShardedTensor:
    """One rank's piece of a global tensor.

    Attributes:
        key: global name, e.g. ``"decoder.layers.3.mlp.fc1.weight"``; unique in a state dict.
        data: this rank's local piece. Shape ``local_shape``, or 1-D of ``stop - start``
            elements when ``flattened_range`` is set. On load it is filled in place.
        global_shape: shape of the whole tensor.
        global_offset: index of the local rectangle's first element in the global tensor.
        replica_id: 0 for the primary copy, >0 for a replica of elements another rank also holds.
        local_shape: shape of the local rectangle; defaults to ``data.shape``. Required when
            ``flattened_range`` is set.
        flattened_range: ``(start, stop)`` into the row-major flattening of the local rectangle.
    """

    key: str
    data: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: int = 0
    local_shape: tuple[int, ...] | None = None
    flattened_range: tuple[int, int] | None = field(default=None)

    def __post_init__(self) -> None:
        key = self.key
        _check_key(key)
        if not isinstance(self.data, torch.Tensor):
            raise ValueError(
                f"{key!r}: data has type {type(self.data).__name__}; valid: a torch.Tensor"
            )
        gshape = _as_int_tuple(key, "global_shape", self.global_shape)
        goff = _as_int_tuple(key, "global_offset", self.global_offset)
        object.__setattr__(self, "global_shape", gshape)
        object.__setattr__(self, "global_offset", goff)
        _check_replica_id(key, self.replica_id)
        if len(goff) != len(gshape):
            raise ValueError(
                f"{key!r}: global_offset={goff} has {len(goff)} dims but global_shape={gshape} "
                f"has {len(gshape)}; valid: one offset per global dim"
            )
        if self.flattened_range is None:
            lshape = tuple(self.data.shape)
            if self.local_shape is not None:
                given = _as_int_tuple(key, "local_shape", self.local_shape)
                if given != lshape:
                    raise ValueError(
                        f"{key!r}: local_shape={given} differs from data.shape={lshape}; valid: "
                        f"local_shape == data.shape unless flattened_range is set"
                    )
        else:
            if self.local_shape is None:
                raise ValueError(
                    f"{key!r}: local_shape=None with flattened_range={self.flattened_range}; "
                    f"valid: the shape of the local rectangle the flat range indexes"
                )
            lshape = _as_int_tuple(key, "local_shape", self.local_shape)
            rng = _as_int_tuple(key, "flattened_range", self.flattened_range)
            numel = math.prod(lshape)
            if len(rng) != 2 or not (0 <= rng[0] <= rng[1] <= numel):
                raise ValueError(
                    f"{key!r}: flattened_range={self.flattened_range} is not valid; valid: "
                    f"(start, stop) with 0 <= start <= stop <= {numel} (= prod(local_shape))"
                )
            if self.data.dim() != 1 or self.data.numel() != rng[1] - rng[0]:
                raise ValueError(
                    f"{key!r}: data.shape={tuple(self.data.shape)} with flattened_range={rng}; "
                    f"valid: a 1-D tensor of {rng[1] - rng[0]} elements"
                )
            object.__setattr__(self, "flattened_range", rng)
        object.__setattr__(self, "local_shape", lshape)
        if len(lshape) != len(gshape):
            raise ValueError(
                f"{key!r}: local_shape={lshape} has {len(lshape)} dims but global_shape={gshape} "
                f"has {len(gshape)}; valid: the same number of dims"
            )
        for d, (o, s, g) in enumerate(zip(goff, lshape, gshape)):
            if o + s > g:
                raise ValueError(
                    f"{key!r}: global_offset[{d}]={o} + local_shape[{d}]={s} exceeds "
                    f"global_shape[{d}]={g}; valid: offset + local size <= global size"
                )

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: tuple[int, int, int],
        replica_id: int = 0,
    ) -> ShardedTensor:
        """Describe an evenly split tensor: each ``(axis, rank, num_ranks)`` says ``data`` is
        piece ``rank`` of ``num_ranks`` equal pieces along ``axis``. Global size on that axis is
        ``data.shape[axis] * num_ranks``; axes not named are whole."""
        _check_key(key)
        if not isinstance(data, torch.Tensor):
            raise ValueError(f"{key!r}: data has type {type(data).__name__}; valid: a torch.Tensor")
        gshape = list(data.shape)
        goff = [0] * data.dim()
        seen: set[int] = set()
        for entry in rank_offsets:
            if len(entry) != 3:
                raise ValueError(
                    f"{key!r}: rank_offsets entry {entry!r} is not valid; "
                    f"valid: (axis, rank, num_ranks)"
                )
            axis, rank, num_ranks = (int(v) for v in entry)
            if not 0 <= axis < data.dim() or axis in seen:
                raise ValueError(
                    f"{key!r}: rank_offsets axis={axis} is not valid; valid: a distinct axis in "
                    f"[0, {data.dim()}) (data.dim()={data.dim()})"
                )
            if num_ranks < 1 or not 0 <= rank < num_ranks:
                raise ValueError(
                    f"{key!r}: rank_offsets (rank={rank}, num_ranks={num_ranks}) on axis {axis} "
                    f"is not valid; valid: num_ranks >= 1 and 0 <= rank < num_ranks"
                )
            seen.add(axis)
            gshape[axis] = data.shape[axis] * num_ranks
            goff[axis] = data.shape[axis] * rank
        return cls(key, data, tuple(gshape), tuple(goff), replica_id=replica_id)

    @classmethod
    def from_flattened(
        cls,
        key: str,
        flat_data: torch.Tensor,
        *,
        local_shape: tuple[int, ...],
        global_shape: tuple[int, ...],
        global_offset: tuple[int, ...],
        flattened_range: tuple[int, int],
        replica_id: int = 0,
    ) -> ShardedTensor:
        """Describe a ZeRO-style flat shard: ``flat_data`` (1-D) holds elements
        ``[start, stop)`` of the row-major flattening of the ``local_shape`` rectangle at
        ``global_offset`` of the ``global_shape`` tensor."""
        return cls(
            key,
            flat_data,
            tuple(global_shape),
            tuple(global_offset),
            replica_id=replica_id,
            local_shape=tuple(local_shape),
            flattened_range=tuple(flattened_range),
        )

    @property
    def is_flattened(self) -> bool:
        return self.flattened_range is not None

    def __repr__(self) -> str:
        flat = f", flattened_range={self.flattened_range}" if self.flattened_range else ""
        return (
            f"ShardedTensor(key={self.key!r}, dtype={self.data.dtype}, "
            f"global_shape={self.global_shape}, global_offset={self.global_offset}, "
            f"local_shape={self.local_shape}{flat}, replica_id={self.replica_id})"
        )


@dataclass(frozen=True, eq=False)
class ShardedObject:
    """A picklable value, one per cell of a ``global_shape`` grid of ranks' objects.

    ``global_shape=(1,)`` (default) means one object for the whole job, written by the rank
    with ``replica_id == 0``. For per-rank state (RNG states), use e.g.
    ``global_shape=(pp, tp)``, ``global_offset=(pp_rank, tp_rank)`` and a ``replica_id``
    that is non-zero on data-parallel replicas.
    """

    key: str
    data: Any
    global_shape: tuple[int, ...] = (1,)
    global_offset: tuple[int, ...] = (0,)
    replica_id: int = 0

    def __post_init__(self) -> None:
        _check_key(self.key)
        gshape = _as_int_tuple(self.key, "global_shape", self.global_shape)
        goff = _as_int_tuple(self.key, "global_offset", self.global_offset)
        if not gshape or any(g < 1 for g in gshape):
            raise ValueError(
                f"{self.key!r}: global_shape={gshape} is not valid; valid: a non-empty tuple "
                f"of ints >= 1"
            )
        if len(goff) != len(gshape) or any(o >= g for o, g in zip(goff, gshape)):
            raise ValueError(
                f"{self.key!r}: global_offset={goff} is not valid for global_shape={gshape}; "
                f"valid: one index per dim with 0 <= offset < size"
            )
        _check_replica_id(self.key, self.replica_id)
        object.__setattr__(self, "global_shape", gshape)
        object.__setattr__(self, "global_offset", goff)

    @property
    def unique_key(self) -> str:
        """Storage key of this cell: ``key/shard_<offset>_<shape>``."""
        off = ".".join(map(str, self.global_offset))
        shape = ".".join(map(str, self.global_shape))
        return f"{self.key}/shard_{off}_{shape}"
