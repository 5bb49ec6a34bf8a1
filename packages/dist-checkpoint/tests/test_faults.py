"""A save killed (SIGKILL) before any data, mid-file, before DCP's .metadata or before the commit
leaves `latest()` on the previous checkpoint; the partial directory is recognised as incomplete,
cannot be loaded, and is removed by the next save."""

import os
import signal

import pytest
import torch

from shardwork.dist_checkpoint import CheckpointManager, IncompleteCheckpointError, load
from shardwork.dist_checkpoint.testing import example_global, example_state, run_killed_save

pytest.importorskip("shardwork.parallel_state")
from shardwork.parallel_state.testing import run_on_ranks


def _save_step(root, step):
    import torch.distributed as dist

    manager = CheckpointManager(root)
    manager.save(step, example_state(dist.get_rank(), dist.get_world_size(), seed=step))
    return manager.list(), [p.name for p in manager.incomplete()]


def _matrix_of(path):
    """Load the model matrix of a checkpoint in this process (world size 1)."""
    template = example_state(0, 1, seed=0, fill=False)
    out = load(template, path, key_filter=lambda p, key: p[0] == "model")
    return out["model"]["matrix"]


@pytest.mark.multirank
@pytest.mark.parametrize(
    "fault", ["before_data", "mid_file@1", "before_metadata", "before_commit@0"]
)
def test_killed_save_leaves_previous_checkpoint_latest(tmp_path, fault):
    root = str(tmp_path)
    assert run_on_ranks(_save_step, 2, args=(root, 1))[0] == ([1], [])

    exitcodes = run_killed_save(root, 2, world_size=2, fault=fault)
    # a rank died at the fault point; the other one either blocks on it or notices the
    # closed connection and fails; none finishes the save
    assert -signal.SIGKILL in exitcodes and 0 not in exitcodes, exitcodes
    if "@" in fault:
        assert exitcodes[int(fault.split("@")[1])] == -signal.SIGKILL, exitcodes

    manager = CheckpointManager(root)
    assert manager.latest() == 1 and manager.list() == [1]
    assert [p.name for p in manager.incomplete()] == ["step_000000002"]
    partial = manager.step_path(2)
    if fault == "mid_file@1":  # a data file exists, partly written
        assert any(name.endswith(".distcp") for name in os.listdir(partial))
    with pytest.raises(IncompleteCheckpointError, match="no COMMITTED marker"):
        _matrix_of(partial)
    assert torch.equal(_matrix_of(manager.step_path(1)), example_global(1)["matrix"])

    # the next save removes the partial directory and commits normally
    assert run_on_ranks(_save_step, 2, args=(root, 2))[0] == ([1, 2], [])
    assert torch.equal(_matrix_of(manager.step_path(2)), example_global(2)["matrix"])
