"""How the trainer wires ``parallel.fsdp`` to the model (dist-optimizer knows no model).

- The FSDP units are the model's transformer layers: every decoder layer of the chunk and
  every MTP depth (each its own all-gather and reduce-scatter); the embedding, final norm and
  LM head are the root unit. dist-optimizer's ``FullyShardedDataParallel`` splits each layer's
  experts into a unit of their own over the expert-data-parallel group.
- The options come from the parallel and precision sections: ``'zero2'`` keeps parameters
  gathered from forward to backward; bf16 runs compute on bf16 copies of fp32 shards and
  reduce gradients in fp32 (bf16 with ``precision.grad_reduce_in_fp32 = false``).
"""

from __future__ import annotations

import torch

from shardwork.dist_optimizer import FSDPConfig, FullyShardedDataParallel

__all__ = ["fsdp_blocks", "fsdp_config", "wrap_fsdp"]


def fsdp_blocks(module) -> list[torch.nn.Module]:
    """A GPTModel chunk's transformer layers in forward order: decoder layers, then MTP depths."""
    blocks = list(module.decoder.layers)
    if getattr(module, "mtp", None) is not None:
        blocks += list(module.mtp.layers)
    return blocks


def fsdp_config(config) -> FSDPConfig:
    """``FSDPConfig`` of the run's ``parallel.fsdp*`` and precision options."""
    p = config.parallel
    bf16 = config.precision.dtype == "bf16"
    return FSDPConfig(
        reshard_after_forward=p.fsdp == "full",
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=(torch.float32 if config.precision.grad_reduce_in_fp32 else torch.bfloat16)
        if bf16
        else None,
        reduce_per_micro_batch=p.fsdp_reduce_per_micro_batch,
        forward_prefetch=p.fsdp_prefetch,
        backward_prefetch=p.fsdp_prefetch,
    )


def wrap_fsdp(modules, config, groups) -> list[FullyShardedDataParallel]:
    """Every model chunk sharded by its layers over the run's data-parallel groups."""
    options = fsdp_config(config)
    return [
        FullyShardedDataParallel(m, blocks=fsdp_blocks(m), config=options, process_groups=groups)
        for m in modules
    ]
