"""shardwork.models.megatron: import Megatron-Core ``torch_dist`` checkpoints.

- :func:`read_megatron_tensors`: the checkpoint's whole tensors at world 1 (no process group).
- :func:`megatron_state_dict`: ``{shardwork key: full tensor}`` for a given GPTConfig (names,
  TE vs local spec, fused QKV and gate/up split, experts, checked against the config).
- :func:`load_megatron_weights`: fill a model (stage) at any layout.
- :func:`import_megatron`: write a shardwork dist-checkpoint folder (``shardwork-ckpt
  import-megatron``, registered by :mod:`.cli`).
"""

from shardwork.models.megatron.convert import (
    check_megatron_checkpoint,
    import_megatron,
    load_megatron_weights,
    megatron_state_dict,
)
from shardwork.models.megatron.export import export_megatron
from shardwork.models.megatron.reader import (
    NotAMegatronCheckpointError,
    read_megatron_args,
    read_megatron_tensors,
)

__all__ = [
    "NotAMegatronCheckpointError",
    "check_megatron_checkpoint",
    "export_megatron",
    "import_megatron",
    "load_megatron_weights",
    "megatron_state_dict",
    "read_megatron_args",
    "read_megatron_tensors",
]
