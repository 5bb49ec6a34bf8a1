"""The validator rejects overlapping, missing and inconsistent shards on every rank, naming the
key, before anything is written; a sync save likewise refuses a value that does not pickle,
naming its path in the state."""

import os
import re

import pytest
import torch

from shardwork.dist_checkpoint import (
    ShardedObject,
    ShardedTensor,
    is_committed,
    load,
    save,
    verify,
)

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


def _unpicklable():
    return lambda: 1


@pytest.mark.parametrize(
    ("state", "named"),
    [
        ({"f": _unpicklable()}, "state['f']=<function _unpicklable.<locals>.<lambda>"),
        (
            {"optimizer": {"groups": [{"lr": 0.1, "hook": _unpicklable()}]}},
            "state['optimizer/groups/0/hook']=<function",
        ),
        (
            {"rng": ShardedObject("rng", {"gen": _unpicklable()})},
            "state['rng'] (ShardedObject 'rng').data={'gen': <function",
        ),
    ],
)
def test_a_value_that_does_not_pickle_is_refused_before_writing(tmp_path, state, named):
    state = {**state, "w": ShardedTensor.from_rank_offsets("w", torch.zeros(2))}
    with pytest.raises(TypeError, match=re.escape(named)) as info:
        save(state, tmp_path / "new")
    assert "cannot be pickled" in str(info.value) and "nothing was written" in str(info.value)
    assert "valid: a picklable value" in str(info.value)
    assert not (tmp_path / "new").exists()


def test_a_value_that_does_not_pickle_leaves_the_target_untouched(tmp_path):
    """Even with overwrite=True, the committed checkpoint there is not cleared first."""
    path = tmp_path / "ckpt"
    good = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(3.0)), "step": 4}
    save(good, path)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    with pytest.raises(TypeError, match=re.escape("state['step']=<function")):
        save({**good, "step": _unpicklable()}, path, overwrite=True)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    verify(path)
    # the same save with a picklable value replaces it
    save({**good, "step": 5}, path, overwrite=True)
    template = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3)), "step": 0}
    assert load(template, path)["step"] == 5


def _save_with_unpicklable_on_rank_1(root):
    """Sync saves of 2 ranks where rank 1 holds a lambda: as an object it writes (refused on
    every rank), then as a plain value (taken from rank 0 only, so it is never written)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    hook = _unpicklable() if rank == 1 else None
    tensor = ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, rank, 2))
    outcome = None
    try:
        save({"w": tensor, "rng": ShardedObject("rng", hook, (2,), (rank,))}, f"{root}/a")
    except TypeError as exc:
        outcome = str(exc)
    save({"w": tensor, "hook": hook}, f"{root}/b")
    return outcome, os.path.exists(f"{root}/a"), is_committed(f"{root}/b")


@pytest.mark.multirank
def test_a_value_that_does_not_pickle_on_one_rank_is_refused_on_every_rank(tmp_path):
    results = run_on_ranks(_save_with_unpicklable_on_rank_1, 2, args=(str(tmp_path),))
    message = results[0][0]
    assert message is not None and results[1][0] == message
    assert "state['rng'] (ShardedObject 'rng').data=<function" in message
    assert "(on rank 1); nothing was written" in message
    assert [r[1:] for r in results] == [(False, True), (False, True)]
