"""Adapter-only checkpoints through dist-checkpoint: the LoRA factors and their LoRAConfig.

The checkpoint holds ``{"model": lora_state_dict(model)}`` (global coordinates, so it loads
at any TP/PP/EP layout) and records the :class:`LoRAConfig` in ``shardwork.json``'s user
metadata under ``"lora"``. :func:`load_lora_checkpoint` compares that record with the model's
adapters before reading anything, so an adapter of another rank, scale or target set is
refused with the differing fields named instead of failing on shapes (or, for alpha, loading
silently with the wrong scale).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from shardwork.dist_checkpoint import load, read_info, save
from shardwork.models.lora import lora_modules, lora_state_dict
from shardwork.models.lora_config import LoRAConfig
from shardwork.models.module import ShardedModule

__all__ = [
    "LORA_METADATA_KEY",
    "check_lora_record",
    "load_lora_checkpoint",
    "lora_config_record",
    "save_lora_checkpoint",
]

LORA_METADATA_KEY = "lora"
# Dropout changes training only, not what the adapter computes: a resumed or re-used adapter
# may train with another dropout.
_MUST_AGREE = ("rank", "alpha", "use_rslora", "target_modules")


def lora_config_record(config: LoRAConfig) -> dict[str, Any]:
    """``config`` as JSON values (target_modules a list, or the regular expression)."""
    record = dataclasses.asdict(config)
    if isinstance(config.target_modules, tuple):
        record["target_modules"] = list(config.target_modules)
    return record


def _model_config(model: ShardedModule) -> LoRAConfig:
    configs = {id(m.lora_config): m.lora_config for m in lora_modules(model)}
    if not configs:
        raise ValueError("the model has no LoRA adapters: call apply_lora first")
    return next(iter(configs.values()))


def save_lora_checkpoint(
    model: ShardedModule, path: str | os.PathLike, *, group: Any = None, overwrite: bool = False
) -> None:
    """Save ``model``'s adapters (only) to the directory ``path`` (collective over ``group``)."""
    record = lora_config_record(_model_config(model))
    save(
        {"model": lora_state_dict(model)},
        path,
        group=group,
        metadata={LORA_METADATA_KEY: record},
        overwrite=overwrite,
    )


def check_lora_record(saved: dict[str, Any] | None, config: LoRAConfig, path) -> None:
    """Raise ``ValueError`` unless the checkpoint's LoRA record agrees with ``config``."""
    if saved is None:
        raise ValueError(f"{str(path)!r} is not a LoRA adapter checkpoint (no 'lora' record)")
    mine = lora_config_record(config)
    differ = [f"{k}: saved {saved.get(k)!r}, model {mine[k]!r}" for k in _MUST_AGREE]
    differ = [d for d, k in zip(differ, _MUST_AGREE) if saved.get(k) != mine[k]]
    if differ:
        raise ValueError(
            f"LoRA adapter checkpoint {str(path)!r} does not fit this model's LoRAConfig: "
            + "; ".join(differ)
        )


def load_lora_checkpoint(model: ShardedModule, path: str | os.PathLike, *, group: Any = None):
    """Load adapters saved by :func:`save_lora_checkpoint` into ``model`` at its layout."""
    info = read_info(path)
    saved = (info.get("user_metadata") or {}).get(LORA_METADATA_KEY)
    check_lora_record(saved, _model_config(model), path)
    load({"model": lora_state_dict(model)}, path, group=group)
