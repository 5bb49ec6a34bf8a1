"""Where a local parameter sits in its global tensor(s), and flat ranges inside those boxes.

- :class:`ParamRect`: "the local parameter's slice ``[start, stop)`` along ``axis`` is the box
  of global tensor ``key`` at ``global_offset``". A plain parameter is one rect; a TP-fused
  parameter (``ParamMeta.tp_partition_sizes``) is one rect per block.
- :func:`default_param_rects` derives the rects from ``ParamMeta`` and the TP rank alone;
  :func:`rects_from_model_state` takes keys and offsets from the model's own ShardedTensors
  (needed under pipeline/expert parallelism, where local names collide).
- :func:`piece_entries` intersects a ZeRO piece (flat range ``[a, b)`` of the parameter)
  with each rect: the intersection of a row-major interval with a sub-box is an interval of
  the box's own row-major order, so each intersection is one ``flattened_range``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardwork.parallel_state import get_param_meta

__all__ = ["ParamRect", "ParamRectsFn", "default_param_rects", "rects_from_model_state"]


@dataclass(frozen=True)
class ParamRect:
    """The local parameter's slice ``[start, stop)`` along ``axis`` (all of it if ``axis`` is
    None) is the box of global tensor ``key`` at ``global_offset``."""

    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    axis: int | None = None
    start: int = 0
    stop: int | None = None
    replica_id: int = 0


ParamRectsFn = Callable[[str, torch.nn.Parameter], Sequence[ParamRect]]


def default_param_rects(
    name: str, param: torch.Tensor, *, tp_rank: int, tp_size: int
) -> list[ParamRect]:
    """Rectangles of a parameter from its ``ParamMeta`` (TP split, fused blocks) alone."""
    meta = get_param_meta(param)
    shape = tuple(param.shape)
    if meta.tp_axis is None or tp_size == 1:
        return [
            ParamRect(
                name, shape, (0,) * len(shape), replica_id=tp_rank if meta.tp_axis is None else 0
            )
        ]
    axis = meta.tp_axis
    gshape = list(shape)
    gshape[axis] = shape[axis] * tp_size
    blocks = meta.tp_partition_sizes or (gshape[axis],)
    rects, local_start, global_start = [], 0, 0
    for size in blocks:
        local = size // tp_size
        offset = [0] * len(shape)
        offset[axis] = global_start + tp_rank * local
        rects.append(
            ParamRect(name, tuple(gshape), tuple(offset), axis, local_start, local_start + local)
        )
        local_start += local
        global_start += size
    return rects


def rects_from_model_state(
    model_state: Mapping[str, Any], *, tp_rank: int, pp_rank: int = 0
) -> ParamRectsFn:
    """``param_rects`` built from the model's own sharded state dict.

    ``model_state`` maps each parameter's name (as in the DDP-wrapped module's
    ``named_parameters()``) to the ``ShardedTensor`` the model saves it as, or to a list of
    them, one per fused block along ``ParamMeta.tp_axis`` in order. Keys, global shapes and
    offsets come from them; replica ids do not (data-parallel ranks hold *different* optimizer
    pieces): a TP-replicated parameter is a replica on TP ranks > 0 (pass the ``etp`` rank for
    an expert optimizer), and the shared embedding's copy on pipeline stages > 0 is a replica
    of stage 0's (the model must give both copies the same key).
    """

    def rects(name: str, param: torch.nn.Parameter) -> list[ParamRect]:
        if name not in model_state:
            raise ValueError(f"param_rects: no model ShardedTensor for parameter {name!r}")
        entry = model_state[name]
        sts = list(entry) if isinstance(entry, (list, tuple)) else [entry]
        meta = get_param_meta(param)
        replica = tp_rank if meta.tp_axis is None else 0
        if meta.shared_embedding and pp_rank > 0:
            replica += 1
        if len(sts) == 1:
            st = sts[0]
            return [ParamRect(st.key, st.global_shape, st.global_offset, replica_id=replica)]
        if meta.tp_axis is None:
            raise ValueError(
                f"param_rects: {name!r} has {len(sts)} ShardedTensors but ParamMeta.tp_axis=None; "
                "valid: one ShardedTensor, or one per fused block along tp_axis"
            )
        out, start = [], 0
        for st in sts:
            size = st.local_shape[meta.tp_axis]
            out.append(
                ParamRect(
                    st.key,
                    st.global_shape,
                    st.global_offset,
                    meta.tp_axis,
                    start,
                    start + size,
                    replica,
                )
            )
            start += size
        if start != param.shape[meta.tp_axis]:
            raise ValueError(
                f"param_rects: the blocks of {name!r} cover {start} of {param.shape[meta.tp_axis]} "
                f"rows along tp_axis={meta.tp_axis}; valid: blocks that tile the local parameter"
            )
        return out

    return rects


def _box(rect: ParamRect, shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(axis, lo, hi) of the rect's box in the local parameter."""
    if rect.axis is None:
        return 0, 0, shape[0] if shape else 1
    return rect.axis, rect.start, rect.stop if rect.stop is not None else shape[rect.axis]


def _count_before(shape: tuple[int, ...], axis: int, lo: int, hi: int, p: int) -> int:
    """Number of elements of the box ``lo <= idx[axis] < hi`` with flat index < p."""
    inner = math.prod(shape[axis + 1 :])
    n = shape[axis] if shape else 1
    outer, rem = divmod(p, n * inner)
    b, i = divmod(rem, inner)
    width = hi - lo
    within = 0 if b < lo else width * inner if b >= hi else (b - lo) * inner + i
    return outer * width * inner + within


def piece_entries(
    rects: Sequence[ParamRect], shape: tuple[int, ...], a: int, b: int
) -> list[tuple[ParamRect, tuple[int, ...], tuple[int, int], Any]]:
    """For each rect meeting the flat range [a, b): (rect, box shape, flat range in the box,
    selector into the piece: a slice, or a bool mask when the elements are not contiguous)."""
    out = []
    for rect in rects:
        axis, lo, hi = _box(rect, shape)
        bshape = list(shape) or [1]
        bshape[axis] = hi - lo
        fa, fb = _count_before(shape, axis, lo, hi, a), _count_before(shape, axis, lo, hi, b)
        if fa == fb:
            continue
        if math.prod(shape[:axis]) == 1:  # box is contiguous in flat order
            inner = math.prod(shape[axis + 1 :])
            s, e = max(a, lo * inner), min(b, hi * inner)
            selector: Any = slice(s - a, e - a)
        else:
            inner = math.prod(shape[axis + 1 :])
            coord = (torch.arange(a, b) // inner) % shape[axis]
            selector = (coord >= lo) & (coord < hi)
        out.append((rect, tuple(bshape), (fa, fb), selector))
    return out
