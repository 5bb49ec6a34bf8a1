"""The run's optimizer, from ``optimizer.name``: AdamW over ZeRO-1 shards, or Muon layer-wise.

- ``adamw``: shardwork.dist_optimizer's ZeRO-1 :class:`DistributedOptimizer` (DDP
  reduce-scatters gradients; each data-parallel rank keeps fp32 masters and AdamW moments
  for its flat shard) with ``torch.optim.AdamW``; under ``parallel.fsdp`` its
  :class:`FSDPOptimizer` over the rows FSDP gives the rank (the same param groups).
- ``muon``: Muon needs whole matrices (Newton–Schulz orthogonalisation of the full update),
  which flat ZeRO shards do not have, so DDP all-reduces gradients and shardwork.dist_optimizer's
  :class:`LayerWiseDistributedOptimizer` gives every parameter one data-parallel owner that
  steps it with :class:`shardwork.dist_optimizer.Muon` and broadcasts it back. TP-split matrices
  are all-gathered over TP inside Muon and fused blocks ([Q | K | V], [gate | up]) are
  orthogonalised block by block; the update is scaled by ``sqrt(max(1, rows/cols))`` (the
  scaling dist-optimizer's Muon applies).
- Attention's fused ``linear_qkv`` weights form their own Muon group with
  ``fused_blocks=3`` (4 with ``attention_output_gate``: [Q | K | V | gate], Qwen3-Next): one
  Newton–Schulz per Q, K and V projection (and gate; all heads of each together), the update
  separate q/k/v matrices get in Moonlight/Kimi-style Muon and the split Megatron-Core's
  ``split_qkv`` makes; not per head. The option makes Muon check, when the optimizer is
  built, that each of them carries its [Q | K | V] (| gate) blocks in its layout metadata
  (else it would be orthogonalised as one fused matrix).
- Which parameters get Muon, as Muon is commonly used: the 2-D weight matrices of the hidden
  layers (attention and MLP projections, shared experts, routers, MTP projections). AdamW
  (``beta1``, ``beta2``, ``eps``, inside the same Muon optimizer via ``use_muon=False``) for the
  rest: token embedding and LM head (including MTP's embedding copy), norms and biases, and
  stacked expert weights ``[experts, ...]`` (3-D; Muon orthogonalises 2-D matrices only).
- Param-group keys read by the loop: ``wd_mult`` (0 for 1-D parameters: no weight decay) and
  ``lr_mult`` (Muon matrices: ``muon_lr / lr``, so both follow one LR schedule).
- MoE models: a ChainedOptimizer of a dense part (over dp×cp) and an expert part (over the
  expert-data-parallel group) stepping as one (shared grad norm, clipping, inf/nan skip).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardwork.dist_optimizer import (
    ChainedOptimizer,
    DistributedOptimizer,
    DynamicLossScaler,
    FSDPOptimizer,
    LayerWiseDistributedOptimizer,
    Muon,
)
from shardwork.dist_optimizer import OptimizerConfig as DistOptimizerConfig

_ADAMW_NAMES = ("embedding.", "output_layer.")
"""Prefixes of the token embedding and LM head; ``mtp.embedding_weight`` is matched apart."""
_QKV_NAME = "linear_qkv.weight"


def is_fused_qkv(name: str) -> bool:
    """True for an attention layer's fused [Q | K | V] weight (``...linear_qkv.weight``)."""
    return name.endswith(_QKV_NAME)


def qkv_blocks(model_config) -> int:
    """Blocks of the model's fused ``linear_qkv`` weights: [Q | K | V], plus the output gate's
    block with ``attention_output_gate``."""
    return 4 if getattr(model_config, "attention_output_gate", False) else 3


def is_muon_matrix(name: str, param: torch.Tensor) -> bool:
    """True for a 2-D hidden-layer weight (Muon); False for embedding / head / 1-D / 3-D."""
    if param.ndim != 2:
        return False
    # The embedding and LM head are 2-D too but stay on AdamW (see the module docstring).
    return not (name.startswith(_ADAMW_NAMES) or name.endswith("embedding_weight"))


def uses_zero_shards(config) -> bool:
    """Whether DDP reduce-scatters for ZeRO-1 shards (AdamW) or all-reduces (Muon)."""
    return config.optimizer.name == "adamw"


