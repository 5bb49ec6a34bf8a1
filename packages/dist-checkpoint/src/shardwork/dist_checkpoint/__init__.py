"""shardwork.dist_checkpoint — sharded, reshardable, async, crash-safe checkpoints.

Describe what each rank holds with `ShardedTensor` / `ShardedObject` (nested in dicts/lists:
a "sharded state dict"); `save` / `load` on torch.distributed.checkpoint reshard between any
layouts; `CheckpointManager` adds atomic commit, retention and integrity checks.
"""

from shardwork.dist_checkpoint.sharded import ShardedObject, ShardedTensor

__all__ = ["ShardedObject", "ShardedTensor"]
