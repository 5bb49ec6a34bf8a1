"""How each local parameter maps onto its global tensor(s): checkpoint description and init.

- A parameter created by this package carries, besides its :class:`ParamMeta`, small
  attributes set by :func:`describe_param`: the names of its fused blocks (``("q", "k", "v")``,
  ``("gate", "up")``), the number of real rows (padded vocabulary: padding rows are neither
  saved nor initialised randomly), its init rule (``"normal"``, ``"scaled_normal"``,
  ``"ones"``, ``"zeros"``, or a :class:`UniformInit` for the per-head vectors of state-space
  mixers) and, rarely, a std of its own (the MoE router's ``RouterConfig.init_std``) instead of
  the model's ``init_method_std``.
- :func:`param_shards` turns one local parameter into the ShardedTensors that say where it sits
  in global coordinates: one per fused block (keys ``<name>.q`` ...), each a view of the
  parameter, so a checkpoint load fills the parameter in place. A parameter sharded by FSDP
  (a DTensor of rows of the TP-local tensor, ``shardwork.parallel_state.row_shard``) is
  described by the same rules cut to its rows: every block's intersection with a row range is
  again a box, so the pieces are plain rectangles, views of the local shard, with no data-
  parallel replica.
- :func:`init_from_shards` initialises a parameter from the same description. A key's global
  tensor is cut, along the one axis any layout splits it on (the TP axis; axis 0 otherwise),
  into blocks of ``INIT_BLOCK`` lines. Each block is drawn from its own generator, seeded by
  ``(init_seed, key, block)``, and a rank draws only the blocks its slice overlaps
  (:func:`normal_slice`). Values therefore depend only on the key, never on tp/pp/cp, and no
  rank ever holds a whole global tensor.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from shardwork.dist_checkpoint import ShardedTensor
from shardwork.parallel_state import ParamMeta, get_param_meta, row_shard, set_param_meta

__all__ = [
    "INIT_BLOCK",
    "INIT_RULES",
    "ShardContext",
    "UniformInit",
    "describe_param",
    "fsdp_rows",
    "init_from_shards",
    "key_seed",
    "normal_slice",
    "param_blocks",
    "param_shards",
]

INIT_RULES = ("normal", "scaled_normal", "ones", "zeros")
INIT_BLOCK = 64
"""Lines (indices along the split axis) per independently seeded block of an initial tensor.
Part of the initial values' definition: changing it changes every model's initial weights."""
_BLOCKS = "_shardwork_blocks"
_ROWS = "_shardwork_real_rows"
_INIT = "_shardwork_init"
_STD = "_shardwork_init_std"
_CUSTOM = "_shardwork_custom_shards"
"""Optional object with ``param_shards(param, key, *, replica_offset, source)`` and
``init_param(param, key, *, init_seed, std, num_layers)`` overriding the TP description
(stacked MoE experts, split over ep and etp: ``shardwork.models.moe.ExpertShards``)."""


@dataclass(frozen=True)
class UniformInit:
    """Init rule: ``transform(U(low, high))`` per element, drawn layout-independently.

    The uniform draws follow :func:`normal_slice`'s blocks and seeds (``torch.rand`` instead of
    ``torch.randn``), so the values depend only on the key. ``transform`` maps the float32
    draws to the parameter's values (e.g. ``torch.log`` for a Mamba ``A_log``); None keeps them.
    """

    low: float
    high: float
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass(frozen=True)
class ShardContext:
    """Where this rank sits: its tp rank/size and its index among data replicas (dp×cp)."""

    tp_rank: int = 0
    tp_size: int = 1
    replica_rank: int = 0
    """Rank in the dp×cp group: every parameter is replicated across it."""

    def replica_id(self, tp_split: bool) -> int:
        """0 for the primary copy; a positive id on every rank holding a duplicate."""
        # A TP-split piece differs per TP rank, so each TP rank of replica 0 holds a primary; a
        # replicated tensor's only primary is tp rank 0 of replica 0. One rank saves each piece.
        tp_part = 0 if tp_split else self.tp_rank
        return tp_part + self.tp_size * self.replica_rank


def describe_param(
    param: torch.nn.Parameter,
    meta: ParamMeta,
    *,
    init: str | UniformInit,
    blocks: tuple[str, ...] | None = None,
    real_rows: int | None = None,
    std: float | None = None,
) -> torch.nn.Parameter:
    """Attach ``meta`` and the checkpoint/init description to ``param``; returns it.

    ``std``: the normal draw's standard deviation when the parameter has its own (None: the
    model's, given to :func:`init_from_shards`)."""
    assert isinstance(init, UniformInit) or init in INIT_RULES, init
    if blocks is not None:
        assert meta.tp_partition_sizes is not None and len(blocks) == len(meta.tp_partition_sizes)
    set_param_meta(param, meta)
    setattr(param, _INIT, init)
    setattr(param, _BLOCKS, blocks)
    setattr(param, _ROWS, real_rows)
    setattr(param, _STD, std)
    return param


