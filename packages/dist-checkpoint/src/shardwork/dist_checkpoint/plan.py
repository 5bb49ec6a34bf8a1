"""Save planning: what every rank holds, global validation, and who writes what.

- `collect_local` turns a sharded state dict into this rank's pieces: every `ShardedTensor`
  becomes one or more rectangles (several when it is a flat range, see `boxes`), every
  `ShardedObject` one grid cell, every other leaf a plain value.
- `summarize` reduces that to a small picklable description; `save` gathers the descriptions
  on the first rank, which runs `build_rank_plans` once for all ranks and sends each rank only
  its `RankAssignment` (or the `ValueError`, raised on every rank before anything is written).
- Validation: per key the kind, dtype and global shape agree on all ranks; the primary pieces
  (``replica_id == 0``) tile the global tensor exactly (no overlap, nothing missing); every
  object cell has exactly one primary.
- Writer choice: each distinct rectangle is written once. Candidates are the ranks holding the
  identical rectangle (primary or replica); rectangles are taken largest first and given to the
  candidate with the fewest bytes assigned so far, so data-parallel replicas share the writing
  instead of one rank writing everything. Objects are written by their primary.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from shardwork.dist_checkpoint.boxes import Box, boxes_overlap, flat_range_boxes
from shardwork.dist_checkpoint.sharded import ShardedObject, ShardedTensor
from shardwork.dist_checkpoint.tree import Path, iter_leaves, path_str

__all__ = [
    "COMMON_KEY",
    "GlobalPlan",
    "LocalState",
    "RankAssignment",
    "build_global_plan",
    "build_rank_plans",
    "collect_local",
    "summarize",
]

#: DCP key of the pickled dict of plain values (written by the first rank only).
COMMON_KEY = "_shardwork/common"
RESERVED_PREFIX = "_shardwork/"
_MAX_ERRORS = 12


@dataclass
class TensorPiece:
    """One rectangle of a global tensor held by this rank, as a view of the local data."""

    key: str
    box: Box
    view: torch.Tensor


@dataclass
class LocalState:
    """This rank's leaves, split by kind."""

    tensors: list[tuple[Path, ShardedTensor, list[TensorPiece]]] = field(default_factory=list)
    objects: list[tuple[Path, ShardedObject]] = field(default_factory=list)
    plain: list[tuple[Path, Any]] = field(default_factory=list)


def tensor_pieces(st: ShardedTensor) -> list[TensorPiece]:
    """Rectangles (global coordinates) of ``st`` with views into ``st.data``."""
    assert st.local_shape is not None
    if st.flattened_range is None:
        return [TensorPiece(st.key, (st.global_offset, st.local_shape), st.data)]
    start, stop = st.flattened_range
    # The pieces are views at offsets into the 1-D data, which needs contiguous storage.
    if not st.data.is_contiguous():
        raise ValueError(
            f"{st.key!r}: flattened data with stride {st.data.stride()} is not valid; "
            f"valid: a contiguous 1-D tensor"
        )
    pieces = []
    for (off, sizes), flat in flat_range_boxes(st.local_shape, start, stop):
        numel = math.prod(sizes)
        # Row-major order restricted to a sub-box is the sub-box's own row-major order, so each box
        # is a contiguous run of the flat data.
        view = st.data[flat - start : flat - start + numel].view(sizes)
        goff = tuple(g + o for g, o in zip(st.global_offset, off))
        pieces.append(TensorPiece(st.key, (goff, sizes), view))
    return pieces


def collect_local(state: Any) -> LocalState:
    """Sort the leaves of a sharded state dict into tensors, objects and plain values."""
    local = LocalState()
    for path, leaf in iter_leaves(state):
        if isinstance(leaf, ShardedTensor):
            _check_reserved(leaf.key)
            local.tensors.append((path, leaf, tensor_pieces(leaf)))
        elif isinstance(leaf, ShardedObject):
            _check_reserved(leaf.key)
            local.objects.append((path, leaf))
        else:
            local.plain.append((path, leaf))
    return local


def _check_reserved(key: str) -> None:
    if key.startswith(RESERVED_PREFIX):
        raise ValueError(
            f"key={key!r} starts with the reserved prefix {RESERVED_PREFIX!r}; "
            f"valid: any other name"
        )


def summarize(local: LocalState) -> dict[str, Any]:
    """Small picklable description of ``local`` for the all-gather."""
    return {
        "tensors": [
            (
                st.key,
                str(st.data.dtype).removeprefix("torch."),
                st.global_shape,
                st.replica_id,
                path_str(path),
                [p.box for p in pieces],
            )
            for path, st, pieces in local.tensors
        ],
        "objects": [
            (obj.key, obj.global_shape, obj.global_offset, obj.replica_id, path_str(path))
            for path, obj in local.objects
        ],
        "plain": [path_str(path) for path, _ in local.plain],
    }


