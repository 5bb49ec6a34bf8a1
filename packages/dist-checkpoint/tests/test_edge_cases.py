"""One-process round trips of unusual leaves: dtypes, scalars, empty tensors, non-contiguous
views, dtype casts on load (within a kind of dtype; across kinds refused), nested lists/tuples
of plain values."""

import re

import pytest
import torch

from shardwork.dist_checkpoint import (
    CheckpointMismatchError,
    ShardedObject,
    ShardedTensor,
    load,
    save,
)


def test_round_trip_of_unusual_leaves(tmp_path):
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(6, 4, generator=gen)
    values = {
        "bf16": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
        "int64": torch.randint(-100, 100, (7,), generator=gen),
        "bool": torch.rand(4, 2, generator=gen) > 0.5,
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "transposed": base.t(),  # non-contiguous source
    }
    state = {
        "t": {k: ShardedTensor.from_rank_offsets(k, v) for k, v in values.items()},
        "flat_scalar": ShardedTensor.from_flattened(
            "flat_scalar",
            torch.tensor([7.0]),
            local_shape=(),
            global_shape=(),
            global_offset=(),
            flattened_range=(0, 1),
        ),
        "plain": {"tuple": (1, "a", [2.0, None]), "tensor": torch.arange(3)},
        "obj": ShardedObject("obj", {"nested": [1, 2, {"x": torch.ones(2)}]}),
    }
    save(state, tmp_path / "c")

    target = base.clone().zero_()
    template = {
        "t": {
            k: ShardedTensor.from_rank_offsets(
                k, torch.zeros_like(v, memory_format=torch.contiguous_format)
            )
            for k, v in values.items()
            if k != "transposed"
        },
        "flat_scalar": ShardedTensor.from_flattened(
            "flat_scalar",
            torch.zeros(1),
            local_shape=(),
            global_shape=(),
            global_offset=(),
            flattened_range=(0, 1),
        ),
        "plain": {"tuple": (0, "", [0.0, 0]), "tensor": None},
        "obj": ShardedObject("obj", None),
    }
    # load the transposed tensor into a non-contiguous view, cast to float64
    template["t"]["transposed"] = ShardedTensor.from_rank_offsets("transposed", target.t())
    template["t"]["bf16"] = ShardedTensor.from_rank_offsets("bf16", torch.zeros(3, 5))  # fp32
    out = load(template, tmp_path / "c")
    for k, v in values.items():
        assert torch.equal(out["t"][k].to(v.dtype), v), k
    assert torch.equal(target, base)  # filled through the view
    assert out["t"]["bf16"].dtype == torch.float32
    assert out["flat_scalar"].item() == 7.0
    assert out["plain"]["tuple"] == (1, "a", [2.0, None])
    assert torch.equal(out["plain"]["tensor"], torch.arange(3))
    assert out["obj"]["nested"][:2] == [1, 2] and torch.equal(
        out["obj"]["nested"][2]["x"], torch.ones(2)
    )


def test_thread_count_writes_one_file_per_thread(tmp_path):
    from shardwork.dist_checkpoint import read_info, verify

    tensors = {f"w{i}": torch.randn(64, 16) for i in range(6)}
    save(
        {k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()},
        tmp_path / "c",
        thread_count=3,
    )
    files = sorted(read_info(tmp_path / "c")["files"])
    assert files == [".metadata", "__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
    assert verify(tmp_path / "c")["files"] == 4
    template = {k: ShardedTensor.from_rank_offsets(k, torch.zeros(64, 16)) for k in tensors}
    out = load(template, tmp_path / "c")
    assert all(torch.equal(out[k], v) for k, v in tensors.items())


def _dtype_state(dtypes: dict[str, torch.dtype], fill: float) -> dict[str, ShardedTensor]:
    return {
        k: ShardedTensor.from_rank_offsets(k, torch.full((3,), fill).to(dtype))
        for k, dtype in dtypes.items()
    }


SAVED_DTYPES = {
    "f32": torch.float32,
    "i64": torch.int64,
    "b": torch.bool,
    "c64": torch.complex64,
}


@pytest.mark.parametrize(
    ("key", "wanted", "saved_text", "wanted_text"),
    [
        ("f32", torch.int64, "torch.float32 (floating point)", "torch.int64 (integer)"),
        ("f32", torch.bool, "torch.float32 (floating point)", "torch.bool (bool)"),
        ("i64", torch.float32, "torch.int64 (integer)", "torch.float32 (floating point)"),
        ("b", torch.uint8, "torch.bool (bool)", "torch.uint8 (integer)"),
        ("c64", torch.float64, "torch.complex64 (complex)", "torch.float64 (floating point)"),
    ],
)
def test_a_dtype_of_another_kind_is_refused_before_reading(
    tmp_path, key, wanted, saved_text, wanted_text
):
    """Casting on copy would truncate (2.5 -> 2), saturate (into bool) or drop a part: refused
    whatever ``strict``, naming the key and both dtypes, with the template untouched."""
    save(_dtype_state(SAVED_DTYPES, 2.5), tmp_path / "c")
    template = _dtype_state({key: wanted}, 7)
    expected = f"{key!r}: checkpoint has dtype {saved_text}, template has dtype {wanted_text}"
    with pytest.raises(CheckpointMismatchError, match=re.escape(expected)) as info:
        load(template, tmp_path / "c", strict=False)
    assert info.value.mismatched == [(key, f"dtype {saved_text}", f"dtype {wanted_text}")]
    assert torch.equal(template[key].data, torch.full((3,), 7).to(wanted))


def test_dtypes_of_one_kind_are_cast_on_load(tmp_path):
    save(_dtype_state(SAVED_DTYPES, 2.5), tmp_path / "c")
    wanted = {"f32": torch.bfloat16, "i64": torch.int32, "b": torch.bool, "c64": torch.complex128}
    out = load(_dtype_state(wanted, 0), tmp_path / "c")
    assert torch.equal(out["f32"], torch.full((3,), 2.5, dtype=torch.bfloat16))
    assert torch.equal(out["i64"], torch.full((3,), 2, dtype=torch.int32))  # saved as 2
    assert out["b"].all() and torch.equal(
        out["c64"], torch.full((3,), 2.5 + 0j).to(torch.complex128)
    )
