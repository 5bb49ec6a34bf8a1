"""Assemble whole (unsharded) tensors from every rank's shards: for export, tests and debugging.

:func:`full_state_dict` gives every rank ``{key: global tensor}`` for all keys of the model
(all pipeline stages): each rank writes its primary pieces (``replica_id == 0``) into
zero tensors and one SUM all-reduce per key over ``group`` (default: the whole world) adds
them up. Memory is one full tensor at a time per key plus the result, so it is meant for
export and checks of models that fit one host, not for training checkpoints (use
``shardwork.dist_checkpoint`` with :meth:`ShardedModule.sharded_state_dict` for those).
``grads=True`` assembles gradients instead (parameters without a gradient count as zero).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from shardwork.dist_checkpoint import ShardedTensor
from shardwork.models.module import ShardedModule
from shardwork.models.sharding import param_shards

__all__ = ["full_state_dict"]


def full_state_dict(
    model: ShardedModule,
    *,
    grads: bool = False,
    group=None,
    dtype: torch.dtype | None = None,
    keys: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """``{key: full tensor}`` of ``model`` (or of its gradients) on every rank of ``group``.

    ``keys``: assemble only the keys it accepts (e.g. ``shardwork.models.lora.is_lora_key``
    for the adapters alone, without gathering the base weights)."""
    if grads:
        pieces = {st.key: st for st in _grad_shards(model)}
    else:
        pieces = dict(model.sharded_state_dict())
    if keys is not None:
        pieces = {k: st for k, st in pieces.items() if keys(k)}
    distributed = dist.is_initialized() and (group is not None or dist.get_world_size() > 1)
    if distributed:
        world = dist.get_world_size(group)
        entries = [None] * world
        mine = {k: (tuple(st.global_shape), str(st.data.dtype)) for k, st in pieces.items()}
        # Every rank must know every key (other pipeline stages' too): all of them then issue the
        # same all-reduces, one per key, in the same sorted order.
        dist.all_gather_object(entries, mine, group=group)
        keys: dict[str, tuple] = {}
        for entry in entries:
            keys |= entry
    else:
        keys = {k: (tuple(st.global_shape), str(st.data.dtype)) for k, st in pieces.items()}
    out: dict[str, torch.Tensor] = {}
    for key in sorted(keys):
        shape, dt = keys[key]
        target = dtype or getattr(torch, dt.removeprefix("torch."))
        full = torch.zeros(shape, dtype=target)
        st = pieces.get(key)
        # Only primary pieces are written into the zeros, so the SUM all-reduce adds each element
        # once.
        if st is not None and st.replica_id == 0:
            index = tuple(slice(o, o + s) for o, s in zip(st.global_offset, st.data.shape))
            full[index] = st.data.detach().to("cpu", target)
        if distributed:
            dist.all_reduce(full, group=group)
        out[key] = full
    return out


def _grad_shards(model: ShardedModule):
    """ShardedTensors of the gradients, keyed exactly like ``model.sharded_state_dict()``."""
    by_data = model.sharded_state_dict()
    result = []
    for key, param, module in model.named_param_keys():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        for st in param_shards(param, key, module.shard_ctx, source=grad):
            ref = by_data.get(st.key)
            if ref is None:
                continue
            result.append(
                ShardedTensor(
                    st.key, st.data, st.global_shape, st.global_offset, replica_id=ref.replica_id
                )
            )
    return result
