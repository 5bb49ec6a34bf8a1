"""ShardedTensor / ShardedObject construction and validation."""

import pytest
import torch

from shardwork.dist_checkpoint import ShardedObject, ShardedTensor


def test_from_rank_offsets_computes_global_shape_and_offset():
    data = torch.randn(3, 5)
    st = ShardedTensor.from_rank_offsets("w", data, (0, 2, 4), (1, 1, 2), replica_id=1)
    assert st.global_shape == (12, 10)
    assert st.global_offset == (6, 5)
    assert st.local_shape == (3, 5)
    assert st.replica_id == 1
    assert st.data is data
    assert not st.is_flattened


def test_from_flattened():
    flat = torch.randn(7)
    st = ShardedTensor.from_flattened(
        "w",
        flat,
        local_shape=(4, 3),
        global_shape=(8, 3),
        global_offset=(4, 0),
        flattened_range=(2, 9),
    )
    assert st.is_flattened and st.flattened_range == (2, 9) and st.local_shape == (4, 3)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(global_shape=(4, 4), global_offset=(0,)), "global_offset"),
        (dict(global_shape=(4, 4), global_offset=(2, 0)), "global_offset"),
        (dict(global_shape=(4, -1), global_offset=(0, 0)), "global_shape"),
        (dict(global_shape=(4, 4), global_offset=(0, 0), replica_id=-1), "replica_id"),
        (dict(global_shape=(4, 4), global_offset=(0, 0), local_shape=(2, 2)), "local_shape"),
    ],
)
def test_bad_fields_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field) as err:
        ShardedTensor("my.key", torch.randn(3, 4), **kwargs)
    assert "my.key" in str(err.value)


def test_bad_flattened_range():
    with pytest.raises(ValueError, match="flattened_range"):
        ShardedTensor.from_flattened(
            "k",
            torch.randn(5),
            local_shape=(2, 2),
            global_shape=(2, 2),
            global_offset=(0, 0),
            flattened_range=(0, 5),
        )
    with pytest.raises(ValueError, match="1-D tensor of 3"):
        ShardedTensor.from_flattened(
            "k",
            torch.randn(5),
            local_shape=(2, 2),
            global_shape=(2, 2),
            global_offset=(0, 0),
            flattened_range=(1, 4),
        )
    with pytest.raises(ValueError, match="local_shape=None"):
        ShardedTensor("k", torch.randn(3), (4,), (0,), flattened_range=(0, 3))


def test_bad_rank_offsets():
    with pytest.raises(ValueError, match="axis=2"):
        ShardedTensor.from_rank_offsets("k", torch.randn(2, 2), (2, 0, 2))
    with pytest.raises(ValueError, match="rank=2, num_ranks=2"):
        ShardedTensor.from_rank_offsets("k", torch.randn(2, 2), (0, 2, 2))
    with pytest.raises(ValueError, match="key="):
        ShardedTensor.from_rank_offsets("", torch.randn(2, 2))


def test_sharded_object():
    obj = ShardedObject("rng", {"a": 1}, global_shape=(2, 4), global_offset=(1, 3))
    assert obj.unique_key == "rng/shard_1.3_2.4"
    with pytest.raises(ValueError, match="global_offset"):
        ShardedObject("rng", 1, global_shape=(2,), global_offset=(2,))
    with pytest.raises(ValueError, match="replica_id"):
        ShardedObject("rng", 1, replica_id=True)
