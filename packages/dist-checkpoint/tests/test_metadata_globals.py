"""The save-plan classes Megatron-Core's indexes carry in ``Metadata.all_local_plans`` decode
through the allow-list (by value and, for the enum, by name), equal to what plain pickle
builds; the Megatron-written fixtures are decoded in shardwork-models'
test_megatron_untrusted.py."""

import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from shardwork.dist_checkpoint.decode import decode_metadata
from shardwork.dist_checkpoint.metadata import CheckpointRefusedError


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


def test_an_index_written_under_python_3_13_names_pathlib_local(monkeypatch):
    """CPython 3.13 pickles a PosixPath as ``pathlib._local.PosixPath`` (DCP keeps the
    checkpoint path in ``storage_meta``): such an index decodes on every release, to the same
    path. The 3.13 pickle is made here from this Python's by renaming the module."""
    from pathlib import PosixPath

    from shardwork.dist_checkpoint import decode

    metadata = Metadata(state_dict_metadata={})
    metadata.all_local_plans = [PosixPath("/runs/a/step_000000004")]
    renamed = pickle.dumps(metadata, protocol=4)
    if b"pathlib._local" not in renamed:  # an older Python: name the module as 3.13 does
        renamed = renamed.replace(b"\x8c\x07pathlib\x94", b"\x8c\x0epathlib._local\x94")
    assert b"\x8c\x0epathlib._local\x94" in renamed
    decoded = decode_metadata(renamed, name="py313/.metadata")
    assert decoded.all_local_plans == [PosixPath("/runs/a/step_000000004")]
    assert type(decoded.all_local_plans[0]) is PosixPath
    monkeypatch.setattr(decode, "_MODULE_ALIASES", {})
    with pytest.raises(CheckpointRefusedError, match=r"pathlib\._local\.PosixPath is not allowed"):
        decode_metadata(renamed, name="py313/.metadata")
