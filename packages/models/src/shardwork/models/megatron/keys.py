"""Megatron-Core tensor names and fused layouts -> shardwork keys (the key map).

Names are first brought to Megatron's local-spec form (:data:`TE_RENAMES`): the Transformer
Engine spec fuses each pre-norm into the following linear, so its weight is stored as
``self_attention.linear_qkv.layer_norm_weight`` / ``mlp.linear_fc1.layer_norm_weight``, and
the local spec writes those same names through its ``sharded_state_dict_keys_map`` unless that
map is emptied. Then each per-layer key maps by :data:`RULES` (regex on the key after
``decoder.layers.<i>.``) to one shardwork key, or is split:

- ``self_attention.linear_qkv.weight`` ``[g*(q/g+2)*d, h]`` is interleaved per query group
  (the group's ``q/g`` query heads, then its key head, then its value head): split into
  ``linear_qkv.weight.q`` / ``.k`` / ``.v`` (biases alike).
- ``mlp.linear_fc1.weight`` of a SwiGLU MLP is ``[gate; up]`` (``2*ffn`` rows, global order
  whatever the TP size): split into ``mlp.fc1.weight.gate`` / ``.up``; experts alike.
- Experts: SequentialMLP ``mlp.experts.local_experts.<e>.linear_fc1.weight`` (module name;
  its sharded key is ``mlp.experts.experts.<e>.linear_fc1.weight``) and TE's grouped
  GEMM ``mlp.experts.linear_fc1.weight<e>`` both become ``mlp.experts.linear_fc1.weight.<e>.*``.
"""

from __future__ import annotations

import re

import torch

__all__ = ["RULES", "TE_RENAMES", "megatron_to_shardwork"]

TE_RENAMES: list[tuple[str, str]] = [
    (r"self_attention\.linear_qkv\.layer_norm_weight", "input_layernorm.weight"),
    (r"mlp\.linear_fc1\.layer_norm_weight", "pre_mlp_layernorm.weight"),
]
"""Per-layer TE-spec names -> local-spec names."""

_TOP = {
    "embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "decoder.final_layernorm.weight": "decoder.final_norm.weight",
    "output_layer.weight": "output_layer.weight",
}
_EXPERT = (
    r"mlp\.experts\.(?:(?:local_experts|experts)\.(\d+)\.linear_(fc[12])\.weight"
    r"|linear_(fc[12])\.weight(\d+))"
)
RULES: list[tuple[str, str]] = [
    (r"input_layernorm\.weight", "input_layernorm.weight"),
    (r"pre_mlp_layernorm\.weight", "pre_mlp_layernorm.weight"),
    (r"self_attention\.linear_qkv\.(weight|bias)", "qkv"),
    (r"self_attention\.linear_proj\.weight", "self_attention.linear_proj.weight"),
    (r"self_attention\.q_layernorm\.weight", "self_attention.q_layernorm.weight"),
    (r"self_attention\.k_layernorm\.weight", "self_attention.k_layernorm.weight"),
    (r"mlp\.linear_fc1\.weight", "fc1"),
    (r"mlp\.linear_fc2\.weight", "mlp.fc2.weight"),
    (r"mlp\.router\.weight", "mlp.router.weight"),
    (r"mlp\.router\.expert_bias", "mlp.router.expert_bias"),
    (r"mlp\.router\.qb_beta", "mlp.router.qb_beta"),
    (_EXPERT, "expert"),
]
"""Per-layer Megatron local-spec name (regex) -> shardwork name, or a split kind."""

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def _split_qkv(t: torch.Tensor, key: str, attn: tuple[int, ...]) -> dict[str, torch.Tensor]:
    heads, groups, head_dim, hidden = attn
    per = heads // groups
    expected = (groups * (per + 2) * head_dim, hidden)[: t.dim()]
    if tuple(t.shape) != expected:
        raise ValueError(
            f"Megatron {key!r} has shape {tuple(t.shape)} in the checkpoint, but the config "
            f"gives {expected} ({groups} query groups of {per} query heads + key + value, "
            f"head_dim {head_dim}, hidden_size {hidden})"
        )
    blocks = t.reshape(groups, (per + 2) * head_dim, *t.shape[1:])
    q, k, v = blocks.split([per * head_dim, head_dim, head_dim], dim=1)
    flat = (lambda x: x.reshape(-1, *t.shape[1:])) if t.dim() > 1 else (lambda x: x.reshape(-1))
    return {"q": flat(q), "k": flat(k), "v": flat(v)}


def _split_fc1(t: torch.Tensor, key: str) -> dict[str, torch.Tensor]:
    if t.shape[0] % 2:
        raise ValueError(f"Megatron {key!r} has {t.shape[0]} rows: a SwiGLU fc1 needs [gate; up]")
    gate, up = t.chunk(2, dim=0)
    return {"gate": gate, "up": up}


def _layer_entries(rest: str, t: torch.Tensor, attn: tuple[int, ...], full_key: str):
    """``(shardwork suffix, tensor)`` pairs of one per-layer Megatron tensor; None if unknown."""
    for pattern, repl in TE_RENAMES:
        rest = re.sub(f"^{pattern}$", repl, rest)
    for pattern, target in RULES:
        m = re.fullmatch(pattern, rest)
        if m is None:
            continue
        if target == "qkv":
            parts = _split_qkv(t, full_key, attn)
            return [(f"self_attention.linear_qkv.{m[1]}.{p}", x) for p, x in parts.items()]
        if target == "fc1":
            return [(f"mlp.fc1.weight.{p}", x) for p, x in _split_fc1(t, full_key).items()]
        if target == "expert":
            expert, fc = (m[1], m[2]) if m[1] is not None else (m[4], m[3])
            base = f"mlp.experts.linear_{fc}.weight.{int(expert)}"
            if fc == "fc2":
                return [(base, t)]
            return [(f"{base}.{p}", x) for p, x in _split_fc1(t, full_key).items()]
        return [(target, t)]
    return None


def megatron_to_shardwork(
    tensors: dict[str, torch.Tensor], *, heads: int, groups: int, head_dim: int, hidden: int
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``({shardwork key: tensor}, [Megatron keys with no mapping])`` of per-layer-indexed keys."""
    out: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    for key, t in tensors.items():
        if key in _TOP:
            out[_TOP[key]] = t
            continue
        m = _LAYER.fullmatch(key)
        entries = (
            None if m is None else _layer_entries(m[2], t, (heads, groups, head_dim, hidden), key)
        )
        if entries is None:
            unknown.append(key)
            continue
        for suffix, x in entries:
            out[f"decoder.layers.{m[1]}.{suffix}"] = x
    return out, unknown
