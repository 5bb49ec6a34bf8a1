"""From the trainer's model section to shardwork.models objects (no model code lives here).

- :func:`gpt_config` builds the :class:`shardwork.models.GPTConfig`: a preset
  (or the demo dimensions), then the explicit fields, the tokenizer's
  vocabulary, precision and seeds, then ``model.overrides``.
- :func:`build_model_chunks` builds this rank's model chunks through
  ``shardwork.models.pipeline.build_model_chunks`` (one per virtual stage).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from shardwork.trainer.config.sections import DEMO_MODEL, TrainConfig

_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}


def preset_fields(name: str) -> dict[str, Any]:
    """The architecture fields of preset ``name`` (ValueError naming the valid presets)."""
    from shardwork.models.presets import preset

    config = preset(name)
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def gpt_config(config: TrainConfig):
    """The GPTConfig this run trains (config must be resolved: vocab_size set)."""
    from shardwork.models.config import GPTConfig
    from shardwork.models.presets import preset

    m = config.model
    explicit = {name: getattr(m, name) for name in DEMO_MODEL if getattr(m, name) is not None}
    explicit["vocab_size"] = m.vocab_size
    if m.make_vocab_size_divisible_by is not None:
        explicit["make_vocab_size_divisible_by"] = m.make_vocab_size_divisible_by
    explicit.update(
        params_dtype=_DTYPES[config.precision.dtype],
        sequence_parallel=config.parallel.sequence_parallel,
        init_seed=config.seed,
        dropout_seed=config.seed,
    )
    if m.preset is not None:
        base = preset(m.preset)
        explicit.setdefault(
            "max_position_embeddings", max(base.max_position_embeddings, config.data.seq_length)
        )
        return base.replace(**explicit, **m.overrides)
    dims = {**DEMO_MODEL, **explicit}
    dims.setdefault("max_position_embeddings", config.data.seq_length)
    return GPTConfig(**dims, **m.overrides)


def build_model_chunks(
    model_config,
    groups,
    *,
    device: torch.device,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> list:
    """This rank's model chunks: one per virtual pipeline stage (one at pp = 1).

    shardwork.models.pipeline.build_model_chunks decides the layers of each chunk.
    """
    from shardwork.models.pipeline import build_model_chunks as build

    return build(
        model_config,
        groups,
        device=device,
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
    )
