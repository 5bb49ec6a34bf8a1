"""shardwork.models.hf: Hugging Face bridge for Llama (2, 3, 3.1, 3.2), Qwen2, Qwen3, GPT-2,
Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, Nemotron-H and Qwen3-Next.

- One :class:`HFAdapter` per ``model_type`` (config fields both ways, tensor names, weight
  layout) in a registry (:data:`ADAPTERS`, :func:`register_adapter`, :func:`adapter_for`);
  the rest of the bridge is generic.
- :func:`from_pretrained` / :func:`load_hf_weights`: import a transformers checkpoint folder
  (config.json + safetensors, sharded index included) into a GPTModel at any layout, each rank
  reading only its slices.
  The one call builds this rank's pipeline stage at any layout and returns it in eval mode.
- :func:`save_pretrained`: export to a folder transformers loads, with the model's token ids
  (:class:`~shardwork.models.token_ids.TokenIds`, :func:`read_token_ids`) in ``config.json``
  and ``generation_config.json``.
- :func:`hf_outputs`: logits ``[b, s, V]``, per-layer hidden states and router logits shaped
  as transformers returns them, for parity checks.
- :func:`gpt_config_from_hf` / :func:`hf_config_from_gpt`: config translation (transformers
  4.x and 5.x field names); :func:`to_hf_key` / ``KEY_RULES``: tensor names.
- :mod:`~shardwork.models.hf.gated_attention_weights`: Qwen3-Next's per-head interleaved
  ``q_proj`` to and from shardwork's ``q`` and ``gate`` blocks (gated attention).
- :func:`export_peft` / :func:`import_peft`: LoRA adapters to and from a Hugging Face PEFT
  folder (``adapter_config.json`` + ``adapter_model.safetensors``); fused q/k/v and gate/up
  become per-projection adapters and back (rank-``k r`` blocks for independent ``A`` s).
"""

from shardwork.models.hf.adapter import HFAdapter
from shardwork.models.hf.checkpoint import (
    check_hf_weights,
    from_pretrained,
    load_hf_weights,
    save_pretrained,
)
from shardwork.models.hf.config_map import (
    SUPPORTED_MODEL_TYPES,
    gpt_config_from_hf,
    hf_config_from_gpt,
    read_hf_config,
)
from shardwork.models.hf.keys import KEY_RULES, to_hf_key
from shardwork.models.hf.outputs import HFOutputs, hf_outputs
from shardwork.models.hf.peft_export import export_peft
from shardwork.models.hf.peft_import import import_peft
from shardwork.models.hf.registry import (
    ADAPTERS,
    adapter_for,
    adapter_for_config,
    register_adapter,
    supported_model_types,
)
from shardwork.models.hf.token_ids import read_token_ids

__all__ = [
    "ADAPTERS",
    "KEY_RULES",
    "SUPPORTED_MODEL_TYPES",
    "HFAdapter",
    "HFOutputs",
    "adapter_for",
    "adapter_for_config",
    "check_hf_weights",
    "export_peft",
    "from_pretrained",
    "gpt_config_from_hf",
    "hf_config_from_gpt",
    "hf_outputs",
    "import_peft",
    "load_hf_weights",
    "read_hf_config",
    "read_token_ids",
    "register_adapter",
    "save_pretrained",
    "supported_model_types",
    "to_hf_key",
]