def param_blocks(param: torch.Tensor) -> tuple[str, ...] | None:
    """Names of ``param``'s fused blocks along its TP axis (``("q", "k", "v")``), or None."""
    return getattr(param, _BLOCKS, None)


def _tp_blocks(
    param: torch.Tensor,
    ctx: ShardContext,
    source: torch.Tensor | None = None,
    *,
    first_row: int | None = None,
):
    """Yield (suffix, local view, global shape, global offset, tp_split) for ``param``
    (views of ``source`` instead when given).

    ``first_row`` (not None): ``source`` holds only rows ``[first_row, first_row +
    len(source))`` of the parameter (its FSDP shard); each block is then cut to those rows, and
    its global offset moves with them (along the TP axis when it is axis 0, else along axis 0)."""
    meta = get_param_meta(param)
    blocks = getattr(param, _BLOCKS, None)
    shape = tuple(param.shape)
    data = param if source is None else source
    if first_row is None:
        assert source is None or tuple(source.shape) == shape, (tuple(source.shape), shape)
        first_row = 0
    stop_row = first_row + (data.shape[0] if data.dim() else 1)
    if meta.tp_axis is None:
        off = [0] * len(shape)
        if shape:
            off[0] = first_row
        yield "", data, shape, tuple(off), False
        return
    axis = meta.tp_axis
    sizes = meta.tp_partition_sizes or (shape[axis] * ctx.tp_size,)
    if meta.tp_partition_sizes is None:
        names: tuple[str, ...] = ("",)
    else:
        names = tuple(f".{n}" for n in (blocks or [f"part{i}" for i in range(len(sizes))]))
    local_start = 0
    for suffix, size in zip(names, sizes):
        local = size // ctx.tp_size
        gshape = list(shape)
        gshape[axis] = size
        off = [0] * len(shape)
        # Each fused block is split on its own: this rank's slice of block q sits at q's tp_rank-th
        # slice, not at an offset into the concatenated [q | k | v] tensor.
        off[axis] = local * ctx.tp_rank
        if axis == 0:
            lo, hi = max(local_start, first_row), min(local_start + local, stop_row)
            # No rows of this block on this FSDP rank: an empty view, skipped by the caller.
            view = data.narrow(0, lo - first_row, hi - lo) if hi > lo else data.narrow(0, 0, 0)
            off[0] += lo - local_start
        else:
            view = data.narrow(axis, local_start, local)
            off[0] += first_row
        local_start += local
        yield suffix, view, tuple(gshape), tuple(off), True


def fsdp_rows(param: torch.Tensor, source: torch.Tensor | None) -> tuple[torch.Tensor, int] | None:
    """``(local rows, first row)`` of an FSDP-sharded ``param`` (of ``source`` — a DTensor
    gradient, or a tensor of the parameter's full shape — when given); None for a plain one."""
    rows = row_shard(param)
    if rows is None:
        return None
    if source is None:
        return rows.local, rows.start
    if isinstance(source, DTensor):
        with torch.no_grad():
            return source.to_local(), rows.start
    return source.narrow(0, rows.start, rows.stop - rows.start), rows.start


def _real_rows(view, gshape, goff, real_rows):
    """Clip a vocab-padded (axis 0) piece to the real rows; None if nothing real is held."""
    if real_rows is None:
        return view, gshape, goff
    start = goff[0]
    # Padding rows sit at the end of the vocabulary, so clipping keeps a prefix of the piece.
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
    first_row = None
    fsdp = fsdp_rows(param, source)
    if fsdp is not None:
        # FSDP: each data-parallel rank holds different rows, so none is a replica of another.
        source, first_row = fsdp
        ctx = dataclasses.replace(ctx, replica_rank=0)
    out = []
    for suffix, view, gshape, goff, split in _tp_blocks(param, ctx, source, first_row=first_row):
        clipped = _real_rows(view, gshape, goff, rows)
        if clipped is None or (fsdp is not None and view.numel() == 0):
            continue
        view, gshape, goff = clipped
        rid = ctx.replica_id(split) + replica_offset
        out.append(ShardedTensor(key + suffix, view.data, gshape, goff, replica_id=rid))
    return out


