"""A resumed run reads on where the checkpoint's run stopped, whatever its new length or batch
sizes: its steps equal those of one uninterrupted run. (The training set's order used to be
drawn over its size, so a longer ``train_steps`` re-read 10 of 16 samples after a resume, and a
new batch size started at the sample its own schedule put at the resumed step.)

The reference is an uninterrupted run of the same model and data in this process, with a
constant learning rate so that the run's length does not change its first steps: the resumed
steps' losses must equal its losses exactly (same process, same layout, RNG restored).

Settings that do change the order (seed, data sources, sequence length, ...) are named in a
warning at resume."""

import io

import pytest

from shardwork.trainer.run.trainer import train
from shardwork.trainer.testing import tiny_config

GBS = 8


@pytest.fixture(autouse=True)
def _corpus_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SHARDWORK_CACHE", str(tmp_path_factory.getbasetemp() / "corpus"))


def _config(tmp_path, name, *, steps, ckpt="ckpt", shuffle=True, seed=1234, **schedule):
    return tiny_config(
        tmp_path / name,
        seed=seed,
        schedule={
            "train_steps": steps,
            "warmup_steps": 0,
            "lr_schedule": "constant",
            "global_batch_size": GBS,
            **schedule,
        },
        data={"shuffle": shuffle},
        eval={"interval": None, "at_end": False},
        checkpoint={"dir": str(tmp_path / ckpt), "resume": "auto", "save_at_end": True},
    )


def _resume(first, then):
    """Train ``first``, then ``then`` resuming its checkpoint: (``then``'s result, its output)."""
    train(first, stream=io.StringIO())
    stream = io.StringIO()
    result = train(then, stream=stream)
    return result, stream.getvalue()


def _reference_losses(config) -> dict[int, float]:
    return train(config, stream=io.StringIO()).train_losses


def test_a_longer_train_steps_continues_the_uninterrupted_run(tmp_path):
    reference = _reference_losses(_config(tmp_path, "ref", steps=4, ckpt="ref_ckpt"))
    resumed, out = _resume(_config(tmp_path, "a", steps=2), _config(tmp_path, "b", steps=4))
    assert "resumed from" in out and "step 2" in out
    assert "warning" not in out and "notice" not in out
    assert sorted(resumed.train_losses) == [2, 3]
    assert {s: resumed.train_losses[s] for s in (2, 3)} == {s: reference[s] for s in (2, 3)}


def test_a_larger_batch_size_reads_on_from_the_checkpoints_consumed_samples(tmp_path):
    # The uninterrupted run: 2 steps of 8 samples, then steps of 16 (a ramp), so step 2 reads
    # samples 16..32. Resumed with global_batch_size 16, its own schedule would put step 2 at
    # sample 32.
    ramp = {"batch_size_ramp": [(2, 2 * GBS)]}
    reference = _reference_losses(_config(tmp_path, "ref", steps=4, ckpt="ref_ckpt", **ramp))
    resumed, out = _resume(
        _config(tmp_path, "a", steps=2),
        _config(tmp_path, "b", steps=4, global_batch_size=2 * GBS),
    )
    assert "consumed 16 samples in its 2 steps" in out
    assert "would have consumed 32: reading continues at sample 16" in out
    assert {s: resumed.train_losses[s] for s in (2, 3)} == {s: reference[s] for s in (2, 3)}


def test_a_smaller_batch_size_needs_a_larger_training_set(tmp_path):
    # 2 steps of 16 samples, resumed at 8 a step: the set sized by this schedule (4 x 8 = 32)
    # holds too few for the last steps (32 + 16 = 48) unless the resume enlarges it.
    ramp = {"batch_size_ramp": [(0, 2 * GBS), (2, GBS)]}
    reference = _reference_losses(_config(tmp_path, "ref", steps=4, ckpt="ref_ckpt", **ramp))
    resumed, out = _resume(
        _config(tmp_path, "a", steps=2, global_batch_size=2 * GBS),
        _config(tmp_path, "b", steps=4),
    )
    assert "reading continues at sample 32" in out
    assert {s: resumed.train_losses[s] for s in (2, 3)} == {s: reference[s] for s in (2, 3)}


def test_checkpoints_record_their_sample_order_and_an_unknown_one_is_refused(tmp_path):
    from shardwork.dist_checkpoint import read_info
    from shardwork.trainer.run.checkpointing import ResumeError, saved_sample_order

    train(_config(tmp_path, "a", steps=1), stream=io.StringIO())
    info = read_info(tmp_path / "ckpt" / "step_000000001")
    assert info["user_metadata"]["sample_order"] == "blocks"
    assert saved_sample_order(info) == "blocks"
    assert saved_sample_order({"user_metadata": {}}) == "whole"  # written before it existed
    with pytest.raises(ResumeError, match=r"sample_order='spiral'.*valid: \['blocks', 'whole'\]"):
        saved_sample_order({"user_metadata": {"sample_order": "spiral"}})


def test_another_seed_is_named(tmp_path):
    _, out = _resume(_config(tmp_path, "a", steps=2), _config(tmp_path, "b", steps=3, seed=7))
    assert "warning: resuming at step 2 with other data settings" in out
    assert "seed=1234 (this run: 7)" in out


def test_unshuffled_runs_ignore_the_seed(tmp_path):
    _, out = _resume(
        _config(tmp_path, "a", steps=2, shuffle=False),
        _config(tmp_path, "b", steps=3, shuffle=False, seed=7),
    )
    assert "resumed from" in out and "warning" not in out


def test_same_settings_do_not_warn(tmp_path):
    _, out = _resume(_config(tmp_path, "a", steps=2), _config(tmp_path, "b", steps=2))
    assert "resumed from" in out and "warning" not in out
