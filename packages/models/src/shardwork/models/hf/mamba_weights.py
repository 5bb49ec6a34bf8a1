"""Hugging Face NemotronH Mamba-2 mixer <-> :class:`~shardwork.models.mamba.Mamba2Mixer`:
tensor names and config fields (the nemotron_h family adapter calls these per Mamba layer).

Tensors: transformers' ``NemotronHMamba2Mixer`` fuses ``in_proj.weight`` as rows
``[z | x | B | C | dt]`` and ``conv1d.weight`` / ``.bias`` as channels ``[x | B | C]``;
shardwork keeps each block under its own key (``in_proj.weight.z`` ...,
``conv1d.weight.x`` ...) so that its checkpoints are layout-free. The block widths are read
from the tensors themselves (``A_log`` gives the heads, ``conv1d.weight`` the conv channels),
so no config is needed. ``dt_bias``, ``A_log``, ``D``, ``norm.weight`` and ``out_proj.*``
keep their names.

Config: :func:`mamba_config_from_hf` reads the mixer's fields of a ``NemotronHConfig`` (a
``config.json`` dict or the config object); :func:`mamba_config_to_hf` is the reverse. The
transformers mixer clamps ``dt`` to ``(time_step_min, inf)`` whatever ``time_step_limit``
says, so ``dt_limit`` is read as that, and only a ``MambaConfig`` whose ``dt_limit`` is
``(dt_min, inf)`` can be written back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from shardwork.models.mamba_config import MambaConfig

__all__ = ["mamba_config_from_hf", "mamba_config_to_hf", "mamba_from_hf", "mamba_to_hf"]

_KEPT = ("dt_bias", "A_log", "D", "norm.weight", "out_proj.weight", "out_proj.bias")
_PROJ_BLOCKS = ("z", "x", "B", "C", "dt")
_CONV_BLOCKS = ("x", "B", "C")


def _widths(heads: int, conv_channels: int, proj_rows: int) -> tuple[int, int]:
    """``(inner, bc)``: the x/z width and the B/C width, from the fused tensors' sizes (x is
    whole heads, B and C equally wide)."""
    inner = proj_rows - conv_channels - heads
    bc, odd = divmod(conv_channels - inner, 2)
    if inner <= 0 or bc <= 0 or odd or inner % heads:
        raise ValueError(
            f"in_proj has {proj_rows} rows and conv1d {conv_channels} channels with {heads} "
            "heads: not the [z | x | B | C | dt] / [x | B | C] layout of a Mamba-2 mixer"
        )
    return inner, bc


def mamba_from_hf(
    tensors: Mapping[str, torch.Tensor], prefix: str, *, out_prefix: str = ""
) -> dict[str, torch.Tensor]:
    """The mixer's tensors named ``prefix + <HF name>`` in ``tensors`` as shardwork keys
    ``out_prefix + <key>`` (views; fused blocks split)."""
    weight = tensors[prefix + "in_proj.weight"]
    conv_w = tensors[prefix + "conv1d.weight"]
    inner, bc = _widths(tensors[prefix + "A_log"].shape[0], conv_w.shape[0], weight.shape[0])
    heads = tensors[prefix + "A_log"].shape[0]
    proj_sizes, conv_sizes = (inner, inner, bc, bc, heads), (inner, bc, bc)
    out: dict[str, torch.Tensor] = {}
    for name, sizes, blocks in (
        ("in_proj.weight", proj_sizes, _PROJ_BLOCKS),
        ("in_proj.bias", proj_sizes, _PROJ_BLOCKS),
        ("conv1d.weight", conv_sizes, _CONV_BLOCKS),
        ("conv1d.bias", conv_sizes, _CONV_BLOCKS),
    ):
        if prefix + name not in tensors:  # biases are optional
            continue
        for block, part in zip(blocks, tensors[prefix + name].split(sizes, dim=0)):
            out[f"{out_prefix}{name}.{block}"] = part
    for name in _KEPT:
        if prefix + name in tensors:
            out[out_prefix + name] = tensors[prefix + name]
    return out


def mamba_to_hf(
    tensors: Mapping[str, torch.Tensor], prefix: str, *, hf_prefix: str = ""
) -> dict[str, torch.Tensor]:
    """The inverse of :func:`mamba_from_hf`: shardwork keys ``prefix + <key>`` -> HF names
    ``hf_prefix + <name>`` (fused blocks concatenated)."""
    out: dict[str, torch.Tensor] = {}
    for name, blocks in (
        ("in_proj.weight", _PROJ_BLOCKS),
        ("in_proj.bias", _PROJ_BLOCKS),
        ("conv1d.weight", _CONV_BLOCKS),
        ("conv1d.bias", _CONV_BLOCKS),
    ):
        keys = [f"{prefix}{name}.{block}" for block in blocks]
        present = [k in tensors for k in keys]
        if not any(present):
            continue
        if not all(present):
            missing = [k for k, p in zip(keys, present) if not p]
            raise KeyError(f"mamba_to_hf: {name} lacks blocks {missing}")
        out[hf_prefix + name] = torch.cat([tensors[k] for k in keys], dim=0)
    for name in _KEPT:
        if prefix + name in tensors:
            out[hf_prefix + name] = tensors[prefix + name]
    return out


_ALIASES = {  # NemotronHConfig accepts these older names in config.json
    "n_groups": "mamba_n_groups",
    "conv_kernel": "mamba_d_conv",
    "time_step_min": "mamba_dt_min",
    "time_step_max": "mamba_dt_max",
    "time_step_floor": "mamba_dt_init_floor",
    "use_conv_bias": "mamba_conv_bias",
    "chunk_size": "mamba_chunk_size",
}
_DEFAULTS = {  # NemotronHConfig's defaults, for fields a config.json may omit
    "n_groups": 8,
    "conv_kernel": 4,
    "chunk_size": 128,
    "use_conv_bias": True,
    "use_bias": False,
    "time_step_min": 0.001,
    "time_step_max": 0.1,
    "time_step_floor": 1e-4,
    "layer_norm_epsilon": 1e-5,
    "mamba_hidden_act": "silu",
}


def _field(hf: Mapping[str, Any], name: str) -> Any:
    if name in hf:
        return hf[name]
    if name in _ALIASES and _ALIASES[name] in hf:
        return hf[_ALIASES[name]]
    if name in _DEFAULTS:
        return _DEFAULTS[name]
    raise ValueError(f"NemotronH config lacks {name!r}: the Mamba mixer needs it")


def mamba_config_from_hf(hf_config: Mapping[str, Any] | Any) -> MambaConfig:
    """The :class:`MambaConfig` of a NemotronH config (``config.json`` dict or config object)."""
    hf = hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
    act = _field(hf, "mamba_hidden_act")
    if act != "silu":
        raise ValueError(f"NemotronH mamba_hidden_act={act!r} is not supported: only 'silu' is")
    dt_min = float(_field(hf, "time_step_min"))
    return MambaConfig(
        num_heads=int(_field(hf, "mamba_num_heads")),
        head_dim=int(_field(hf, "mamba_head_dim")),
        state_size=int(_field(hf, "ssm_state_size")),
        num_groups=int(_field(hf, "n_groups")),
        conv_kernel=int(_field(hf, "conv_kernel")),
        chunk_size=int(_field(hf, "chunk_size")),
        conv_bias=bool(_field(hf, "use_conv_bias")),
        proj_bias=bool(_field(hf, "use_bias")),
        dt_min=dt_min,
        dt_max=float(_field(hf, "time_step_max")),
        dt_init_floor=float(_field(hf, "time_step_floor")),
        dt_limit=(dt_min, math.inf),
        norm_epsilon=float(_field(hf, "layer_norm_epsilon")),
    )


def mamba_config_to_hf(mamba: MambaConfig, *, norm_epsilon: float) -> dict[str, Any]:
    """The NemotronH ``config.json`` fields of ``mamba`` (``norm_epsilon``: the model's, used
    when ``mamba.norm_epsilon`` is None). NemotronH shares ``layer_norm_epsilon`` and
    ``use_bias`` with its other layers: the adapter must check they agree."""
    if tuple(mamba.dt_limit) != (mamba.dt_min, math.inf):
        raise ValueError(
            f"MambaConfig.dt_limit={mamba.dt_limit!r} cannot be written to a NemotronH config: "
            f"its mixer clamps dt to (time_step_min, inf) = ({mamba.dt_min}, inf)"
        )
    return {
        "mamba_num_heads": mamba.num_heads,
        "mamba_head_dim": mamba.head_dim,
        "ssm_state_size": mamba.state_size,
        "n_groups": mamba.num_groups,
        "conv_kernel": mamba.conv_kernel,
        "chunk_size": mamba.chunk_size,
        "use_conv_bias": mamba.conv_bias,
        "use_bias": mamba.proj_bias,
        "mamba_hidden_act": "silu",
        "time_step_min": mamba.dt_min,
        "time_step_max": mamba.dt_max,
        "time_step_floor": mamba.dt_init_floor,
        "time_step_limit": [mamba.dt_min, math.inf],
        "layer_norm_epsilon": norm_epsilon if mamba.norm_epsilon is None else mamba.norm_epsilon,
    }