@dataclass
class GlobalPlan:
    """Outcome of planning, identical on every rank except the ``mine_*`` fields."""

    #: key -> {"kind", "dtype", "global_shape", "paths", "num_chunks"} for the metadata file.
    catalogue: dict[str, dict[str, Any]]
    #: (key, offsets) of the rectangles this rank writes.
    mine_tensors: set[tuple[str, tuple[int, ...]]]
    #: unique keys of the objects this rank writes.
    mine_objects: set[str]
    #: keys of zero-element tensors this rank records (one rank per key).
    mine_empty: set[str]
    #: bytes each rank writes (for logs and the load-balancing test).
    bytes_per_rank: list[int]
    #: paths of plain values (taken from the first rank).
    plain_paths: list[str]


@dataclass
class RankAssignment:
    """What one rank writes: all it needs from planning unless it writes the metadata."""

    #: (key, offsets) of the rectangles this rank writes.
    mine_tensors: set[tuple[str, tuple[int, ...]]] = field(default_factory=set)
    #: unique keys of the objects this rank writes.
    mine_objects: set[str] = field(default_factory=set)
    #: keys of zero-element tensors this rank records (one rank per key).
    mine_empty: set[str] = field(default_factory=set)
    #: bytes of tensor data this rank writes.
    nbytes: int = 0


@functools.cache
def _dtype_itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _find_overlap(boxes: list[tuple[Box, int]]) -> tuple[tuple[Box, int], tuple[Box, int]] | None:
    """First pair of overlapping boxes (sweep over dim 0), or None."""
    if not boxes:
        return None
    if not boxes[0][0][0]:  # 0-d tensor: every box is the whole scalar
        return (boxes[0], boxes[1]) if len(boxes) > 1 else None
    # Sweep over dim 0: boxes sorted by their dim-0 start; ``active`` holds those still open.
    order = sorted(boxes, key=lambda b: (b[0][0][0], b[0][0]))
    active: list[tuple[Box, int]] = []
    for item in order:
        start = item[0][0][0]
        # A box ending on dim 0 before this one starts cannot overlap it or any later box.
        active = [a for a in active if a[0][0][0] + a[0][1][0] > start]
        for other in active:
            if boxes_overlap(item[0], other[0]):
                return other, item
        active.append(item)
    return None


@dataclass
class _Gathered:
    """Phase 1's result: what every rank holds, per key and per distinct rectangle."""

    #: key -> {"kind", "dtype", "global_shape", "paths", "rank" (first rank seen)}.
    info: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: key -> [(box, rank)] of the primary pieces (replica_id == 0).
    primaries: dict[str, list[tuple[Box, int]]] = field(default_factory=lambda: defaultdict(list))
    #: (key, box) -> ranks holding that rectangle (primary or replica): the writer candidates.
    holders: dict[tuple[str, Box], set[int]] = field(default_factory=lambda: defaultdict(set))
    errors: list[str] = field(default_factory=list)

    def note(
        self, key: str, kind: str, dtype: str | None, gshape: tuple, r: int, path: str
    ) -> bool:
        """Record rank ``r``'s view of ``key``; False (and an error) if it disagrees."""
        entry = self.info.setdefault(
            key,
            {"kind": kind, "dtype": dtype, "global_shape": gshape, "paths": set(), "rank": r},
        )
        entry["paths"].add(path)
        for field_name, value in (("kind", kind), ("dtype", dtype), ("global_shape", gshape)):
            if entry[field_name] != value:
                self.errors.append(
                    f"key {key!r}: {field_name} differs across ranks: rank {entry['rank']} has "
                    f"{entry[field_name]!r}, rank {r} has {value!r}; valid: the same on every rank"
                )
                return False
        return True


def _gather(summaries: list[dict[str, Any]]) -> _Gathered:
    """Phase 1: every rank's tensors and objects by key; kind/dtype/shape disagreements."""
    g = _Gathered()
    for r, summary in enumerate(summaries):
        for key, dtype, gshape, replica_id, path, boxes in summary["tensors"]:
            if not g.note(key, "tensor", dtype, tuple(gshape), r, path):
                continue
            for box in boxes:
                # A zero-element box holds nothing to write and covers nothing.
                if math.prod(box[1]) == 0:
                    continue
                g.holders[(key, box)].add(r)
                if replica_id == 0:
                    g.primaries[key].append((box, r))
        for key, gshape, goff, replica_id, path in summary["objects"]:
            if not g.note(key, "object", None, tuple(gshape), r, path):
                continue
            # An object is one grid cell: size 1 in every dimension at its offset.
            cell = (tuple(goff), (1,) * len(goff))
            g.holders[(key, cell)].add(r)
            if replica_id == 0:
                g.primaries[key].append((cell, r))
    return g


