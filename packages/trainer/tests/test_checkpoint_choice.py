"""The one choice of the checkpoints a resume may load (run/checkpoint_choice.py), shared by
preflight, the trainer's resume and shardwork-generate, against checkpoints saved by
dist_checkpoint's CheckpointManager."""

import numpy as np
import torch

from shardwork.dist_checkpoint import CheckpointManager
from shardwork.trainer.run.checkpoint_choice import named_candidates, resume_candidates


def test_candidates_are_the_complete_checkpoints_a_resume_names(tmp_path):
    rng = np.random.default_rng(7)
    saved = sorted(int(s) for s in rng.choice(np.arange(1, 400), size=5, replace=False))
    root = tmp_path / "checkpoints"
    manager = CheckpointManager(root)
    for step in saved:
        manager.save(step, {"w": torch.full((3,), float(step))})
    unfinished = manager.step_path(saved[-1] + 1)  # a save that never committed, newest by name
    unfinished.mkdir()
    (root / "step_notes").mkdir()  # not a step number
    (root / f"step_{saved[-1] + 2}").write_text("a file, not a checkpoint directory")

    auto = resume_candidates("auto", root)
    assert auto.root == root
    assert auto.checkpoints == {s: manager.step_path(s) for s in saved}
    assert auto.steps == saved and auto.newest == manager.step_path(saved[-1])

    middle = manager.step_path(saved[2])  # a complete step_<N> directory: itself alone
    named = resume_candidates(str(middle), "elsewhere")
    assert (named.root, named.checkpoints) == (root, {saved[2]: middle})
    as_root = resume_candidates(str(root), "elsewhere")  # a root: its newest complete one
    assert (as_root.root, as_root.checkpoints) == (root, {saved[-1]: manager.step_path(saved[-1])})
    assert named_candidates(root) == as_root

    assert resume_candidates("none", root) is None
    for nothing in (unfinished, tmp_path / "missing", tmp_path / "missing" / "step_000000003"):
        assert resume_candidates(str(nothing), root).checkpoints == {}
        assert named_candidates(nothing).newest is None
    assert resume_candidates("auto", tmp_path / "missing").steps == []
