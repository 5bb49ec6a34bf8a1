"""The registry of Hugging Face adapters, keyed by ``model_type``; the bridge's only entry to
family knowledge.

Import direction: the registry imports the adapter modules of :mod:`shardwork.models.hf`
(:mod:`~shardwork.models.hf.dense_adapters`, :mod:`~shardwork.models.hf.gemma`,
:mod:`~shardwork.models.hf.moe_adapters`,
:mod:`~shardwork.models.hf.nemotron_h`, :mod:`~shardwork.models.hf.qwen3_next`,
:mod:`~shardwork.models.hf.gpt2`); the
family modules in :mod:`shardwork.models.families` name their ``model_type`` s
(``HF_MODEL_TYPES``) and point to those adapters, but neither side imports the other, so no
cycle can form (a test checks that the families' types are exactly the registry's keys).
"""

from __future__ import annotations

from typing import Any

from shardwork.models.config import GPTConfig
from shardwork.models.hf.adapter import HFAdapter
from shardwork.models.hf.dense_adapters import DENSE_ADAPTERS
from shardwork.models.hf.gemma import GEMMA_ADAPTERS
from shardwork.models.hf.gpt2 import GPT2
from shardwork.models.hf.moe_adapters import MOE_ADAPTERS
from shardwork.models.hf.nemotron_h import NEMOTRON_H
from shardwork.models.hf.qwen3_next import QWEN3_NEXT
from shardwork.models.layer_options import non_default_layer_options

__all__ = [
    "ADAPTERS",
    "adapter_for",
    "adapter_for_config",
    "register_adapter",
    "supported_model_types",
]

ADAPTERS: dict[str, HFAdapter] = {
    a.model_type: a
    for a in (*DENSE_ADAPTERS, *GEMMA_ADAPTERS, *MOE_ADAPTERS, NEMOTRON_H, QWEN3_NEXT, GPT2)
}
"""Every registered adapter by ``model_type`` (built-in ones, then :func:`register_adapter`)."""


def register_adapter(adapter: HFAdapter) -> None:
    """Add ``adapter`` to the registry (ValueError if its ``model_type`` already has one)."""
    if adapter.model_type in ADAPTERS:
        raise ValueError(
            f"model_type={adapter.model_type!r} already has an adapter; "
            f"registered: {', '.join(supported_model_types())}"
        )
    ADAPTERS[adapter.model_type] = adapter


def supported_model_types() -> tuple[str, ...]:
    """The registered ``model_type`` s, sorted."""
    return tuple(sorted(ADAPTERS))


def adapter_for(model_type: Any) -> HFAdapter:
    """The adapter of an HF ``model_type`` (ValueError listing the supported ones otherwise)."""
    if model_type not in ADAPTERS:
        raise ValueError(
            f"model_type={model_type!r} is not supported; "
            f"valid: {', '.join(supported_model_types())}"
        )
    return ADAPTERS[model_type]


def adapter_for_config(config: GPTConfig) -> HFAdapter:
    """The one adapter that claims ``config`` (ValueError when none or several do)."""
    found = [a for a in ADAPTERS.values() if a.claims(config)]
    if len(found) != 1:
        features = (
            f"moe={'yes' if config.moe is not None else 'no'}, "
            f"mla={'yes' if config.mla is not None else 'no'}, "
            f"qk_layernorm={config.qk_layernorm}, add_qkv_bias={config.add_qkv_bias}"
        )
        for name, value in non_default_layer_options(config).items():
            features += f", {name}={value!r}"
        claimed = ", ".join(a.model_type for a in found) or "none"
        raise ValueError(
            f"a config with {features} has no single Hugging Face model_type (claimed by: "
            f"{claimed}); supported: {', '.join(supported_model_types())}"
        )
    return found[0]