def _check_tiling(g: _Gathered) -> None:
    """Phase 2: per key, the primary pieces neither overlap nor leave elements uncovered."""
    for key, entry in g.info.items():
        boxes = g.primaries.get(key, [])
        total = math.prod(entry["global_shape"])
        if entry["kind"] == "tensor" and total == 0:
            continue
        # With no overlap found, a covered count below the total means a piece is missing.
        covered = sum(math.prod(b[1]) for b, _ in boxes)
        pair = _find_overlap(boxes)
        what = "object cell" if entry["kind"] == "object" else "shard"
        if pair is not None:
            (b0, r0), (b1, r1) = pair
            g.errors.append(
                f"key {key!r}: {what} at offset {b0[0]} size {b0[1]} on rank {r0} overlaps "
                f"{what} at offset {b1[0]} size {b1[1]} on rank {r1}, both with replica_id=0; "
                f"valid: exactly one rank holds each element with replica_id=0 "
                f"(mark copies with replica_id > 0)"
            )
        elif covered != total:
            g.errors.append(
                f"key {key!r}: primary {what}s (replica_id=0) cover {covered} of {total} "
                f"elements of global_shape {entry['global_shape']} (held by ranks "
                f"{sorted({r for _, r in boxes})}); valid: replica_id=0 pieces that tile the "
                f"whole tensor"
            )


def _raise_errors(errors: list[str]) -> None:
    if errors:
        more = f"\n... and {len(errors) - _MAX_ERRORS} more" if len(errors) > _MAX_ERRORS else ""
        raise ValueError("invalid sharded state dict:\n" + "\n".join(errors[:_MAX_ERRORS]) + more)


def _choose_writers(g: _Gathered, num_ranks: int) -> tuple[list[int], list[RankAssignment]]:
    """Phase 3: bytes per rank, and the rectangles and objects every rank writes, in one pass.

    Rectangles largest first, each to the holder with the fewest bytes so far (ties: lowest
    rank), a deterministic assignment; objects go to their primary.
    """
    load = [0] * num_ranks
    shares = [RankAssignment() for _ in range(num_ranks)]
    units = []
    for key, boxes in g.primaries.items():
        entry = g.info[key]
        for box, primary in boxes:
            if entry["kind"] == "object":
                obj = ShardedObject(key, None, entry["global_shape"], box[0])
                shares[primary].mine_objects.add(obj.unique_key)
                continue
            nbytes = math.prod(box[1]) * _dtype_itemsize(entry["dtype"])
            units.append((nbytes, key, box))
    # A total order (size desc, key, box) makes the assignment independent of arrival order.
    units.sort(key=lambda u: (-u[0], u[1], u[2]))
    for nbytes, key, box in units:
        writer = min(g.holders[(key, box)], key=lambda r: (load[r], r))
        load[writer] += nbytes
        shares[writer].mine_tensors.add((key, box[0]))
    for key, e in g.info.items():
        # a zero-element tensor has nothing to tile: its first holder records it in the metadata
        if e["kind"] == "tensor" and math.prod(e["global_shape"]) == 0:
            shares[e["rank"]].mine_empty.add(key)
    for r, share in enumerate(shares):
        share.nbytes = load[r]
    return load, shares


def _catalogue(g: _Gathered) -> dict[str, dict[str, Any]]:
    """Phase 4: the per-key record of the metadata file, in key order."""
    return {
        key: {
            "kind": e["kind"],
            "dtype": e["dtype"],
            "global_shape": list(e["global_shape"]),
            "paths": sorted(e["paths"]),
            "num_chunks": len(g.primaries.get(key, [])),
        }
        for key, e in sorted(g.info.items())
    }


def build_rank_plans(summaries: list[dict[str, Any]]) -> tuple[GlobalPlan, list[RankAssignment]]:
    """Validate all ranks' summaries and choose every rank's writes. Raises ValueError naming keys.

    Phases: gather every rank's pieces by key (`_gather`), check kinds/dtypes/shapes and
    the tiling of the primaries (`_check_tiling`), raise every error found at once, then
    choose every rank's writers in one pass (`_choose_writers`) and build the catalogue
    (`_catalogue`). Time and memory are linear in the total number of pieces over all ranks.
    Returns the plan of the first rank (which writes the metadata) and each rank's share.
    """
    g = _gather(summaries)
    _check_tiling(g)
    _raise_errors(g.errors)
    load, shares = _choose_writers(g, len(summaries))
    first = shares[0]
    plan = GlobalPlan(
        _catalogue(g),
        set(first.mine_tensors),
        set(first.mine_objects),
        set(first.mine_empty),
        load,
        list(summaries[0]["plain"]),
    )
    return plan, shares


def build_global_plan(summaries: list[dict[str, Any]], rank: int) -> GlobalPlan:
    """The plan of ``rank``: the shared catalogue, bytes and plain paths with its own writes
    (`build_rank_plans`, for callers that hold every rank's summary)."""
    plan, shares = build_rank_plans(summaries)
    mine = shares[rank]
    plan.mine_tensors, plan.mine_objects, plan.mine_empty = (
        mine.mine_tensors,
        mine.mine_objects,
        mine.mine_empty,
    )
    return plan
