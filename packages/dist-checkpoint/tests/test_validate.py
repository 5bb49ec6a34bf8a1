"""The validator rejects overlapping, missing and inconsistent shards on every rank, naming the
key, before anything is written."""

import os

import pytest
import torch

from shardwork.dist_checkpoint import ShardedObject, ShardedTensor, save

pytest.importorskip("shardwork.parallel_state")
from shardwork.parallel_state.testing import run_on_ranks


def _bad_state(case, rank):
    if case == "overlap":  # both ranks claim rows 0-1 as primary copy
        return {"w": ShardedTensor("layer.w", torch.randn(2, 3), (4, 3), (0, 0))}
    if case == "missing":  # rows 2-3 of rank 1 are replicas: nobody owns them
        return {
            "w": ShardedTensor.from_rank_offsets(
                "layer.w", torch.randn(2, 3), (0, rank, 2), replica_id=rank
            )
        }
    if case == "shape":  # global shapes disagree
        return {"w": ShardedTensor("layer.w", torch.randn(2, 3), (4, 3 + rank), (2 * rank, 0))}
    if case == "dtype":
        dtype = torch.float32 if rank == 0 else torch.float64
        return {
            "w": ShardedTensor.from_rank_offsets(
                "layer.w", torch.randn(2, 3, dtype=dtype), (0, rank, 2)
            )
        }
    if case == "object":  # two primaries of one object
        return {"rng": ShardedObject("layer.w", rank)}
    raise AssertionError(case)


def _try_save(case, path):
    import torch.distributed as dist

    try:
        save(_bad_state(case, dist.get_rank()), path)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("overlap", "overlaps"),
        ("missing", "cover 6 of 12"),
        ("shape", "global_shape differs"),
        ("dtype", "dtype differs"),
        ("object", "overlaps"),
    ],
)
def test_invalid_layouts_fail_on_every_rank_before_writing(tmp_path, case, words):
    path = str(tmp_path / "ckpt")
    messages = run_on_ranks(_try_save, 2, args=(case, path))
    assert messages[0] is not None and messages[0] == messages[1]
    assert "'layer.w'" in messages[0] and words in messages[0]
    assert not os.path.exists(path)


def test_reserved_key_and_committed_target(tmp_path):
    with pytest.raises(ValueError, match="reserved prefix"):
        save({"x": ShardedTensor.from_rank_offsets("_shardwork/x", torch.ones(2))}, tmp_path / "a")
    state = {"x": ShardedTensor.from_rank_offsets("x", torch.randn(3))}
    save(state, tmp_path / "b")
    with pytest.raises(ValueError, match="overwrite=True"):
        save(state, tmp_path / "b")
    save(state, tmp_path / "b", overwrite=True)
    with pytest.raises(ValueError, match="thread_count"):
        save(state, tmp_path / "c", thread_count=0)
    # a directory with other files is never cleared
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not checkpoint files"):
        save(state, tmp_path / "d", overwrite=True)
    assert (tmp_path / "d" / "notes.txt").read_text() == "keep me"
