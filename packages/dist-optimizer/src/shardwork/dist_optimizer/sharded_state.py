"""Optimizer state in global parameter coordinates, as dist-checkpoint ``ShardedTensor`` s.

Representation of a ZeRO shard (chosen: *flat ranges*, no gather)
  A rank's piece of a parameter is a flat range ``[a, b)`` of the parameter's row-major
  flattening — generally not a rectangle. Each piece is described as a ``ShardedTensor`` with
  ``flattened_range`` over the rectangle that the local (TP) parameter occupies in the global
  tensor; dist-checkpoint splits such a range into rectangles itself and reshards on load
  (another DP size, TP size, ...). Memory cost at save time: none for the common case (the
  data are views of the fp32 masters and moments); only a parameter that is several TP
  blocks split along an axis other than 0 (fused blocks on a row-parallel axis) needs a
  copy of its piece. The alternative (all-gather over DP to TP-local tensors) would need the
  whole TP-local optimizer state, ``DP×`` the shard, on every rank at save time.
- A local parameter may map to several global rectangles (fused [gate | up] or QKV blocks
  split over TP, ``ParamMeta.tp_partition_sizes``): one :class:`ParamRect` per block. The
  intersection of a flat range with any sub-box is again a flat range of that box
  (row-major order restricted to a box is the box's own row-major order).
- Keys: ``f"{prefix}{rect.key}.{state}"`` with state ``fp32_param`` (master weights),
  ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ... — every tensor state with the
  parameter's element count. Scalar states (Adam's ``step``) must be equal for all
  parameters; they are merged over the statistics groups (so every rank agrees) and saved
  once as plain values, with the loss scaler's state.
- Default rectangles come from ``ParamMeta`` and the TP rank: key = the parameter's name,
  TP-split axes offset by rank, TP-replicated parameters marked ``replica_id = tp_rank``.
  Pipeline stages and expert-parallel ranks hold different parameters whose names may
  collide (local layer/expert numbering): pass ``param_rects``, e.g.
  :func:`rects_from_model_state` of the model's own sharded state dict, for global keys and
  offsets.
- Loading: build the template with :func:`optimizer_sharded_state_dict` on the new layout,
  call ``dist_checkpoint.load`` and hand the result to
  :func:`load_optimizer_sharded_state_dict`, which copies every tensor into place.
  Optimizer state that does not exist yet (no step taken) is created by one step of the
  local optimizer with zero gradients and ``lr = 0`` (parameters unchanged).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardwork.dist_checkpoint import ShardedTensor
from shardwork.dist_optimizer.param_rects import (
    ParamRect,
    ParamRectsFn,
    default_param_rects,
    piece_entries,
    rects_from_model_state,
)
from shardwork.parallel_state import group_rank, group_size

__all__ = [
    "ParamRect",
    "default_param_rects",
    "load_optimizer_sharded_state_dict",
    "optimizer_sharded_state_dict",
    "rects_from_model_state",
]


def _tensor_states(
    optimizer: torch.optim.Optimizer | None, master: torch.Tensor
) -> dict[str, torch.Tensor]:
    states = {"fp32_param": master}
    if optimizer is not None:
        for name, value in optimizer.state.get(master, {}).items():
            # Per-element states only (same element count as the master); scalars are saved apart.
            if torch.is_tensor(value) and value.dim() > 0 and value.numel() == master.numel():
                states[name] = value
    return states


def _scalar_states(optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    found: dict[str, Any] = {}
    if optimizer is None:
        return found
    for state in optimizer.state.values():
        for name, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                continue
            v = value.item() if torch.is_tensor(value) else value
            if name in found and found[name] != v:
                raise ValueError(f"optimizer scalar state {name!r} differs between parameters")
            found[name] = v
    return found


def _merged_scalars(opt: Any) -> dict[str, Any]:
    """Scalar states merged over ``opt.stats_groups`` so every rank saves the same plain value
    (a rank may hold no parameter with a given scalar, e.g. Muon-only owners have no ``step``)."""
    merged = _scalar_states(opt.optimizer)
    for group in opt.stats_groups:
        if group is None or dist.get_world_size(group) == 1:
            continue
        gathered: list[Any] = [None] * dist.get_world_size(group)
        # Every rank of the group joins, a rank without masters too (its dict is empty).
        dist.all_gather_object(gathered, merged, group=group)
        for other in gathered:
            for name, value in other.items():
                if merged.setdefault(name, value) != value:
                    raise ValueError(f"optimizer scalar state {name!r} differs between ranks")
    # Sorted so every rank saves the same plain values in the same key order.
    return dict(sorted(merged.items()))


def _ensure_state(optimizer: torch.optim.Optimizer | None, masters: Sequence[torch.Tensor]) -> None:
    """Create lazily-initialised optimizer state by one zero-gradient step with lr 0."""
    if optimizer is None or all(m in optimizer.state and optimizer.state[m] for m in masters):
        return
    fresh = [m for m in masters if not optimizer.state.get(m)]
    saved_grads = [m.grad for m in masters]
    lrs = [g["lr"] for g in optimizer.param_groups]
    # Zero gradients and lr 0 leave the parameters unchanged (AdamW's decay is scaled by lr too)
    # while the optimizer allocates its lazy state.
    for m in masters:
        m.grad = torch.zeros_like(m)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    for m, g in zip(masters, saved_grads):
        m.grad = g
    for m in fresh:  # a step counter of 0 with zero moments is a fresh state
        for name, value in optimizer.state[m].items():
            if torch.is_tensor(value) and value.dim() == 0:
                optimizer.state[m][name] = torch.zeros_like(value)


def _entries(opt: Any, prefix: str, param_rects: ParamRectsFn | None):
    """(path, ShardedTensor args, target tensor, selector) for every saved tensor piece."""
    tp_rank, tp_size = group_rank(opt.tp_group), group_size(opt.tp_group)
    for item in opt.master_ranges():
        name, param, master, a, b = item
        rects = (
            param_rects(name, param)
            if param_rects is not None
            else default_param_rects(name, param, tp_rank=tp_rank, tp_size=tp_size)
        )
        shape = tuple(param.shape)
        for state_name, tensor in _tensor_states(opt.optimizer, master).items():
            flat = tensor.view(-1)
            for rect, bshape, frange, selector in piece_entries(rects, shape, a, b):
                key = f"{prefix}{rect.key}.{state_name}"
                yield (
                    key,
                    rect,
                    bshape,
                    frange,
                    flat,
                    selector,
                    (a, b) == (0, math.prod(shape) or 1),
                )


def _build(opt: Any, prefix: str, param_rects: ParamRectsFn | None):
    tensors: dict[str, Any] = {}
    targets: dict[str, tuple[torch.Tensor, Any]] = {}
    for key, rect, bshape, frange, flat, selector, whole in _entries(opt, prefix, param_rects):
        data = flat[selector]
        # A rank may hold several pieces of one key (fused blocks), each at its own global offset.
        path = f"{key}@{','.join(map(str, rect.global_offset))}"
        if whole and frange == (0, math.prod(bshape)) and isinstance(selector, slice):
            # the whole box: a plain rectangle (layer-wise optimizer, or a piece = a parameter)
            st = ShardedTensor(
                key,
                data.view(bshape),
                rect.global_shape,
                rect.global_offset,
                replica_id=rect.replica_id,
            )
        else:
            st = ShardedTensor.from_flattened(
                key,
                data.contiguous(),
                local_shape=bshape,
                global_shape=rect.global_shape,
                global_offset=rect.global_offset,
                flattened_range=frange,
                replica_id=rect.replica_id,
            )
        tensors[path] = st
        targets[path] = (flat, selector)
    return tensors, targets


def _state_dict(opt: Any, prefix: str, param_rects: ParamRectsFn | None) -> dict[str, Any]:
    if param_rects is None and getattr(opt, "collision_axes", None):
        raise ValueError(
            f"sharded_state_dict(param_rects=None) with {opt.collision_axes}: ranks along these "
            "axes hold different parameters whose local names may collide; valid: pass "
            "param_rects, e.g. rects_from_model_state(model's sharded state dict, tp_rank=...)"
        )
    tensors, _ = _build(opt, prefix, param_rects)
    out: dict[str, Any] = {"tensors": tensors, "scalars": _merged_scalars(opt)}
    if opt.loss_scaler is not None:
        out["loss_scaler"] = opt.loss_scaler.state_dict()
    return out


def _load(
    opt: Any, state: Mapping[str, Any], prefix: str, param_rects: ParamRectsFn | None
) -> None:
    _, targets = _build(opt, prefix, param_rects)
    with torch.no_grad():
        for path, (flat, selector) in targets.items():
            value = state["tensors"][path]
            flat[selector] = value.reshape(-1).to(flat.dtype)
    if opt.optimizer is not None:
        for s in opt.optimizer.state.values():
            for name, value in state.get("scalars", {}).items():
                if name in s:
                    # torch's Adam/AdamW keep ``step`` as a 0-d tensor: restore it in the same
                    # form, dtype and device (the fused kernels keep it float32 on the
                    # parameters' device; torch's own load_state_dict keeps it there too).
                    old = s[name]
                    s[name] = (
                        torch.tensor(float(value), dtype=old.dtype, device=old.device)
                        if torch.is_tensor(old)
                        else value
                    )
    if opt.loss_scaler is not None and "loss_scaler" in state:
        opt.loss_scaler.load_state_dict(state["loss_scaler"])


def optimizer_sharded_state_dict(
    opt: Any, *, prefix: str = "optimizer.", param_rects: ParamRectsFn | None = None
) -> dict[str, Any]:
    """Sharded state dict of a :class:`DistributedOptimizer` (flat-range ShardedTensors) or a
    :class:`LayerWiseDistributedOptimizer` (whole TP-local rectangles, owner ranks only).

    Creates the optimizer state first if no step has run, so the same call gives the
    template for loading.
    """
    opt.finish_param_sync()
    _ensure_state(opt.optimizer, [owned.master for owned in opt.masters])
    return _state_dict(opt, prefix, param_rects)


def load_optimizer_sharded_state_dict(
    opt: Any,
    state: Mapping[str, Any],
    *,
    prefix: str = "optimizer.",
    param_rects: ParamRectsFn | None = None,
) -> None:
    """Copy a loaded state dict (from ``dist_checkpoint.load`` of the template) into the
    masters and optimizer state, then publish the masters to the model parameters on every
    rank (the optimizer's own write-back and gather/broadcast, waited for)."""
    _ensure_state(opt.optimizer, [owned.master for owned in opt.masters])
    _load(opt, state, prefix, param_rects)
    # Write the loaded masters into the parameters and gather them, so every rank's model matches.
    opt.finish_step()
    opt.finish_param_sync()
