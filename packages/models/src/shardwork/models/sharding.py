"""How each local parameter maps onto its global tensor(s): checkpoint description and init.

- A parameter created by this package carries, besides its :class:`ParamMeta`, three small
  attributes set by :func:`describe_param`: the names of its fused blocks (``("q", "k", "v")``,
  ``("gate", "up")``), the number of real rows (padded vocabulary: padding rows are neither
  saved nor initialised randomly) and its init rule (``"normal"``, ``"scaled_normal"``,
  ``"ones"``, ``"zeros"``).
- :func:`param_shards` turns one local parameter into the ShardedTensors that say where it sits
  in global coordinates: one per fused block (keys ``<name>.q`` ...), each a view of the
  parameter, so a checkpoint load fills the parameter in place.
- :func:`init_from_shards` initialises a parameter from the same description: the global
  tensor of every key is drawn from a generator seeded by ``(init_seed, key)`` and the local
  slice copied in. Values therefore depend only on the key, never on tp/pp/cp.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from shardwork.dist_checkpoint import ShardedTensor
from shardwork.parallel_state import ParamMeta, get_param_meta, set_param_meta

__all__ = [
    "INIT_RULES",
    "ShardContext",
    "describe_param",
    "init_from_shards",
    "key_seed",
    "param_shards",
]

INIT_RULES = ("normal", "scaled_normal", "ones", "zeros")
_BLOCKS = "_shardwork_blocks"
_ROWS = "_shardwork_real_rows"
_INIT = "_shardwork_init"
_CUSTOM = "_shardwork_custom_shards"
"""Optional object with ``param_shards(param, key, *, replica_offset, source)`` and
``init_param(param, key, *, init_seed, std, num_layers)`` overriding the TP description
(stacked MoE experts, split over ep and etp: ``shardwork.models.moe.ExpertShards``)."""


@dataclass(frozen=True)
class ShardContext:
    """Where this rank sits: its tp rank/size and its index among data replicas (dp×cp)."""

    tp_rank: int = 0
    tp_size: int = 1
    replica_rank: int = 0
    """Rank in the dp×cp group: every parameter is replicated across it."""

    def replica_id(self, tp_split: bool) -> int:
        """0 for the primary copy; a positive id on every rank holding a duplicate."""
        tp_part = 0 if tp_split else self.tp_rank
        return tp_part + self.tp_size * self.replica_rank


def describe_param(
    param: torch.nn.Parameter,
    meta: ParamMeta,
    *,
    init: str,
    blocks: tuple[str, ...] | None = None,
    real_rows: int | None = None,
) -> torch.nn.Parameter:
    """Attach ``meta`` and the checkpoint/init description to ``param``; returns it."""
    assert init in INIT_RULES, init
    if blocks is not None:
        assert meta.tp_partition_sizes is not None and len(blocks) == len(meta.tp_partition_sizes)
    set_param_meta(param, meta)
    setattr(param, _INIT, init)
    setattr(param, _BLOCKS, blocks)
    setattr(param, _ROWS, real_rows)
    return param


def _tp_blocks(param: torch.Tensor, ctx: ShardContext, source: torch.Tensor | None = None):
    """Yield (suffix, local view, global shape, global offset, tp_split) for ``param``
    (views of ``source`` instead when given)."""
    meta = get_param_meta(param)
    blocks = getattr(param, _BLOCKS, None)
    shape = tuple(param.shape)
    if source is not None:
        assert tuple(source.shape) == shape, (tuple(source.shape), shape)
        param = source
    if meta.tp_axis is None:
        yield "", param, shape, (0,) * len(shape), False
        return
    axis = meta.tp_axis
    if meta.tp_partition_sizes is None:
        gshape = list(shape)
        gshape[axis] = shape[axis] * ctx.tp_size
        off = [0] * len(shape)
        off[axis] = shape[axis] * ctx.tp_rank
        yield "", param, tuple(gshape), tuple(off), True
        return
    names = blocks or tuple(f"part{i}" for i in range(len(meta.tp_partition_sizes)))
    local_start = 0
    for name, size in zip(names, meta.tp_partition_sizes):
        local = size // ctx.tp_size
        view = param.narrow(axis, local_start, local)
        gshape = list(shape)
        gshape[axis] = size
        off = [0] * len(shape)
        off[axis] = local * ctx.tp_rank
        local_start += local
        yield f".{name}", view, tuple(gshape), tuple(off), True


def _real_rows(view, gshape, goff, real_rows):
    """Clip a vocab-padded (axis 0) piece to the real rows; None if nothing real is held."""
    if real_rows is None:
        return view, gshape, goff
    start = goff[0]
    keep = min(view.shape[0], real_rows - start)
    if keep <= 0:
        return None
    return view.narrow(0, 0, keep), (real_rows, *gshape[1:]), goff


def param_shards(
    param: torch.Tensor,
    key: str,
    ctx: ShardContext,
    *,
    replica_offset: int = 0,
    source: torch.Tensor | None = None,
) -> list[ShardedTensor]:
    """ShardedTensors (views of ``param``) describing it in global coordinates.

    ``replica_offset`` > 0 marks a second copy of a tensor held elsewhere too (the LM head's
    copy of a tied embedding on the last pipeline stage). ``source`` (same shape as
    ``param``, e.g. its gradient) is described instead of the parameter's own data.
    """
    custom = getattr(param, _CUSTOM, None)
    if custom is not None:  # e.g. stacked MoE experts: one key per expert
        return custom.param_shards(param, key, replica_offset=replica_offset, source=source)
    rows = getattr(param, _ROWS, None)
    out = []
    for suffix, view, gshape, goff, split in _tp_blocks(param, ctx, source):
        clipped = _real_rows(view, gshape, goff, rows)
        if clipped is None:
            continue
        view, gshape, goff = clipped
        rid = ctx.replica_id(split) + replica_offset
        out.append(ShardedTensor(key + suffix, view.data, gshape, goff, replica_id=rid))
    return out


def key_seed(init_seed: int, key: str) -> int:
    """A 63-bit seed derived from the base seed and the global key (stable across runs)."""
    digest = hashlib.sha256(f"{init_seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_from_shards(
    param: torch.Tensor, key: str, ctx: ShardContext, *, init_seed: int, std: float, num_layers: int
) -> None:
    """Initialise ``param`` from the global tensors of its keys (layout-independent values).

    Normal draws use a CPU generator in float32 and are cast to the parameter dtype, so the
    same config gives the same values in float32 and float64.
    """
    custom = getattr(param, _CUSTOM, None)
    if custom is not None:
        custom.init_param(param, key, init_seed=init_seed, std=std, num_layers=num_layers)
        return
    rule = getattr(param, _INIT, "normal")
    if rule == "ones":
        param.fill_(1.0)
        return
    param.zero_()
    if rule == "zeros":
        return
    scale = std / math.sqrt(2.0 * num_layers) if rule == "scaled_normal" else std
    rows = getattr(param, _ROWS, None)
    for suffix, view, gshape, goff, _split in _tp_blocks(param, ctx):
        clipped = _real_rows(view, gshape, goff, rows)
        if clipped is None:
            continue
        view, gshape, goff = clipped
        gen = torch.Generator(device="cpu").manual_seed(key_seed(init_seed, key + suffix))
        full = torch.randn(gshape, generator=gen, dtype=torch.float32) * scale
        index = tuple(slice(o, o + s) for o, s in zip(goff, view.shape))
        view.copy_(full[index].to(view.dtype))
