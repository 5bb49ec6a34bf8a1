"""A ``logging.run_dir`` used again: a run starting at step 0 sets the earlier run's logs aside
(renamed, never deleted) and writes its own; a resumed run appends to the log it continues."""

import io

import numpy as np
import pytest

from shardwork.trainer.observe.metrics import read_metrics
from shardwork.trainer.run.trainer import train
from shardwork.trainer.testing import tiny_config


@pytest.fixture(autouse=True)
def _corpus_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SHARDWORK_CACHE", str(tmp_path_factory.getbasetemp() / "corpus"))


def _run(run_dir, steps: int, **checkpoint) -> str:
    """Train ``steps`` steps logging every step (TensorBoard on); return what the run said."""
    stream = io.StringIO()
    config = tiny_config(
        run_dir,
        schedule={"train_steps": steps, "warmup_steps": 1},
        eval={"interval": None, "at_end": False},
        logging={"interval": 1, "tensorboard": True},
        checkpoint=checkpoint,
    )
    train(config, stream=stream)
    return stream.getvalue()


def _train_steps(path) -> list[int]:
    return [r["step"] for r in read_metrics(path) if r["kind"] == "train"]


def _snapshot(run_dir) -> dict[str, bytes]:
    """Every file of the run's logs (not its checkpoints), by path relative to ``run_dir``."""
    files = (p for p in run_dir.rglob("*") if p.is_file() and "checkpoints" not in p.parts)
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in files}


def test_a_fresh_run_sets_earlier_logs_aside_and_a_resumed_run_appends(tmp_path):
    rng = np.random.default_rng(23)
    first, second = (int(n) for n in rng.integers(2, 5, size=2))
    third = second + int(rng.integers(1, 3))
    run_dir = tmp_path / "run"

    _run(run_dir, first)
    earlier = _snapshot(run_dir)
    assert {"metrics.jsonl", "config.toml"} <= set(earlier)
    said = _run(run_dir, second, save_at_end=True)  # afresh, in the same run_dir
    moved = {
        name.replace("metrics.jsonl", "metrics.1.jsonl")
        .replace("config.toml", "config.1.toml")
        .replace("tensorboard/", "tensorboard.1/"): data
        for name, data in earlier.items()
    }
    now = _snapshot(run_dir)
    assert {name: now[name] for name in moved} == moved  # the first run's logs, renamed whole
    assert _train_steps(run_dir / "metrics.jsonl") == list(range(1, second + 1))
    assert (
        f"notice: logging.run_dir={str(run_dir)!r} held an earlier run's logs and this run "
        "starts at step 0, so they were set aside (metrics.jsonl -> metrics.1.jsonl, "
        "config.toml -> config.1.toml, tensorboard -> tensorboard.1) instead of mixed with "
        "this run's; a resumed run appends to its own"
    ) in said.splitlines()

    before = (run_dir / "metrics.jsonl").read_bytes()
    said = _run(run_dir, third, resume="auto", save_at_end=True)  # continues the second run
    assert "set aside" not in said and not (run_dir / "metrics.2.jsonl").exists()
    continued = (run_dir / "metrics.jsonl").read_bytes()
    assert continued.startswith(before)
    assert _train_steps(run_dir / "metrics.jsonl") == list(range(1, third + 1))

    _run(run_dir, first, resume="none")  # afresh again: the resumed log moves whole, to .2
    assert (run_dir / "metrics.2.jsonl").read_bytes() == continued
    assert (run_dir / "metrics.1.jsonl").read_bytes() == earlier["metrics.jsonl"]
    assert _train_steps(run_dir / "metrics.jsonl") == list(range(1, first + 1))
