"""One-process round trips of unusual leaves: dtypes, scalars, empty tensors, non-contiguous
views, dtype casts on load, nested lists/tuples of plain values."""

import torch

from shardwork.dist_checkpoint import ShardedObject, ShardedTensor, load, save


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
