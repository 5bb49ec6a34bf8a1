"""Start a run from a Megatron-Core checkpoint (``checkpoint.megatron_init``), through
shardwork.models.megatron.

Import happens on the model chunks before DistributedDataParallel wraps them and the
optimizer copies its fp32 master weights (as ``hf_init`` does, :mod:`.hf`), so step 0 trains
the imported weights at any layout. Each rank reads the checkpoint's tensors whole and keeps
its slices: meant for models whose full weights fit one host's memory.
"""

from __future__ import annotations

import torch

from shardwork.models.megatron import load_megatron_weights


@torch.no_grad()
def import_megatron_weights(modules, folder: str) -> None:
    """Fill every model chunk of this rank with its slices of the checkpoint in ``folder``."""
    for module in modules:
        load_megatron_weights(module, folder)
