"""shardwork.dist_checkpoint — sharded, reshardable, async, crash-safe checkpoints.

Describe what each rank holds with `ShardedTensor` / `ShardedObject` (nested in dicts/lists:
a "sharded state dict"); `save` / `load` on torch.distributed.checkpoint reshard between any
layouts; `CheckpointManager` adds step directories, atomic commit, retention, granular loads
and integrity checks. DCP's files are the format: plain ``torch.distributed.checkpoint.load``
reads a shardwork checkpoint.
"""

from shardwork.dist_checkpoint.keycheck import CheckpointMismatchError
from shardwork.dist_checkpoint.load import load
from shardwork.dist_checkpoint.manager import CheckpointManager
from shardwork.dist_checkpoint.metadata import (
    CheckpointCorruptError,
    CheckpointRefusedError,
    IncompleteCheckpointError,
    UnsupportedFormatError,
    is_committed,
    read_info,
)
from shardwork.dist_checkpoint.save import (
    AsyncSave,
    CheckpointSaveError,
    SaveResult,
    StagingBuffers,
    save,
)
from shardwork.dist_checkpoint.sharded import ShardedObject, ShardedTensor
from shardwork.dist_checkpoint.verify import verify

__all__ = [
    "AsyncSave",
    "CheckpointCorruptError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointRefusedError",
    "CheckpointSaveError",
    "IncompleteCheckpointError",
    "SaveResult",
    "ShardedObject",
    "ShardedTensor",
    "StagingBuffers",
    "UnsupportedFormatError",
    "is_committed",
    "load",
    "read_info",
    "save",
    "verify",
]
