"""shardwork.dist_optimizer: bucketed DDP, a ZeRO-1 distributed optimizer, layer-wise Muon.

- :class:`DistributedDataParallel` / :class:`DDPConfig` — contiguous param/grad buffers,
  buckets reduced asynchronously from backward hooks (all-reduce or reduce-scatter).
- :class:`DistributedOptimizer` / :class:`OptimizerConfig` — ZeRO-1 over DDP's shards:
  fp32 masters and optimizer state for this rank's shard only, overlapped param all-gather.
- :class:`ChainedOptimizer` — dense + expert optimizers stepping as one.
- :class:`LayerWiseDistributedOptimizer` + :class:`Muon` — whole matrices updated on owner
  ranks (TP shards gathered first), broadcast back.
- :class:`FullyShardedDataParallel` / :class:`FSDPConfig` + :class:`FSDPOptimizer` — torch's
  FSDP2 per block over shardwork's dp×cp / edp groups: parameters, gradients and optimizer
  state sharded by rows; ParamMeta carried onto the DTensor parameters.
- :class:`ParamIndexMap` — the buffer/bucket/shard layout as pure computation.
- :class:`AdamW` (bf16 moments option), :class:`DynamicLossScaler`, :class:`ConstantLossScaler`.
- ``sharded_state_dict()`` on every optimizer: state in global parameter coordinates.
"""

from shardwork.dist_optimizer.adamw import AdamW
from shardwork.dist_optimizer.chained import ChainedOptimizer, build_optimizer
from shardwork.dist_optimizer.ddp import DDPConfig, DistributedDataParallel
from shardwork.dist_optimizer.distributed_optimizer import DistributedOptimizer
from shardwork.dist_optimizer.fsdp import FSDPConfig, FullyShardedDataParallel
from shardwork.dist_optimizer.fsdp_optimizer import FSDPOptimizer
from shardwork.dist_optimizer.layerwise import LayerWiseDistributedOptimizer
from shardwork.dist_optimizer.layout import BufferKey, BufferLayout, ParamIndexMap, ShardPiece
from shardwork.dist_optimizer.local_masters import OptimizerConfig
from shardwork.dist_optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler
from shardwork.dist_optimizer.muon import Muon
from shardwork.dist_optimizer.param_rects import ParamRect, rects_from_model_state
from shardwork.dist_optimizer.step_flow import StepResult

__version__ = "0.1.0"

__all__ = [
    "AdamW",
    "BufferKey",
    "BufferLayout",
    "ChainedOptimizer",
    "ConstantLossScaler",
    "DDPConfig",
    "DistributedDataParallel",
    "DistributedOptimizer",
    "DynamicLossScaler",
    "FSDPConfig",
    "FSDPOptimizer",
    "FullyShardedDataParallel",
    "LayerWiseDistributedOptimizer",
    "Muon",
    "OptimizerConfig",
    "ParamIndexMap",
    "ParamRect",
    "ShardPiece",
    "StepResult",
    "build_optimizer",
    "rects_from_model_state",
]
