"""From the trainer's model section to shardwork.models objects (no model code lives here).

- :func:`gpt_config` builds the :class:`shardwork.models.GPTConfig`: a preset, the
  config.json of ``checkpoint.hf_init`` (translated by shardwork.models.hf) or the demo
  dimensions, then the explicit fields, the tokenizer's vocabulary, precision and seeds,
  then ``model.overrides`` (``"field"`` for a GPTConfig field, ``"section.field"`` for a
  field of a nested config such as ``moe`` or ``mtp``).
- :func:`build_model_chunks` builds this rank's model chunks through
  ``shardwork.models.pipeline.build_model_chunks`` (one per virtual stage).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from shardwork.models.config import GPTConfig
from shardwork.models.hf import gpt_config_from_hf, read_hf_config
from shardwork.models.pipeline import build_model_chunks as build_pipeline_chunks
from shardwork.models.presets import preset
from shardwork.trainer.config.sections import DEMO_MODEL, TrainConfig

_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}


def preset_fields(name: str) -> dict[str, Any]:
    """The architecture fields of preset ``name`` (ValueError naming the valid presets)."""
    config = preset(name)
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def hf_config(folder: str) -> dict[str, Any]:
    """The config.json of a Hugging Face checkpoint folder (ValueError if it has none)."""
    return read_hf_config(folder)


def hf_gpt_config(hf: dict[str, Any]):
    """The GPTConfig of a Hugging Face config.json dict (ValueError naming what is unsupported)."""
    return gpt_config_from_hf(hf)


def gpt_config(config: TrainConfig, *, hf: dict[str, Any] | None = None):
    """The GPTConfig this run trains (config must be resolved: vocab_size set).

    With ``checkpoint.hf_init`` the architecture is the folder's config.json, read from disk
    unless ``hf`` (its contents, as a checkpoint stores them) is given.
    """
    m = config.model
    if config.checkpoint.hf_init is not None:
        base = hf_gpt_config(hf if hf is not None else hf_config(config.checkpoint.hf_init))
        explicit = {name: getattr(m, name) for name in DEMO_MODEL if getattr(m, name) is not None}
        explicit.update(
            vocab_size=m.vocab_size or base.vocab_size,
            params_dtype=_DTYPES[config.precision.dtype],
            sequence_parallel=config.parallel.sequence_parallel,
            init_seed=config.seed,
            dropout_seed=config.seed,
        )
        flat = {k: v for k, v in m.overrides.items() if "." not in k}
        return _nested_overrides(base.replace(**explicit, **flat), m.overrides)
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
    flat = {k: v for k, v in m.overrides.items() if "." not in k}
    if m.preset is not None:
        base = preset(m.preset)
        explicit.setdefault(
            "max_position_embeddings", max(base.max_position_embeddings, config.data.seq_length)
        )
        return _nested_overrides(base.replace(**explicit, **flat), m.overrides)
    dims = {**DEMO_MODEL, **explicit}
    dims.setdefault("max_position_embeddings", config.data.seq_length)
    return _nested_overrides(GPTConfig(**dims, **flat), m.overrides)


def _nested_overrides(model_config, overrides: dict[str, Any]):
    """Apply ``"section.field"`` overrides to a nested config of the GPTConfig (e.g.
    ``{"moe.aux_loss_coeff": 0.01, "mtp.loss_coeff": 0.3}``); ValueError naming the key."""
    nested: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        if "." in key:
            section, name = key.split(".", 1)
            nested.setdefault(section, {})[name] = value
    for section, changes in nested.items():
        sub = getattr(model_config, section, None)
        if sub is None or not dataclasses.is_dataclass(sub):
            raise ValueError(
                f"model.overrides[{section + '.' + next(iter(changes))!r}]: "
                f"the model has no {section!r} section to override (valid: a nested config the "
                f"model has, e.g. 'moe.' for MoE models, 'mtp.' for models with MTP)"
            )
        known = {f.name for f in dataclasses.fields(sub)}
        for name in changes:
            if name not in known:
                raise ValueError(
                    f"model.overrides[{section + '.' + name!r}]: {type(sub).__name__} has no field "
                    f"{name!r}; valid: {sorted(known)}"
                )
        model_config = model_config.replace(**{section: dataclasses.replace(sub, **changes)})
    return model_config


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
    return build_pipeline_chunks(
        model_config,
        groups,
        device=device,
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
    )
