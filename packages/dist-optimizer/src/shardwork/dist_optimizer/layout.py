"""Where every parameter lives: buffers, buckets and each data-parallel rank's shard.

Pure computation from the parameter list (shapes, dtypes, :class:`ParamMeta`), no processes,
so it is unit-testable for any data-parallel size (meta-device tensors are enough).

- Parameters are grouped into one contiguous buffer per :class:`BufferKey`
  ``(param_dtype, grad_dtype, is_expert)``; within a buffer they are laid out in *backward
  order* (reverse of registration order), so the first bucket holds the last layers, whose
  gradients are ready first.
- A buffer is cut into buckets of at least ``bucket_size`` elements (the last one may be
  smaller); a parameter never spans two buckets.
- With ``pad_for_dp=True`` (distributed optimizer) each bucket's length is padded up to a
  multiple of ``lcm(dp_size, pad_multiple)`` so that a reduce-scatter gives every rank an
  equal contiguous shard: rank ``r`` owns ``[start + r*S, start + (r+1)*S)`` of the bucket,
  ``S = padded_len / dp_size``. A parameter may straddle two ranks' shards.
- :class:`ParamIndexMap` is the ``param_index_map``: per parameter its buffer, its
  ``[start, end)`` in that buffer and its bucket; per (buffer, rank) the list of
  :class:`ShardPiece` (which flat range of which parameter the rank's shard holds).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shardwork.parallel_state import get_param_meta

__all__ = [
    "BucketRange",
    "BufferKey",
    "BufferLayout",
    "ParamIndexMap",
    "ParamLocation",
    "ShardPiece",
]


@dataclass(frozen=True, order=True)
class BufferKey:
    """Which buffer a parameter belongs to."""

    param_dtype: str
    """``str(torch.dtype)`` of the parameter, e.g. ``"torch.bfloat16"``."""
    grad_dtype: str
    """``str(torch.dtype)`` of the gradient buffer (``main_grad``)."""
    is_expert: bool
    """Expert buffers reduce over the expert-data-parallel group."""

    @property
    def torch_param_dtype(self) -> torch.dtype:
        return getattr(torch, self.param_dtype.removeprefix("torch."))

    @property
    def torch_grad_dtype(self) -> torch.dtype:
        return getattr(torch, self.grad_dtype.removeprefix("torch."))


@dataclass(frozen=True)
class BucketRange:
    """One bucket: ``[start, end)`` of the buffer (``end`` padded), parameters in it."""

    index: int
    start: int
    end: int
    param_indices: tuple[int, ...]
    """Indices into :attr:`BufferLayout.numels` (buffer order)."""

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter inside one rank's shard of one bucket."""

    param_index: int
    """Index into the buffer's parameter list (buffer order)."""
    param_start: int
    """First element, in the parameter's row-major flattening."""
    param_end: int
    buffer_start: int
    """Same range in buffer coordinates."""
    buffer_end: int
    bucket_index: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


@dataclass(frozen=True)
class BufferLayout:
    """Layout of one contiguous buffer: parameter ranges, buckets, shards."""

    numels: tuple[int, ...]
    """Element count of each parameter, in buffer (backward) order."""
    param_ranges: tuple[tuple[int, int], ...]
    """``[start, end)`` of each parameter in the buffer."""
    buckets: tuple[BucketRange, ...]
    dp_size: int
    padded: bool

    @property
    def numel(self) -> int:
        """Total buffer length including padding."""
        return self.buckets[-1].end if self.buckets else 0

    @classmethod
    def build(
        cls,
        numels: Sequence[int],
        *,
        bucket_size: int | None,
        dp_size: int,
        pad_for_dp: bool,
        pad_multiple: int = 64,
        isolated: Sequence[bool] | None = None,
    ) -> BufferLayout:
        """Lay out parameters of ``numels`` (already in buffer order) into buckets.

        ``bucket_size=None`` puts everything in one bucket. A parameter flagged in
        ``isolated`` gets a bucket of its own, so its shard boundaries depend only on its
        size and ``dp_size`` — the same on every pipeline stage that holds a copy of it.
        """
        if dp_size < 1:
            raise ValueError(f"dp_size={dp_size} must be >= 1")
        if bucket_size is not None and bucket_size < 1:
            raise ValueError(f"bucket_size={bucket_size} must be >= 1 or None (one bucket)")
        # Padded bucket lengths are divisible by dp_size (equal reduce-scatter shards) and by
        # pad_multiple.
        align = math.lcm(dp_size, pad_multiple) if pad_for_dp else 1
        ranges: list[tuple[int, int]] = []
        buckets: list[BucketRange] = []
        cursor = 0
        bucket_start = 0
        members: list[int] = []

        def close() -> None:
            nonlocal cursor, bucket_start, members
            # Round the bucket end up to the next multiple of align (ceil division).
            end = -(-cursor // align) * align
            buckets.append(BucketRange(len(buckets), bucket_start, end, tuple(members)))
            cursor = bucket_start = end
            members = []

        for index, numel in enumerate(numels):
            alone = bool(isolated[index]) if isolated is not None else False
            # An isolated parameter starts a fresh bucket and (below) closes it right after itself.
            if alone and members:
                close()
            ranges.append((cursor, cursor + int(numel)))
            cursor += int(numel)
            members.append(index)
            if alone or (bucket_size is not None and cursor - bucket_start >= bucket_size):
                close()
        if members:
            close()
        return cls(
            tuple(int(n) for n in numels), tuple(ranges), tuple(buckets), dp_size, pad_for_dp
        )

    def shard_range(self, bucket_index: int, dp_rank: int) -> tuple[int, int]:
        """``[start, end)`` in buffer coordinates of ``dp_rank``'s shard of a bucket."""
        bucket = self.buckets[bucket_index]
        if not self.padded:
            raise ValueError("shard_range needs a layout built with pad_for_dp=True")
        # Equal shards: the padded bucket length is a multiple of dp_size.
        size = bucket.numel // self.dp_size
        return bucket.start + dp_rank * size, bucket.start + (dp_rank + 1) * size

    def shard_pieces(self, dp_rank: int) -> list[ShardPiece]:
        """Every (parameter ∩ shard) of ``dp_rank``, in buffer order."""
        if not 0 <= dp_rank < self.dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, {self.dp_size})")
        pieces = []
        for bucket in self.buckets:
            lo, hi = self.shard_range(bucket.index, dp_rank)
            for index in bucket.param_indices:
                start, end = self.param_ranges[index]
                # The intersection of the parameter's range with the shard, if any.
                a, b = max(start, lo), min(end, hi)
                if a < b:
                    pieces.append(ShardPiece(index, a - start, b - start, a, b, bucket.index))
        return pieces


