"""ParamMeta: one setter/getter pair, defaults for unmarked parameters, invalid combinations refused."""

import pytest
import torch

from shardwork.parallel_state import ParamMeta, get_param_meta, set_param_meta


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
