"""Model families, one module each: the place that says "this is Llama 3 / Qwen3-MoE / DeepSeek-V3".

Each family module declares its presets (``PRESETS``: published shapes, ``TINY_PRESETS``: CPU
twins with the same features), the published parameter counts they are checked against
(``PUBLISHED_PARAMS``), the layer layout :func:`~shardwork.models.spec.spec_for` gives its
configs (module docstring), and the Hugging Face ``model_type`` s its configs map to
(``HF_MODEL_TYPES``) with the Hugging Face adapter of each (the ``HFAdapter`` in
:mod:`shardwork.models.hf.registry`, keyed by those types). Families do not import the bridge
and the bridge does not import families (no cycle); a test checks the two agree.

:data:`DENSE_FAMILIES` and :data:`MOE_FAMILIES` list them in preset order;
:mod:`shardwork.models.presets` and :mod:`shardwork.models.presets_moe` gather their presets.
"""

from shardwork.models.families import (
    deepseek,
    gemma,
    gpt2,
    llama,
    mixtral,
    nemotron_h,
    qwen,
    qwen3_next,
    qwen_moe,
)

__all__ = ["DENSE_FAMILIES", "FAMILIES", "MOE_FAMILIES"]

DENSE_FAMILIES = (llama, qwen, gemma, nemotron_h, gpt2)
MOE_FAMILIES = (mixtral, qwen_moe, deepseek, qwen3_next)
FAMILIES = DENSE_FAMILIES + MOE_FAMILIES
