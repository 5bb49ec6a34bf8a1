"""The fast read path: blob parsing, and each read path (direct, scatter, staged, fallback)
filling templates with exactly the saved values, at 1, 2 and 4 ranks.

References are independent of the reader: ``torch.load`` of the same bytes for blob parsing,
slices of seeded global tensors for loads.
"""

import io

import pytest
import torch

from shardwork.dist_checkpoint import ShardedTensor, load, save
from shardwork.dist_checkpoint import reader as reader_module
from shardwork.dist_checkpoint.blob import HEAD_BYTES, parse_tensor_blob
from shardwork.dist_checkpoint.testing import TENSOR_CASES, seeded


def _blob(value):
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("name", sorted(TENSOR_CASES))
def test_parse_tensor_blob_locates_the_storage_bytes(name):
    tensor = TENSOR_CASES[name]()
    raw = _blob(tensor)
    stored = parse_tensor_blob(raw[:HEAD_BYTES], len(raw))
    assert stored is not None
    loaded = torch.load(io.BytesIO(raw), weights_only=True)
    assert stored.dtype == loaded.dtype
    assert stored.size == tuple(loaded.shape)
    assert stored.stride == loaded.stride()
    assert stored.storage_offset == loaded.storage_offset()
    nbytes = loaded.untyped_storage().nbytes()
    storage = torch.frombuffer(
        bytearray(raw[stored.data_offset : stored.data_offset + nbytes]), dtype=torch.uint8
    ).view(stored.dtype)
    rebuilt = storage.as_strided(stored.size, stored.stride, stored.storage_offset)
    assert torch.equal(rebuilt, tensor)


def test_parse_tensor_blob_returns_none_for_what_it_cannot_read():
    tensor = torch.randn(16, 16, generator=seeded(8))
    raw = _blob(tensor)
    assert parse_tensor_blob(raw[:HEAD_BYTES], len(raw)) is not None
    assert parse_tensor_blob(raw[:60], len(raw)) is None  # head ends inside the pickle
    assert parse_tensor_blob(raw[:HEAD_BYTES], 200) is None  # data past the blob's end
    dict_blob = _blob({"a": tensor})
    assert parse_tensor_blob(dict_blob[:HEAD_BYTES], len(dict_blob)) is None
    assert parse_tensor_blob(b"not a zip archive", 17) is None


def _single_state(template):
    """One process, one chunk per tensor: values from seeded generators."""
    ref = {
        "exact": torch.randn(64, 48, generator=seeded(10)),
        "cast": torch.randn(32, 16, generator=seeded(11)),
        "strided": torch.randn(40, 24, generator=seeded(12)),
    }
    if not template:
        return ref, {k: ShardedTensor.from_rank_offsets(k, v.clone()) for k, v in ref.items()}
    state = {
        "exact": ShardedTensor.from_rank_offsets("exact", torch.zeros(64, 48)),
        "cast": ShardedTensor.from_rank_offsets("cast", torch.zeros(32, 16, dtype=torch.float64)),
        # a transposed buffer: the destination is not contiguous, its runs are 4 bytes
        "strided": ShardedTensor.from_rank_offsets("strided", torch.zeros(24, 40).t()),
    }
    return ref, state


def test_a_damaged_head_cannot_make_the_parser_allocate_what_it_claims():
    """The head is parsed before its file's CRC-32 is compared. One flipped bit turned a
    ``BINPUT`` into ``LONG_BINPUT`` (``q`` -> ``r``) whose 4-byte index the C unpickler sized its
    memo by (30 GB asked for in the bit-flip sweep, which ran CI out of memory). Here the index
    is 2**24: 128 MiB of memo for the C unpickler; the parser must stay under 1 MiB."""
    import tracemalloc

    raw = _blob(torch.randn(8, 8))
    at = raw.index(b"q\x00", raw.index(b"\x80\x02"))  # the pickle's first BINPUT (index 0)
    damaged = raw[:at] + b"r" + (1 << 24).to_bytes(4, "little") + raw[at + 2 :]
    tracemalloc.start()
    try:
        parse_tensor_blob(damaged[:HEAD_BYTES], len(damaged))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20, f"parsing the damaged head allocated {peak / 2**20:.0f} MiB"


def test_single_process_direct_and_staged_paths(tmp_path):
    ref, state = _single_state(template=False)
    save(state, tmp_path / "c")
    _, template = _single_state(template=True)
    stats = {}
    loaded = load(template, tmp_path / "c", stats=stats)
    assert stats == {"direct": 1, "staged": 2}
    assert torch.equal(loaded["exact"], ref["exact"])
    assert torch.equal(loaded["cast"], ref["cast"].double())
    assert torch.equal(loaded["strided"], ref["strided"])


