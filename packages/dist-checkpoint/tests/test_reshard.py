"""Save at 4 ranks (and at 1), load at 1, 2, 3 and 8 ranks with other shardings; every element
equal. The data files hold exactly the bytes the plan assigned to each rank.

The saved state (tp=2 x dp=2) has a 2x2-sharded 2-D tensor, tensors replicated over all ranks
and over DP, ZeRO-style flat shards (ranges crossing rows of 1-, 2- and 3-D rectangles),
per-rank and replicated objects and plain values. Global reference values come from a seeded
generator, so each rank checks its loaded pieces against slices of the same global tensors.
"""

import math
import os
from collections import defaultdict

import pytest
import torch

from shardwork.dist_checkpoint import ShardedObject, ShardedTensor, load, read_info, save
from shardwork.dist_checkpoint.cli import main
from shardwork.dist_checkpoint.testing import example_state

pytest.importorskip("shardwork.parallel_state")
from shardwork.parallel_state.testing import run_on_ranks

SHAPES = {
    "w2d": (8, 6),
    "bias": (10,),
    "tp_col": (6, 5),
    "opt.exp_avg.bias": (10,),
    "opt.exp_avg.tp_col": (6, 5),
    "opt.m3": (4, 4, 5),
}


def reference(key):
    gen = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(SHAPES[key], generator=gen, dtype=torch.float64)


def split_bounds(n, parts, idx):
    """Bounds of piece ``idx`` when ``n`` is split like torch.tensor_split."""
    base, extra = divmod(n, parts)
    start = idx * base + min(idx, extra)
    return start, start + base + (1 if idx < extra else 0)


def block(key, grid, coord, replica_id=0, fill=True):
    """ShardedTensor for block ``coord`` of a ``grid`` split of the global tensor."""
    ref = reference(key)
    slices, offset = [], []
    for d, (parts, idx) in enumerate(zip(grid, coord)):
        a, b = split_bounds(ref.shape[d], parts, idx)
        slices.append(slice(a, b))
        offset.append(a)
    local = ref[tuple(slices)].clone()
    data = local if fill else torch.full_like(local, float("nan"))
    return ShardedTensor(key, data, ref.shape, tuple(offset), replica_id=replica_id)


def flat(key, grid, coord, parts, idx, fill=True):
    """Flat shard ``idx`` of ``parts`` of block ``coord`` (a ZeRO-style optimizer shard)."""
    whole = block(key, grid, coord)
    numel = whole.data.numel()
    a, b = split_bounds(numel, parts, idx)
    data = whole.data.flatten()[a:b].clone()
    if not fill:
        data = torch.full_like(data, float("nan"))
    return ShardedTensor.from_flattened(
        key,
        data,
        local_shape=whole.local_shape,
        global_shape=whole.global_shape,
        global_offset=whole.global_offset,
        flattened_range=(a, b),
    )


def state(rank, world, tp, w2d_grid, *, fill):
    """Sharded state dict of ``rank`` in a tp x dp layout (dp = world // tp)."""
    dp = world // tp
    tp_rank, dp_rank = rank % tp, rank // tp
    w2d_coord = divmod(rank, w2d_grid[1])
    model = {
        "w2d": block("w2d", w2d_grid, w2d_coord, fill=fill),
        "bias": block("bias", (1,), (0,), replica_id=rank, fill=fill),
        "tp_col": block("tp_col", (tp, 1), (tp_rank, 0), replica_id=dp_rank, fill=fill),
    }
    optimizer = {
        "state": {
            "bias": flat("opt.exp_avg.bias", (1,), (0,), world, rank, fill=fill),
            "tp_col": flat("opt.exp_avg.tp_col", (tp, 1), (tp_rank, 0), dp, dp_rank, fill=fill),
            "m3": flat("opt.m3", (1, tp, 1), (0, tp_rank, 0), dp, dp_rank, fill=fill),
        },
        "param_groups": [{"lr": 0.25, "betas": (0.9, 0.95)}],
    }
    rng = ShardedObject(
        "rng", {"rank": rank % 4} if fill else None, (4,), (rank % 4,), replica_id=rank // 4
    )
    sched = ShardedObject("sched", {"step": 7} if fill else None, replica_id=rank)
    return {"model": model, "optimizer": optimizer, "rng": rng, "sched": sched, "iteration": 7}


def _save4(path):
    result = save(state(*_rank_world(), tp=2, w2d_grid=(2, 2), fill=True), path, layout={"tp": 2})
    return result.bytes_per_rank


def _save_on_ranks_1_and_3(path):
    import torch.distributed as dist

    group = dist.new_group([1, 3])
    if dist.get_rank() in (1, 3):
        rank = dist.get_rank(group)
        save(example_state(rank, 2, seed=1), path, group=group)


def _rank_world():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def _expected(st):
    ref = reference(st.key)
    local = ref[tuple(slice(o, o + s) for o, s in zip(st.global_offset, st.local_shape))]
    if st.flattened_range is not None:
        local = local.flatten()[st.flattened_range[0] : st.flattened_range[1]]
    return local


def _load_and_check(path, tp, w2d_grid):
    rank, world = _rank_world() if _dist_on() else (0, 1)
    template = state(rank, world, tp, w2d_grid, fill=False)
    out = load(template, path)
    bad = []
    for section in ("model",):
        for name, st in template[section].items():
            if not torch.equal(out[section][name], _expected(st)):
                bad.append(st.key)
    for name, st in template["optimizer"]["state"].items():
        if not torch.equal(out["optimizer"]["state"][name], _expected(st)):
            bad.append(st.key)
    if out["rng"] != {"rank": rank % 4} or out["sched"] != {"step": 7}:
        bad.append("objects")
    if out["optimizer"]["param_groups"] != [{"lr": 0.25, "betas": (0.9, 0.95)}]:
        bad.append("plain")
    if out["iteration"] != 7:
        bad.append("iteration")
    return bad


