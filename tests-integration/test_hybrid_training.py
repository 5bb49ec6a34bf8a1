"""The tiny hybrid example trains, and its checkpoints resume at another layout.

- ``test_tiny_hybrid_example_trains``: ``examples/cpu/tiny-hybrid.toml`` (the Nemotron-H
  twin: Mamba-2, squared-ReLU MLP and RoPE-less attention from a layer pattern, one MTP depth,
  pipeline 2) on its 2 ranks, shortened to :data:`EXAMPLE_STEPS` steps: the loss falls.
- ``test_hybrid_resumes_at_another_layout``: the same model in float64 saves at PP=2 after
  step 2, resumes at TP=2 with sequence parallelism and then in one process; every resumed
  step's loss equals the uninterrupted one-process run (rtol ``RTOL``: layouts differ only in
  reduction order, as in the layout matrix).
"""

from __future__ import annotations

import dataclasses
import io
import os
from pathlib import Path

import pytest
import torch.distributed as dist

from shardwork.parallel_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cpu" / "tiny-hybrid.toml"
EXAMPLE_STEPS = 30
RTOL = 1e-9


def _run_example(run_dir: str, cache: str, steps: int) -> dict[int, float]:
    os.environ["SHARDWORK_CACHE"] = cache
    from shardwork.trainer.config.load import load_config
    from shardwork.trainer.config.validate import validate_config
    from shardwork.trainer.run.trainer import train

    config = load_config(EXAMPLE)
    config = dataclasses.replace(
        config,
        schedule=dataclasses.replace(config.schedule, train_steps=steps),
        logging=dataclasses.replace(config.logging, run_dir=run_dir),
        checkpoint=dataclasses.replace(config.checkpoint, dir=str(Path(run_dir) / "ckpt")),
    )
    resolved = validate_config(config, world_size=dist.get_world_size())
    return train(resolved, stream=io.StringIO()).train_losses


def test_tiny_hybrid_example_trains(tmp_path, corpus_cache):
    results = run_on_ranks(
        _run_example, 2, args=(str(tmp_path), corpus_cache, EXAMPLE_STEPS), timeout=600
    )
    losses = results[-1]  # the last pipeline stage computes the loss; every rank logs it
    assert sorted(losses) == list(range(EXAMPLE_STEPS))
    first = sum(losses[s] for s in range(3)) / 3
    last = sum(losses[s] for s in range(EXAMPLE_STEPS - 3, EXAMPLE_STEPS)) / 3
    assert last < first - 1.0, (first, last)


def _sections(parallel: dict, **extra) -> dict:
    sections = {
        "model": {
            "preset": "tiny-nemotron-h-8b",
            "num_layers": 6,
            "hybrid_layer_pattern": "M-*-M-/*-",
            "mtp": {"num_layers": 1},
        },
        "parallel": parallel,
        "precision": {"dtype": "fp64"},
        "schedule": {"train_steps": 6, "warmup_steps": 2, "micro_batch_size": 2},
        "eval": {"interval": None, "at_end": False},
    }
    return sections | extra


def _train(run_dir: str, sections: dict, cache: str) -> dict[int, float]:
    os.environ["SHARDWORK_CACHE"] = cache
    from shardwork.trainer.run.trainer import train
    from shardwork.trainer.testing import tiny_config

    world = dist.get_world_size() if dist.is_initialized() else 1
    return train(
        tiny_config(run_dir, world_size=world, **sections), stream=io.StringIO()
    ).train_losses


def _assert_curve(losses: dict, reference: dict, steps: list[int]) -> None:
    assert sorted(losses) == steps
    for step in steps:
        assert losses[step] == pytest.approx(reference[step], rel=RTOL), f"step {step}"


def test_hybrid_resumes_at_another_layout(tmp_path, corpus_cache):
    reference = _train(str(tmp_path / "ref"), _sections({}), corpus_cache)
    ckpt = {"interval": 2, "keep_last": 5}
    first = _sections({"pp": 2}, checkpoint=ckpt)
    run_on_ranks(_train, 2, args=(str(tmp_path / "a"), first, corpus_cache), timeout=600)
    step2 = tmp_path / "a" / "checkpoints" / "step_000000002"
    tp = {"tp": 2, "sequence_parallel": True}
    second = _sections(tp, checkpoint={**ckpt, "resume": str(step2)})
    results = run_on_ranks(_train, 2, args=(str(tmp_path / "b"), second, corpus_cache), timeout=600)
    for losses in results:
        _assert_curve(losses, reference, [2, 3, 4, 5])
    step4 = tmp_path / "b" / "checkpoints" / "step_000000004"
    third = _sections({}, checkpoint={"resume": str(step4)})
    _assert_curve(_train(str(tmp_path / "c"), third, corpus_cache), reference, [4, 5])
