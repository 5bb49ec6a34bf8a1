"""shardwork.models.hf: Hugging Face bridge for Llama (2, 3, 3.1, 3.2), Qwen2 and Qwen3.

- :func:`from_pretrained` / :func:`load_hf_weights`: import a transformers checkpoint folder
  (config.json + safetensors, sharded index included) into a GPTModel at any layout, each rank
  reading only its slices.
- :func:`save_pretrained`: export to a folder transformers loads.
- :func:`gpt_config_from_hf` / :func:`hf_config_from_gpt`: config translation (transformers
  4.x and 5.x field names); :func:`to_hf_key` / ``KEY_RULES``: tensor names.
"""

from shardwork.models.hf.checkpoint import from_pretrained, load_hf_weights, save_pretrained
from shardwork.models.hf.config_map import (
    SUPPORTED_MODEL_TYPES,
    gpt_config_from_hf,
    hf_config_from_gpt,
    read_hf_config,
)
from shardwork.models.hf.keys import KEY_RULES, to_hf_key

__all__ = [
    "KEY_RULES",
    "SUPPORTED_MODEL_TYPES",
    "from_pretrained",
    "gpt_config_from_hf",
    "hf_config_from_gpt",
    "load_hf_weights",
    "read_hf_config",
    "save_pretrained",
    "to_hf_key",
]