def key_seed(init_seed: int, key: str) -> int:
    """A 63-bit seed derived from the base seed and the global key (stable across runs)."""
    # sha256 rather than hash(): Python's str hash is salted per process, so ranks would disagree.
    digest = hashlib.sha256(f"{init_seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def normal_slice(
    init_seed: int,
    key: str,
    global_shape: tuple[int, ...],
    global_offset: tuple[int, ...],
    shape: tuple[int, ...],
    *,
    axis: int = 0,
    draw: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """The ``shape`` slice at ``global_offset`` of key ``key``'s layout-free N(0, 1) tensor
    (U(0, 1) with ``draw=torch.rand``; None means ``torch.randn``, looked up at call time).

    ``axis`` is the axis any layout splits the key along (its TP or ETP axis; 0 if none). It
    must not depend on the layout. The tensor is cut along it into blocks of
    :data:`INIT_BLOCK` lines. Block ``b`` is ``randn`` of the global shape with that axis cut
    to the block's lines, drawn in float32 from a CPU generator seeded by
    ``key_seed(init_seed, f"{key}#{b}")``. Only the blocks the slice overlaps are drawn, so the
    cost is the slice plus at most two partial blocks.
    """
    draw = torch.randn if draw is None else draw
    if not global_shape:  # a scalar parameter: one block
        gen = torch.Generator(device="cpu").manual_seed(key_seed(init_seed, f"{key}#0"))
        return draw((), generator=gen, dtype=torch.float32)
    for a, (g, o, n) in enumerate(zip(global_shape, global_offset, shape)):
        if a != axis and (o, n) != (0, g):
            raise ValueError(
                f"{key}: slice {tuple(shape)} at {tuple(global_offset)} of {tuple(global_shape)} "
                f"is cut along axis {a}; this key may only be split along axis {axis}"
            )
    lines = global_shape[axis]
    start, stop = global_offset[axis], global_offset[axis] + shape[axis]
    # The blocks overlapping [start, stop); max() keeps an empty slice from ending before it starts.
    first, last = start // INIT_BLOCK, max(start, stop - 1) // INIT_BLOCK
    parts = []
    for block in range(first, last + 1):
        block_shape = list(global_shape)
        block_shape[axis] = min(INIT_BLOCK, lines - block * INIT_BLOCK)
        gen = torch.Generator(device="cpu").manual_seed(key_seed(init_seed, f"{key}#{block}"))
        parts.append(draw(block_shape, generator=gen, dtype=torch.float32))
    drawn = parts[0] if len(parts) == 1 else torch.cat(parts, dim=axis)
    return drawn.narrow(axis, start - first * INIT_BLOCK, stop - start)


@torch.no_grad()
def init_from_shards(
    param: torch.Tensor, key: str, ctx: ShardContext, *, init_seed: int, std: float, num_layers: int
) -> None:
    """Initialise ``param`` from the global tensors of its keys (layout-independent values).

    Normal draws are float32 (:func:`normal_slice`, only this rank's slice) and cast to the
    parameter dtype, so the same config gives the same values in float32 and float64.
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
    if isinstance(rule, UniformInit):
        _init_uniform(param, key, ctx, rule, init_seed)
        return
    own = getattr(param, _STD, None)
    std = std if own is None else own
    # Output projections: std / sqrt(2·num_layers), Megatron's scaled_init_method_normal (GPT-2's
    # scaling of residual-branch weights, two residual branches per layer).
    scale = std / math.sqrt(2.0 * num_layers) if rule == "scaled_normal" else std
    rows = getattr(param, _ROWS, None)
    tp_axis = get_param_meta(param).tp_axis
    axis = 0 if tp_axis is None else tp_axis  # the same at every layout
    for suffix, view, gshape, goff, _split in _tp_blocks(param, ctx):
        clipped = _real_rows(view, gshape, goff, rows)
        if clipped is None:
            continue
        view, gshape, goff = clipped
        local = normal_slice(init_seed, key + suffix, gshape, goff, tuple(view.shape), axis=axis)
        view.copy_((local * scale).to(view.dtype))


def _init_uniform(param: torch.Tensor, key: str, ctx: ShardContext, rule: UniformInit, seed: int):
    tp_axis = get_param_meta(param).tp_axis
    axis = 0 if tp_axis is None else tp_axis
    for suffix, view, gshape, goff, _split in _tp_blocks(param, ctx):
        unit = normal_slice(
            seed, key + suffix, gshape, goff, tuple(view.shape), axis=axis, draw=torch.rand
        )
        values = rule.low + (rule.high - rule.low) * unit
        if rule.transform is not None:
            values = rule.transform(values)
        view.copy_(values.to(view.dtype))
