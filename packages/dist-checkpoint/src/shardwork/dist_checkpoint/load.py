"""`load`: fill a template sharded state dict from a checkpoint saved at any layout.

- Every template `ShardedTensor` asks for its rectangles (a flat range asks for the boxes of
  `boxes.flat_range_boxes`, read straight into views of its flat tensor); DCP intersects them
  with the saved chunks, so any layout loads into any other (TP/PP/EP/DP changes, flat
  optimizer shards at another DP size, 1 rank to 8 and back).
- Key checks run before any data is read, and every rank's findings are all-gathered so all
  ranks raise the same error: *missing* (in the template, not in the checkpoint), *unexpected*
  (in the checkpoint, in no rank's template), *mismatch* (global shape or kind differs).
  ``strict=True`` raises on missing and unexpected, ``strict="missing"`` only on missing,
  ``strict=False`` on neither (missing entries keep the template's values). Mismatches always
  raise.
- ``key_filter(path, key)`` restricts the load to some leaves (granular loads); the others are
  returned as the template has them, and unexpected keys are judged among the saved keys whose
  recorded path passes the same filter.
- Data are read by `reader.ShardworkReader` (same files as DCP's reader): each file once, in
  order, straight into the template's memory where a saved chunk covers a destination as one
  dense byte range; ``thread_count`` files at a time.
- A read failure is re-raised as `CheckpointCorruptError` naming files whose size differs
  from the recorded one (a truncated or missing file).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from shardwork.dist_checkpoint import metadata as md
from shardwork.dist_checkpoint.comm import all_gather_object, resolve_group
from shardwork.dist_checkpoint.plan import COMMON_KEY, collect_local
from shardwork.dist_checkpoint.planners import PlannedLoadPlanner
from shardwork.dist_checkpoint.reader import ShardworkReader
from shardwork.dist_checkpoint.sharded import ShardedObject, ShardedTensor
from shardwork.dist_checkpoint.tree import Path as TreePath
from shardwork.dist_checkpoint.tree import map_leaves, path_str

__all__ = ["KeyFilter", "load", "parse_path"]

KeyFilter = Callable[[TreePath, str], bool]
_MAX_LISTED = 20
_STRICT_VALUES = (True, False, "missing")


def parse_path(text: str) -> TreePath:
    """Inverse of `tree.path_str` for filtering recorded paths (digits become ints)."""
    return tuple(int(p) if p.isdigit() else p for p in text.split("/")) if text else ()


def _listing(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_MAX_LISTED])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > _MAX_LISTED else "")


def _byteio_read(fqn: str) -> ReadItem:
    index = MetadataIndex(fqn)
    return ReadItem(
        type=LoadItemType.BYTE_IO,
        dest_index=index,
        dest_offsets=torch.Size((0,)),
        storage_index=index,
        storage_offsets=torch.Size((0,)),
        lengths=torch.Size((0,)),
    )


def _size_problems(path: Path, info: dict[str, Any]) -> list[str]:
    problems = []
    for name, rec in sorted(info.get("files", {}).items()):
        f = path / name
        if not f.is_file():
            problems.append(f"{name}: missing")
        elif f.stat().st_size != rec["size"]:
            problems.append(f"{name}: {f.stat().st_size} bytes, recorded {rec['size']}")
    return problems


def load(
    template: Any,
    path: str | os.PathLike,
    *,
    group: Any = None,
    strict: bool | str = True,
    key_filter: KeyFilter | None = None,
    thread_count: int = 1,
    stats: dict[str, int] | None = None,
) -> Any:
    """Load ``path`` into ``template`` (collective over ``group``); return the loaded state.

    Args:
        template: sharded state dict describing what this rank wants; its `ShardedTensor`
            data are filled in place (any device, dtype cast on copy).
        path: a committed checkpoint directory.
        group: ranks that load together (None: world, or one process).
        strict: True, ``"missing"`` or False (see the module docstring).
        key_filter: ``(path, key) -> bool``; leaves it rejects are left as in the template.
        thread_count: data files this rank reads concurrently (one thread each).
        stats: if given, updated with this rank's count of read items per read path
            (``direct``, ``staged``, ``fallback``, ``bytes``, ``empty``; see `reader`).

    Returns:
        The template's structure with each `ShardedTensor` replaced by its (filled) tensor,
        each `ShardedObject` by the loaded object, plain values by the saved ones.
    """
    if strict not in _STRICT_VALUES or (isinstance(strict, int) and not isinstance(strict, bool)):
        raise ValueError(f"strict={strict!r} is not valid; valid: True, False or 'missing'")
    path = Path(path)
    reader = ShardworkReader(path, thread_count=thread_count)
    g = resolve_group(group)
    info = md.read_info(path)
    saved = reader.read_metadata().state_dict_metadata
    keep = key_filter or (lambda _p, _k: True)

    local = collect_local(template)
    tensors = [(p, st, pcs) for p, st, pcs in local.tensors if keep(p, st.key)]
    objects = [(p, obj) for p, obj in local.objects if keep(p, obj.key)]
    plain_saved = set(info.get("plain_paths", []))
    plain = [(p, v) for p, v in local.plain if keep(p, path_str(p))]

    missing: list[str] = []
    mismatched: list[str] = []
    wanted: set[str] = set()
    views: dict[str, list[torch.Tensor]] = {}
    chunks: dict[str, list[ChunkStorageMetadata]] = {}
    for _, st, pieces in tensors:
        wanted.add(st.key)
        meta = saved.get(st.key)
        if meta is None:
            missing.append(st.key)
            continue
        if not isinstance(meta, TensorStorageMetadata):
            mismatched.append(f"{st.key!r}: saved as an object, template has a ShardedTensor")
            continue
        if tuple(meta.size) != st.global_shape:
            mismatched.append(
                f"{st.key!r}: saved global_shape {tuple(meta.size)}, template {st.global_shape}"
            )
            continue
        for piece in pieces:
            if any(s == 0 for s in piece.box[1]):
                continue
            chunks.setdefault(st.key, []).append(
                ChunkStorageMetadata(torch.Size(piece.box[0]), torch.Size(piece.box[1]))
            )
            views.setdefault(st.key, []).append(piece.view)
    object_reads: set[str] = set()
    for _, obj in objects:
        wanted.add(obj.key)
        meta = saved.get(obj.unique_key)
        if meta is None:
            known = info["keys"].get(obj.key)
            if known is not None and tuple(known["global_shape"]) != obj.global_shape:
                mismatched.append(
                    f"{obj.key!r}: saved as an object grid {tuple(known['global_shape'])}, "
                    f"template asks for cell {obj.global_offset} of {obj.global_shape}"
                )
            else:
                missing.append(obj.unique_key)
            continue
        if not isinstance(meta, BytesStorageMetadata):
            mismatched.append(f"{obj.key!r}: saved as a tensor, template has a ShardedObject")
            continue
        object_reads.add(obj.unique_key)
    for p, _ in plain:
        wanted.add(path_str(p))
        if path_str(p) not in plain_saved:
            missing.append(path_str(p))

    everyone = all_gather_object((sorted(missing), mismatched, sorted(wanted)), g)
    errors = []
    all_mismatched = sorted({m for _, mm, _ in everyone for m in mm})
    if all_mismatched:
        errors.append("shape or kind mismatch for " + "; ".join(all_mismatched))
    if strict in (True, "missing"):
        all_missing = sorted({k for miss, _, _ in everyone for k in miss})
        if all_missing:
            errors.append(f"missing from the checkpoint: {_listing(all_missing)}")
    if strict is True:
        union = {k for _, _, w in everyone for k in w}
        saved_names = [(key, entry["paths"]) for key, entry in info["keys"].items()] + [
            (p, [p]) for p in plain_saved
        ]
        unexpected = sorted(
            name
            for name, paths in saved_names
            if name not in union and any(keep(parse_path(p), name) for p in paths)
        )
        if unexpected:
            errors.append(f"unexpected (saved, in no rank's template): {_listing(unexpected)}")
    if errors:
        raise ValueError(
            f"cannot load {str(path)!r} (strict={strict!r}):\n"
            + "\n".join(errors)
            + "\nvalid: a template with the saved keys and global shapes, or strict='missing' "
            "/ strict=False / key_filter to load a subset"
        )

    items: list[ReadItem] = []
    for key, key_chunks in chunks.items():
        meta = saved[key]
        assert isinstance(meta, TensorStorageMetadata)
        items += create_read_items_for_chunk_list(key, meta, key_chunks)
    items += [_byteio_read(k) for k in sorted(object_reads)]
    if plain:
        items.append(_byteio_read(COMMON_KEY))
    planner = PlannedLoadPlanner(items, views)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                {},
                storage_reader=reader,
                planner=planner,
                process_group=g.pg,
                no_dist=not g.distributed,
            )
    except (Exception, CheckpointException) as exc:
        problems = _size_problems(path, info)
        if problems:
            raise md.CheckpointCorruptError(
                f"reading {str(path)!r} failed; files differ from what was recorded: "
                + "; ".join(problems)
            ) from exc
        raise
    if stats is not None:
        for name, count in reader.stats.items():
            stats[name] = stats.get(name, 0) + count

    common = planner.objects.get(COMMON_KEY, {})
    loaded_objects = planner.objects
    plain_included = {path_str(p) for p, _ in plain}

    def fill(p: TreePath, leaf: Any) -> Any:
        if isinstance(leaf, ShardedTensor):
            return leaf.data
        if isinstance(leaf, ShardedObject):
            if keep(p, leaf.key) and leaf.unique_key in loaded_objects:
                return loaded_objects[leaf.unique_key]
            return leaf.data
        if path_str(p) in plain_included and path_str(p) in common:
            return common[path_str(p)]
        return leaf

    return map_leaves(template, fill)