@dataclass(frozen=True)
class ParamLocation:
    """Where one parameter lives."""

    key: BufferKey
    index: int
    """Position in its buffer's parameter list (buffer order)."""
    start: int
    end: int
    bucket_index: int


class ParamIndexMap:
    """``param_index_map`` of a parameter list: buffers, buckets, locations and shards.

    Build it with :meth:`build`; it only reads shapes, dtypes and :class:`ParamMeta`.
    """

    def __init__(
        self,
        buffers: dict[BufferKey, BufferLayout],
        params: dict[BufferKey, list[torch.Tensor]],
    ) -> None:
        self.buffers = buffers
        """One :class:`BufferLayout` per buffer key, keys sorted."""
        self.params = params
        """Each buffer's parameters in buffer order."""
        self._where: dict[int, ParamLocation] = {}
        for key, layout in buffers.items():
            for bucket in layout.buckets:
                for index in bucket.param_indices:
                    p = params[key][index]
                    start, end = layout.param_ranges[index]
                    self._where[id(p)] = ParamLocation(key, index, start, end, bucket.index)

    @classmethod
    def build(
        cls,
        params: Sequence[torch.Tensor],
        *,
        dp_size: int,
        expert_dp_size: int | None = None,
        bucket_size: int | None = 40_000_000,
        pad_for_dp: bool = False,
        grad_dtype: Callable[[int, torch.Tensor], torch.dtype] | None = None,
        pad_multiple: int = 64,
    ) -> ParamIndexMap:
        """Lay out ``params`` (registration order) into buffers and buckets.

        ``grad_dtype(i, p)`` chooses the gradient-buffer dtype of parameter ``i``
        (default: the parameter's dtype). Expert parameters (``ParamMeta.is_expert``) are
        sharded over ``expert_dp_size`` ranks (default ``dp_size``). Duplicate parameters are a
        ValueError.
        """
        seen: set[int] = set()
        grouped: dict[BufferKey, list[torch.Tensor]] = {}
        for i, p in enumerate(params):
            if id(p) in seen:
                raise ValueError(
                    f"params[{i}] (shape {tuple(p.shape)}) appears twice; valid: each "
                    "parameter once (a shared parameter is registered once)"
                )
            seen.add(id(p))
            gdt = grad_dtype(i, p) if grad_dtype is not None else p.dtype
            key = BufferKey(str(p.dtype), str(gdt), bool(get_param_meta(p).is_expert))
            grouped.setdefault(key, []).append(p)
        buffers: dict[BufferKey, BufferLayout] = {}
        ordered: dict[BufferKey, list[torch.Tensor]] = {}
        # Sorted keys: the buffer order does not depend on which dtype the parameter list shows
        # first.
        for key in sorted(grouped):
            in_order = list(reversed(grouped[key]))  # backward order
            # Expert parameters are sharded over the expert-data-parallel group.
            size = (expert_dp_size or dp_size) if key.is_expert else dp_size
            buffers[key] = BufferLayout.build(
                [p.numel() for p in in_order],
                bucket_size=bucket_size,
                dp_size=size,
                pad_for_dp=pad_for_dp,
                pad_multiple=pad_multiple,
                # A weight shared across pipeline stages (tied embedding / head) is summed over
                # the embedding group after the data-parallel reduce-scatter; that sum is only
                # right on a rank's shard if both stages shard the weight identically.
                isolated=[get_param_meta(p).shared_embedding for p in in_order],
            )
            ordered[key] = in_order
        return cls(buffers, ordered)

    def locate(self, param: torch.Tensor) -> ParamLocation:
        """Buffer key, index, buffer range and bucket of ``param``."""
        try:
            return self._where[id(param)]
        except KeyError:
            raise ValueError(
                f"parameter of shape {tuple(param.shape)} is not in this map"
            ) from None

    def shard_pieces(self, key: BufferKey, dp_rank: int) -> list[ShardPiece]:
        """Pieces of ``dp_rank``'s shard in buffer ``key``."""
        return self.buffers[key].shard_pieces(dp_rank)
