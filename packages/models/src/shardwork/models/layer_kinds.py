"""Registries of a layer's parts: the token mixer, the MLP and the norms, by kind name.

A :class:`~shardwork.models.spec.LayerSpec` names its parts by kind (``mixer="attention"``,
``mlp="moe"``, ``norm="rmsnorm"``); this module maps each kind to the function that builds the
module. Built in:

- mixers ``"attention"`` (:class:`~shardwork.models.attention.Attention`: MHA/GQA, QKV bias,
  QK-norm), ``"mla"`` (:class:`~shardwork.models.mla.MLAttention`, DeepSeek), ``"mamba"``
  (:class:`~shardwork.models.mamba.Mamba2Mixer`, needs ``GPTConfig.mamba``) and
  ``"gated_deltanet"`` (:class:`~shardwork.models.deltanet.GatedDeltaNetMixer`, Qwen3-Next);
- MLPs ``"dense"`` (:class:`~shardwork.models.mlp.SwiGLUMLP`, SwiGLU or GeGLU), ``"relu2"``
  (:class:`~shardwork.models.squared_relu_mlp.SquaredReLUMLP`, Nemotron-H), ``"gelu"``
  (:class:`~shardwork.models.gelu_mlp.GeLUMLP`, GPT-2) and ``"moe"``
  (:class:`~shardwork.models.moe.layer.MoELayer`);
- norms ``"rmsnorm"`` (:class:`~shardwork.models.norm.RMSNorm`) and ``"layernorm"``
  (:class:`~shardwork.models.layer_norm.LayerNorm`, GPT-2), for a layer's two pre-norms
  and the decoder's final norm (a norm builder takes the context and the normalised size);
  zero-centred (``1 + w``) when ``config.layernorm_zero_centered_gamma``, like every RMSNorm
  of the model (QK-norm, MLA and MTP norms too), so that the flag cannot disagree between them.

A new kind (Mamba-2, DeltaNet, a zero-centred RMSNorm, a toy mixer in a test) is registered
from its own file with :func:`register_mixer` / :func:`register_mlp` / :func:`register_norm`;
nothing in ``GPTModel`` changes. A builder
takes a :class:`BuildContext` (config, explicit process groups, RNG tracker, device and the
owning model) and the layer's global index, and returns a :class:`ShardedModule` mapping
``[s(/tp), b, h]`` to the same shape (a mixer also takes the
:class:`~shardwork.models.attention.AttentionInputs`). Parameters are created, not
initialised: ``GPTModel.init_parameters`` fills them from their global keys afterwards.

An MLP kind may also have ``attach(owner, config, device)``: :func:`attach_model_state` runs
every registered one once per model chunk, before any layer is built, and each decides from
the config whether the model needs its state. The MoE kind gives the model its aux-loss
tracker and scale when ``config.moe`` is set: on every pipeline stage, whether or not the
stage holds an MoE layer, because the tracker's reductions span all stages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardwork.models.attention import Attention
from shardwork.models.config import GPTConfig
from shardwork.models.deltanet import GatedDeltaNetMixer
from shardwork.models.gelu_mlp import GeLUMLP
from shardwork.models.layer_norm import LayerNorm
from shardwork.models.mamba import Mamba2Mixer
from shardwork.models.mla import MLAttention
from shardwork.models.mlp import SwiGLUMLP
from shardwork.models.moe.layer import MoELayer
from shardwork.models.moe.state import attach_moe
from shardwork.models.norm import RMSNorm
from shardwork.models.rng import RNGTracker
from shardwork.models.squared_relu_mlp import SquaredReLUMLP
from shardwork.parallel_state import ProcessGroups

__all__ = [
    "MIXERS",
    "MLPS",
    "NORMS",
    "WHOLE_SEQUENCE_MIXERS",
    "BuildContext",
    "MLPKind",
    "attach_model_state",
    "build_mixer",
    "build_mlp",
    "build_norm",
    "register_mixer",
    "register_mlp",
    "register_norm",
]


@dataclass(frozen=True)
class BuildContext:
    """What a part's builder may use: nothing global, every group explicit."""

    config: GPTConfig
    groups: ProcessGroups
    rng: RNGTracker
    """The model's tracker (dropout streams)."""
    device: torch.device
    owner: torch.nn.Module
    """The model chunk being built: holds state shared by its layers (``recompute_replay``,
    the MoE ``aux_loss_tracker`` / ``aux_loss_scale`` set by an MLP kind's ``attach``)."""


Builder = Callable[[BuildContext, int], torch.nn.Module]
NormBuilder = Callable[[BuildContext, int], torch.nn.Module]
"""``build(ctx, size)``: a norm over the last dimension, of size ``size``."""


@dataclass(frozen=True)
class MLPKind:
    """An MLP kind: its builder and the optional model-level ``attach(owner, config, device)``."""

    build: Builder
    attach: Callable[[torch.nn.Module, GPTConfig, torch.device], None] | None = None


