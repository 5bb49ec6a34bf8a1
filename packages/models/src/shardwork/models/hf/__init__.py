"""shardwork.models.hf: Hugging Face bridge for Llama (2, 3, 3.1, 3.2), Qwen2, Qwen3, GPT-2,
Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, Nemotron-H and Qwen3-Next.

- One :class:`HFAdapter` per ``model_type`` (config fields both ways, tensor names, weight
  layout) in a registry (:data:`ADAPTERS`, :func:`register_adapter`, :func:`adapter_for`);
  the rest of the bridge is generic.
- :func:`from_pretrained` / :func:`load_hf_weights`: import a transformers checkpoint folder
  (config.json + safetensors, sharded index included) into a GPTModel at any layout, each rank
  reading only its slices.
- :func:`save_pretrained`: export to a folder transformers loads.
- :func:`gpt_config_from_hf` / :func:`hf_config_from_gpt`: config translation (transformers
  4.x and 5.x field names); :func:`to_hf_key` / ``KEY_RULES``: tensor names.
- :mod:`~shardwork.models.hf.gated_attention_weights`: Qwen3-Next's per-head interleaved
  ``q_proj`` to and from shardwork's ``q`` and ``gate`` blocks (gated attention).
"""

from shardwork.models.hf.adapter import HFAdapter
from shardwork.models.hf.checkpoint import from_pretrained, load_hf_weights, save_pretrained
from shardwork.models.hf.config_map import (
    SUPPORTED_MODEL_TYPES,
    gpt_config_from_hf,
    hf_config_from_gpt,
    read_hf_config,
)
from shardwork.models.hf.keys import KEY_RULES, to_hf_key
from shardwork.models.hf.registry import (
    ADAPTERS,
    adapter_for,
    adapter_for_config,
    register_adapter,
    supported_model_types,
)

__all__ = [
    "ADAPTERS",
    "KEY_RULES",
    "SUPPORTED_MODEL_TYPES",
    "HFAdapter",
    "adapter_for",
    "adapter_for_config",
    "from_pretrained",
    "gpt_config_from_hf",
    "hf_config_from_gpt",
    "load_hf_weights",
    "read_hf_config",
    "register_adapter",
    "save_pretrained",
    "supported_model_types",
    "to_hf_key",
]