#: Bytes a data file holds per item beyond the tensor payload: each tensor chunk is one
#: ``torch.save``-format zip archive (`archive`: 4 records with local headers padded to 64-byte
#: alignment, data descriptors, central directory, end record and a ~150-byte pickle: about
#: 0.9 KiB; ``torch.save``'s own, used for unusual dtypes, about 1.6 KiB); objects and plain
#: values are pickled byte items of a few hundred bytes.
ITEM_OVERHEAD_MAX = 2048


def _check_files_against_plan(path, bytes_per_rank):
    """The plan's ``bytes_per_rank`` against the data files on disk, read back through DCP's
    own metadata (which item lies where in which file) and ``os.path.getsize``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(path).read_metadata()
    payload, items, extent = defaultdict(int), defaultdict(int), defaultdict(int)
    for index, where in meta.storage_data.items():
        name = where.relative_path
        items[name] += 1
        extent[name] = max(extent[name], where.offset + where.length)
        entry = meta.state_dict_metadata[index.fqn]
        if isinstance(entry, TensorStorageMetadata):
            chunk = next(c for c in entry.chunks if c.offsets == index.offset)
            nbytes = math.prod(chunk.sizes) * entry.properties.dtype.itemsize
            assert 0 <= where.length - nbytes <= ITEM_OVERHEAD_MAX, (index, where)
            payload[name] += nbytes
    files = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))
    assert files == [f"__{r}_0.distcp" for r in range(len(bytes_per_rank))]
    for rank, written in enumerate(bytes_per_rank):
        name = f"__{rank}_0.distcp"
        size = os.path.getsize(os.path.join(path, name))
        assert size == extent[name]  # the items tile the file: no byte unaccounted for
        assert payload[name] == written
        assert 0 <= size - written <= items[name] * ITEM_OVERHEAD_MAX


def _dist_on():
    import torch.distributed as dist

    return dist.is_initialized()


@pytest.mark.multirank
def test_save_at_4_load_at_1_2_3(tmp_path, capsys):
    path = str(tmp_path / "ckpt")
    bytes_per_rank = run_on_ranks(_save4, 4, args=(path,))[0]
    # replicated tensors are written once, spread over the ranks holding them
    total = sum(math.prod(s) for s in SHAPES.values()) * 8
    assert sum(bytes_per_rank) == total
    assert max(bytes_per_rank) < total / 2
    info = read_info(path)
    assert info["world_size"] == 4 and info["layout"] == {"tp": 2}
    assert info["group_ranks"] == [0, 1, 2, 3]
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "world size 4 (global ranks 0-3)" in out and "layout          tp=2" in out
    # a save by a subgroup records that group's size and global ranks
    sub = str(tmp_path / "sub")
    run_on_ranks(_save_on_ranks_1_and_3, 4, args=(sub,))
    sub_info = read_info(sub)
    assert sub_info["world_size"] == 2 and sub_info["group_ranks"] == [1, 3]
    assert main(["inspect", sub]) == 0
    assert "world size 2 (global ranks 1, 3)" in capsys.readouterr().out
    assert info["keys"]["w2d"]["global_shape"] == [8, 6]
    _check_files_against_plan(path, bytes_per_rank)

    assert _load_and_check(path, 1, (1, 1)) == []  # in this process, no torch.distributed
    assert run_on_ranks(_load_and_check, 2, args=(path, 1, (1, 2))) == [[]] * 2
    assert run_on_ranks(_load_and_check, 3, args=(path, 3, (3, 1))) == [[]] * 3


@pytest.mark.multirank
@pytest.mark.slow
def test_save_at_4_and_at_1_load_at_8_and_back_to_1(tmp_path):
    # slow only because growing the rank pool to 8 processes costs ~40 s on 2 cores
    path = str(tmp_path / "ckpt")
    run_on_ranks(_save4, 4, args=(path,))
    assert run_on_ranks(_load_and_check, 8, args=(path, 2, (4, 2))) == [[]] * 8

    # literally 1 -> 8: this process (no torch.distributed) saves, 8 ranks load
    path1 = str(tmp_path / "ckpt1")
    single = state(0, 1, 1, (1, 1), fill=True)
    # the one process holds every cell of the 4-cell RNG grid
    single["rng"] = [ShardedObject("rng", {"rank": i}, (4,), (i,)) for i in range(4)]
    save(single, path1)
    assert read_info(path1)["world_size"] == 1
    assert run_on_ranks(_load_and_check, 8, args=(path1, 4, (2, 4))) == [[]] * 8

    # and back: 8 ranks save (w2d 4x2, flat shards over dp=4), one process loads
    path8 = str(tmp_path / "ckpt8")
    run_on_ranks(_save_and_load_8, 8, args=(path8,))
    assert _load_and_check(path8, 1, (1, 1)) == []


def _save_and_load_8(path):
    rank, world = _rank_world()
    save(state(rank, world, 2, (4, 2), fill=True), path)


@pytest.mark.multirank
def test_plain_dcp_load_reads_a_shardwork_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt4")
    run_on_ranks(_save4, 4, args=(path,))

    import torch.distributed.checkpoint as dcp

    plain = {key: torch.zeros(shape, dtype=torch.float64) for key, shape in SHAPES.items()}
    dcp.load(plain, checkpoint_id=path)
    for key, tensor in plain.items():
        assert torch.equal(tensor, reference(key)), key
