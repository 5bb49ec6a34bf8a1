"""ParamMeta: one setter/getter pair, defaults for unmarked parameters, invalid combinations
refused; the description carried onto a replacing parameter; an FSDP shard's rows."""

import pytest
import torch

from shardwork.parallel_state import (
    ParamMeta,
    carry_param_attributes,
    get_param_meta,
    has_param_meta,
    row_shard,
    set_param_meta,
)
from shardwork.parallel_state.testing import run_on_ranks


def test_default_is_replicated_dense():
    param = torch.nn.Parameter(torch.randn(3))
    meta = get_param_meta(param)
    assert meta == ParamMeta()
    assert meta.tp_axis is None and not meta.is_expert and not meta.sequence_parallel


def test_set_and_get_round_trip_and_survive_module_moves():
    linear = torch.nn.Linear(4, 6)
    meta = ParamMeta(tp_axis=0, tp_partition_sizes=(3, 3), is_expert=True)
    assert set_param_meta(linear.weight, meta) is linear.weight
    linear.to(torch.float64)
    assert get_param_meta(linear.weight) is meta
    assert get_param_meta(linear.bias) == ParamMeta()


def test_invalid_combinations():
    with pytest.raises(ValueError, match="tp_partition_sizes needs tp_axis"):
        ParamMeta(tp_partition_sizes=(2, 2))
    with pytest.raises(ValueError, match="sequence_parallel=True with tp_axis=0"):
        ParamMeta(tp_axis=0, sequence_parallel=True)
    with pytest.raises(TypeError, match="must be a ParamMeta"):
        set_param_meta(torch.zeros(1), {"tp_axis": 0})


def test_has_param_meta_tells_a_described_parameter_from_the_default():
    plain = torch.nn.Parameter(torch.randn(3))
    described = set_param_meta(torch.nn.Parameter(torch.randn(3)), ParamMeta())
    assert not has_param_meta(plain) and get_param_meta(plain) == ParamMeta()
    assert has_param_meta(described)


def test_carry_param_attributes_copies_every_shardwork_attribute_onto_the_replacement():
    old = set_param_meta(torch.nn.Parameter(torch.randn(4, 2)), ParamMeta(tp_axis=1))
    old._shardwork_init = "scaled_normal"  # another package's description
    old.unrelated = "kept where it was"
    new = torch.nn.Parameter(torch.randn(4, 2))
    assert not has_param_meta(new)
    assert carry_param_attributes(old, new) == 2
    assert get_param_meta(new) is get_param_meta(old) and new._shardwork_init == "scaled_normal"
    assert not hasattr(new, "unrelated")


def _row_shards(rows: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = DeviceMesh.from_group(dist.group.WORLD, device_type="cpu")
    full = torch.arange(rows * 2, dtype=torch.float64).view(rows, 2)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    shard = row_shard(sharded)
    local_equal = torch.equal(shard.local, full[shard.start : shard.stop])
    shard.local.add_(100.0)  # a write through the view reaches the DTensor
    written = sharded.full_tensor()
    with pytest.raises(ValueError, match=r"valid: \(Shard\(dim=0\),\)"):
        row_shard(distribute_tensor(full, mesh, [Replicate()]))
    return shard.start, shard.stop, shard.num_rows, local_equal, bool((written >= 100).all())


@pytest.mark.multirank
@pytest.mark.parametrize("rows", [7, 2])
def test_row_shard_gives_torch_chunks_rows_and_a_writable_view(rows):
    results = run_on_ranks(_row_shards, 3, args=(rows,))
    # torch.chunk's split of the row indices, padded with empty chunks for trailing ranks
    chunks = list(torch.arange(rows).chunk(3)) + [torch.arange(0)] * 3
    for rank, (start, stop, num_rows, local_equal, written) in enumerate(results):
        want = chunks[rank]
        assert (stop - start) == len(want) and num_rows == rows
        if len(want):
            assert (start, stop) == (int(want[0]), int(want[-1]) + 1)
        assert local_equal and written
    assert row_shard(torch.zeros(3)) is None
