"""Rectangles ("boxes") of an n-D tensor and the mapping of flat ranges onto them.

DCP stores rectangular chunks only. A ZeRO-style flat shard holds elements ``[start, stop)``
of the row-major flattening of a rectangle; such a range is the disjoint union of at most
``2 * ndim - 1`` sub-rectangles, each of which is a *contiguous* slice of the flat data
(row-major order is preserved inside every piece):

    a partial first row   |   whole rows   |   a partial last row

applied recursively on the trailing dims. `flat_range_boxes` computes that decomposition;
save writes each piece as a DCP chunk and load reads each piece into a view of the flat data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["boxes_overlap", "flat_range_boxes"]

Box = tuple[tuple[int, ...], tuple[int, ...]]


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[Box, int]]:
    """Split elements ``[start, stop)`` of the row-major flattening of ``shape`` into boxes.

    Returns ``[((offsets, sizes), flat_start), ...]`` in increasing flat order, where the box
    holds exactly the flat elements ``[flat_start, flat_start + prod(sizes))``.
    """
    shape = tuple(int(s) for s in shape)
    if not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(
            f"flat range ({start}, {stop}) is not valid for shape {shape}; "
            f"valid: 0 <= start <= stop <= {math.prod(shape)}"
        )
    return [((off, sizes), flat) for off, sizes, flat in _split(shape, start, stop)]


def _split(
    shape: tuple[int, ...], start: int, stop: int
) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Boxes covering flat ``[start, stop)`` of ``shape``; flat starts relative to ``shape``."""
    if start >= stop:
        return []
    if not shape:  # a scalar: the only non-empty range is (0, 1)
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    # Rows of the leading dim the range touches, and its offsets inside the first and last row.
    first_row, last_row = start // inner, (stop - 1) // inner
    head, tail = start % inner, stop % inner

    def row(r: int, lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        return [
            ((r, *off), (1, *sizes), flat + r * inner)
            for off, sizes, flat in _split(shape[1:], lo, hi)
        ]

    # The range lies inside one row (not whole): recurse into that row alone.
    if first_row == last_row and (head or tail):
        return row(first_row, head, stop - first_row * inner)
    out = row(first_row, head, inner) if head else []
    full_begin = first_row + 1 if head else first_row
    full_end = last_row if tail else last_row + 1
    if full_end > full_begin:
        offsets = (full_begin,) + (0,) * (len(shape) - 1)
        out.append((offsets, (full_end - full_begin, *shape[1:]), full_begin * inner))
    if tail:
        out += row(last_row, 0, tail)
    return out


def boxes_overlap(a: Box, b: Box) -> bool:
    """Whether two boxes (offsets, sizes) share at least one element."""
    # An empty box shares no element with anything.
    if any(s == 0 for s in a[1]) or any(s == 0 for s in b[1]):
        return False
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1]):
        # Disjoint along one dimension is enough to share no element.
        if ao >= bo + bsz or bo >= ao + asz:
            return False
    return True
