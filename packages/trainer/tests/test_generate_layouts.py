"""``shardwork-generate`` on checkpoints of multi-rank layouts: the model is rebuilt on one
process and computes what the training run measured.

A run with tensor parallelism and ``parallel.sequence_parallel`` stores that setting; at tp = 1
it used to fail inside the model's layout check with a traceback (exit 1)."""

import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwork.parallel_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

SECTIONS = dict(
    parallel={"tp": 2, "sequence_parallel": True},
    schedule={"train_steps": 2, "warmup_steps": 1},
    eval={"interval": None, "steps": 1, "at_end": True},
    checkpoint={"save_at_end": True},
)


def _train_tp2_sp(run_dir, cache):
    import os

    os.environ["SHARDWORK_CACHE"] = cache
    from shardwork.trainer.run.trainer import train
    from shardwork.trainer.testing import tiny_config

    config = tiny_config(run_dir, world_size=dist.get_world_size(), **SECTIONS)
    result = train(config, stream=io.StringIO())
    return result.checkpoint, result.valid_losses


def _validation_batch(config) -> torch.Tensor:
    """The samples of one evaluation (``eval.steps`` = 1 global batch), read independently
    of the trainer's evaluator: the first global batch of the unshuffled validation set."""
    from shardwork.trainer.data.builder import build_eval_set, split_components

    size = config.schedule.global_batch_size
    valid = build_eval_set(
        split_components(config.data)["valid"],
        seq_length=config.data.seq_length,
        num_samples=size,
    )
    return torch.stack([torch.as_tensor(valid[i]) for i in range(size)])


def test_generate_loads_a_tp2_sequence_parallel_checkpoint(tmp_path, monkeypatch):
    cache = str(tmp_path / "corpus")
    monkeypatch.setenv("SHARDWORK_CACHE", cache)
    (checkpoint, valid_losses), _ = run_on_ranks(
        _train_tp2_sp, 2, args=(str(tmp_path / "run"), cache), timeout=300
    )
    from shardwork.trainer.inference import load_for_inference

    model, config, _ = load_for_inference(checkpoint)
    assert config.parallel.sequence_parallel  # the stored setting is kept as it was trained
    samples = _validation_batch(config)
    with torch.no_grad():
        logits = model(input_ids=samples[:, :-1])  # [s, b, padded vocabulary]
    real = logits[..., : model.config.vocab_size].transpose(0, 1).float()
    loss = F.cross_entropy(real.reshape(-1, real.shape[-1]), samples[:, 1:].reshape(-1))
    # The run's final validation loss, measured at tp=2 with sequence parallelism.
    assert loss.item() == pytest.approx(valid_losses[2], rel=1e-4)