def test_fallback_path_reads_through_torch_load(tmp_path, monkeypatch):
    ref, state = _single_state(template=False)
    save(state, tmp_path / "c")
    monkeypatch.setattr(reader_module, "parse_tensor_blob", lambda head, length: None)
    _, template = _single_state(template=True)
    stats = {}
    loaded = load(template, tmp_path / "c", stats=stats, thread_count=2)
    assert stats == {"fallback": 3}
    for key, value in ref.items():
        assert torch.equal(loaded[key], value.to(loaded[key].dtype))


def test_thread_count_is_checked():
    with pytest.raises(ValueError, match="thread_count=0"):
        reader_module.ShardworkReader("unused", thread_count=0)


ROWS, COLS = 32, 2048  # rows of 8 KiB: column blocks are scatter-read
GLOBAL = {
    "rowwise": lambda: torch.randn(ROWS, COLS, generator=seeded(20)),
    "grid": lambda: torch.randn(ROWS, COLS, generator=seeded(21)),
    "narrow": lambda: torch.randn(ROWS, 12, generator=seeded(22)),
    "flat": lambda: torch.randn(6, 7, generator=seeded(23)),
}


def _bounds(n, parts, idx):
    return n * idx // parts, n * (idx + 1) // parts


def _saved_state(rank, world):
    """Layout at save (4 ranks): row shards, a 2x2 grid, row shards of a narrow tensor,
    ZeRO-style flat shards."""
    g = {k: f() for k, f in GLOBAL.items()}
    r0, r1 = _bounds(ROWS, world, rank)
    gr, gc = divmod(rank, 2)
    a, b = _bounds(ROWS, 2, gr)
    c, d = _bounds(COLS, 2, gc)
    fa, fb = _bounds(42, world, rank)
    return {
        "rowwise": ShardedTensor("rowwise", g["rowwise"][r0:r1].clone(), (ROWS, COLS), (r0, 0)),
        "grid": ShardedTensor("grid", g["grid"][a:b, c:d].clone(), (ROWS, COLS), (a, c)),
        "narrow": ShardedTensor("narrow", g["narrow"][r0:r1].clone(), (ROWS, 12), (r0, 0)),
        "flat": ShardedTensor.from_flattened(
            "flat",
            g["flat"].flatten()[fa:fb].clone(),
            local_shape=(6, 7),
            global_shape=(6, 7),
            global_offset=(0, 0),
            flattened_range=(fa, fb),
        ),
    }


def _load_layout(rank, world):
    """Layout at load: column shards of row-saved tensors (strided regions of the saved
    chunks: staged), row shards of the grid (dense regions of the blocks into strided
    destinations with 4 KiB rows: scatter), flat shards (dense into contiguous: direct)."""
    c, d = _bounds(COLS, world, rank)
    n0, n1 = _bounds(12, world, rank)
    r0, r1 = _bounds(ROWS, world, rank)
    fa, fb = _bounds(42, world, rank)
    template = {
        "rowwise": ShardedTensor("rowwise", torch.zeros(ROWS, d - c), (ROWS, COLS), (0, c)),
        "grid": ShardedTensor("grid", torch.zeros(r1 - r0, COLS), (ROWS, COLS), (r0, 0)),
        "narrow": ShardedTensor("narrow", torch.zeros(ROWS, n1 - n0), (ROWS, 12), (0, n0)),
        "flat": ShardedTensor.from_flattened(
            "flat",
            torch.zeros(fb - fa),
            local_shape=(6, 7),
            global_shape=(6, 7),
            global_offset=(0, 0),
            flattened_range=(fa, fb),
        ),
    }
    g = {k: f() for k, f in GLOBAL.items()}
    expected = {
        "rowwise": g["rowwise"][:, c:d],
        "grid": g["grid"][r0:r1],
        "narrow": g["narrow"][:, n0:n1],
        "flat": g["flat"].flatten()[fa:fb],
    }
    return template, expected


def _save_at_4(path):
    import torch.distributed as dist

    save(_saved_state(dist.get_rank(), 4), path)


def _load_and_compare(path, world):
    import torch.distributed as dist

    rank = dist.get_rank()
    template, expected = _load_layout(rank, world)
    stats = {}
    loaded = load(template, path, stats=stats, thread_count=2)
    equal = {k: torch.equal(loaded[k], v) for k, v in expected.items()}
    return equal, stats


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
def test_reshard_through_each_read_path(tmp_path, world):
    testing = pytest.importorskip("shardwork.parallel_state.testing")
    path = str(tmp_path / "ckpt")
    testing.run_on_ranks(_save_at_4, 4, args=(path,))
    results = testing.run_on_ranks(_load_and_compare, world, args=(path, world))
    for rank, (equal, _) in enumerate(results):
        assert all(equal.values()), (rank, equal)
    totals = {}
    for _, stats in results:
        for name, count in stats.items():
            totals[name] = totals.get(name, 0) + count
    assert totals["scatter"] == 2 * world  # each rank's rows lie in 2 grid blocks
    assert totals["staged"] == 8 * world  # every rank: 4 row chunks x 2 keys
    assert totals["direct"] > 0  # flat boxes
