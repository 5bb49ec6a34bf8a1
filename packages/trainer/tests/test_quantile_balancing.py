"""Quantile balancing from the trainer's config: validated before work, updated every step.

A tiny Mixtral with ``model.moe.router.load_balancing_type = "quantile_balancing"`` trains
two steps; the checkpoint it saves holds every MoE layer's ``qb_beta``, moved away from its
initial zeros by the per-step update (so the finalize hook ran) and centred over the experts
(the update's last operation). With EMA 1 the offset is frozen at its start: the same run
saves zeros, so the non-zero offsets come from the update and not from elsewhere. A token
count that cannot be split evenly over the experts is refused by validation, naming fields.
"""

from __future__ import annotations

import io

import pytest
import torch

from shardwork.models.moe import moe_routers
from shardwork.trainer.config.load import ConfigError
from shardwork.trainer.inference import load_for_inference
from shardwork.trainer.run.trainer import train
from shardwork.trainer.testing import tiny_config


@pytest.fixture(autouse=True)
def _corpus_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SHARDWORK_CACHE", str(tmp_path_factory.getbasetemp() / "corpus"))


def _config(run_dir, *, ema: float, micro_batch_size: int = 4):
    router = {"load_balancing_type": "quantile_balancing", "quantile_balancing_ema": ema}
    return tiny_config(
        run_dir,
        model={"preset": "tiny-mixtral-8x7b", "num_layers": 2, "moe": {"router": router}},
        data={"seq_length": 32},
        schedule={"train_steps": 2, "warmup_steps": 1, "micro_batch_size": micro_batch_size},
        eval={"interval": None, "at_end": False},
        checkpoint={"save_at_end": True},
    )


def _saved_offsets(run_dir) -> torch.Tensor:
    model, _, _ = load_for_inference(run_dir / "checkpoints")
    return torch.stack([r.qb_beta for r in moe_routers(model)])


def test_training_updates_and_saves_qb_beta(tmp_path):
    train(_config(tmp_path / "ema0", ema=0.0), stream=io.StringIO())
    offsets = _saved_offsets(tmp_path / "ema0")
    assert offsets.shape == (2, 8) and bool((offsets != 0).all())
    eps = torch.finfo(torch.float32).eps
    assert float(offsets.mean(dim=1).abs().max()) <= 8 * eps * float(offsets.abs().max())
    train(_config(tmp_path / "frozen", ema=1.0), stream=io.StringIO())
    assert not _saved_offsets(tmp_path / "frozen").any()


def test_uneven_token_split_refused_before_work(tmp_path):
    # 32 tokens × micro-batch 1 × top_k 2 = 64 is a multiple of 8 experts; 31-token sequences are not
    with pytest.raises(ConfigError, match=r"data.seq_length × schedule.micro_batch_size × top_k"):
        tiny_config(
            tmp_path,
            model={
                "preset": "tiny-mixtral-8x7b",
                "moe": {"router": {"load_balancing_type": "quantile_balancing"}},
            },
            data={"seq_length": 31},
            schedule={"micro_batch_size": 1, "global_batch_size": 1},
        )
