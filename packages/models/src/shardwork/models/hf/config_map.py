"""Translate between a Hugging Face ``config.json`` (transformers 4.x or 5.x) and ``GPTConfig``.

Generic: the ``model_type`` picks an adapter from :mod:`~shardwork.models.hf.registry`, which
holds every family-specific field and check (dense: :mod:`~shardwork.models.hf.dense_adapters`,
MoE: :mod:`~shardwork.models.hf.moe_adapters`); export picks the adapter that claims the
config. RoPE: 5.x ``rope_parameters`` or 4.x ``rope_theta`` + ``rope_scaling``
(:mod:`~shardwork.models.hf.rope_map`); export writes the 4.x spelling, which 5.x also reads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from shardwork.models.config import GPTConfig
from shardwork.models.hf.registry import adapter_for, adapter_for_config, supported_model_types

__all__ = ["SUPPORTED_MODEL_TYPES", "gpt_config_from_hf", "hf_config_from_gpt", "read_hf_config"]

SUPPORTED_MODEL_TYPES = supported_model_types()
"""The built-in ``model_type`` s (dense and MoE), sorted."""


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a checkpoint folder as a dict."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder!s} has no config.json; valid: a Hugging Face checkpoint folder")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path!s} is not valid JSON ({err}); valid: a config.json") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{path!s} holds a {type(hf).__name__}; valid: a JSON object")
    return hf


def gpt_config_from_hf(hf: dict[str, Any], **overrides: Any) -> GPTConfig:
    """A ``GPTConfig`` for the HF config dict ``hf`` (``overrides`` win, e.g. dtypes, tp options)."""
    adapter = adapter_for(hf.get("model_type"))
    try:
        fields = adapter.fields_from_hf(hf)
    except KeyError as err:
        # The adapters index the fields every config.json of their family has.
        raise ValueError(
            f"config.json (model_type={hf.get('model_type')!r}) has no {err.args[0]!r} field, "
            "which this family's config.json always has: is the file complete?"
        ) from None
    return GPTConfig(**(fields | overrides))


def hf_config_from_gpt(config: GPTConfig, *, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """A ``config.json`` dict that transformers (4.x and 5.x) loads as the same model."""
    adapter = adapter_for_config(config)
    dt = str(dtype or config.params_dtype).removeprefix("torch.")
    return (
        {"architectures": [adapter.architecture], "model_type": adapter.model_type}
        | adapter.fields_to_hf(config)
        | {"torch_dtype": dt, "dtype": dt}
    )
