"""A resume whose data settings differ from the checkpoint's run says so: the training set's
sample order is drawn over its size (``train_steps`` × batch sizes) with the seed, so a longer
``train_steps`` or another batch size reads another order from the resumed step on, and
samples already trained on come again. That used to happen without a word.

Each case checks the claim itself on the data (independently of the warning's code): the
resumed steps' samples are compared with those the checkpoint's run read."""

import io

import pytest

from shardwork.trainer.run.trainer import train
from shardwork.trainer.testing import tiny_config

GBS = 8


@pytest.fixture(autouse=True)
def _corpus_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SHARDWORK_CACHE", str(tmp_path_factory.getbasetemp() / "corpus"))


def _config(tmp_path, name, *, steps, shuffle=True, **schedule):
    return tiny_config(
        tmp_path / name,
        schedule={"train_steps": steps, "warmup_steps": 1, "global_batch_size": GBS, **schedule},
        data={"shuffle": shuffle},
        eval={"interval": None, "at_end": False},
        checkpoint={"dir": str(tmp_path / "ckpt"), "resume": "auto", "save_at_end": True},
    )


def _samples(config, first: int, count: int) -> list[tuple[int, ...]]:
    """Samples ``first .. first + count`` of the run's training set, as token tuples."""
    from shardwork.trainer.data.builder import split_components
    from shardwork.trainer.run.trainer import build_train_set

    train_set = build_train_set(config, split_components(config.data)["train"])
    return [tuple(train_set[i].tolist()) for i in range(first, first + count)]


def _resume_output(tmp_path, first, then) -> str:
    train(first, stream=io.StringIO())
    stream = io.StringIO()
    train(then, stream=stream)
    return stream.getvalue()


def test_longer_train_steps_warns_and_the_order_did_change(tmp_path):
    first = _config(tmp_path, "a", steps=2)
    longer = _config(tmp_path, "b", steps=4)
    seen = set(_samples(first, 0, 2 * GBS))
    resumed = _samples(longer, 2 * GBS, 2 * GBS)
    assert seen & set(resumed)  # the claim: samples of steps 1-2 come again in steps 3-4
    out = _resume_output(tmp_path, first, longer)
    assert "warning: resuming at step 2 with other data settings" in out
    assert "schedule.train_steps=2 (this run: 4)" in out


def test_another_batch_size_is_named(tmp_path):
    out = _resume_output(
        tmp_path,
        _config(tmp_path, "a", steps=2),
        _config(tmp_path, "b", steps=3, global_batch_size=2 * GBS),
    )
    assert "schedule.global_batch_size=8 (this run: 16)" in out


def test_unshuffled_longer_run_keeps_its_order_and_does_not_warn(tmp_path):
    first = _config(tmp_path, "a", steps=2, shuffle=False)
    longer = _config(tmp_path, "b", steps=4, shuffle=False)
    assert _samples(first, 0, 2 * GBS) == _samples(longer, 0, 2 * GBS)
    out = _resume_output(tmp_path, first, longer)
    assert "resumed from" in out and "warning" not in out


def test_same_settings_do_not_warn(tmp_path):
    out = _resume_output(tmp_path, _config(tmp_path, "a", steps=2), _config(tmp_path, "b", steps=2))
    assert "resumed from" in out and "warning" not in out