WHOLE_SEQUENCE_MIXERS = frozenset({"mamba", "gated_deltanet"})
"""Mixer kinds whose recurrent scans need whole, unpacked rows (a model refuses
``cu_seqlens`` when its spec has one)."""
MIXERS: dict[str, Builder] = {}
"""Mixer kind -> builder."""
MLPS: dict[str, MLPKind] = {}
"""MLP kind -> :class:`MLPKind`."""
NORMS: dict[str, NormBuilder] = {}
"""Norm kind -> builder."""


def register_mixer(kind: str, build: Builder) -> None:
    """Make ``LayerSpec(mixer=kind)`` build with ``build(ctx, layer_number)``."""
    if kind in MIXERS and MIXERS[kind] is not build:
        raise ValueError(f"mixer kind {kind!r} is already registered")
    MIXERS[kind] = build


def register_mlp(kind: str, build: Builder, *, attach=None) -> None:
    """Make ``LayerSpec(mlp=kind)`` build with ``build(ctx, layer_number)``."""
    entry = MLPKind(build, attach)
    if kind in MLPS and MLPS[kind] != entry:
        raise ValueError(f"MLP kind {kind!r} is already registered")
    MLPS[kind] = entry


def register_norm(kind: str, build: NormBuilder) -> None:
    """Make ``LayerSpec(norm=kind)`` / ``DecoderSpec(final_norm=kind)`` build with
    ``build(ctx, size)``."""
    if kind in NORMS and NORMS[kind] is not build:
        raise ValueError(f"norm kind {kind!r} is already registered")
    NORMS[kind] = build


def _lookup(table: dict, field: str, kind: str):
    if kind not in table:
        raise ValueError(
            f"LayerSpec.{field}={kind!r} is not a registered kind: known are {sorted(table)}"
        )
    return table[kind]


def build_mixer(kind: str, ctx: BuildContext, layer_number: int) -> torch.nn.Module:
    """The mixer of kind ``kind`` for global layer ``layer_number``."""
    return _lookup(MIXERS, "mixer", kind)(ctx, layer_number)


def build_mlp(kind: str, ctx: BuildContext, layer_number: int) -> torch.nn.Module:
    """The MLP of kind ``kind`` for global layer ``layer_number``."""
    return _lookup(MLPS, "mlp", kind).build(ctx, layer_number)


def build_norm(kind: str, ctx: BuildContext, size: int) -> torch.nn.Module:
    """The norm of kind ``kind`` over a last dimension of ``size``."""
    return _lookup(NORMS, "norm", kind)(ctx, size)


def attach_model_state(owner: torch.nn.Module, config: GPTConfig, device: torch.device) -> None:
    """Run every registered MLP kind's ``attach`` on ``owner`` (see module docstring)."""
    for kind in MLPS.values():
        if kind.attach is not None:
            kind.attach(owner, config, device)


def _moe(ctx: BuildContext, layer_number: int) -> MoELayer:
    return MoELayer(
        ctx.config,
        ctx.groups,
        layer_number=layer_number,
        tracker=ctx.owner.aux_loss_tracker,
        loss_scale=ctx.owner.aux_loss_scale,
        replay=ctx.owner.recompute_replay,
        device=ctx.device,
    )


register_mixer(
    "attention",
    lambda c, i: Attention(c.config, c.groups, rng=c.rng, device=c.device, layer_number=i),
)
register_mixer("mla", lambda c, i: MLAttention(c.config, c.groups, rng=c.rng, device=c.device))
register_mlp("dense", lambda c, i: SwiGLUMLP(c.config, c.groups, device=c.device))
register_mlp("relu2", lambda c, i: SquaredReLUMLP(c.config, c.groups, device=c.device))
register_mlp("gelu", lambda c, i: GeLUMLP(c.config, c.groups, device=c.device))
register_mlp("moe", _moe, attach=attach_moe)


def _norm_options(ctx: BuildContext) -> dict:
    """What every norm kind of a layer takes from the config."""
    return dict(
        groups=ctx.groups,
        eps=ctx.config.norm_epsilon,
        backend=ctx.config.kernel_backend,
        # Under SP the norm sees only this rank's tokens: its weight gradient is all-reduced over
        # TP.
        partial_grad=ctx.config.sequence_parallel,
        zero_centered_gamma=ctx.config.layernorm_zero_centered_gamma,
        params_dtype=ctx.config.params_dtype,
        device=ctx.device,
    )


def _rmsnorm(ctx: BuildContext, size: int) -> RMSNorm:
    return RMSNorm(size, **_norm_options(ctx))


def _layernorm(ctx: BuildContext, size: int) -> LayerNorm:
    return LayerNorm(size, **_norm_options(ctx))


register_norm("rmsnorm", _rmsnorm)
register_norm("layernorm", _layernorm)

register_mixer("mamba", lambda c, i: Mamba2Mixer(c.config, c.groups, device=c.device))
register_mixer(
    "gated_deltanet", lambda c, i: GatedDeltaNetMixer(c.config, c.groups, device=c.device)
)
