"""Process setup and assembly: device, process groups, model chunks, DDP, optimizer.

- One process without torchrun gets ``ProcessGroups.single()`` and no
  torch.distributed at all; under torchrun (WORLD_SIZE > 1) every group is
  created once by shardwork.parallel_state with the configured timeout.
- The model comes from shardwork.models, wrapped per chunk in
  shardwork.dist_optimizer's DistributedDataParallel (summing gradients:
  the loss is a token sum, and finalize_model_grads divides by the global
  token count): reduce-scatter for AdamW's ZeRO-1 shards, all-reduce for
  Muon's whole-matrix owners.
- The optimizer (AdamW / Muon, dense + expert parts for MoE, weight-decay
  and LR multipliers per parameter group) is built by :mod:`.optimizers`.
- With ``checkpoint.hf_init`` the chunks are filled from the Hugging Face folder before
  DDP wraps them (:mod:`.hf`).
- With ``peft.method = "lora"`` every chunk is frozen and gets its adapters after that, still
  before DDP.
- With ``precision.compile`` every transformer layer of every chunk is compiled in place
  (``shardwork.models.compile_blocks``) after the adapters exist and before DDP registers its
  hooks; compilation itself happens in the first forward.
- With ``parallel.fsdp`` each chunk is wrapped in shardwork.dist_optimizer's
  FullyShardedDataParallel instead (sharded by its transformer layers, :mod:`.fsdp`), and the
  optimizer keeps AdamW state for the local rows. (``precision.compile`` with FSDP is refused
  by validation.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shardwork.dist_optimizer import DDPConfig, DistributedDataParallel
from shardwork.models.block_compile import CompileReport, compile_blocks, compile_report
from shardwork.models.calculator import num_parameters
from shardwork.models.lora import apply_lora
from shardwork.parallel_state import ProcessGroups, init_process_groups
from shardwork.trainer.config.sections import TrainConfig
from shardwork.trainer.config.validate import parallel_config
from shardwork.trainer.config.validate_peft import lora_config_of
from shardwork.trainer.model_factory import build_model_chunks, gpt_config
from shardwork.trainer.run import hf, megatron
from shardwork.trainer.run.fsdp import wrap_fsdp
from shardwork.trainer.run.optimizers import build_optimizer, uses_zero_shards


@dataclass
class Runtime:
    """Where this rank runs and which groups it belongs to."""

    groups: ProcessGroups
    device: torch.device
    rank: int
    world_size: int
    owns_distributed: bool
    """True when this run initialised torch.distributed (and must destroy it)."""

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == 0


def init_runtime(config: TrainConfig) -> Runtime:
    """Pick the device and create the process groups (after the config was validated)."""
    want = config.precision.device
    use_cuda = want == "cuda" or (want == "auto" and torch.cuda.is_available())
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        # One GPU per process on its node: torchrun's LOCAL_RANK picks it.
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # One process started without torchrun: no torch.distributed at all.
    if world == 1 and not dist.is_initialized():
        return Runtime(ProcessGroups.single(), device, 0, 1, owns_distributed=False)
    backend = config.parallel.backend
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    # Only a process group created here is destroyed at the end of the run.
    owns = not dist.is_initialized()
    groups = init_process_groups(
        parallel_config(config),
        backend=backend,
        timeout=timedelta(minutes=config.parallel.timeout_minutes),
        gloo_twins=True,
    )
    return Runtime(groups, device, dist.get_rank(), dist.get_world_size(), owns_distributed=owns)


@dataclass
class Assembly:
    """The model chunks (DDP-wrapped), their unwrapped modules, and the optimizer."""

    model_config: Any
    chunks: list
    modules: list
    optimizer: Any
    num_params: int
    """Parameters of the whole model (all ranks), from shardwork.models' calculator."""
    compiled_layers: int = 0
    """Transformer layers of this rank's chunks compiled with torch.compile (precision.compile)."""
    compile_baseline: CompileReport | None = None
    """dynamo's counters before this run compiled anything (they are process-wide)."""


def build_assembly(
    config: TrainConfig,
    runtime: Runtime,
    *,
    hf_init: str | None = None,
    megatron_init: str | None = None,
    peft_init: str | None = None,
) -> Assembly:
    """Model chunks, DDP wrappers and optimizer; ``hf_init``: a Hugging Face folder
    (:mod:`.hf`), ``megatron_init``: a Megatron-Core checkpoint (:mod:`.megatron`), whose weights
    the chunks get before DDP and the optimizer see them; ``peft_init``: a PEFT folder the LoRA
    adapters start from."""
    model_config = gpt_config(config)
    modules = build_model_chunks(
        model_config,
        runtime.groups,
        device=runtime.device,
        first_stage_layers=config.parallel.first_stage_layers,
        last_stage_layers=config.parallel.last_stage_layers,
        first_virtual_stage_layers=config.parallel.first_virtual_stage_layers,
        last_virtual_stage_layers=config.parallel.last_virtual_stage_layers,
        mtp_standalone=config.parallel.mtp_standalone,
    )
    if hf_init is not None:
        hf.import_hf_weights(modules, hf_init)  # looked up at call time: tests replace it
    if megatron_init is not None:
        megatron.import_megatron_weights(modules, megatron_init)
    lora = lora_config_of(config)
    if lora is not None:
        # After the base weights are final and before DDP: its buffers then hold only the
        # adapters (frozen parameters are left out), so gradients, masters and optimizer state
        # are adapter-sized.
        for module in modules:
            apply_lora(module, lora, require_every_target=False)
        if peft_init is not None:
            hf.import_peft_adapters(modules, peft_init)
    if config.parallel.fsdp != "off":
        chunks = wrap_fsdp(modules, config, runtime.groups)
        optimizer = build_optimizer(config, runtime, chunks, model_config=model_config)
        return Assembly(model_config, chunks, modules, optimizer, num_parameters(model_config))
    compiled, baseline = 0, None
    if config.precision.compile:
        baseline = compile_report()
        # In place: parameters, keys and modules stay the same objects for DDP and checkpoints.
        compiled = sum(compile_blocks(module) for module in modules)
    o = config.optimizer
    ddp_config = DDPConfig(
        # bucket_size counts elements: MiB at 4 bytes (fp32 gradients) per element.
        bucket_size=max(1, int(o.bucket_size_mb * 2**20 / 4)),
        overlap_grad_reduce=o.overlap_grad_reduce,
        use_distributed_optimizer=uses_zero_shards(config),
        # Summed, not averaged: the loss is a token sum and finalize_model_grads divides by the
        # global token count.
        average_gradients=False,
        grad_reduce_in_fp32=config.precision.grad_reduce_in_fp32,
    )
    chunks = [
        DistributedDataParallel(m, config=ddp_config, process_groups=runtime.groups)
        for m in modules
    ]
    optimizer = build_optimizer(config, runtime, chunks, model_config=model_config)
    num_params = num_parameters(model_config)
    return Assembly(model_config, chunks, modules, optimizer, num_params, compiled, baseline)
