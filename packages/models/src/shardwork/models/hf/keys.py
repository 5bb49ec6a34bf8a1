"""Names of tensors in shardwork checkpoints vs. Hugging Face checkpoints (dense families).

shardwork keys come from ``GPTModel.sharded_state_dict()``; fused blocks have their own keys
(``linear_qkv.weight.q``, ``mlp.fc1.weight.gate``), so every shardwork key maps to exactly one
HF tensor and slices of it can be read without touching the rest. ``KEY_RULES`` is an ordered
list of (regex, template) pairs; model families with more tensors (MoE) extend it.
"""

from __future__ import annotations

import re

__all__ = ["KEY_RULES", "to_hf_key"]

_L = r"decoder\.layers\.(\d+)\."
KEY_RULES: list[tuple[str, str]] = [
    (r"embedding\.word_embeddings\.weight", "model.embed_tokens.weight"),
    (r"decoder\.final_norm\.weight", "model.norm.weight"),
    (r"output_layer\.weight", "lm_head.weight"),
    (_L + r"input_layernorm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (_L + r"pre_mlp_layernorm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (
        _L + r"self_attention\.linear_qkv\.(weight|bias)\.(q|k|v)",
        r"model.layers.\1.self_attn.\3_proj.\2",
    ),
    (_L + r"self_attention\.linear_proj\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (_L + r"self_attention\.q_layernorm\.weight", r"model.layers.\1.self_attn.q_norm.weight"),
    (_L + r"self_attention\.k_layernorm\.weight", r"model.layers.\1.self_attn.k_norm.weight"),
    (_L + r"mlp\.fc1\.weight\.(gate|up)", r"model.layers.\1.mlp.\2_proj.weight"),
    (_L + r"mlp\.fc2\.weight", r"model.layers.\1.mlp.down_proj.weight"),
]


def to_hf_key(key: str, rules: list[tuple[str, str]] | None = None) -> str:
    """The HF tensor name of shardwork ``key`` (ValueError if no rule matches)."""
    for pattern, template in rules or KEY_RULES:
        if re.fullmatch(pattern, key):
            return re.sub(pattern, template, key)
    raise ValueError(f"no Hugging Face name for checkpoint key {key!r}")
