"""CheckpointManager in one process: retention, granular loads, strictness and key errors."""

import re

import pytest
import torch

from shardwork.dist_checkpoint import CheckpointManager, ShardedObject, ShardedTensor
from shardwork.dist_checkpoint.testing import example_global, example_state


def _save_steps(manager, steps):
    for step in steps:
        manager.save(step, example_state(0, 1, seed=step))


@pytest.mark.parametrize(
    ("keep_last", "keep_every", "kept"),
    [
        (2, None, [6, 7]),
        (2, 3, [3, 6, 7]),
        (1, 5, [5, 7]),
        (None, None, [1, 2, 3, 4, 5, 6, 7]),
    ],
)
def test_retention(tmp_path, keep_last, keep_every, kept):
    manager = CheckpointManager(tmp_path, keep_last=keep_last, keep_every=keep_every)
    _save_steps(manager, range(1, 8))
    assert manager.list() == kept
    assert manager.latest() == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step_{s:09d}" for s in kept]


def test_retention_never_deletes_the_latest_and_skips_incomplete(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=1, keep_every=10)
    _save_steps(manager, [10, 20])
    # an interrupted save at a later step is neither "latest" nor one of the last N
    partial = manager.step_path(30)
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"partial")
    assert manager.latest() == 20 and manager.incomplete() == [partial]
    assert manager.list() == [10, 20]
    # the next save removes it; 25 is the latest and kept although 25 % 10 != 0
    _save_steps(manager, [25])
    assert not partial.exists()
    assert manager.list() == [10, 20, 25] and manager.latest() == 25
    # a newer save makes 25 the one the policy drops (not the last 1, not a multiple of 10)
    _save_steps(manager, [26])
    assert manager.list() == [10, 20, 26] and manager.latest() == 26
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step_{s:09d}" for s in (10, 20, 26)]


def test_granular_loads(tmp_path):
    manager = CheckpointManager(tmp_path, layout={"tp": 1}, content_version=3)
    _save_steps(manager, [5])
    ref = example_global(5)

    # model only: a template holding only the model section loads strictly
    model_only = {"model": example_state(0, 1, seed=0, fill=False)["model"]}
    out = manager.load(model_only, include=("model",))
    assert torch.equal(out["model"]["matrix"], ref["matrix"])

    # no optimizer: optimizer leaves come back as the template had them (NaN), others loaded
    full = example_state(0, 1, seed=0, fill=False)
    out = manager.load(full, exclude=("optimizer",))
    assert torch.isnan(out["optimizer"]["moment"]).all() and out["optimizer"]["step"] == 0
    assert torch.equal(out["model"]["replicated"], ref["replicated"])
    assert out["rng"] == {"rank": 0, "seed": 5}

    # no RNG
    out = manager.load(example_state(0, 1, seed=0, fill=False), exclude=("rng",))
    assert out["rng"] is None and out["optimizer"]["step"] == 5

    # explicit key filter
    out = manager.load(
        example_state(0, 1, seed=0, fill=False), key_filter=lambda path, key: key == "moment"
    )
    assert torch.equal(out["optimizer"]["moment"], ref["moment"].flatten())
    assert torch.isnan(out["model"]["matrix"]).all()

    # without a filter a model-only template has unexpected keys
    with pytest.raises(ValueError, match=r"unexpected.*'moment'"):
        manager.load(model_only)
    out = manager.load(model_only, strict="missing")
    assert torch.equal(out["model"]["matrix"], ref["matrix"])


def test_key_errors_name_the_keys(tmp_path):
    manager = CheckpointManager(tmp_path)
    _save_steps(manager, [1])
    template = example_state(0, 1, seed=0, fill=False)
    template["model"]["extra"] = ShardedTensor.from_rank_offsets("decoder.extra", torch.zeros(2))
    with pytest.raises(ValueError, match=r"missing: 'decoder\.extra'"):
        manager.load(template)
    out = manager.load(template, strict=False)
    assert torch.equal(out["model"]["extra"], torch.zeros(2))
    assert torch.equal(out["model"]["matrix"], example_global(1)["matrix"])

    bad_shape = example_state(0, 1, seed=0, fill=False)
    bad_shape["model"]["matrix"] = ShardedTensor.from_rank_offsets("matrix", torch.zeros(4, 6))
    with pytest.raises(
        ValueError,
        match=r"'matrix': checkpoint has global shape \(8, 6\), template has global shape \(4, 6\)",
    ):
        manager.load(bad_shape, strict=False)

    grid = example_state(0, 1, seed=0, fill=False)
    grid["rng"] = ShardedObject("rng", None, (2,), (0,))
    with pytest.raises(ValueError, match="'rng': checkpoint has an object grid"):
        manager.load(grid)

    with pytest.raises(ValueError, match="strict="):
        manager.load(template, strict="sometimes")
    with pytest.raises(ValueError, match="step=9"):
        manager.load(template, step=9)
    with pytest.raises(ValueError, match="include="):
        manager.load(template, include="model")


def test_include_exclude_names_must_be_sections(tmp_path):
    """A misspelt section would load nothing (include) or exclude nothing: refused, naming
    the valid sections, before anything is loaded (the template keeps its NaN)."""
    manager = CheckpointManager(tmp_path)
    _save_steps(manager, [1])
    template = example_state(0, 1, seed=0, fill=False)
    valid = re.escape("valid: ['model', 'optimizer', 'rng']")
    with pytest.raises(
        ValueError, match=r"include=\('modle',\): 'modle' is not a top-level .*" + valid
    ):
        manager.load(template, include=("modle",))
    with pytest.raises(
        ValueError, match=r"exclude=\('rgn',\): 'rgn' is not a top-level .*" + valid
    ):
        manager.load(template, exclude=("rgn",))
    with pytest.raises(
        ValueError, match=r"exclude=\['rng', 'optimiser'\]: 'optimiser' is not a top-level"
    ):
        manager.load(template, exclude=["rng", "optimiser"])
    with pytest.raises(TypeError, match=r"include=\(0,\) is not valid: 0 is a int; valid: section"):
        manager.load(template, include=(0,))
    assert torch.isnan(template["model"]["matrix"].data).all()

    # a section the checkpoint has but this template lacks may be excluded (the trainer does so
    # when it does not load the optimizer) and may be included (where another rank holds it)
    model_only = {"model": example_state(0, 1, seed=0, fill=False)["model"]}
    out = manager.load(model_only, exclude=("optimizer", "rng"))
    assert torch.equal(out["model"]["matrix"], example_global(1)["matrix"])
    out = manager.load({}, include=("model",), strict="missing")
    assert out == {}


def test_manager_argument_checks(tmp_path):
    with pytest.raises(ValueError, match="keep_last=0"):
        CheckpointManager(tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="keep_every"):
        CheckpointManager(tmp_path, keep_every=True)
    manager = CheckpointManager(tmp_path)
    with pytest.raises(ValueError, match="step=-1"):
        manager.save(-1, {})
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        manager.load({})
