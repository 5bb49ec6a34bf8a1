"""Flat ranges decompose into at most 2*ndim-1 boxes that are contiguous slices, in order."""

import math
import random

import pytest
import torch

from shardwork.dist_checkpoint.boxes import boxes_overlap, flat_range_boxes


def test_flat_range_boxes_cover_exactly_the_range_in_order():
    rnd = random.Random(0)
    for _ in range(2000):
        ndim = rnd.randint(0, 4)
        shape = tuple(rnd.randint(1, 5) for _ in range(ndim))
        numel = math.prod(shape)
        start = rnd.randint(0, numel)
        stop = rnd.randint(start, numel)
        boxes = flat_range_boxes(shape, start, stop)
        assert len(boxes) <= max(2 * ndim - 1, 1)
        index = torch.arange(numel).reshape(shape)
        seen = []
        for (offsets, sizes), flat_start in boxes:
            piece = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            assert piece.flatten().tolist() == list(range(flat_start, flat_start + piece.numel()))
            seen += piece.flatten().tolist()
        assert seen == list(range(start, stop))


def test_examples():
    # (4, 3) flat [2, 10): tail of row 0, rows 1-2, head of row 3
    assert flat_range_boxes((4, 3), 2, 10) == [
        (((0, 2), (1, 1)), 2),
        (((1, 0), (2, 3)), 3),
        (((3, 0), (1, 1)), 9),
    ]
    assert flat_range_boxes((4, 3), 3, 9) == [(((1, 0), (2, 3)), 3)]
    assert flat_range_boxes((), 0, 1) == [(((), ()), 0)]
    assert flat_range_boxes((4, 3), 5, 5) == []
    with pytest.raises(ValueError, match="flat range"):
        flat_range_boxes((4, 3), 5, 13)


def test_boxes_overlap():
    assert boxes_overlap(((0, 0), (2, 2)), ((1, 1), (2, 2)))
    assert not boxes_overlap(((0, 0), (2, 2)), ((2, 0), (2, 2)))
    assert not boxes_overlap(((0, 0), (2, 0)), ((0, 0), (2, 2)))
