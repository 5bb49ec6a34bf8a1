"""TensorBoard events when tensorboard is installed, JSONL only (with one notice) when not."""

import io
import math
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from shardwork.trainer.observe.metrics import read_metrics
from shardwork.trainer.run.trainer import train
from shardwork.trainer.testing import tiny_config


@pytest.fixture(autouse=True)
def _corpus_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SHARDWORK_CACHE", str(tmp_path_factory.getbasetemp() / "corpus"))


def _config(run_dir):
    return tiny_config(
        run_dir,
        schedule={"train_steps": 6, "warmup_steps": 2},
        eval={"interval": 3, "steps": 1},
        logging={"interval": 2, "tensorboard": True},
    )


def test_event_scalars_equal_the_jsonl_values(tmp_path):
    stream = io.StringIO()
    train(_config(tmp_path), stream=stream)
    assert "tensorboard is not installed" not in stream.getvalue()
    assert f"tensorboard: {tmp_path / 'tensorboard'}" in stream.getvalue()

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {}
    for record in read_metrics(tmp_path / "metrics.jsonl"):
        for key, value in record.items():
            if key in ("kind", "step") or isinstance(value, bool | list | str):
                continue
            expected.setdefault(f"{record['kind']}/{key}", {})[record["step"]] = value
    assert {"train/loss", "train/lr", "train/grad_norm", "valid/loss", "event/bigram_nats"} <= tags
    assert tags == set(expected)
    for tag, by_step in expected.items():
        logged = {e.step: e.value for e in events.Scalars(tag)}
        assert set(logged) == set(by_step), tag
        for step, value in by_step.items():
            # event files hold float32
            assert logged[step] == pytest.approx(value, rel=1e-6, abs=1e-30), (tag, step)
    assert sorted(s.step for s in events.Scalars("train/loss")) == [2, 4, 6]
    assert sorted(s.step for s in events.Scalars("valid/loss")) == [3, 6]


def test_without_tensorboard_the_run_writes_jsonl_and_one_notice(tmp_path, monkeypatch):
    # a None entry makes `from torch.utils.tensorboard import SummaryWriter` raise ImportError
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    stream = io.StringIO()
    result = train(_config(tmp_path), stream=stream)
    text = stream.getvalue()
    assert text.count("tensorboard is not installed") == 1
    assert "tensorboard:" not in text
    assert not (tmp_path / "tensorboard").exists()
    losses = [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert result.final_step == 6