def adamw_parts(o) -> tuple[Callable, Callable]:
    """``(factory_for, param_group_fn)`` of ``optimizer.name = "adamw"`` (``o``: the optimizer
    section): ``torch.optim.AdamW`` on each ZeRO shard, no weight decay for 1-D parameters."""

    def factory_for(expert: bool):
        def factory(param_groups):
            return torch.optim.AdamW(
                param_groups,
                lr=o.lr,
                betas=(o.beta1, o.beta2),
                eps=o.eps,
                weight_decay=o.weight_decay,
                fused=_fused_adamw_runs(param_groups),
            )

        return factory

    def param_group_fn(name: str, param: torch.nn.Parameter) -> dict[str, Any]:
        # 1-D parameters (norms, biases) get no weight decay.
        return {"wd_mult": 0.0 if param.ndim < 2 else 1.0}

    return factory_for, param_group_fn


def _fused_adamw_runs(param_groups) -> bool | None:
    """True (torch's one-pass AdamW kernel) where every parameter is on the CPU or a CUDA
    device, else None (torch's default choice). Same update as the default per-tensor loop up
    to rounding (after 20 steps on unit-scale fp32 values: 99.6 % of elements bit-equal, the
    rest <= 2.4e-7 apart); on the 2-core AMD EPYC a 25 M-element fp32 shard steps in 11-16 ms
    instead of 39 ms."""
    devices = {p.device.type for group in param_groups for p in group["params"]}
    return True if devices and devices <= {"cpu", "cuda"} else None


def muon_parts(o, groups, *, fused_qkv_blocks: int = 3) -> tuple[Callable, Callable]:
    """``(factory_for, param_group_fn)`` of ``optimizer.name = "muon"``: Muon for hidden-layer
    matrices (TP-aware over ``tp``, or ``etp`` for experts), its AdamW for the rest;
    ``fused_qkv_blocks``: the blocks of each ``linear_qkv`` weight (:func:`qkv_blocks`)."""
    # The loop sets one lr from the schedule; Muon matrices follow it at muon_lr / lr times it.
    lr_mult = o.muon_lr / o.lr

    def factory_for(expert: bool):
        tp_group = groups.group("etp" if expert else "tp")

        def factory(param_groups):
            return Muon(
                param_groups,
                lr=o.muon_lr,
                momentum=o.muon_momentum,
                nesterov=o.muon_nesterov,
                ns_steps=o.muon_ns_steps,
                weight_decay=o.weight_decay,
                adam_betas=(o.beta1, o.beta2),
                adam_eps=o.eps,
                tp_group=tp_group,
            )

        return factory

    def param_group_fn(name: str, param: torch.nn.Parameter) -> dict[str, Any]:
        if is_muon_matrix(name, param):
            group = {"use_muon": True, "wd_mult": 1.0, "lr_mult": lr_mult}
            if is_fused_qkv(name):
                # [Q | K | V] (| gate): one Newton–Schulz per block
                group["fused_blocks"] = fused_qkv_blocks
            return group
        return {"use_muon": False, "wd_mult": 0.0 if param.ndim < 2 else 1.0}

    return factory_for, param_group_fn


def build_optimizer(config, runtime, chunks, *, model_config) -> Any:
    """The optimizer for the DDP-wrapped ``chunks`` (see the module docstring)."""
    o = config.optimizer
    groups = runtime.groups
    scaler = None
    if config.precision.dtype == "fp16":
        # fp16's narrow exponent range needs a loss scale; bf16 and fp32 train without one.
        scaler = DynamicLossScaler(initial_scale=config.precision.initial_loss_scale)
    dist_config = DistOptimizerConfig(
        clip_grad=o.clip_grad, overlap_param_gather=o.overlap_param_gather
    )
    if o.name == "adamw":
        # FSDP chunks: AdamW over each rank's rows of every parameter; else over ZeRO-1 shards.
        kind = FSDPOptimizer if config.parallel.fsdp != "off" else DistributedOptimizer
        factory_for, param_group_fn = adamw_parts(o)
    else:
        kind = LayerWiseDistributedOptimizer
        blocks = qkv_blocks(model_config)
        factory_for, param_group_fn = muon_parts(o, groups, fused_qkv_blocks=blocks)

    def part(expert: bool):
        return kind(
            chunks,
            factory_for(expert),
            expert=expert,
            config=dist_config,
            process_groups=groups,
            param_group_fn=param_group_fn,
            loss_scaler=scaler,
        )

    if getattr(model_config, "moe", None) is None:
        return part(False)
    # dense parameters shard (or are owned) over dp×cp, expert parameters over edp: one part
    # each, stepping as one (global norm and clipping over both)
    return ChainedOptimizer([part(False), part(True)], config=dist_config, loss_scaler=scaler)
