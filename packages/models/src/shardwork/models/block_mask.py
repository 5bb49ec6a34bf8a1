"""Which keys each query attends, as query segments over contiguous key ranges (no ``[s, s]`` mask).

Masked attention here is always causal on global token indices, cut by packed-document
boundaries and, for sliding-window layers, by a window. Such a mask is fully described by a few
integers per contiguous run of queries, so it is never materialised:

- A :class:`QuerySegment` is local queries ``[start, stop)`` at global token indices
  ``position, position + 1, ...``, all inside one document. Query ``i`` of it attends key ``j``
  of the range ``[key_start, position + (stop - start))`` when ``0 <= (position + i) - j``
  (causal) and ``(position + i) - j < window`` (sliding layers only). ``key_start`` is the
  document's start, or the window's first key when that is later.
- Keys are indexed by global token index: at cp > 1 the all-gathered keys are put back in
  position order first (:func:`~shardwork.models.context_parallel.gather_in_position_order`),
  so every segment's keys are one contiguous slice.
- Segments never straddle a context-parallel chunk or a document boundary, so each splits into
  at most two mask-free pieces (:meth:`QuerySegment.pieces`): keys before the segment, which
  every query attends ("full"), and the segment's own positions, causal and aligned
  ("causal", SDPA's ``is_causal``). Only a sliding-window segment whose key span is longer
  than the window keeps an explicit mask ("banded"); :func:`build_block_mask` cuts those into tiles
  of at most ``tile`` queries, so that mask is at most ``tile x (tile + window - 1)``.
- :func:`build_block_mask` builds the mask of one cp rank's queries from ``cu_seqlens``, the cp
  layout and the window; :meth:`BlockMask.to_dense` materialises it for tests and inspection
  (the attention path never calls it).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

__all__ = ["BANDED_TILE", "BlockMask", "KeyPiece", "QuerySegment", "build_block_mask"]

BANDED_TILE = 256
"""Queries per tile of a sliding-window segment that needs an explicit (banded) mask."""


class KeyPiece(NamedTuple):
    """Keys ``[start, stop)`` of one segment, attended ``"full"`` (every query, every key),
    ``"causal"`` (square and aligned with the segment: SDPA's ``is_causal``) or ``"banded"``
    (the segment's explicit window mask, :meth:`QuerySegment.allowed`)."""

    start: int
    stop: int
    kind: Literal["full", "causal", "banded"]


@dataclass(frozen=True)
class QuerySegment:
    """Local queries ``[start, stop)`` at global indices from ``position``, attending keys from
    ``key_start`` up to their own index (see the module docstring)."""

    start: int
    stop: int
    position: int
    key_start: int

    @property
    def key_stop(self) -> int:
        """One past the last key any query of the segment attends (the last query's index)."""
        return self.position + self.stop - self.start

    def pieces(self, window: int | None) -> tuple[KeyPiece, ...]:
        """The mask-free pieces of the segment's keys, or one banded piece (see module doc)."""
        span = self.key_stop - self.key_start
        if window is not None and span > window:
            return (KeyPiece(self.key_start, self.key_stop, "banded"),)
        causal = KeyPiece(self.position, self.key_stop, "causal")
        if self.key_start == self.position:
            return (causal,)
        return (KeyPiece(self.key_start, self.position, "full"), causal)

    def allowed(self, window: int | None, device: torch.device | str | None = None) -> torch.Tensor:
        """Boolean ``[stop - start, key_stop - key_start]``: True where query i attends key j."""
        queries = torch.arange(self.position, self.key_stop, device=device)
        keys = torch.arange(self.key_start, self.key_stop, device=device)
        back = queries.unsqueeze(1) - keys.unsqueeze(0)
        allowed = back >= 0
        if window is not None:
            allowed &= back < window
        return allowed


@dataclass(frozen=True)
class BlockMask:
    """The attention mask of ``num_queries`` local queries over ``num_keys`` keys (global order).

    ``segments`` cover the queries in order; ``window`` is the sliding window (None: global).
    """

    segments: tuple[QuerySegment, ...]
    num_queries: int
    num_keys: int
    window: int | None = None

    def __post_init__(self) -> None:
        covered = 0
        for seg in self.segments:
            # Internal invariant: build_block_mask makes segments in query order, each non-empty and
            # ending at or before its own last key.
            assert seg.start == covered and seg.stop > seg.start, self.segments
            assert 0 <= seg.key_start <= seg.position and seg.key_stop <= self.num_keys
            covered = seg.stop
        assert covered == self.num_queries, (covered, self.num_queries)

    def to_dense(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Boolean ``[num_queries, num_keys]`` (True = attend), for tests and inspection only."""
        dense = torch.zeros(self.num_queries, self.num_keys, dtype=torch.bool, device=device)
        for seg in self.segments:
            dense[seg.start : seg.stop, seg.key_start : seg.key_stop] = seg.allowed(
                self.window, device
            )
        return dense


def _checked_boundaries(cu_seqlens: torch.Tensor | None, total: int) -> list[int]:
    """Document boundaries ``[0, ..., total]`` from ``cu_seqlens`` (whole sequence if None)."""
    if cu_seqlens is None:
        return [0, total]
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens.shape={tuple(cu_seqlens.shape)} must be 1-D [num_docs + 1] with at "
            "least one document"
        )
    cu = [int(x) for x in cu_seqlens.tolist()]
    if cu[0] != 0 or any(b < a for a, b in itertools.pairwise(cu)):
        raise ValueError(f"cu_seqlens={cu} must start at 0 and be non-decreasing")
    if cu[-1] != total:
        raise ValueError(
            f"cu_seqlens[-1]={cu[-1]} must equal the packed sequence length {total} (the whole "
            "sequence, all context-parallel ranks together)"
        )
    # Empty documents (repeated boundaries) hold no tokens: drop them.
    return sorted(set(cu))


def _rank_ranges(local_len: int, cp_rank: int, cp_size: int) -> list[tuple[int, int]]:
    """``(local start, global start)`` of each of the rank's contiguous query runs (one at
    cp 1, two equal chunks at cp > 1)."""
    if cp_size == 1:
        return [(0, 0)]
    chunk = local_len // 2
    # The load-balanced layout of context_parallel.slice_for_context_parallel: chunk cp_rank,
    # then chunk 2cp-1-cp_rank.
    return [(0, cp_rank * chunk), (chunk, (2 * cp_size - 1 - cp_rank) * chunk)]


def _window_tiles(seg: QuerySegment, doc_start: int, window: int | None, tile: int):
    """``seg`` itself, or its tiles of at most ``tile`` queries when its keys outrun the window."""
    if window is None or seg.key_stop - doc_start <= window:
        return [seg]
    tiles = []
    for start in range(seg.start, seg.stop, tile):
        stop = min(start + tile, seg.stop)
        position = seg.position + start - seg.start
        key_start = max(doc_start, position - window + 1)
        tiles.append(QuerySegment(start, stop, position, key_start))
    return tiles


def build_block_mask(
    local_len: int,
    *,
    cp_rank: int = 0,
    cp_size: int = 1,
    cu_seqlens: torch.Tensor | None = None,
    window: int | None = None,
    tile: int = BANDED_TILE,
) -> BlockMask | None:
    """The mask of a cp rank's ``local_len`` queries; None when it is plain causal attention
    over the rank's own keys (cp 1, one document, no window), which SDPA's ``is_causal`` does.

    ``cu_seqlens``: ``[num_docs + 1]`` global document boundaries of the whole (packed)
    sequence of ``local_len · cp_size`` tokens. ``window``: a sliding window (keys with
    ``q - k < window``, Hugging Face's rule); ``tile``: queries per banded tile.
    """
    if cp_size > 1 and local_len % 2 != 0:
        raise ValueError(
            f"local sequence length {local_len} at cp={cp_size} must hold two equal chunks"
        )
    if window is not None and window < 1:
        raise ValueError(f"window={window} must be >= 1 (or None for global attention)")
    if tile < 1:
        raise ValueError(f"tile={tile} must be >= 1")
    total = local_len * cp_size
    bounds = _checked_boundaries(cu_seqlens, total)
    if cp_size == 1 and len(bounds) == 2 and window is None:
        return None
    run = local_len // len(_rank_ranges(local_len, cp_rank, cp_size))
    segments = []
    for local_start, first in _rank_ranges(local_len, cp_rank, cp_size):
        last = first + run
        # Cut the run at every document boundary inside it; each piece's keys start at its
        # document's start.
        cuts = [first, *(b for b in bounds if first < b < last), last]
        for lo, hi in itertools.pairwise(cuts):
            doc_start = bounds[bisect.bisect_right(bounds, lo) - 1]
            seg = QuerySegment(local_start + lo - first, local_start + hi - first, lo, doc_start)
            segments.extend(_window_tiles(seg, doc_start, window, tile))
    return BlockMask(tuple(segments), local_len, total, window)
