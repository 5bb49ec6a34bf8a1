"""Qwen3-Next's Gated DeltaNet weights <-> :class:`~shardwork.models.deltanet.GatedDeltaNetMixer`
keys, and the ``linear_*`` config fields <-> :class:`~shardwork.models.GatedDeltaNetConfig`.

Transformers (``Qwen3NextGatedDeltaNet``) fuses its input projections per key-head group: the
rows of ``in_proj_qkvz.weight`` are, for each key head ``i`` in turn, ``q_i (dk), k_i (dk),
v_i (r·dv), z_i (r·dv)`` with ``r = nv/nk`` value heads per key head, and the rows of
``in_proj_ba.weight`` are ``b_i (r), a_i (r)``. Shardwork keeps each of q, k, v, z, b, a as a
block of its own (``in_proj.weight.<block>``, heads in order), so that tensor parallelism
splits every block by heads. The convolution's channels are q|k|v with heads in order on both
sides (only the ``[C, 1, K]`` vs ``[C, K]`` shape differs); ``A_log``, ``dt_bias``,
``norm.weight`` and ``out_proj.weight`` are the same tensors.

Both directions only reorder rows, so ``deltanet_to_hf(deltanet_from_hf(x)) == x`` exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from shardwork.models.deltanet_config import GatedDeltaNetConfig

__all__ = [
    "HF_DELTANET_FIELDS",
    "deltanet_config_from_hf",
    "deltanet_config_to_hf",
    "deltanet_from_hf",
    "deltanet_to_hf",
]

HF_DELTANET_FIELDS = {
    "linear_num_key_heads": "num_key_heads",
    "linear_num_value_heads": "num_value_heads",
    "linear_key_head_dim": "key_head_dim",
    "linear_value_head_dim": "value_head_dim",
    "linear_conv_kernel_dim": "conv_kernel",
}
"""Qwen3-Next config field -> :class:`GatedDeltaNetConfig` field."""


def deltanet_config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> GatedDeltaNetConfig:
    """The mixer config of a Qwen3-Next ``config.json`` dict (``overrides``: e.g. chunk_size)."""
    missing = [name for name in HF_DELTANET_FIELDS if name not in hf]
    if missing:
        raise ValueError(f"the Hugging Face config lacks {missing}: not a Qwen3-Next config?")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(
            f"hidden_act={act!r} is not supported for Gated DeltaNet layers: their convolution "
            "and output gate use SiLU (hidden_act='silu')"
        )
    fields = {ours: hf[theirs] for theirs, ours in HF_DELTANET_FIELDS.items()}
    return GatedDeltaNetConfig(**fields, **overrides)


def deltanet_config_to_hf(config: GatedDeltaNetConfig) -> dict[str, Any]:
    """The ``linear_*`` fields of a Qwen3-Next config for ``config``."""
    return {theirs: getattr(config, ours) for theirs, ours in HF_DELTANET_FIELDS.items()}


def _get(tensors: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"no tensor {name!r} among the Hugging Face weights")
    t = tensors[name]
    if tuple(t.shape) != shape:
        raise ValueError(f"{name!r} has shape {tuple(t.shape)}, expected {shape}")
    return t


def _dims(config: GatedDeltaNetConfig) -> tuple[int, int, int, int]:
    """(nk, dk, r·dv, r): per key-head group, its widths."""
    r = config.num_value_heads // config.num_key_heads
    return config.num_key_heads, config.key_head_dim, r * config.value_head_dim, r


def deltanet_from_hf(
    tensors: Mapping[str, torch.Tensor],
    prefix: str,
    config: GatedDeltaNetConfig,
    *,
    key_prefix: str = "",
) -> dict[str, torch.Tensor]:
    """Shardwork's global tensors (keys ``key_prefix + "in_proj.weight.q"`` ...) of the
    ``Qwen3NextGatedDeltaNet`` whose names start with ``prefix`` (e.g.
    ``"model.layers.0.linear_attn."``) in ``tensors``."""
    nk, dk, vg, r = _dims(config)
    out_proj = tensors.get(prefix + "out_proj.weight")
    if out_proj is None:
        raise ValueError(f"no tensor {prefix + 'out_proj.weight'!r} among the Hugging Face weights")
    h = out_proj.shape[0]
    qkvz = _get(tensors, prefix + "in_proj_qkvz.weight", (nk * (2 * dk + 2 * vg), h))
    ba = _get(tensors, prefix + "in_proj_ba.weight", (nk * 2 * r, h))
    channels = 2 * config.key_dim + config.value_dim
    conv = _get(tensors, prefix + "conv1d.weight", (channels, 1, config.conv_kernel))
    nv = config.num_value_heads
    out = {}
    q, k, v, z = qkvz.reshape(nk, 2 * dk + 2 * vg, h).split((dk, dk, vg, vg), dim=1)
    b, a = ba.reshape(nk, 2 * r, h).split((r, r), dim=1)
    for name, part in zip("qkvzba", (q, k, v, z, b, a)):
        out[f"in_proj.weight.{name}"] = part.reshape(-1, h)
    conv_q, conv_k, conv_v = conv[:, 0].split((config.key_dim, config.key_dim, config.value_dim))
    out.update({"conv_weight.q": conv_q, "conv_weight.k": conv_k, "conv_weight.v": conv_v})
    out["A_log"] = _get(tensors, prefix + "A_log", (nv,))
    out["dt_bias"] = _get(tensors, prefix + "dt_bias", (nv,))
    out["norm.weight"] = _get(tensors, prefix + "norm.weight", (config.value_head_dim,))
    out["out_proj.weight"] = _get(tensors, prefix + "out_proj.weight", (h, config.value_dim))
    return {key_prefix + key: t.contiguous().clone() for key, t in out.items()}


def deltanet_to_hf(
    tensors: Mapping[str, torch.Tensor],
    key_prefix: str,
    config: GatedDeltaNetConfig,
    *,
    prefix: str = "",
) -> dict[str, torch.Tensor]:
    """The inverse of :func:`deltanet_from_hf`: Hugging Face names (``prefix +
    "in_proj_qkvz.weight"`` ...) of the mixer whose global keys start with ``key_prefix``."""
    nk, dk, vg, r = _dims(config)
    out_proj = tensors.get(key_prefix + "out_proj.weight")
    if out_proj is None:
        raise ValueError(f"no tensor {key_prefix + 'out_proj.weight'!r} among the mixer's keys")
    h = out_proj.shape[0]
    widths = {"q": dk, "k": dk, "v": vg, "z": vg, "b": r, "a": r}
    parts = {
        name: _get(tensors, f"{key_prefix}in_proj.weight.{name}", (nk * width, h)).reshape(
            nk, width, h
        )
        for name, width in widths.items()
    }
    conv = [
        _get(tensors, f"{key_prefix}conv_weight.{name}", (width, config.conv_kernel))
        for name, width in (("q", config.key_dim), ("k", config.key_dim), ("v", config.value_dim))
    ]
    nv = config.num_value_heads
    out = {
        "in_proj_qkvz.weight": torch.cat([parts[n] for n in "qkvz"], dim=1).reshape(-1, h),
        "in_proj_ba.weight": torch.cat([parts[n] for n in "ba"], dim=1).reshape(-1, h),
        "conv1d.weight": torch.cat(conv).unsqueeze(1),
        "A_log": _get(tensors, key_prefix + "A_log", (nv,)),
        "dt_bias": _get(tensors, key_prefix + "dt_bias", (nv,)),
        "norm.weight": _get(tensors, key_prefix + "norm.weight", (config.value_head_dim,)),
        "out_proj.weight": _get(tensors, key_prefix + "out_proj.weight", (h, config.value_dim)),
    }
    return {prefix + name: t.contiguous().clone() for name, t in out.items()}
