"""``ParamIndexMap`` / ``BufferLayout`` as pure computation (meta tensors, no processes)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwork.dist_optimizer import BufferKey, BufferLayout, ParamIndexMap
from shardwork.parallel_state import ParamMeta, set_param_meta


def meta_params(shapes, dtype=torch.float32):
    return [torch.nn.Parameter(torch.empty(s, device="meta", dtype=dtype)) for s in shapes]


def test_buffers_split_by_dtype_and_expert_in_backward_order():
    params = meta_params([(4, 3), (5,), (2, 2)]) + meta_params([(3, 3)], torch.bfloat16)
    set_param_meta(params[1], ParamMeta(is_expert=True))
    pim = ParamIndexMap.build(
        params,
        dp_size=4,
        expert_dp_size=2,
        bucket_size=None,
        pad_for_dp=True,
        grad_dtype=lambda i, p: torch.float32,
    )
    dense = BufferKey("torch.float32", "torch.float32", False)
    expert = BufferKey("torch.float32", "torch.float32", True)
    bf16 = BufferKey("torch.bfloat16", "torch.float32", False)
    assert set(pim.buffers) == {dense, expert, bf16}
    assert [p.shape for p in pim.params[dense]] == [(2, 2), (4, 3)]  # reversed
    loc = pim.locate(params[0])
    assert (loc.key, loc.start, loc.end) == (dense, 4, 16)
    assert pim.buffers[expert].dp_size == 2
    assert pim.buffers[dense].numel % 4 == 0 and pim.buffers[dense].numel >= 16


def test_buckets_close_at_bucket_size_and_params_do_not_split():
    layout = BufferLayout.build([10, 10, 10, 25, 3], bucket_size=20, dp_size=1, pad_for_dp=False)
    assert [b.param_indices for b in layout.buckets] == [(0, 1), (2, 3), (4,)]
    assert [(b.start, b.end) for b in layout.buckets] == [(0, 20), (20, 55), (55, 58)]


def test_a_parameter_straddles_two_shards():
    layout = BufferLayout.build(
        [6, 10, 4], bucket_size=None, dp_size=2, pad_for_dp=True, pad_multiple=1
    )
    r0, r1 = layout.shard_pieces(0), layout.shard_pieces(1)
    assert [(p.param_index, p.param_start, p.param_end) for p in r0] == [(0, 0, 6), (1, 0, 4)]
    assert [(p.param_index, p.param_start, p.param_end) for p in r1] == [(1, 4, 10), (2, 0, 4)]


def test_duplicate_parameter_is_rejected():
    p = meta_params([(3,)])[0]
    with pytest.raises(ValueError, match="appears twice"):
        ParamIndexMap.build([p, p], dp_size=1)


@settings(max_examples=60, deadline=None)
@given(
    numels=st.lists(st.integers(1, 50), min_size=1, max_size=12),
    dp=st.integers(1, 8),
    bucket=st.one_of(st.none(), st.integers(1, 80)),
    pad=st.sampled_from([1, 4, 64]),
)
def test_shards_tile_every_parameter_exactly_once(numels, dp, bucket, pad):
    layout = BufferLayout.build(
        numels, bucket_size=bucket, dp_size=dp, pad_for_dp=True, pad_multiple=pad
    )
    covered = [torch.zeros(n, dtype=torch.int64) for n in numels]
    for r in range(dp):
        size = 0
        for piece in layout.shard_pieces(r):
            covered[piece.param_index][piece.param_start : piece.param_end] += 1
            assert piece.buffer_end - piece.buffer_start == piece.numel
        for b in layout.buckets:
            lo, hi = layout.shard_range(b.index, r)
            size += hi - lo
            assert b.numel % dp == 0
        assert size == layout.numel // dp
    assert all(bool((c == 1).all()) for c in covered)
    # padding is below one alignment unit per bucket
    import math

    assert layout.numel - sum(numels) < len(layout.buckets) * math.lcm(dp, pad)
