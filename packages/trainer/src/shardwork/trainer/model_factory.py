"""From the trainer's model section to shardwork.models objects (no model code lives here).

- :func:`gpt_config` builds the :class:`shardwork.models.GPTConfig`: a preset, the
  config.json of ``checkpoint.hf_init`` (translated by shardwork.models.hf) or the demo
  dimensions, then the ``[model]`` settings (GPTConfig fields and nested tables, applied by
  :func:`~shardwork.trainer.config.model_table.apply_model_settings`), then precision,
  sequence parallelism and seeds from their own sections.
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
from shardwork.trainer.config.model_settings import apply_model_settings
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

    The base is ``checkpoint.hf_init``'s config.json (read from disk unless ``hf``, its
    contents as a checkpoint stores them, is given), else ``model.preset``, else the demo
    dimensions; the ``[model]`` settings apply on top, then what other sections decide
    (precision, sequence parallelism, seeds).
    """
    m = config.model
    settings = dict(m.settings)
    decided: dict[str, Any] = dict(
        params_dtype=_DTYPES[config.precision.dtype],
        sequence_parallel=config.parallel.sequence_parallel,
        init_seed=config.seed,
        dropout_seed=config.seed,
    )
    if config.parallel.fsdp != "off" and config.precision.dtype == "bf16":
        # FSDP mixed precision: the sharded parameters are the fp32 masters, the layers compute
        # in bf16 on bf16 copies gathered for them.
        decided.update(params_dtype=torch.float32, compute_dtype=torch.bfloat16)
    if config.checkpoint.hf_init is not None:
        base = hf_gpt_config(hf if hf is not None else hf_config(config.checkpoint.hf_init))
    elif m.preset is not None:
        base = preset(m.preset)
        decided["max_position_embeddings"] = max(
            base.max_position_embeddings, config.data.seq_length
        )
    else:
        dims = {k: settings.pop(k, v) for k, v in DEMO_MODEL.items()}
        base = GPTConfig(
            **dims,
            vocab_size=settings.pop("vocab_size"),
            max_position_embeddings=settings.pop("max_position_embeddings", config.data.seq_length),
        )
    # A max_position_embeddings the run sets wins over the one derived from the sequence length.
    decided = {k: v for k, v in decided.items() if k not in settings}
    return apply_model_settings(base.replace(**decided), settings)


def build_model_chunks(
    model_config,
    groups,
    *,
    device: torch.device,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    first_virtual_stage_layers: int | None = None,
    last_virtual_stage_layers: int | None = None,
    mtp_standalone: bool = False,
) -> list:
    """This rank's model chunks: one per virtual pipeline stage (one at pp = 1).

    shardwork.models.pipeline.build_model_chunks decides the layers of each chunk
    (``mtp_standalone``: the MTP depths alone on the last rank).
    """
    return build_pipeline_chunks(
        model_config,
        groups,
        device=device,
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
        first_virtual_stage_layers=first_virtual_stage_layers,
        last_virtual_stage_layers=last_virtual_stage_layers,
        mtp_standalone=mtp_standalone,
    )
