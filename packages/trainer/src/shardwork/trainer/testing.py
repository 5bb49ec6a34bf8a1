"""Small configurations for tests, benchmarks and smoke runs of the trainer.

:func:`tiny_config` is a complete, resolved :class:`TrainConfig` for a 2-layer,
32-wide GPT on the built-in corpus that trains a step in well under a second
on one CPU core; keyword arguments override sections, e.g.
``tiny_config(run_dir, schedule={"train_steps": 12}, parallel={"tp": 2})``. A model
section naming a ``preset`` replaces the tiny architecture with the preset's, and a
checkpoint section naming ``hf_init`` with the Hugging Face folder's.

:func:`first_global_batch` reads step 0's micro-batches as the trainer does, for tests that
score them with a reference model outside the trainer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from shardwork.trainer.config.sections import ModelSection, TrainConfig
from shardwork.trainer.config.validate import validate_config
from shardwork.trainer.data.builder import micro_batch, split_components
from shardwork.trainer.run.trainer import build_train_set
from shardwork.trainer.schedules import batch_size

TINY_SECTIONS: dict[str, dict[str, Any]] = {
    "model": {
        "num_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "ffn_hidden_size": 64,
        "make_vocab_size_divisible_by": 64,
    },
    "data": {"seq_length": 32},
    "schedule": {
        "train_steps": 40,
        "global_batch_size": 8,
        "micro_batch_size": 4,
        "warmup_steps": 4,
    },
    "optimizer": {"lr": 1e-2, "min_lr": 1e-3},
    "eval": {"interval": 20, "steps": 1},
    "logging": {"interval": 5, "progress": "none", "tensorboard": False, "plot": False},
    "checkpoint": {"resume": "none", "save_at_end": False},
}


def tiny_config(run_dir: str | Path, *, world_size: int = 1, **sections: Any) -> TrainConfig:
    """A validated, resolved tiny config writing under ``run_dir`` (see module docstring)."""
    config = TrainConfig()
    merged = {name: dict(values) for name, values in TINY_SECTIONS.items()}
    merged["logging"]["run_dir"] = str(run_dir)
    merged["checkpoint"]["dir"] = str(Path(run_dir) / "checkpoints")
    if (sections.get("checkpoint") or {}).get("hf_init"):
        merged["model"] = {}  # the Hugging Face folder brings its architecture
    for name, values in sections.items():
        if name == "model" and isinstance(values, dict) and values.get("preset"):
            merged["model"] = dict(values)  # a preset brings its own (tiny) architecture
        elif isinstance(values, dict):
            merged.setdefault(name, {}).update(values)
        else:
            config = dataclasses.replace(config, **{name: values})
    for name, values in merged.items():
        if name == "model":  # the [model] table: a preset and GPTConfig settings
            settings = {k: v for k, v in values.items() if k != "preset"}
            section = ModelSection(preset=values.get("preset"), settings=settings)
        else:
            section = dataclasses.replace(getattr(config, name), **values)
        config = dataclasses.replace(config, **{name: section})
    return validate_config(config, world_size=world_size)


def first_global_batch(config: TrainConfig) -> list[Any]:
    """Step 0's global batch on one process (dp = 1): its micro-batches in order, each an int64
    ``[micro_batch_size, seq_length + 1]`` tensor, read from the run's training set with the
    trainer's data layout (the set's size, seed and shuffling as in training)."""
    s = config.schedule
    train_set = build_train_set(config, split_components(config.data)["train"])
    size = batch_size(0, global_batch_size=s.global_batch_size, ramp=s.batch_size_ramp)
    mbs = s.micro_batch_size
    return [
        micro_batch(train_set, consumed=0, index=i, micro_batch_size=mbs, dp_rank=0, dp_size=1)
        for i in range(size // mbs)
    ]
