"""The save-plan classes Megatron-Core's indexes carry in ``Metadata.all_local_plans`` decode
through the allow-list (by value and, for the enum, by name), equal to what plain pickle
builds; the Megatron-written fixtures are decoded in shardwork-models'
test_megatron_untrusted.py."""

import pickle

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from shardwork.dist_checkpoint.decode import decode_metadata


class _ByName:
    """Pickles as ``getattr(WriteItemType, name)``: an enum member pickled by name."""

    def __reduce__(self):
        return getattr, (WriteItemType, "SHARD")


def test_save_plans_in_all_local_plans_decode():
    item = WriteItem(
        index=MetadataIndex("w", torch.Size([0, 0])),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3])),
            properties=TensorProperties(dtype=torch.float32),
            size=torch.Size([2, 3]),
        ),
    )
    metadata = Metadata(state_dict_metadata={})
    metadata.all_local_plans = [SavePlan([item])]  # an attribute Megatron-Core sets
    decoded = decode_metadata(pickle.dumps(metadata), name="megatron/.metadata")
    assert decoded.all_local_plans == metadata.all_local_plans
    assert decoded.all_local_plans[0].items[0].type is WriteItemType.SHARD
    metadata.all_local_plans = [_ByName()]
    decoded = decode_metadata(pickle.dumps(metadata), name="megatron/.metadata")
    assert decoded.all_local_plans == [WriteItemType.SHARD]


def test_tensor_properties_of_a_newer_torch_decode_under_an_older_one(monkeypatch):
    """torch 2.15 appended ``strides`` to TensorProperties' pickled state; an older torch's
    class takes five values. The decoder's stand-in drops the sixth and leaves a plain
    TensorProperties (under torch < 2.15 the fixtures' tests run this path for real)."""
    from shardwork.dist_checkpoint import decode

    properties = TensorProperties(dtype=torch.bfloat16, requires_grad=True)
    state = properties.__getstate__()
    metadata = Metadata(state_dict_metadata={})
    metadata.all_local_plans = [properties]
    raw = pickle.dumps(metadata)
    monkeypatch.setattr(decode, "_TENSOR_PROPERTIES", decode._TensorPropertiesOfANewerTorch)
    monkeypatch.setattr(TensorProperties, "__setstate__", _five_values_only(TensorProperties))
    (decoded,) = decode_metadata(raw, name="newer/.metadata").all_local_plans
    assert type(decoded) is TensorProperties
    assert (decoded.dtype, decoded.requires_grad, decoded.layout) == (
        torch.bfloat16,
        True,
        torch.strided,
    )
    assert len(state) in (5, 6)


def _five_values_only(cls):
    """An older torch's ``__setstate__``: exactly five values, or "too many values"."""
    original = cls.__setstate__

    def setstate(self, state):
        dtype, layout, requires_grad, memory_format, pin_memory = state
        original(self, (dtype, layout, requires_grad, memory_format, pin_memory))

    return setstate
